// C++-only checks of the core (no Python): build with
//   cmake -S . -B build/cpp-tests -DMOEPLUG_BUILD_TESTS=ON -DMOEPLUG_BUILD_PYTHON=OFF
//   cmake --build build/cpp-tests -j2 && ctest --test-dir build/cpp-tests
// Each check compares a kernel against a naive loop written here.
#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <random>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "moeplug/capacity.h"
#include "moeplug/fastmath.h"
#include "moeplug/permute.h"
#include "moeplug/row_plan.h"
#include "moeplug/swiglu.h"
#include "moeplug/thread_pool.h"
#include "moeplug/vec8.h"

namespace {

using moeplug_test::check;

void check_a_chunks_exception_reaches_the_caller(const std::string& where) {
  bool threw = false;
  try {
    moeplug::parallel_for(0, 100, 1, [](int64_t lo, int64_t) {
      if (lo >= 50) throw std::runtime_error("boom");
    });
  } catch (const std::runtime_error&) {
    threw = true;
  }
  check(threw, "an exception inside a chunk reaches the caller " + where);
}

void test_parallel_for_covers_range_once() {
  for (int threads : {1, 2, 3}) {
    moeplug::set_num_threads(threads);
    std::vector<std::atomic<int>> hits(1000);
    moeplug::parallel_for(0, 1000, 7, [&](int64_t lo, int64_t hi) {
      for (int64_t i = lo; i < hi; ++i) hits[i]++;
    });
    bool ok = true;
    for (auto& h : hits) ok &= h.load() == 1;
    check(ok, "parallel_for visits every index exactly once, threads=" + std::to_string(threads));
  }
  check_a_chunks_exception_reaches_the_caller("on the pool");
}

// A stand-in for libgomp's GOMP_parallel: fn(data) on num_threads threads, the caller one of
// them (what `#pragma omp parallel` does), counting the teams it ran.
std::atomic<int> g_teams{0};
void fake_gomp_parallel(void (*fn)(void*), void* data, unsigned num_threads, unsigned) {
  ++g_teams;
  std::vector<std::thread> team;
  for (unsigned i = 1; i < num_threads; ++i) team.emplace_back(fn, data);
  fn(data);
  for (auto& t : team) t.join();
}

void test_parallel_for_on_an_openmp_team() {
  moeplug::set_num_threads(2);
  moeplug::use_openmp(&fake_gomp_parallel);
  check(std::string(moeplug::executor()) == "openmp", "executor() says openmp once handed one");
  std::vector<std::atomic<int>> hits(1000);
  std::atomic<int> nested_teams{0};
  moeplug::parallel_for(0, 1000, 7, [&](int64_t lo, int64_t hi) {
    const int before = g_teams.load();
    moeplug::parallel_for(0, 100, 1, [](int64_t, int64_t) {});  // inside a chunk: serial
    nested_teams += g_teams.load() - before;
    for (int64_t i = lo; i < hi; ++i) hits[i]++;
  });
  bool ok = true;
  for (auto& h : hits) ok &= h.load() == 1;
  check(ok, "on the OpenMP team, parallel_for visits every index exactly once");
  check(g_teams.load() == 1 && nested_teams.load() == 0,
        "one team per call, none for a parallel_for inside a chunk; teams=" +
            std::to_string(g_teams.load()));
  check_a_chunks_exception_reaches_the_caller("on the OpenMP team");
  moeplug::use_openmp(nullptr);
  check(std::string(moeplug::executor()) == "pool", "use_openmp(nullptr) returns to the pool");
}

void test_permute_matches_naive() {
  const int64_t T = 301, K = 3, D = 5, E = 7;
  std::mt19937 rng(0);
  std::vector<int64_t> ids(T * K);
  for (auto& v : ids) v = rng() % E;
  std::vector<float> x(T * D);
  for (auto& v : x) v = float(rng() % 1000);
  std::vector<float> xs(T * K * D);
  std::vector<int64_t> row_map(T * K), counts(E);
  moeplug::permute(x.data(), ids.data(), T, K, D, E, moeplug::DType::kFloat32, xs.data(),
                   row_map.data(), counts.data());
  // Naive stable grouping: for each expert, walk (t, k) in order.
  int64_t row = 0;
  bool ok = true;
  for (int64_t e = 0; e < E; ++e) {
    int64_t count = 0;
    for (int64_t i = 0; i < T * K; ++i) {
      if (ids[i] != e) continue;
      ok &= row_map[i] == row;
      for (int64_t d = 0; d < D; ++d) ok &= xs[row * D + d] == x[(i / K) * D + d];
      ++row;
      ++count;
    }
    ok &= counts[e] == count;
  }
  check(ok, "permute equals the naive stable grouping");

  ids[5] = E;
  bool threw = false;
  try {
    moeplug::permute(x.data(), ids.data(), T, K, D, E, moeplug::DType::kFloat32, xs.data(),
                     row_map.data(), counts.data());
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("ids[1, 2] = 7") != std::string::npos;
  }
  check(threw, "permute names the out-of-range id and its position");
}

void test_swiglu_matches_naive() {
  const int64_t S = 9, F = 37;
  std::vector<float> h(S * 2 * F), p(S), a(S * F);
  std::mt19937 rng(1);
  std::normal_distribution<float> normal(0.0f, 4.0f);
  for (auto& v : h) v = normal(rng);
  for (auto& v : p) v = float(rng() % 100) / 100.0f;
  moeplug::swiglu_forward(h.data(), p.data(), S, F, moeplug::DType::kFloat32, a.data());
  double worst = 0;
  for (int64_t s = 0; s < S; ++s) {
    for (int64_t f = 0; f < F; ++f) {
      const double g = h[s * 2 * F + f], u = h[s * 2 * F + F + f];
      const double want = g / (1.0 + std::exp(-g)) * u * p[s];
      worst = std::fmax(worst, std::fabs(want - a[s * F + f]) / (1.0 + std::fabs(want)));
    }
  }
  check(worst < 1e-5, "swiglu_forward within 1e-5 of the double-precision formula, got " +
                          std::to_string(worst));
}

// The SwiGLU loops run eight columns on exp_approx8 and the tail on exp_approx: a column's
// result must not depend on which of the two it fell in.
void test_exp_approx8_equals_the_scalar_lanes() {
  int64_t differ = 0;
  for (int i = 0; i < 4096; i += 8) {
    float in[8];
    for (int l = 0; l < 8; ++l) in[l] = -100.0f + 200.0f * float(i + l) / 4096.0f;  // past both clamps
    if (i < 16) {  // the edges: the clamps' bounds, signed zeros, infinities, NaN
      const float edges[] = {-0.0f, 0.0f, -87.0f, 88.0f, -87.0001f, 88.0001f,
                             INFINITY, -INFINITY, NAN, 1e-30f, -1e-30f, 0.34657359f,
                             -87.5f, 88.5f, 1.0f, -1.0f};
      std::copy(edges + i, edges + i + 8, in);
    }
    float out[8];
    const moeplug::v8f v = moeplug::exp_approx8(moeplug::load8(in));
    std::memcpy(out, &v, sizeof out);
    for (int l = 0; l < 8; ++l) {
      const float want = moeplug::exp_approx(in[l]);
      differ += std::memcmp(&want, &out[l], sizeof want) != 0 &&
                !(std::isnan(want) && std::isnan(out[l]));
    }
  }
  check(differ == 0, "exp_approx8 lanes equal exp_approx bit for bit, " +
                         std::to_string(differ) + " of 4096 differ");
}

void test_store8_bf16_equals_the_scalar_rounding() {
  // Round to nearest even and quiet NaNs, lane by lane as f32_to_bf16: ties both ways,
  // payload NaNs of both signs, infinities, zeros, subnormals, the largest finite floats.
  const uint32_t bits[] = {0x3F808000u, 0x3F818000u, 0x3F807FFFu, 0x3F808001u,
                           0x7FC00001u, 0xFF800001u, 0x7F800001u, 0xFFFFFFFFu,
                           0x7F800000u, 0xFF800000u, 0x00000000u, 0x80000000u,
                           0x00000001u, 0x807FFFFFu, 0x7F7FFFFFu, 0xFF7FFFFFu};
  float in[16];
  std::memcpy(in, bits, sizeof in);
  int64_t differ = 0;
  uint16_t out8[16];
  moeplug::store8(out8, moeplug::load8(in));
  moeplug::store8(out8 + 8, moeplug::load8(in + 8));
  for (int l = 0; l < 16; ++l) differ += out8[l] != moeplug::f32_to_bf16(in[l]);
  check(differ == 0, "store8 to bf16 rounds every lane as f32_to_bf16, " +
                         std::to_string(differ) + " of 16 differ");
  // load8 of bf16 widens exactly: the stored bf16 read back equals bf16_to_f32 of it.
  float back[8];
  moeplug::store8(back, moeplug::load8(out8));
  differ = 0;
  for (int l = 0; l < 8; ++l) {
    const float want = moeplug::bf16_to_f32(out8[l]);
    differ += std::memcmp(&back[l], &want, sizeof want) != 0;
  }
  check(differ == 0, "load8 of bf16 widens as bf16_to_f32, " + std::to_string(differ) +
                         " of 8 differ");

  // The even/odd pair forms: store16_pairs rounds as f32_to_bf16 and puts every element back
  // in its place; load16_pairs widens exactly, even elements in one vector, odd in the other.
  float even_in[8], odd_in[8];
  for (int l = 0; l < 8; ++l) {
    even_in[l] = in[2 * l];
    odd_in[l] = in[2 * l + 1];
  }
  uint16_t pairs[16];
  moeplug::store16_pairs(pairs, moeplug::load8(even_in), moeplug::load8(odd_in));
  differ = 0;
  for (int l = 0; l < 16; ++l) differ += pairs[l] != moeplug::f32_to_bf16(in[l]);
  check(differ == 0, "store16_pairs rounds and places every element as f32_to_bf16, " +
                         std::to_string(differ) + " of 16 differ");
  moeplug::v8f even, odd;
  moeplug::load16_pairs(pairs, even, odd);
  float even_out[8], odd_out[8];
  moeplug::store8(even_out, even);
  moeplug::store8(odd_out, odd);
  differ = 0;
  for (int l = 0; l < 8; ++l) {
    const float want_even = moeplug::bf16_to_f32(pairs[2 * l]);
    const float want_odd = moeplug::bf16_to_f32(pairs[2 * l + 1]);
    differ += std::memcmp(&even_out[l], &want_even, sizeof want_even) != 0;
    differ += std::memcmp(&odd_out[l], &want_odd, sizeof want_odd) != 0;
  }
  check(differ == 0, "load16_pairs widens the even and the odd elements as bf16_to_f32, " +
                         std::to_string(differ) + " of 16 differ");
}

// Against a naive rank count: a choice of expert e is kept iff fewer than C other choices of e
// come before it (larger prob, or equal prob and earlier).
void test_capacity_matches_naive_ranks() {
  const int64_t T = 300, K = 3, E = 7, C = 40;
  std::vector<int64_t> ids(T * K);
  std::vector<float> p(T * K);
  std::mt19937 rng(3);
  for (int64_t t = 0; t < T; ++t) {
    std::vector<int64_t> all(E);
    for (int64_t e = 0; e < E; ++e) all[e] = e;
    std::shuffle(all.begin(), all.end(), rng);
    for (int64_t k = 0; k < K; ++k) {
      ids[t * K + k] = all[k];
      p[t * K + k] = float(rng() % 5) / 4.0f;  // many ties
    }
  }
  std::vector<int64_t> scratch(T * K + E + 1);
  std::vector<uint8_t> dropped(T * K);
  for (const bool by_probs : {true, false}) {
    moeplug::drop_over_capacity(p.data(), ids.data(), T, K, E, C, by_probs, scratch.data(),
                                dropped.data());
    int64_t wrong = 0, num_dropped = 0;
    for (int64_t i = 0; i < T * K; ++i) {
      int64_t ahead = 0;
      for (int64_t j = 0; j < T * K; ++j) {
        if (ids[j] != ids[i] || j == i) continue;
        const bool earlier = j < i;
        ahead += by_probs ? (p[j] > p[i] || (p[j] == p[i] && earlier)) : earlier;
      }
      wrong += (ahead >= C) != bool(dropped[i]);
      num_dropped += dropped[i];
    }
    check(wrong == 0 && num_dropped > 0,
          std::string("drop_over_capacity ") + (by_probs ? "probs" : "position") +
              " policy keeps exactly the first C by rank; wrong " + std::to_string(wrong) +
              ", dropped " + std::to_string(num_dropped));
  }
}

// place_rows against a naive count: a kept choice's row is the number of kept choices of lower
// experts plus those of its expert before it; its destination row adds that index to the base.
void test_place_rows_matches_naive() {
  const int64_t N = 300, E = 8, L = 2;
  std::vector<int64_t> ids(N), base(E), scratch(2 * E + 1), row(N), rank(N), dest(N);
  for (int64_t i = 0; i < N; ++i) ids[i] = (i * 7 + i / 13) % (E + 1);  // E: dropped
  for (int64_t e = 0; e < E; ++e) base[e] = 1000 * e + 3;
  moeplug::place_rows(ids.data(), N, E, L, base.data(), scratch.data(), row.data(), rank.data(),
                      dest.data());
  int64_t wrong = 0;
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = ids[i];
    if (e == E) {
      wrong += row[i] != -1 || rank[i] != -1 || dest[i] != -1;
      continue;
    }
    int64_t lower = 0, same_before = 0;
    for (int64_t j = 0; j < N; ++j) {
      lower += ids[j] < e;
      same_before += ids[j] == e && j < i;
    }
    wrong += row[i] != lower + same_before || rank[i] != e / L ||
             dest[i] != base[e] + same_before;
  }
  check(wrong == 0, "place_rows: rows and destinations as a stable count gives them; wrong " +
                        std::to_string(wrong));
  ids[17] = E + 1;
  bool threw = false;
  try {
    moeplug::place_rows(ids.data(), N, E, L, base.data(), scratch.data(), row.data(),
                        rank.data(), dest.data());
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("ids[17] = 9") != std::string::npos;
  }
  check(threw, "place_rows names the first bad id");
}

