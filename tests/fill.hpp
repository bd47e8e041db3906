// The one random fill of plsh's tests and benchmarks: element i of a fill seeded `seed` is
// amplitude * (2U - 1) with U = plsh::detail::CounterRandom(seed).unit(i, 0), the same numbers on
// every platform.

#ifndef PLSH_TESTS_FILL_HPP
#define PLSH_TESTS_FILL_HPP

#include <cstddef>
#include <cstdint>
#include <vector>

#include <plsh/detail/random.hpp>

namespace plsh_test {

/// Element `index` of the fill of `random`'s seed: amplitude * (2U - 1), in [-amplitude,
/// amplitude].
inline double uniform_value(const plsh::detail::CounterRandom& random, std::uint64_t index,
                            double amplitude = 1.0) {
  return amplitude * (2.0 * random.unit(index, 0) - 1.0);
}

/// Every element of `values` from the fill seeded `seed`.
template <class Scalar>
void fill_uniform(std::vector<Scalar>& values, std::uint64_t seed, double amplitude = 1.0) {
  const plsh::detail::CounterRandom random(seed);
  for (std::size_t i = 0; i < values.size(); ++i) {
    values[i] = static_cast<Scalar>(uniform_value(random, i, amplitude));
  }
}

/// `count` elements of the fill seeded `seed`.
template <class Scalar>
std::vector<Scalar> uniform_values(std::size_t count, std::uint64_t seed, double amplitude = 1.0) {
  std::vector<Scalar> values(count);
  fill_uniform(values, seed, amplitude);
  return values;
}

}  // namespace plsh_test

#endif  // PLSH_TESTS_FILL_HPP
