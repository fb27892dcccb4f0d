// C++-only checks of the shared-memory heap and its row copies (no Python). Two "ranks" live in
// this one process: each ShmHeap maps the other's segment by name, exactly as two processes do.
// Built and run by ctest:  cmake -S . -B build/cpp-tests -DMOEPLUG_BUILD_TESTS=ON
// -DMOEPLUG_BUILD_PYTHON=OFF && cmake --build build/cpp-tests && ctest --test-dir build/cpp-tests
#include <sys/stat.h>
#include <unistd.h>

#include <chrono>
#include <cstdint>
#include <cstring>
#include <memory>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "moeplug/shm_heap.h"

namespace {

using moeplug::ShmHeap;
using moeplug_test::check;

bool in_dev_shm(const std::string& name) {
  struct stat st;
  return stat(("/dev/shm" + name).c_str(), &st) == 0;
}

std::string unique(const char* tag) {
  return "/moeplug-ctest-" + std::string(tag) + "-" + std::to_string(getpid());
}

template <class E, class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const E& e) {
    return e.what();
  }
  return "";
}

void test_two_ranks_map_each_other_then_unlink() {
  const std::string n0 = unique("a0"), n1 = unique("a1");
  ShmHeap h0(n0, 1 << 16, 8, 0, 2), h1(n1, 1 << 16, 8, 1, 2);
  check(in_dev_shm(n0) && in_dev_shm(n1), "created segments are named in /dev/shm");
  h0.attach({n0, n1});
  h1.attach({n0, n1});
  h0.unlink_all();
  h1.unlink_all();  // the other rank already unlinked both: ENOENT is fine
  check(!in_dev_shm(n0) && !in_dev_shm(n1), "unlink_all leaves nothing in /dev/shm");
  // The mappings outlive the names: rank 0 writes into rank 1's data and slots.
  std::memset(h0.data(1), 0xab, 1 << 16);
  h0.slots(1)[7] = 42;
  check(h1.data(1)[0] == 0xab && h1.data(1)[(1 << 16) - 1] == 0xab, "rank 1 sees rank 0's rows");
  check(h1.slots(1)[7] == 42, "rank 1 sees the slot rank 0 wrote");
  check(reinterpret_cast<uintptr_t>(h0.data(0)) % ShmHeap::kAlign == 0, "data region aligned");
  h1.publish(2, 5);
  check(h0.flag(1, 2) == 5, "a published flag is visible to the peer");
}

void test_destructor_unlinks_when_never_attached() {
  const std::string n = unique("b");
  { ShmHeap h(n, 4096, 0, 0, 2); }
  check(!in_dev_shm(n), "a heap that never reached unlink_all still removes its own name");
}

void test_wait_all_orders_and_times_out_naming_the_rank() {
  const std::string n0 = unique("c0"), n1 = unique("c1");
  ShmHeap h0(n0, 4096, 1, 0, 2), h1(n1, 4096, 1, 1, 2);
  h0.attach({n0, n1});
  h1.attach({n0, n1});
  h0.unlink_all();
  // Release/acquire: rank 1 writes a slot, then publishes; the waiter must see the slot.
  std::thread writer([&] {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    h1.slots(1)[0] = 1234;
    h1.publish(0, 1);
  });
  h0.publish(0, 1);
  h0.wait_all(0, 1, 10.0, "test step");
  check(h0.slots(1)[0] == 1234, "after wait_all the peer's slot write is visible");
  writer.join();
  const auto t0 = std::chrono::steady_clock::now();
  const std::string msg =
      error_of<moeplug::PeerError>([&] { h0.wait_all(0, 2, 0.2, "counts published"); });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const auto has = [&](const char* s) { return msg.find(s) != std::string::npos; };
  check(has("rank 0 waited") && has("for rank 0"),
        "timeout names the waiting rank and the first missing one: " + msg);
  check(has("counts published") && has("timed out"),
        "timeout names the step: " + msg);
  check(s >= 0.2 && s < 5.0, "wait_all gave up after its timeout: " + std::to_string(s) + " s");
}