// budget_slots against a naive count, packed over W = 2 chunks of L = 3 experts: a kept choice
// sits at its chunk's start, plus the kept (at most C) choices of the chunk's lower experts,
// plus its index among its expert's choices, while that index is under C.
void test_budget_slots_matches_naive() {
  const int64_t N = 200, E = 6, W = 2, L = E / W, C = 9;
  std::vector<int64_t> ids(N), scratch(2 * E + 1), slot(N), counts(E);
  for (int64_t i = 0; i < N; ++i) ids[i] = (i * 5 + i / 7) % (E + 1);  // E: dropped
  uint8_t overflow = 7;
  moeplug::budget_slots(ids.data(), N, E, C, W, true, scratch.data(), slot.data(), counts.data(),
                        &overflow);
  std::vector<int64_t> total(E + 1, 0);
  for (int64_t i = 0; i < N; ++i) ++total[ids[i]];
  int64_t wrong = 0;
  bool over = false;
  for (int64_t e = 0; e < E; ++e) wrong += counts[e] != std::min(total[e], C);
  for (int64_t i = 0; i < N; ++i) {
    const int64_t e = ids[i];
    int64_t before = 0;
    for (int64_t j = 0; j < i; ++j) before += ids[j] == e;
    if (e == E || before >= C) {
      over = over || e != E;
      wrong += slot[i] != E * C;
      continue;
    }
    int64_t start = (e / L) * L * C;
    for (int64_t f = (e / L) * L; f < e; ++f) start += std::min(total[f], C);
    wrong += slot[i] != start + before;
  }
  check(wrong == 0 && over && overflow == 1,
        "budget_slots: slots, counts and the flag as a naive count gives them; wrong " +
            std::to_string(wrong));
  ids[11] = -2;
  bool threw = false;
  try {
    moeplug::budget_slots(ids.data(), N, E, C, W, true, scratch.data(), slot.data(),
                          counts.data(), &overflow);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("ids[11] = -2") != std::string::npos;
  }
  check(threw, "budget_slots names the first bad id");
}

