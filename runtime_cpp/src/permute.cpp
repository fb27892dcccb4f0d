// Counting-sort permute and its gather/scatter inverses, parallel over tokens.
//
// Shape legend: T tokens, K top-k, D hidden, E experts, S routed rows, C token chunks.
#include "moeplug/permute.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "moeplug/thread_pool.h"
#include "moeplug/vec8.h"

namespace moeplug {

namespace {

// Tokens per task: enough rows that per-task overhead (a lock, a wakeup) is noise.
constexpr int64_t kTokenGrain = 64;

void check_dims(const char* op, int64_t T, int64_t K, int64_t D) {
  if (T < 0 || K < 1 || D < 1) {
    throw std::invalid_argument(std::string(op) + ": expected num_tokens >= 0, top_k >= 1, " +
                                "hidden >= 1; got num_tokens=" + std::to_string(T) +
                                ", top_k=" + std::to_string(K) + ", hidden=" + std::to_string(D));
  }
}

// Every row index in range and used once; a duplicate would make the backward scatter race.
// ``missing_ok``: -1 is allowed too (a slot map's "no row").
void check_row_map(const char* op, const int64_t* row_map_TK, int64_t T, int64_t K, int64_t S,
                   bool missing_ok = false) {
  std::vector<uint8_t> seen_S(static_cast<size_t>(S), 0);
  for (int64_t i = 0; i < T * K; ++i) {
    const int64_t r = row_map_TK[i];
    if (missing_ok && r == -1) continue;
    const bool out_of_range = r < 0 || r >= S;
    if (!out_of_range && !seen_S[r]) {
      seen_S[r] = 1;
      continue;
    }
    const std::string where = std::string(op) + (missing_ok ? ": slots[" : ": row_map[") +
                              std::to_string(i / K) + ", " + std::to_string(i % K) + "] = " +
                              std::to_string(r);
    if (out_of_range) {
      throw std::invalid_argument(
          where + " is outside [0, " + std::to_string(S) +
          (missing_ok ? ") and not -1 (no row); pass the slots of this layer's token budget"
                      : "); pass the row_map that permute returned for these rows"));
    }
    throw std::invalid_argument(where + " repeats an earlier entry; each routed row must be "
                                "used by exactly one (token, k), as permute produces");
  }
}

// Rows for tokens [t0, t1) (weighted_row_sums). D is walked in blocks of kSumBlock columns
// held in eight 8-lane registers: each source row is read once, and the output is written once,
// converted. Written with vec8.h's vector types: as a plain loop over a float[64] block, GCC
// scalarised the block for the first k rows (an unroll-and-jam it chose), and bf16 unpermute
// ran at 0.3 of memcpy, no faster than fp32; the direct-write combine's [D]-float accumulator
// in memory cost a load and a store per column and k. Eight lanes, not sixteen: four v16f
// accumulators lived on the stack in the AVX2 and default clones (vec8.h), and bf16
// unpermute ran at 0.47 of memcpy on an AVX2 host.
constexpr int64_t kSumBlock = 64;

template <class T_>
MOEPLUG_INLINE void sum_rows(const T_* rows, const int64_t* row_map_TK, const float* w_TK,
                             int64_t t0, int64_t t1, int64_t K, int64_t D, T_* y_TD) {
  for (int64_t t = t0; t < t1; ++t) {
    const int64_t* r_K = row_map_TK + t * K;
    const float* w_K = w_TK ? w_TK + t * K : nullptr;
    T_* __restrict dst = y_TD + t * D;
    // The next token's rows are elsewhere in rows (no hardware prefetcher guesses the jump):
    // ask for the same block of them while this block's sums run.
    const int64_t* next_K = t + 1 < t1 ? r_K + K : nullptr;
    int64_t d0 = 0;
    for (; d0 + kSumBlock <= D; d0 += kSumBlock) {
      v8f a0{}, a1{}, a2{}, a3{}, a4{}, a5{}, a6{}, a7{};  // named: an array stayed in memory
      for (int64_t k = 0; k < K; ++k) {
        if (next_K && next_K[k] >= 0) {
          const char* nxt = reinterpret_cast<const char*>(rows + next_K[k] * D + d0);
          for (size_t off = 0; off < kSumBlock * sizeof(T_); off += 64) {
            __builtin_prefetch(nxt + off);
          }
        }
        if (r_K[k] < 0) continue;
        const T_* src = rows + r_K[k] * D + d0;
        const v8f w = splat8(w_K ? w_K[k] : 1.0f);
        a0 += w * load8(src);
        a1 += w * load8(src + 8);
        a2 += w * load8(src + 16);
        a3 += w * load8(src + 24);
        a4 += w * load8(src + 32);
        a5 += w * load8(src + 40);
        a6 += w * load8(src + 48);
        a7 += w * load8(src + 56);
      }
      store8(dst + d0, a0);
      store8(dst + d0 + 8, a1);
      store8(dst + d0 + 16, a2);
      store8(dst + d0 + 24, a3);
      store8(dst + d0 + 32, a4);
      store8(dst + d0 + 40, a5);
      store8(dst + d0 + 48, a6);
      store8(dst + d0 + 56, a7);
    }
    for (int64_t d = d0; d < D; ++d) {  // the tail, column by column
      float acc = 0.0f;
      for (int64_t k = 0; k < K; ++k) {
        if (r_K[k] >= 0) acc += (w_K ? w_K[k] : 1.0f) * load_f32(rows + r_K[k] * D, d);
      }
      store_f32(dst, d, acc);
    }
  }
}

// For tokens [t0, t1): grad_y_SD[row] = p * g[t] (unless grad_y_SD is null); grad_p[t, k] =
// dot(g[t], y_SD[row]). A choice without a row (-1, slot maps only) writes no row and a zero
// grad_p.
template <class T_>
MOEPLUG_INLINE void scatter_rows(const T_* g_TD, const T_* y_SD, const int64_t* row_map_TK,
                                 const float* probs_TK, int64_t t0, int64_t t1, int64_t K,
                                 int64_t D, T_* grad_y_SD, float* grad_probs_TK) {
  for (int64_t t = t0; t < t1; ++t) {
    const T_* __restrict g = g_TD + t * D;
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = row_map_TK[t * K + k];
      if (r < 0) {
        if (probs_TK && grad_probs_TK) grad_probs_TK[t * K + k] = 0.0f;
        continue;
      }
      if (!probs_TK) {
        if (grad_y_SD) std::memcpy(grad_y_SD + r * D, g, sizeof(T_) * D);
        continue;
      }
      const float p = probs_TK[t * K + k];
      if (grad_y_SD) {
        T_* __restrict dst = grad_y_SD + r * D;
        for (int64_t d = 0; d < D; ++d) store_f32(dst, d, p * load_f32(g, d));
      }
      if (grad_probs_TK) {
        const T_* y = y_SD + r * D;
        float dot = 0.0f;
#pragma omp simd reduction(+ : dot)
        for (int64_t d = 0; d < D; ++d) dot += load_f32(g, d) * load_f32(y, d);
        grad_probs_TK[t * K + k] = dot;
      }
    }
  }
}

MOEPLUG_MULTIVERSION void scatter_f32(const float* g, const float* y, const int64_t* rm,
                                      const float* p, int64_t t0, int64_t t1, int64_t K,
                                      int64_t D, float* gy, float* gp) {
  scatter_rows(g, y, rm, p, t0, t1, K, D, gy, gp);
}
MOEPLUG_MULTIVERSION void scatter_bf16(const uint16_t* g, const uint16_t* y, const int64_t* rm,
                                       const float* p, int64_t t0, int64_t t1, int64_t K,
                                       int64_t D, uint16_t* gy, float* gp) {
  scatter_rows(g, y, rm, p, t0, t1, K, D, gy, gp);
}

}  // namespace