void test_bad_arguments_throw() {
  check(!error_of<std::invalid_argument>([] { ShmHeap h("no-slash", 64, 0, 0, 1); }).empty(),
        "a name without a leading '/' is refused");
  check(!error_of<std::invalid_argument>([] { ShmHeap h(unique("d"), 64, 0, 2, 2); }).empty(),
        "rank >= world is refused");
  const std::string n0 = unique("e0"), n1 = unique("e1");
  ShmHeap h0(n0, 4096, 0, 0, 2), h1(n1, 8192, 0, 1, 2);
  const std::string msg = error_of<std::runtime_error>([&] { h0.attach({n0, n1}); });
  check(msg.find("rank 1") != std::string::npos && msg.find("same sizes") != std::string::npos,
        "a peer heap of another size is refused naming the rank: " + msg);
  check(!error_of<std::runtime_error>([&] { h0.attach({n0, unique("missing")}); }).empty(),
        "a missing peer segment is refused");
  check(!error_of<std::runtime_error>([&] { h0.data(1); }).empty(),
        "an unmapped peer's data is refused");
}

void test_row_copies_match_a_naive_loop() {
  // 5 tokens, top-2, rows of 3 floats, 2 destinations (plain buffers stand in for peer heaps).
  const int64_t T = 5, K = 2, D = 3, W = 2;
  std::vector<float> x(T * D);
  for (int64_t i = 0; i < T * D; ++i) x[i] = float(i);
  const std::vector<int64_t> rank = {0, 1, 1, -1, 0, 0, 1, 0, -1, -1};
  const std::vector<int64_t> row = {0, 0, 1, 0, 1, 2, 2, 3, 0, 0};
  std::vector<float> d0(4 * D, -1.0f), d1(3 * D, -1.0f);
  const std::vector<int64_t> base = {int64_t(reinterpret_cast<uintptr_t>(d0.data())),
                                     int64_t(reinterpret_cast<uintptr_t>(d1.data()))};
  moeplug::scatter_rows(x.data(), T, K, D * 4, false, rank.data(), row.data(), base.data(), W);
  bool ok = true;
  for (int64_t i = 0; i < T * K; ++i) {
    if (rank[i] < 0) continue;
    const float* dst = (rank[i] == 0 ? d0.data() : d1.data()) + row[i] * D;
    for (int64_t d = 0; d < D; ++d) ok &= dst[d] == x[(i / K) * D + d];
  }
  check(ok, "scatter_rows puts token t's row at every (dest_rank, dest_row) of its choices");

  // copy_chunks: a run longer than one piece, and an empty run.
  std::vector<float> src(200 * D), out(300 * D, 0.0f);
  for (size_t i = 0; i < src.size(); ++i) src[i] = float(i);
  const std::vector<int64_t> chunks = {10, 0, 50, 150, 0, 0, 0, 0, 160, 0, 0, 7};
  const std::vector<int64_t> one = {int64_t(reinterpret_cast<uintptr_t>(out.data()))};
  moeplug::copy_chunks(src.data(), D * 4, chunks.data(), 3, one.data(), 1);
  ok = true;
  for (int64_t r = 0; r < 150; ++r) {
    for (int64_t d = 0; d < D; ++d) ok &= out[(50 + r) * D + d] == src[(10 + r) * D + d];
  }
  for (int64_t r = 0; r < 7; ++r) ok &= out[r * D] == src[(160 + r) * D];
  check(ok && out[200 * D] == 0.0f, "copy_chunks copies every run and nothing else");

  // sum_received_rows: weighted, skipping dropped (-1) choices; a token with no rows -> 0.
  const std::vector<float> rows = {1, 2, 3, 10, 20, 30, 100, 200, 300};
  const std::vector<int64_t> rm = {0, 2, -1, 1, -1, -1};
  const std::vector<float> w = {0.5f, 2.0f, 9.0f, 1.0f, 7.0f, 7.0f};
  std::vector<float> y(3 * D, -1.0f);
  moeplug::sum_received_rows(rows.data(), 3, rm.data(), w.data(), 3, 2, D,
                             moeplug::DType::kFloat32, y.data());
  check(y[0] == 200.5f && y[3] == 10.0f && y[6] == 0.0f,
        "sum_received_rows: 0.5*row0 + 2*row2, row1 alone, zeros for a token with no rows");
  check(!error_of<std::invalid_argument>([&] {
          const std::vector<int64_t> bad = {0, 3};
          moeplug::sum_received_rows(rows.data(), 3, bad.data(), nullptr, 1, 2, D,
                                     moeplug::DType::kFloat32, y.data());
        }).empty(),
        "a row_map entry past the received rows is refused");
}