// The slot-map kernels against naive loops, fp32, over T = 150 tokens (several pool chunks)
// and D = 70 (a 64-column block and a tail): every fourth choice has no slot (-1), the others
// own distinct rows of S = 500, of which the rest stay untouched.
void test_slot_kernels_match_naive() {
  const int64_t T = 150, K = 3, D = 70, S = 500;
  std::mt19937 gen(5);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  std::vector<int64_t> rows(S);
  for (int64_t r = 0; r < S; ++r) rows[r] = r;
  std::shuffle(rows.begin(), rows.end(), gen);
  std::vector<int64_t> slot(T * K);
  for (int64_t i = 0; i < T * K; ++i) slot[i] = i % 4 == 1 ? -1 : rows[i];
  std::vector<float> x(T * D), y(S * D), p(T * K), g(T * D);
  for (auto* v : {&x, &y, &g}) for (float& f : *v) f = u(gen);
  for (float& f : p) f = u(gen);
  const float kUnset = 12345.0f;
  std::vector<float> x_S(S * D, kUnset), y_T(T * D), gy(S * D, kUnset), gp(T * K, kUnset);
  moeplug::to_slots(x.data(), slot.data(), nullptr, T, K, D, S, moeplug::DType::kFloat32,
                    x_S.data());
  std::vector<float> xp_S(S * D, kUnset), gp_x(T * K, kUnset);
  moeplug::to_slots(x.data(), slot.data(), p.data(), T, K, D, S, moeplug::DType::kFloat32,
                    xp_S.data());
  // to_slots' weight grads: <x[t], the slot's grad> (here y), no row written
  moeplug::from_slots_backward(x.data(), y.data(), slot.data(), p.data(), T, K, D, S,
                               moeplug::DType::kFloat32, nullptr, gp_x.data());
  moeplug::from_slots(y.data(), slot.data(), p.data(), T, K, D, S, moeplug::DType::kFloat32,
                      y_T.data());
  moeplug::from_slots_backward(g.data(), y.data(), slot.data(), p.data(), T, K, D, S,
                               moeplug::DType::kFloat32, gy.data(), gp.data());
  std::vector<uint8_t> owned(S, 0);
  double err = 0.0;
  int64_t wrong = 0;
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t d = 0; d < D; ++d) {
      double want = 0.0;
      for (int64_t k = 0; k < K; ++k) {
        const int64_t r = slot[t * K + k];
        if (r >= 0) want += double(p[t * K + k]) * y[r * D + d];
      }
      err = std::max(err, std::abs(want - y_T[t * D + d]));
    }
    for (int64_t k = 0; k < K; ++k) {
      const int64_t r = slot[t * K + k];
      if (r < 0) {
        wrong += gp[t * K + k] != 0.0f || gp_x[t * K + k] != 0.0f;
        continue;
      }
      owned[r] = 1;
      double dot = 0.0, dot_x = 0.0;
      for (int64_t d = 0; d < D; ++d) {
        wrong += x_S[r * D + d] != x[t * D + d];
        wrong += xp_S[r * D + d] != p[t * K + k] * x[t * D + d];
        err = std::max(err, double(std::abs(gy[r * D + d] - p[t * K + k] * g[t * D + d])));
        dot += double(g[t * D + d]) * y[r * D + d];
        dot_x += double(x[t * D + d]) * y[r * D + d];
      }
      err = std::max(err, std::abs(dot - gp[t * K + k]));
      err = std::max(err, std::abs(dot_x - gp_x[t * K + k]));
    }
  }
  for (int64_t r = 0; r < S; ++r) {
    if (owned[r]) continue;
    for (int64_t d = 0; d < D; ++d) {
      wrong += x_S[r * D + d] != kUnset || xp_S[r * D + d] != kUnset || gy[r * D + d] != kUnset;
    }
  }
  check(wrong == 0 && err < 1e-4,
        "to_slots (plain, weighted) / from_slots / from_slots_backward equal naive loops "
        "(wrong " +
            std::to_string(wrong) + ", max err " + std::to_string(err) + ")");
  slot[7] = S;  // outside [0, S) and not -1
  bool threw = false;
  try {
    moeplug::from_slots(y.data(), slot.data(), p.data(), T, K, D, S, moeplug::DType::kFloat32,
                        y_T.data());
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("slots[2, 1] = 500 is outside [0, 500) and not -1") !=
            std::string::npos;
  }
  check(threw, "from_slots names a slot outside the buffer");
}

