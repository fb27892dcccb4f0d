// Top-k selection for the fused router (route.cpp): the `cap` largest (value, id) pairs of a
// float row, descending, equal values keeping the lower id first.
//
// The scalar path offers every element to a sorted list; most are rejected, but the reject
// test is a branch per element and it was most of the router's forward time. The AVX-512 path
// first bounds the answer: the cap-th largest of the 16 lane maxima is <= the cap-th largest
// element (cap distinct elements reach it), so only elements >= that bound can be in the
// top-cap. One vector compare per 16 elements packs them (typically ~1.5 cap of them), and
// each one's rank (larger value, or equal value and lower id, before it) places it without a
// data-dependent branch: exactly the scalar path's list and tie order. Rows with a NaN take
// the scalar path (its NaN handling is the reference), so do rows under 16 and cap over 16.
// Internal header: route.cpp and runtime_cpp/tests/test_route_topk.cpp include it.
#pragma once

#include <cmath>
#include <cstdint>

#include "moeplug/dtype.h"

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#include <immintrin.h>
#define MOEPLUG_ROUTE_AVX512 1
#endif

namespace moeplug::route_topk {

// Keeps the n best (value, id) pairs seen so far in descending order; equal values keep the
// earlier (lower) id first, and candidates are offered in ascending id order.
MOEPLUG_INLINE void offer(float v, int64_t id, int64_t cap, float* vals, int64_t* ids,
                          int64_t& n) {
  if (n == cap && !(v > vals[n - 1])) return;
  int64_t pos = n < cap ? n : cap - 1;
  while (pos > 0 && v > vals[pos - 1]) {
    vals[pos] = vals[pos - 1];
    ids[pos] = ids[pos - 1];
    --pos;
  }
  vals[pos] = v;
  ids[pos] = id;
  if (n < cap) ++n;
}

// Scalar reference: x[i] is offered with id id_of(i) (ascending in i).
template <class IdOf>
MOEPLUG_INLINE void topk_scalar(const float* x, int64_t n, int64_t cap, IdOf id_of, float* vals,
                                int64_t* ids, int64_t& count) {
  for (int64_t i = 0; i < n; ++i) offer(x[i], id_of(i), cap, vals, ids, count);
}

#ifdef MOEPLUG_ROUTE_AVX512
// GCC 12's intrinsics start some results from _mm512_undefined_*() and then warn that it may
// be used uninitialized (GCC bug 105593, fixed in 13); only the unused lanes are undefined.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif
#define MOEPLUG_AVX512_FN __attribute__((target("avx512f"), noinline))

inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// The AVX-512 path above; id of x[i] is id0 + i. Needs 16 <= n, 1 <= cap <= 16 and an empty
// list (count == 0). Returns false (nothing written) when the row holds a NaN.
MOEPLUG_AVX512_FN inline bool topk_avx512(const float* x, int64_t n, int64_t cap, int64_t id0,
                                          float* vals, int64_t* ids, int64_t& count) {
  const int64_t full = n & ~int64_t{15};
  const __mmask16 tail = static_cast<__mmask16>((1u << (n - full)) - 1u);
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 lane_max = _mm512_loadu_ps(x);
  __mmask16 nan = _mm512_cmp_ps_mask(lane_max, lane_max, _CMP_UNORD_Q);
  for (int64_t i = 16; i < full; i += 16) {
    const __m512 v = _mm512_loadu_ps(x + i);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lane_max = _mm512_max_ps(lane_max, v);
  }
  if (tail) {
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, tail, x + full);
    nan |= _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
    lane_max = _mm512_max_ps(lane_max, v);
  }
  if (nan) return false;
  // bound = the cap-th largest lane maximum: the smallest lane maximum with fewer than cap
  // lane maxima strictly above it.
  alignas(64) float m[16];
  _mm512_store_ps(m, lane_max);
  __m512i above = _mm512_setzero_si512();
  const __m512i one = _mm512_set1_epi32(1);
  for (int j = 0; j < 16; ++j) {
    const __mmask16 lower = _mm512_cmp_ps_mask(lane_max, _mm512_set1_ps(m[j]), _CMP_LT_OQ);
    above = _mm512_mask_add_epi32(above, lower, above, one);
  }
  const __mmask16 top = _mm512_cmplt_epi32_mask(above, _mm512_set1_epi32(static_cast<int>(cap)));
  const float bound = _mm512_mask_reduce_min_ps(top, lane_max);
  // Candidates (v >= bound) packed in id order; rows with more than kMaxCandidates (ties en
  // masse) offer them one by one instead. Branch-free: a block without candidates stores
  // nothing new (nc does not move), which costs less than the mispredicted skip it replaced.
  constexpr int kMaxCandidates = 64;
  alignas(64) float cv[kMaxCandidates + 16];
  alignas(64) int32_t ci[kMaxCandidates + 16];
  const __m512 vb = _mm512_set1_ps(bound);
  const __m512i iota = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  int nc = 0;
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = i < full ? static_cast<__mmask16>(0xffff) : tail;
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, live, x + i);
    const __mmask16 hit = _mm512_mask_cmp_ps_mask(live, v, vb, _CMP_GE_OQ);
    // Compress in registers, then a plain store (the slack after kMaxCandidates takes the
    // unused lanes): a compress straight to memory is microcoded and slow on AMD Zen 4.
    const int at = nc < kMaxCandidates ? nc : kMaxCandidates;
    _mm512_storeu_ps(cv + at, _mm512_maskz_compress_ps(hit, v));
    _mm512_storeu_si512(
        ci + at, _mm512_maskz_compress_epi32(
                     hit, _mm512_add_epi32(iota, _mm512_set1_epi32(static_cast<int32_t>(i)))));
    nc += __builtin_popcount(hit);
  }
  if (nc > kMaxCandidates) {
    for (int64_t i = 0; i < n; ++i) {
      if (x[i] >= bound) offer(x[i], id0 + i, cap, vals, ids, count);
    }
    return true;
  }
  // Rank of each candidate = how many come before it (larger value, or equal and lower id);
  // ranks are distinct, so rank r < cap is the r-th of the answer. No data-dependent branches.
  for (int c0 = 0; c0 < nc; c0 += 16) {
    const __mmask16 live = nc - c0 >= 16 ? static_cast<__mmask16>(0xffff)
                                         : static_cast<__mmask16>((1u << (nc - c0)) - 1u);
    const __m512 v = _mm512_load_ps(cv + c0);
    const __m512i id = _mm512_load_si512(ci + c0);
    __m512i rank = _mm512_setzero_si512();
    for (int j = 0; j < nc; ++j) {
      const __m512 bv = _mm512_set1_ps(cv[j]);
      const __mmask16 before =
          _mm512_cmp_ps_mask(bv, v, _CMP_GT_OQ) |
          (_mm512_cmp_ps_mask(bv, v, _CMP_EQ_OQ) &
           _mm512_cmplt_epi32_mask(_mm512_set1_epi32(ci[j]), id));
      rank = _mm512_mask_add_epi32(rank, before, rank, one);
    }
    alignas(64) int32_t r[16];
    _mm512_store_si512(r, rank);
    uint32_t in = live & _mm512_cmplt_epi32_mask(rank, _mm512_set1_epi32(static_cast<int>(cap)));
    while (in) {
      const int l = __builtin_ctz(in);
      in &= in - 1;
      vals[r[l]] = cv[c0 + l];
      ids[r[l]] = id0 + ci[c0 + l];
    }
  }
  count = cap;
  return true;
}