void test_streamed_rows_and_the_single_copy_sum() {
  // Rows of 64 floats (256 B): the streamed-store path of scatter_rows; then pull_sum_rows reads
  // them through process_vm_readv (this process stands in for the peer "rank 1") and must equal
  // sum_received_rows over the same rows bitwise.
  const int64_t T = 6, K = 3, D = 64, W = 2;
  std::vector<float> x(T * D);
  for (int64_t i = 0; i < T * D; ++i) x[i] = 0.37f * float(i % 97) - 3.0f;
  std::vector<int64_t> rank(T * K), row(T * K);
  int64_t next[2] = {0, 0};
  for (int64_t i = 0; i < T * K; ++i) {
    rank[i] = i % 5 == 4 ? -1 : (i * 7) % W;
    row[i] = rank[i] < 0 ? 0 : next[rank[i]]++;
  }
  alignas(64) static float d0[T * K * D], d1[T * K * D];
  const std::vector<int64_t> base = {int64_t(reinterpret_cast<uintptr_t>(d0)),
                                     int64_t(reinterpret_cast<uintptr_t>(d1))};
  moeplug::scatter_rows(x.data(), T, K, D * 4, false, rank.data(), row.data(), base.data(), W);
  bool ok = true;
  for (int64_t i = 0; i < T * K; ++i) {
    if (rank[i] < 0) continue;
    const float* dst = (rank[i] == 0 ? d0 : d1) + row[i] * D;
    for (int64_t d = 0; d < D; ++d) ok &= dst[d] == x[(i / K) * D + d];
  }
  check(ok, "scatter_rows with streamed stores puts every row in place");

  const std::vector<int64_t> pids = {int64_t(getpid()), int64_t(getpid())};
  std::vector<float> pulled(T * D, -1.0f), summed(T * D, -2.0f);
  moeplug::pull_sum_rows(pids.data(), base.data(), 0, W, rank.data(), row.data(), T, K, D,
                         moeplug::DType::kFloat32, pulled.data());
  // The reference: gather the same rows into one buffer, then sum_received_rows.
  std::vector<float> rows(T * K * D);
  std::vector<int64_t> map(T * K);
  for (int64_t i = 0; i < T * K; ++i) {
    map[i] = rank[i] < 0 ? -1 : i;
    if (rank[i] >= 0) {
      std::memcpy(&rows[i * D], (rank[i] == 0 ? d0 : d1) + row[i] * D, D * 4);
    }
  }
  moeplug::sum_received_rows(rows.data(), T * K, map.data(), nullptr, T, K, D,
                             moeplug::DType::kFloat32, summed.data());
  check(std::memcmp(pulled.data(), summed.data(), T * D * 4) == 0,
        "pull_sum_rows (process_vm_readv) equals sum_received_rows bitwise");
  const std::vector<int64_t> gone = {int64_t(getpid()), 0x7ffffff0};  // no such process
  check(!error_of<std::runtime_error>([&] {
          moeplug::pull_sum_rows(gone.data(), base.data(), 0, W, rank.data(), row.data(), T, K,
                                 D, moeplug::DType::kFloat32, pulled.data());
        }).empty(),
        "a refused read throws naming the rank");
}

}  // namespace

int main() {
  test_two_ranks_map_each_other_then_unlink();
  test_destructor_unlinks_when_never_attached();
  test_wait_all_orders_and_times_out_naming_the_rank();
  test_bad_arguments_throw();
  test_row_copies_match_a_naive_loop();
  test_streamed_rows_and_the_single_copy_sum();
  return moeplug_test::report("shm_heap");
}
