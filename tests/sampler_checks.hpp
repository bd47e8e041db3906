// What the sampler's tests share (test_sampler.cpp, test_latin_hypercube.cpp): the bound of the
// statistical checks, sample statistics, and bitwise equality of draws.

#ifndef PLSH_TESTS_SAMPLER_CHECKS_HPP
#define PLSH_TESTS_SAMPLER_CHECKS_HPP

#include <cstdint>
#include <cstring>
#include <vector>

#include <plsh/sampler.hpp>

namespace plsh_test {

/// Number of standard errors a sample mean may stray from its expectation (two-sided normal tail
/// 6.3e-5).
constexpr double kStandardErrors = 4.0;

/// The bits of a double, for comparing draws exactly.
inline std::uint64_t bits(double value) {
  std::uint64_t result = 0;
  std::memcpy(&result, &value, sizeof(result));
  return result;
}

/// Whether two grids have bit-identical pitch and shift.
inline bool same_bits(const plsh::Grid& a, const plsh::Grid& b) {
  return bits(a.pitch) == bits(b.pitch) && bits(a.shift) == bits(b.shift);
}

inline double mean_of(const std::vector<double>& sample) {
  double sum = 0;
  for (const double x : sample) sum += x;
  return sum / static_cast<double>(sample.size());
}

/// Unbiased sample variance.
inline double variance_of(const std::vector<double>& sample) {
  const double mean = mean_of(sample);
  double sum = 0;
  for (const double x : sample) sum += (x - mean) * (x - mean);
  return sum / static_cast<double>(sample.size() - 1);
}

}  // namespace plsh_test

#endif  // PLSH_TESTS_SAMPLER_CHECKS_HPP