MOEPLUG_MULTIVERSION void weighted_row_sums(const float* rows, const int64_t* row_map_TK,
                                            const float* w_TK, int64_t t0, int64_t t1, int64_t K,
                                            int64_t D, float* y_TD) {
  sum_rows(rows, row_map_TK, w_TK, t0, t1, K, D, y_TD);
}
MOEPLUG_MULTIVERSION void weighted_row_sums(const uint16_t* rows, const int64_t* row_map_TK,
                                            const float* w_TK, int64_t t0, int64_t t1, int64_t K,
                                            int64_t D, uint16_t* y_TD) {
  sum_rows(rows, row_map_TK, w_TK, t0, t1, K, D, y_TD);
}

void permute(const void* x_TD, const int64_t* ids_TK, int64_t T, int64_t K, int64_t D, int64_t E,
             DType dtype, void* x_SD, int64_t* row_map_TK, int64_t* counts_E) {
  check_dims("permute", T, K, D);
  if (E < 1) {
    throw std::invalid_argument("permute: num_experts must be >= 1, got " + std::to_string(E));
  }
  // Fixed token chunks (not the pool's dynamic ones): chunk c's histogram row must describe
  // exactly the tokens chunk c later scatters, so the sort stays stable.
  const int64_t C = std::max<int64_t>(
      1, std::min<int64_t>(get_num_threads() * 4, (T + kTokenGrain - 1) / kTokenGrain));
  const int64_t chunk = std::max<int64_t>(1, (T + C - 1) / C);
  std::vector<int64_t> hist_CE(static_cast<size_t>(C * E), 0);
  std::vector<int64_t> first_bad_C(static_cast<size_t>(C), -1);

  // 1. Per-chunk expert histograms; remember each chunk's first out-of-range id.
  parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* hist = hist_CE.data() + c * E;
      const int64_t i1 = std::min(T, (c + 1) * chunk) * K;
      for (int64_t i = c * chunk * K; i < i1; ++i) {
        const int64_t e = ids_TK[i];
        if (e < 0 || e >= E) {
          first_bad_C[c] = i;
          break;
        }
        ++hist[e];
      }
    }
  });
  for (int64_t c = 0; c < C; ++c) {
    const int64_t i = first_bad_C[c];
    if (i >= 0) {
      throw std::invalid_argument(
          "permute: ids[" + std::to_string(i / K) + ", " + std::to_string(i % K) + "] = " +
          std::to_string(ids_TK[i]) + " is not a valid expert id; expected 0 <= id < num_experts (" +
          std::to_string(E) + "). Check the router's top-k output and num_experts");
    }
  }

  // 2. counts_E, then each chunk's first destination row per expert (expert-major, chunk-minor).
  int64_t row = 0;
  for (int64_t e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int64_t c = 0; c < C; ++c) {
      const int64_t h = hist_CE[c * E + e];
      hist_CE[c * E + e] = row + count;  // reuse the histogram as the offset table
      count += h;
    }
    counts_E[e] = count;
    row += count;
  }

  // 3. Scatter: each chunk walks its tokens in (t, k) order, so rows stay stable per expert.
  const int64_t row_bytes = D * dtype_size(dtype);
  const auto* src = static_cast<const char*>(x_TD);
  auto* dst = static_cast<char*>(x_SD);
  parallel_for(0, C, 1, [&](int64_t c0, int64_t c1) {
    for (int64_t c = c0; c < c1; ++c) {
      int64_t* next_row_E = hist_CE.data() + c * E;
      const int64_t t1 = std::min(T, (c + 1) * chunk);
      for (int64_t t = c * chunk; t < t1; ++t) {
        for (int64_t k = 0; k < K; ++k) {
          const int64_t r = next_row_E[ids_TK[t * K + k]]++;
          row_map_TK[t * K + k] = r;
          std::memcpy(dst + r * row_bytes, src + t * row_bytes, static_cast<size_t>(row_bytes));
        }
      }
    }
  });
}

