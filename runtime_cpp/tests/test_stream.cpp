// C++-only checks of runtime streams and events (no Python): built and run by ctest with
//   cmake -S . -B build/cpp-tests -DMOEPLUG_BUILD_TESTS=ON -DMOEPLUG_BUILD_PYTHON=OFF
#include <atomic>
#include <chrono>
#include <cstdio>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "moeplug/permute.h"
#include "moeplug/stream.h"

namespace {

using moeplug_test::check;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

constexpr int64_t kSleepUs = 200000;  // 0.2 s: long next to thread wake-ups on a loaded box

void test_two_streams_overlap() {
  auto a = moeplug::get_stream("test.a");
  auto b = moeplug::get_stream("test.b");
  check(moeplug::get_stream("test.a") == a, "same name gives the same stream");
  auto t0 = std::chrono::steady_clock::now();
  a->enqueue("sleep", [] { moeplug::sleep_kernel(kSleepUs); });
  b->enqueue("sleep", [] { moeplug::sleep_kernel(kSleepUs); });
  a->synchronize();
  b->synchronize();
  const double two = seconds_since(t0);
  t0 = std::chrono::steady_clock::now();
  a->enqueue("sleep", [] { moeplug::sleep_kernel(kSleepUs); });
  a->enqueue("sleep", [] { moeplug::sleep_kernel(kSleepUs); });
  a->synchronize();
  const double one = seconds_since(t0);
  check(two < 1.5 * kSleepUs * 1e-6, "two streams overlap: " + std::to_string(two) + " s");
  check(one >= 2 * kSleepUs * 1e-6, "one stream runs in order: " + std::to_string(one) + " s");
}

void test_wait_orders_work() {
  auto a = moeplug::get_stream("test.a");
  auto b = moeplug::get_stream("test.b");
  std::atomic<int> value{0};
  int seen = -1;
  a->enqueue("slow_write", [&] {
    moeplug::sleep_kernel(kSleepUs / 2);
    value = 42;
  });
  b->wait(a->record());
  b->enqueue("read", [&] { seen = value; });
  b->synchronize();
  check(seen == 42, "b read after a's write, saw " + std::to_string(seen));
  a->synchronize();
}

void test_error_reaches_waiter_with_kernel_name() {
  auto a = moeplug::get_stream("test.a");
  auto b = moeplug::get_stream("test.b");
  std::vector<int64_t> ids = {0, 9};  // 9 is not an expert of 2
  std::vector<float> x(2), xs(2);
  std::vector<int64_t> row_map(2), counts(2);
  a->enqueue("permute", [&] {
    moeplug::permute(x.data(), ids.data(), 2, 1, 1, 2, moeplug::DType::kFloat32, xs.data(),
                     row_map.data(), counts.data());
  });
  bool skipped = true;
  a->enqueue("after", [&] { skipped = false; });
  b->wait(a->record());
  std::string message;
  try {
    b->synchronize();
  } catch (const moeplug::KernelError& e) {
    message = e.what();
  }
  check(message.find("stream 'test.a': kernel 'permute' failed: permute: ids[1, 0] = 9") == 0,
        "the waiting stream raises the failed kernel's name, got: " + message);
  check(skipped, "kernels after a failure on the same stream are skipped");
  bool a_raised = false;
  try {
    a->synchronize();
  } catch (const moeplug::KernelError&) {
    a_raised = true;
  }
  check(a_raised, "the failing stream raises too");
  a->synchronize();  // cleared: must not throw again
  b->synchronize();
}

}  // namespace

int main() {
  try {
    test_two_streams_overlap();
    test_wait_orders_work();
    test_error_reaches_waiter_with_kernel_name();
  } catch (const std::exception& e) {
    std::fprintf(stderr, "FAIL: unexpected exception: %s\n", e.what());
    return 1;
  }
  return moeplug_test::report("moeplug streams");
}
