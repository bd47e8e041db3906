// Skipping a test whose optional dependency is missing: the executable exits with
// plsh_test::kSkipReturnCode, which tests/CMakeLists.txt declares as the ctest test's
// SKIP_RETURN_CODE, so ctest reports the test as skipped, never as passed.

#ifndef PLSH_TESTS_SKIP_HPP
#define PLSH_TESTS_SKIP_HPP

#include <cstdio>
#include <cstdlib>

namespace plsh_test {

constexpr int kSkipReturnCode = 77;

/// Prints why and ends the test executable with kSkipReturnCode.
[[noreturn]] inline void skip_executable(const char* why) {
  std::fprintf(stderr, "plsh: SKIP: %s\n", why);
  std::exit(kSkipReturnCode);
}

}  // namespace plsh_test

#endif  // PLSH_TESTS_SKIP_HPP
