#ifndef PLSH_DETAIL_RANDOM_HPP
#define PLSH_DETAIL_RANDOM_HPP

#include <cstdint>

namespace plsh {
namespace detail {

/// SplitMix64 output function (Steele, Lea and Flood, 2014) applied to `x + golden gamma`:
/// a bijective 64-bit mix with full avalanche. Integer arithmetic only, so identical on every
/// platform and compiler.
constexpr std::uint64_t mix64(std::uint64_t x) {
  x += 0x9e3779b97f4a7c15ULL;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ULL;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebULL;
  return x ^ (x >> 31);
}

/// Uniform double in the open interval (0, 1) from the top 53 bits of `bits`.
constexpr double open_unit(std::uint64_t bits) {
  return (static_cast<double>(bits >> 11) + 0.5) * 0x1.0p-53;
}

/// A counter-based generator: word `(counter, lane)` is a pure function of the key, so draws can be
/// taken in any order, by any thread, with the same result. Every 64-bit counter gets its own
/// stream: \f$w = \mathrm{mix64}(\mathrm{mix64}(\text{key} \oplus \text{counter}) +
/// \text{lane})\f$.
class CounterRandom {
 public:
  explicit constexpr CounterRandom(std::uint64_t seed) : key_(mix64(seed)) {}

  constexpr std::uint64_t word(std::uint64_t counter, std::uint64_t lane) const {
    return mix64(mix64(key_ ^ counter) + lane);
  }

  constexpr double unit(std::uint64_t counter, std::uint64_t lane) const {
    return open_unit(word(counter, lane));
  }

 private:
  std::uint64_t key_;
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_RANDOM_HPP
