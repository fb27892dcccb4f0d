// C++-only checks of the paged stash pool and the layer registry (no Python): built and run by
// ctest with  cmake -S . -B build/cpp-tests -DMOEPLUG_BUILD_TESTS=ON -DMOEPLUG_BUILD_PYTHON=OFF
#include <cstdint>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "moeplug/stash.h"

namespace {

using moeplug_test::check;
using moeplug::PagePool;
using moeplug::PageRun;

template <class F>
bool throws(F&& f) {
  try {
    f();
  } catch (const std::invalid_argument&) {
    return true;
  }
  return false;
}

void test_alloc_free_and_high_water() {
  PagePool pool(256, 8);
  check(reinterpret_cast<uintptr_t>(pool.data()) % PagePool::kAlignment == 0, "pool aligned");
  PageRun a = pool.alloc(1);    // 1 page
  PageRun b = pool.alloc(600);  // 3 pages
  check(a.first == 0 && a.count == 1, "first run at page 0, one page");
  check(b.first == 1 && b.count == 3, "second run right after, ceil(600/256) = 3 pages");
  check(pool.alloc(0).count == 1, "an empty request still takes a page (distinct addresses)");
  check(pool.stats().pages_in_use == 5 && pool.stats().high_water == 5, "in use 5, high 5");
  pool.free(b);
  check(pool.stats().pages_in_use == 2 && pool.stats().high_water == 5, "free keeps high 5");
  PageRun c = pool.alloc(512);
  check(c.first == 1 && c.count == 2, "freed run reused first-fit: " + std::to_string(c.first));
  pool.reset_high_water();
  check(pool.stats().high_water == 4, "reset_high_water -> pages in use now");
  check(pool.stats().allocs == 4 && pool.stats().overflows == 0, "4 allocs, no overflow");
}

void test_overflow_is_counted_not_truncated() {
  PagePool pool(64, 4);
  PageRun a = pool.alloc(64);
  PageRun b = pool.alloc(64);
  pool.alloc(64);
  pool.free(b);  // 2 free pages, not contiguous: page 1 and page 3
  PageRun c = pool.alloc(128);
  check(c.first == -1 && c.count == 0, "no contiguous run of 2 -> refused");
  check(pool.stats().overflows == 1, "the refusal is counted");
  check(pool.alloc(1000).first == -1 && pool.stats().overflows == 2, "larger than the pool");
  pool.free(a);
  check(pool.alloc(128).first == 0, "pages 0-1 free again -> fits");
}

void test_bad_frees_and_sizes_throw() {
  PagePool pool(64, 4);
  PageRun a = pool.alloc(64);
  pool.free(a);
  check(throws([&] { pool.free(a); }), "double free throws");
  check(throws([&] { pool.free({3, 2}); }), "run past the end throws");
  check(throws([] { PagePool bad(100, 4); }), "page_bytes not a multiple of 64 throws");
  check(throws([] { PagePool bad(64, 0); }), "zero pages throws");
  PagePool book(64, 4, /*own_memory=*/false);
  check(book.data() == nullptr && book.alloc(64).first == 0, "bookkeeping-only pool");
}

void test_threads_never_share_a_page() {
  PagePool pool(64, 4096);
  constexpr int kThreads = 4, kRounds = 2000;
  std::vector<std::thread> threads;
  std::vector<int> bad(kThreads, 0);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      for (int i = 0; i < kRounds; ++i) {
        PageRun r = pool.alloc(64 * (1 + (i + t) % 5));
        if (r.first < 0) {
          ++bad[t];
          continue;
        }
        // Each thread stamps its run; another thread writing into it would change the stamp.
        uint8_t* p = pool.data() + r.first * 64;
        for (int64_t k = 0; k < r.count * 64; ++k) p[k] = static_cast<uint8_t>(t + 1);
        for (int64_t k = 0; k < r.count * 64; ++k) bad[t] += p[k] != t + 1;
        pool.free(r);
      }
    });
  }
  for (auto& th : threads) th.join();
  int total = 0;
  for (int b : bad) total += b;
  check(total == 0, "threads saw foreign bytes or overflows: " + std::to_string(total));
  check(pool.stats().pages_in_use == 0, "every page returned");
  check(pool.stats().allocs == kThreads * kRounds, "every alloc counted");
}

void test_registry() {
  moeplug::Registry reg(1024);
  moeplug::LayerSpec s;
  s.index = 0;
  s.stash_bytes = 2049;
  s.streams = {"compute"};
  auto g0 = reg.register_layer(s);
  s.index = 1;
  s.stash_bytes = 0;
  auto g1 = reg.register_layer(s);
  check(g0.handle == 0 && g1.handle == 1, "handles in registration order");
  check(g0.stash_pages == 3 && g1.stash_pages == 0, "reservation rounded up to pages");
  check(reg.reserved_pages() == 3 && reg.num_layers() == 2, "totals");
  check(reg.layer(0).streams.size() == 1 && reg.layer(0).streams[0] == "compute", "streams kept");
  check(throws([&] { reg.register_layer(s); }), "a repeated index throws");
  check(throws([&] { reg.layer(5); }), "an unknown handle throws");
}

}  // namespace

int main() {
  test_alloc_free_and_high_water();
  test_overflow_is_counted_not_truncated();
  test_bad_frees_and_sizes_throw();
  test_threads_never_share_a_page();
  test_registry();
  return moeplug_test::report("stash");
}