// Sum of the m largest values of x[0..n), added largest first (as summing topk()'s values
// would). Needs 16 <= n <= 64 and 1 <= m <= n. The group score of group-limited routing: a
// group is 2-4 vectors and m is 1-2 in practice, so m max-reductions beat a full top-k.
// Returns false (nothing computed) when x holds a NaN.
MOEPLUG_AVX512_FN inline bool top_sum_avx512(const float* x, int64_t n, int64_t m, float& sum) {
  const __m512 neg_inf = _mm512_set1_ps(-INFINITY);
  __m512 v[4];
  const int nv = static_cast<int>((n + 15) / 16);
  __mmask16 nan = 0;
  for (int q = 0; q < nv; ++q) {
    const int64_t left = n - 16 * q;
    const __mmask16 live = left >= 16 ? static_cast<__mmask16>(0xffff)
                                      : static_cast<__mmask16>((1u << left) - 1u);
    v[q] = _mm512_mask_loadu_ps(neg_inf, live, x + 16 * q);
    nan |= _mm512_cmp_ps_mask(v[q], v[q], _CMP_UNORD_Q);
  }
  if (nan) return false;
  float total = 0.0f;
  for (int64_t j = 0; j < m; ++j) {
    __m512 mx = v[0];
    for (int q = 1; q < nv; ++q) mx = _mm512_max_ps(mx, v[q]);
    const float best = _mm512_reduce_max_ps(mx);
    total += best;
    if (j + 1 == m) break;
    const __m512 vb = _mm512_set1_ps(best);
    for (int q = 0; q < nv; ++q) {  // drop one occurrence: an equal value still counts again
      const uint32_t eq = _mm512_cmp_ps_mask(v[q], vb, _CMP_EQ_OQ);
      if (eq) {
        v[q] = _mm512_mask_mov_ps(v[q], static_cast<__mmask16>(eq & (0u - eq)), neg_inf);
        break;
      }
    }
  }
  sum = total;
  return true;
}
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
#endif

// Offers x[0..n) with ids id0 + i to (vals, ids, count), exactly as n offer() calls would.
MOEPLUG_INLINE void topk(const float* x, int64_t n, int64_t cap, int64_t id0, float* vals,
                         int64_t* ids, int64_t& count) {
#ifdef MOEPLUG_ROUTE_AVX512
  if (count == 0 && n >= 16 && cap <= 16 && cpu_has_avx512() &&
      topk_avx512(x, n, cap, id0, vals, ids, count)) {
    return;
  }
#endif
  topk_scalar(x, n, cap, [id0](int64_t i) { return id0 + i; }, vals, ids, count);
}

// The sum of the m largest values of x[0..n), largest first (the group score). mvals/mids:
// scratch for m entries.
MOEPLUG_INLINE float top_sum(const float* x, int64_t n, int64_t m, float* mvals, int64_t* mids) {
  float sum = 0.0f;
#ifdef MOEPLUG_ROUTE_AVX512
  if (n >= 16 && n <= 64 && m <= n && cpu_has_avx512() && top_sum_avx512(x, n, m, sum)) {
    return sum;
  }
#endif
  int64_t nm = 0;
  topk(x, n, m, 0, mvals, mids, nm);
  for (int64_t j = 0; j < nm; ++j) sum += mvals[j];
  return sum;
}

}  // namespace moeplug::route_topk
