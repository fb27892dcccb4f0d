// Where each routed choice goes when the rows move straight into their experts' ranks (the
// direct-write dispatcher's plan, moeplug_plugins/dispatchers/_dw_plan.py).
//
// Shape legend: N = T*K choices of this rank, E experts, L local experts per rank (E = W*L).
#pragma once

#include <cstdint>

namespace moeplug {

// ids_N in [0, E]; E marks a dropped choice. A stable counting sort by expert (choices keep
// their (token, k) order inside an expert, as permute's) gives each kept choice i
//   row_map_N[i]   its row in this rank's expert-major order,
//   dest_rank_N[i] the rank owning its expert, ids[i] / L,
//   dest_row_N[i]  its row there: base_E[ids[i]] + its index among this rank's choices of
//                  that expert;
// a dropped choice gets -1 in all three. scratch holds 2*E + 1 int64, the caller's (so the
// dispatch allocates nothing here). Throws std::invalid_argument naming the first choice whose
// id is outside [0, E].
void place_rows(const int64_t* ids_N, int64_t N, int64_t E, int64_t L, const int64_t* base_E,
                int64_t* scratch, int64_t* row_map_N, int64_t* dest_rank_N,
                int64_t* dest_row_N);

// The EP dispatcher's sort by local expert (moeplug_plugins/dispatchers/_ep_comm.py). Rows
// arrive (source rank w, local expert l)-major, in chunks of counts_WL[w * L + l] rows of
// row_bytes each; with to_expert_major, dst gets them (l, w)-major (each chunk's rows keep
// their order), else the inverse (src expert-major, dst arrival order). src and dst must not
// overlap. Pieces of at most a few hundred rows run in parallel, so one big chunk still uses
// every thread. Throws std::invalid_argument on a negative count or shape.
void move_row_chunks(const void* src, void* dst, int64_t row_bytes, const int64_t* counts_WL,
                     int64_t W, int64_t L, bool to_expert_major);

}  // namespace moeplug