// Rows tagged by (w, l, i) arrive (w, l)-major; expert-major order sorts by (l, w, i). Chunks
// over 256 rows are split into pieces: one of 600 rows checks the split.
void test_move_row_chunks_sorts_expert_major_and_back() {
  const int64_t W = 3, L = 2;
  const std::vector<int64_t> counts = {2, 0, 600, 1, 3, 4};  // [W, L]
  std::vector<std::array<int64_t, 3>> rows, want;
  for (int64_t w = 0; w < W; ++w)
    for (int64_t l = 0; l < L; ++l)
      for (int64_t i = 0; i < counts[w * L + l]; ++i) rows.push_back({w, l, i});
  want = rows;
  std::stable_sort(want.begin(), want.end(), [](const auto& a, const auto& b) {
    return a[1] != b[1] ? a[1] < b[1] : a[0] < b[0];
  });
  std::vector<std::array<int64_t, 3>> sorted(rows.size()), back(rows.size());
  const int64_t row_bytes = sizeof(rows[0]);
  moeplug::move_row_chunks(rows.data(), sorted.data(), row_bytes, counts.data(), W, L, true);
  check(sorted == want, "move_row_chunks puts the rows in (local expert, rank) order");
  moeplug::move_row_chunks(sorted.data(), back.data(), row_bytes, counts.data(), W, L, false);
  check(back == rows, "move_row_chunks' inverse restores arrival order");
  const std::vector<int64_t> bad = {1, -1};
  bool threw = false;
  try {
    moeplug::move_row_chunks(rows.data(), sorted.data(), row_bytes, bad.data(), 1, 2, true);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("counts[0, 1] = -1") != std::string::npos;
  }
  check(threw, "move_row_chunks names a negative count");
}

}  // namespace

int main() {
  test_parallel_for_covers_range_once();
  test_parallel_for_on_an_openmp_team();
  test_permute_matches_naive();
  test_swiglu_matches_naive();
  test_exp_approx8_equals_the_scalar_lanes();
  test_store8_bf16_equals_the_scalar_rounding();
  test_capacity_matches_naive_ranks();
  test_place_rows_matches_naive();
  test_budget_slots_matches_naive();
  test_slot_kernels_match_naive();
  test_move_row_chunks_sorts_expert_major_and_back();
  return moeplug_test::report("moeplug core");
}
