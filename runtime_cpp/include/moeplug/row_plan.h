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
// The sync-free layer's slots (moeplug.modules.static_moe.slots, packed or not): key_N in
// [0, E] (E: a choice the router dropped); C budget rows per expert. Each kept choice gets
//   slot_N[i] = base[e] + pos, pos its index among this rank's choices of expert e in
//   (token, k) order (a stable count), kept while pos < C;
// base[e] = e * C, or (packed) its chunk's start w * L * C (W chunks of L = E / W experts)
// plus the kept counts of the chunk's experts before e. Dropped and over-budget choices get
// the dump slot E * C; overflow[0] = 1 when some routed choice went over the budget, else 0.
// counts_E[e] = min(choices of e, C). scratch holds 2 * E + 1 int64; on return its first E
// entries are the choices of each expert (before the budget cut). Throws
// std::invalid_argument naming the first choice whose id is outside [0, E].
void budget_slots(const int64_t* key_N, int64_t N, int64_t E, int64_t C, int64_t W, bool packed,
                  int64_t* scratch, int64_t* slot_N, int64_t* counts_E, uint8_t* overflow);

void move_row_chunks(const void* src, void* dst, int64_t row_bytes, const int64_t* counts_WL,
                     int64_t W, int64_t L, bool to_expert_major);

}  // namespace moeplug
