// The direct-write plan's per-choice part: two passes over the N choices (count, then place),
// where the torch form took a stable sort, an inverse scatter and a dozen [N] temporaries (a
// fifth of a bf16 round trip at 4 ranks, 4096 tokens x top-8).
#include "moeplug/row_plan.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>
#include <vector>

#include "moeplug/thread_pool.h"

namespace moeplug {

void place_rows(const int64_t* ids_N, int64_t N, int64_t E, int64_t L, const int64_t* base_E,
                int64_t* scratch, int64_t* row_map_N, int64_t* dest_rank_N,
                int64_t* dest_row_N) {
  if (N < 0 || E < 1 || L < 1 || E % L != 0) {
    throw std::invalid_argument("place_rows: expected choices >= 0, experts >= 1 and local "
                                "experts >= 1 dividing them; got " + std::to_string(N) + ", " +
                                std::to_string(E) + ", " + std::to_string(L));
  }
  int64_t* cursor_E1 = scratch;     // counts, then the next row of each expert here
  int64_t* shift_E = scratch + E + 1;  // base_E[e] - expert e's first row here
  std::fill(cursor_E1, cursor_E1 + E + 1, int64_t{0});
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = ids_N[i];
    if (e < 0 || e > E) {
      throw std::invalid_argument("place_rows: ids[" + std::to_string(i) + "] = " +
                                  std::to_string(e) + " is not an expert id; expected 0 <= id "
                                  "< " + std::to_string(E) + ", or " + std::to_string(E) +
                                  " for a dropped choice");
    }
    ++cursor_E1[e];
  }
  int64_t first = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t n = cursor_E1[e];
    cursor_E1[e] = first;
    shift_E[e] = base_E[e] - first;
    first += n;
  }
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = ids_N[i];
    if (e == E) {
      row_map_N[i] = dest_rank_N[i] = dest_row_N[i] = -1;
      continue;
    }
    const int64_t row = cursor_E1[e]++;
    row_map_N[i] = row;
    dest_rank_N[i] = e / L;
    dest_row_N[i] = shift_E[e] + row;
  }
}

void budget_slots(const int64_t* key_N, int64_t N, int64_t E, int64_t C, int64_t W, bool packed,
                  int64_t* scratch, int64_t* slot_N, int64_t* counts_E, uint8_t* overflow) {
  if (N < 0 || E < 1 || C < 1 || W < 1 || E % W != 0) {
    throw std::invalid_argument("budget_slots: expected choices >= 0, experts >= 1, budget >= 1 "
                                "and chunks >= 1 dividing the experts; got " +
                                std::to_string(N) + ", " + std::to_string(E) + ", " +
                                std::to_string(C) + ", " + std::to_string(W));
  }
  // seen_E1: choices counted, then the next position of each expert, so that its first E
  // entries end at each expert's choice count (moeplug.modules.static_arena reads them).
  int64_t* seen_E1 = scratch;
  int64_t* base_E = scratch + E + 1;
  std::fill(seen_E1, seen_E1 + E + 1, int64_t{0});
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = key_N[i];
    if (e < 0 || e > E) {
      throw std::invalid_argument("budget_slots: ids[" + std::to_string(i) + "] = " +
                                  std::to_string(e) + " is not an expert id; expected 0 <= id "
                                  "< " + std::to_string(E) + ", or " + std::to_string(E) +
                                  " for a dropped choice");
    }
    ++seen_E1[e];
  }
  const int64_t L = E / W;
  for (int64_t e = 0; e < E; ++e) {
    counts_E[e] = std::min(seen_E1[e], C);
    if (!packed) {
      base_E[e] = e * C;
    } else if (e % L == 0) {
      base_E[e] = (e / L) * L * C;
    } else {
      base_E[e] = base_E[e - 1] + counts_E[e - 1];
    }
    seen_E1[e] = 0;
  }
  const int64_t dump = E * C;
  uint8_t over = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = key_N[i];
    if (e == E) {
      slot_N[i] = dump;
      continue;
    }
    const int64_t pos = seen_E1[e]++;
    if (pos < C) {
      slot_N[i] = base_E[e] + pos;
    } else {
      slot_N[i] = dump;
      over = 1;
    }
  }
  overflow[0] = over;
}

void move_row_chunks(const void* src, void* dst, int64_t row_bytes, const int64_t* counts_WL,
                     int64_t W, int64_t L, bool to_expert_major) {
  if (W < 0 || L < 0 || row_bytes < 0) {
    throw std::invalid_argument("move_row_chunks: expected ranks, local experts and row bytes "
                                ">= 0; got " + std::to_string(W) + ", " + std::to_string(L) +
                                ", " + std::to_string(row_bytes));
  }
  // Each chunk's start in arrival order ((w, l)-major) and in expert-major order ((l, w)-major).
  std::vector<int64_t> arrival(W * L), expert(W * L);
  int64_t start = 0;
  for (int64_t c = 0; c < W * L; ++c) {
    if (counts_WL[c] < 0) {
      throw std::invalid_argument("move_row_chunks: counts[" + std::to_string(c / L) + ", " +
                                  std::to_string(c % L) + "] = " +
                                  std::to_string(counts_WL[c]) + " is negative");
    }
    arrival[c] = start;
    start += counts_WL[c];
  }
  start = 0;
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t w = 0; w < W; ++w) {
      expert[w * L + l] = start;
      start += counts_WL[w * L + l];
    }
  }
  // (source row, destination row, rows) pieces of at most kPiece rows.
  constexpr int64_t kPiece = 256;
  struct Piece { int64_t from, to, rows; };
  std::vector<Piece> pieces;
  for (int64_t c = 0; c < W * L; ++c) {
    const int64_t from = to_expert_major ? arrival[c] : expert[c];
    const int64_t to = to_expert_major ? expert[c] : arrival[c];
    for (int64_t r = 0; r < counts_WL[c]; r += kPiece) {
      pieces.push_back({from + r, to + r, std::min(kPiece, counts_WL[c] - r)});
    }
  }
  const char* s = static_cast<const char*>(src);
  char* d = static_cast<char*>(dst);
  parallel_for(0, static_cast<int64_t>(pieces.size()), 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const Piece& q = pieces[p];
      std::memcpy(d + q.to * row_bytes, s + q.from * row_bytes, q.rows * row_bytes);
    }
  });
}

}  // namespace moeplug
