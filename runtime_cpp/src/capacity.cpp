// Capacity dropping: a counting sort of the choices by expert, then one selection per expert.
//
// Shape legend: T tokens, K top-k, E experts, n choices routed to one expert.
#include "moeplug/capacity.h"

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>

namespace moeplug {

void drop_over_capacity(const float* probs_TK, const int64_t* ids_TK, int64_t T, int64_t K,
                        int64_t E, int64_t capacity, bool by_probs, int64_t* scratch_N,
                        uint8_t* dropped_TK) {
  if (T < 0 || K < 1 || E < 1 || capacity < 0) {
    throw std::invalid_argument("drop_over_capacity: expected num_tokens >= 0, top_k >= 1, "
                                "num_experts >= 1, capacity >= 0; got " + std::to_string(T) +
                                ", " + std::to_string(K) + ", " + std::to_string(E) + ", " +
                                std::to_string(capacity));
  }
  if (by_probs && !probs_TK) {
    throw std::invalid_argument("drop_over_capacity: the probs policy needs probs_TK");
  }
  const int64_t N = T * K;
  int64_t* order_N = scratch_N;       // choice indices t*K + k, grouped by expert
  int64_t* start_E1 = scratch_N + N;  // expert e's choices are order_N[start[e], start[e+1])
  std::fill(start_E1, start_E1 + E + 1, int64_t{0});
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = ids_TK[i];
    if (e < 0 || e >= E) {
      throw std::invalid_argument(
          "drop_over_capacity: ids[" + std::to_string(i / K) + ", " + std::to_string(i % K) +
          "] = " + std::to_string(e) + " is not a valid expert id; expected 0 <= id < " +
          std::to_string(E));
    }
    ++start_E1[e + 1];
  }
  for (int64_t e = 0; e < E; ++e) start_E1[e + 1] += start_E1[e];
  // Fill in choice order (so each expert's list is in token order), using start[e] as the
  // cursor; afterwards start[e] has moved to where expert e+1 begins, so shift it back.
  for (int64_t i = 0; i < N; ++i) order_N[start_E1[ids_TK[i]]++] = i;
  for (int64_t e = E; e > 0; --e) start_E1[e] = start_E1[e - 1];
  start_E1[0] = 0;

  std::fill(dropped_TK, dropped_TK + N, uint8_t{0});
  // A strict total order: larger prob first (NaN above every number, as torch's descending
  // sort puts it), then earlier choice. Selecting the first C under it keeps exactly what a
  // stable descending sort of the probs keeps.
  const auto before = [probs_TK](int64_t a, int64_t b) {
    const float pa = probs_TK[a], pb = probs_TK[b];
    const bool na = std::isnan(pa), nb = std::isnan(pb);
    if (na != nb) return na;
    if (!na && pa != pb) return pa > pb;
    return a < b;
  };
  for (int64_t e = 0; e < E; ++e) {
    int64_t* first = order_N + start_E1[e];
    int64_t* last = order_N + start_E1[e + 1];
    if (last - first <= capacity) continue;
    int64_t* cut = first + capacity;
    if (by_probs) std::nth_element(first, cut, last, before);  // in place, no buffer
    for (int64_t* it = cut; it != last; ++it) dropped_TK[*it] = 1;
  }
}

}  // namespace moeplug
