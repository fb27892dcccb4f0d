// Top-k selection for the fused router (route.cpp): the `cap` largest (value, id) pairs of a
// float row, descending, equal values keeping the lower id first.
//
// The scalar path offers every element to a sorted list; most are rejected, but the reject
// test is a branch per element and it was most of the router's forward time. The AVX-512 path
// first bounds the answer: the cap-th largest of the 16 lane maxima is <= the cap-th largest
// element (cap distinct elements reach it), so only elements >= that bound can be in the
// top-cap. One vector compare per 16 elements finds them (typically ~1.5 cap of them) and
// only those are offered, still in ascending id order, so the result and the tie order are
// exactly the scalar path's. Rows with a NaN take the scalar path (its NaN handling is the
// reference). Internal header: included by route.cpp only.
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
#define MOEPLUG_AVX512_FN __attribute__((target("avx512f"), noinline))

inline bool cpu_has_avx512() {
  static const bool has = __builtin_cpu_supports("avx512f");
  return has;
}

// The AVX-512 path above; id of x[i] is id0 + i. Needs 16 <= n and 1 <= cap <= 16. Returns false (nothing written) when the row holds a NaN.
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
  const __m512 vb = _mm512_set1_ps(bound);
  for (int64_t i = 0; i < n; i += 16) {
    const __mmask16 live = i < full ? static_cast<__mmask16>(0xffff) : tail;
    const __m512 v = _mm512_mask_loadu_ps(neg_inf, live, x + i);
    uint32_t hit = _mm512_mask_cmp_ps_mask(live, v, vb, _CMP_GE_OQ);
    while (hit) {
      const int l = __builtin_ctz(hit);
      hit &= hit - 1;
      offer(x[i + l], id0 + i + l, cap, vals, ids, count);
    }
  }
  return true;
}
#endif

// Offers x[0..n) with ids id0 + i to (vals, ids, count), exactly as n offer() calls would. An
// element below the bound is not in the top-cap of x, so neither of x plus what the list holds.
MOEPLUG_INLINE void topk(const float* x, int64_t n, int64_t cap, int64_t id0, float* vals,
                         int64_t* ids, int64_t& count) {
#ifdef MOEPLUG_ROUTE_AVX512
  if (n >= 16 && cap <= 16 && cpu_has_avx512() &&
      topk_avx512(x, n, cap, id0, vals, ids, count)) {
    return;
  }
#endif
  topk_scalar(x, n, cap, [id0](int64_t i) { return id0 + i; }, vals, ids, count);
}

}  // namespace moeplug::route_topk
