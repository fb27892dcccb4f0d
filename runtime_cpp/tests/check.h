// The C++ tests' one assertion helper: count failures, report them all, exit non-zero at the end.
#pragma once

#include <cstdio>
#include <string>

namespace moeplug_test {

inline int g_failures = 0;

inline void check(bool ok, const std::string& what) {
  if (!ok) {
    std::fprintf(stderr, "FAIL: %s\n", what.c_str());
    ++g_failures;
  }
}

// main()'s return value: 0 when every check passed.
inline int report(const char* suite) {
  if (g_failures) {
    std::fprintf(stderr, "%s: %d check(s) failed\n", suite, g_failures);
    return 1;
  }
  std::printf("%s: all checks passed\n", suite);
  return 0;
}

}  // namespace moeplug_test
