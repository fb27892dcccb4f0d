// C++-only checks of the stash's file-backed second tier (no Python): built and run by ctest
// with  cmake -S . -B build/cpp-tests -DMOEPLUG_BUILD_TESTS=ON -DMOEPLUG_BUILD_PYTHON=OFF
#include <sys/stat.h>

#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "check.h"
#include "moeplug/spill.h"
#include "moeplug/stream.h"

namespace {

using moeplug::PageRun;
using moeplug::SpillTier;
using moeplug_test::check;

std::string temp_dir() {
  const char* d = std::getenv("TMPDIR");
  return d && *d ? d : "/tmp";
}

std::vector<uint8_t> pattern(size_t n, uint8_t seed) {
  std::vector<uint8_t> v(n);
  for (size_t i = 0; i < n; ++i) v[i] = static_cast<uint8_t>(seed + i * 31);
  return v;
}

void test_round_trip_and_stats() {
  SpillTier tier(temp_dir(), 4096, 64);
  auto a = pattern(10000, 7), b = pattern(4096, 99);
  PageRun ra = tier.alloc(static_cast<int64_t>(a.size()));
  PageRun rb = tier.alloc(static_cast<int64_t>(b.size()));
  check(ra.first == 0 && ra.count == 3 && rb.first == 3 && rb.count == 1, "runs first fit");
  tier.write(ra, a.data(), static_cast<int64_t>(a.size()));
  tier.write(rb, b.data(), static_cast<int64_t>(b.size()));
  std::vector<uint8_t> out(a.size()), outb(b.size());
  tier.read(ra, out.data(), static_cast<int64_t>(out.size()));
  tier.read(rb, outb.data(), static_cast<int64_t>(outb.size()));
  check(out == a && outb == b, "bytes read back equal the bytes written");
  auto s = tier.stats();
  check(s.bytes_written == 14096 && s.bytes_read == 14096, "byte counters");
  check(s.pages.pages_in_use == 4 && s.pages.high_water == 4, "4 pages in use");
  tier.free(ra);
  tier.free(rb);
  check(tier.stats().pages.pages_in_use == 0, "free returns the pages");
  check(tier.alloc(64 * 4096 + 1).first == -1 && tier.stats().pages.overflows == 1,
        "a request larger than the tier overflows, counted");
}

void test_bad_runs_and_directory() {
  SpillTier tier(temp_dir(), 4096, 4);
  std::vector<uint8_t> buf(8192);
  bool threw = false;
  try {
    tier.write({0, 1}, buf.data(), 8192);  // 2 pages of bytes into a 1-page run
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  check(threw, "writing more bytes than the run holds throws");
  threw = false;
  try {
    SpillTier bad("/nonexistent-moeplug-dir", 4096, 4);
  } catch (const std::invalid_argument& e) {
    threw = std::string(e.what()).find("/nonexistent-moeplug-dir") != std::string::npos;
  }
  check(threw, "an unusable directory throws, naming it");
}

void test_stream_orders_write_then_read() {
  // The copies run on a stream's worker: a read queued after a write sees its bytes.
  auto tier = std::make_shared<SpillTier>(temp_dir(), 4096, 16);
  auto stream = moeplug::get_stream("spill-test");
  auto src = pattern(20000, 3);
  std::vector<uint8_t> dst(src.size());
  PageRun r = tier->alloc(static_cast<int64_t>(src.size()));
  stream->enqueue("spill_write", [&] { tier->write(r, src.data(), 20000); });
  stream->enqueue("spill_read", [&] { tier->read(r, dst.data(), 20000); });
  stream->record()->synchronize();
  check(dst == src, "stream: read after write returns the bytes");
  tier->free(r);
}

}  // namespace

int main() {
  test_round_trip_and_stats();
  test_bad_runs_and_directory();
  test_stream_orders_write_then_read();
  return moeplug_test::report("spill");
}