namespace {

void sum_to_tokens(const void* y_SD, const int64_t* row_map_TK, const float* probs_TK,
                   int64_t T, int64_t K, int64_t D, DType dtype, void* y_TD) {
  parallel_for(0, T, kTokenGrain, [&](int64_t t0, int64_t t1) {
    if (dtype == DType::kFloat32) {
      weighted_row_sums(static_cast<const float*>(y_SD), row_map_TK, probs_TK, t0, t1, K, D,
                        static_cast<float*>(y_TD));
    } else {
      weighted_row_sums(static_cast<const uint16_t*>(y_SD), row_map_TK, probs_TK, t0, t1, K, D,
                        static_cast<uint16_t*>(y_TD));
    }
  });
}

void scatter_to_rows(const char* op, const void* grad_TD, const void* y_SD,
                     const int64_t* row_map_TK, const float* probs_TK, int64_t T, int64_t K,
                     int64_t D, DType dtype, void* grad_y_SD, float* grad_probs_TK) {
  if (grad_probs_TK && (!probs_TK || !y_SD)) {
    throw std::invalid_argument(std::string(op) + ": grad_probs needs probs and y_SD; got a "
                                "null probs or y_SD pointer");
  }
  parallel_for(0, T, kTokenGrain, [&](int64_t t0, int64_t t1) {
    if (dtype == DType::kFloat32) {
      scatter_f32(static_cast<const float*>(grad_TD), static_cast<const float*>(y_SD), row_map_TK,
                  probs_TK, t0, t1, K, D, static_cast<float*>(grad_y_SD), grad_probs_TK);
    } else {
      scatter_bf16(static_cast<const uint16_t*>(grad_TD), static_cast<const uint16_t*>(y_SD),
                   row_map_TK, probs_TK, t0, t1, K, D, static_cast<uint16_t*>(grad_y_SD),
                   grad_probs_TK);
    }
  });
}

}  // namespace

