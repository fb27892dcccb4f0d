// The router's top-k selection (runtime_cpp/src/route_topk.h): the AVX-512 bounded path must
// give exactly the scalar path's (value, id) lists, tie order included, and the group score
// exactly the scalar sum. Rows are drawn to hit its edges: lengths off the 16-lane grid, ties
// (few distinct values, so also the many-candidates fallback), -inf, NaN. On a CPU without
// AVX-512 both sides are the scalar path (the run says so).
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>

#include "../src/route_topk.h"
#include "check.h"

namespace {

using moeplug_test::check;
namespace rt = moeplug::route_topk;

std::vector<float> draw_row(std::mt19937& rng, int64_t n, int kind) {
  std::normal_distribution<float> nd;
  std::uniform_int_distribution<int> few(0, 3), pick(0, static_cast<int>(n) - 1);
  std::vector<float> x(n);
  for (auto& v : x) v = kind == 1 ? static_cast<float>(few(rng)) * 0.25f : nd(rng);
  if (kind == 2) x.assign(n, 0.5f);                                  // all tied
  if (kind == 3) for (int i = 0; i < 5; ++i) x[pick(rng)] = -INFINITY;
  if (kind == 4) x[pick(rng)] = NAN;
  return x;
}

std::string where(int64_t n, int64_t cap, int kind) {
  return "n=" + std::to_string(n) + " cap=" + std::to_string(cap) + " kind=" +
         std::to_string(kind);
}

bool same(float a, float b) { return a == b || (std::isnan(a) && std::isnan(b)); }

void test_topk_equals_scalar() {
  std::mt19937 rng(1);
  for (int64_t n : {16, 17, 31, 32, 33, 48, 64, 100, 128, 255, 256, 300}) {
    for (int64_t cap : {1, 2, 3, 8, 15, 16}) {
      for (int kind = 0; kind < 5; ++kind) {
        for (int rep = 0; rep < 20; ++rep) {
          const auto x = draw_row(rng, n, kind);
          std::vector<float> va(cap), vb(cap);
          std::vector<int64_t> ia(cap), ib(cap);
          int64_t na = 0, nb = 0;
          rt::topk(x.data(), n, cap, 7, va.data(), ia.data(), na);
          rt::topk_scalar(x.data(), n, cap, [](int64_t i) { return 7 + i; }, vb.data(),
                          ib.data(), nb);
          bool ok = na == nb;
          for (int64_t k = 0; ok && k < na; ++k) ok = same(va[k], vb[k]) && ia[k] == ib[k];
          check(ok, "topk == scalar offers, " + where(n, cap, kind));
        }
      }
    }
  }
}

void test_top_sum_equals_scalar() {
  std::mt19937 rng(2);
  for (int64_t n : {16, 20, 32, 47, 64}) {
    for (int64_t m : {1, 2, 3, 4}) {
      for (int kind = 0; kind < 5; ++kind) {
        for (int rep = 0; rep < 20; ++rep) {
          const auto x = draw_row(rng, n, kind);
          std::vector<float> vals(m);
          std::vector<int64_t> ids(m);
          int64_t nm = 0;
          rt::topk_scalar(x.data(), n, m, [](int64_t i) { return i; }, vals.data(),
                          ids.data(), nm);
          float want = 0.0f;
          for (int64_t j = 0; j < nm; ++j) want += vals[j];
          const float got = rt::top_sum(x.data(), n, m, vals.data(), ids.data());
          check(same(got, want), "top_sum == scalar sum, " + where(n, m, kind));
        }
      }
    }
  }
}

}  // namespace

int main() {
#ifdef MOEPLUG_ROUTE_AVX512
  std::printf("route_topk: AVX-512 path %s\n",
              rt::cpu_has_avx512() ? "runs" : "not on this CPU (scalar vs scalar)");
#endif
  test_topk_equals_scalar();
  test_top_sum_equals_scalar();
  return moeplug_test::report("route_topk");
}