void unpermute(const void* y_SD, const int64_t* row_map_TK, const float* probs_TK, int64_t T,
               int64_t K, int64_t D, int64_t S, DType dtype, void* y_TD) {
  check_dims("unpermute", T, K, D);
  check_row_map("unpermute", row_map_TK, T, K, S);
  sum_to_tokens(y_SD, row_map_TK, probs_TK, T, K, D, dtype, y_TD);
}

void unpermute_backward(const void* grad_TD, const void* y_SD, const int64_t* row_map_TK,
                        const float* probs_TK, int64_t T, int64_t K, int64_t D, int64_t S,
                        DType dtype, void* grad_y_SD, float* grad_probs_TK) {
  check_dims("unpermute_backward", T, K, D);
  check_row_map("unpermute_backward", row_map_TK, T, K, S);
  scatter_to_rows("unpermute_backward", grad_TD, y_SD, row_map_TK, probs_TK, T, K, D, dtype,
                  grad_y_SD, grad_probs_TK);
}

void to_slots(const void* x_TD, const int64_t* slot_TK, const float* probs_TK, int64_t T,
              int64_t K, int64_t D, int64_t S, DType dtype, void* x_SD) {
  check_dims("to_slots", T, K, D);
  check_row_map("to_slots", slot_TK, T, K, S, /*missing_ok=*/true);
  scatter_to_rows("to_slots", x_TD, nullptr, slot_TK, probs_TK, T, K, D, dtype, x_SD, nullptr);
}

void from_slots(const void* y_SD, const int64_t* slot_TK, const float* probs_TK, int64_t T,
                int64_t K, int64_t D, int64_t S, DType dtype, void* y_TD) {
  check_dims("from_slots", T, K, D);
  check_row_map("from_slots", slot_TK, T, K, S, /*missing_ok=*/true);
  sum_to_tokens(y_SD, slot_TK, probs_TK, T, K, D, dtype, y_TD);
}

void from_slots_backward(const void* grad_TD, const void* y_SD, const int64_t* slot_TK,
                         const float* probs_TK, int64_t T, int64_t K, int64_t D, int64_t S,
                         DType dtype, void* grad_y_SD, float* grad_probs_TK) {
  check_dims("from_slots_backward", T, K, D);
  check_row_map("from_slots_backward", slot_TK, T, K, S, /*missing_ok=*/true);
  scatter_to_rows("from_slots_backward", grad_TD, y_SD, slot_TK, probs_TK, T, K, D, dtype,
                  grad_y_SD, grad_probs_TK);
}

}  // namespace moeplug
