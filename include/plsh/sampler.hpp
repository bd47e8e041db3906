#ifndef PLSH_SAMPLER_HPP
#define PLSH_SAMPLER_HPP

/// \file sampler.hpp
/// Random Binning Features (Rahimi and Recht, 2007) for the Laplacian kernel on the line.

#include <Eigen/Core>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "detail/check.hpp"
#include "detail/random.hpp"
#include "limits.hpp"

namespace plsh {

using Index = Eigen::Index;

/// A regular grid on the line: bins \f$[\text{shift} + k\,\text{pitch},\ \text{shift} +
/// (k+1)\,\text{pitch})\f$ for every integer \f$k\f$. An infinite pitch is one bin holding
/// everything.
struct Grid {
  double pitch;
  double shift;
};

namespace detail {

/// A grid that partitions the line: pitch positive (infinite allowed, NaN rejected), shift finite.
inline void require_grid(const Grid& grid, const char* function, const char* name = "grid") {
  require(grid.pitch > 0, function, name, " pitch must be positive");
  require(std::isfinite(grid.shift), function, name, " shift must be finite");
}

/// A number of draws per head of the multi-head kernels: 1 to kMaxSamples.
inline void require_samples(Index samples, const char* function, const char* name = "samples") {
  require(samples >= 1 && samples <= kMaxSamples, function, [&] {
    return std::string(name) + " must lie in [1, kMaxSamples = " + std::to_string(kMaxSamples) +
           "] (got " + std::to_string(samples) + ")";
  });
}

}  // namespace detail

/// Draws grids whose bins co-locate two points \f$x, y\f$ with probability
/// \f$e^{-m|x-y|}\f$, the ALiBi factor of slope \f$m\f$.
///
/// Draw \f$t\f$: pitch \f$\delta = (E_1 + E_2)/m \sim \mathrm{Gamma}(2, 1/m)\f$ with
/// \f$E = -\log U\f$ standard exponentials, shift \f$u = U_3\,\delta \sim U[0, \delta)\f$.
/// Given \f$\delta\f$, two points share a bin with probability \f$\max(0, 1 - |x-y|/\delta)\f$;
/// averaging over \f$\delta\f$ gives \f$e^{-m|x-y|}\f$. The uniforms come from a counter-based
/// generator, so draw \f$t\f$ is a pure function of (slope, seed, t), identical on every platform.
/// Slope 0 gives an infinite pitch: one block holding every position.
///
/// \code
/// plsh::RandomBinning sampler(1.0 / 32, 42);
/// std::vector<plsh::Grid> grids = sampler.draw(20);   // draws 0..19
/// plsh::Grid again = sampler(7);                       // equals grids[7]
/// \endcode
class RandomBinning {
 public:
  /// \param slope \f$m \ge 0\f$, finite. \param seed selects an independent stream of draws.
  /// \throws std::invalid_argument for a negative or non-finite slope.
  explicit RandomBinning(double slope, std::uint64_t seed = 0)
      : slope_(slope), seed_(seed), random_(seed) {
    detail::require_slope(slope, "RandomBinning");
  }

  /// Draw number `index`.
  Grid operator()(std::uint64_t index) const {
    if (slope_ == 0) return Grid{std::numeric_limits<double>::infinity(), 0.0};
    const double exponentials =
        -std::log(random_.unit(index, 0)) - std::log(random_.unit(index, 1));
    double pitch = exponentials / slope_;
    // A huge slope can underflow the pitch to 0; any pitch <= 1 gives the same blocks (one
    // position each), and the grid stays valid.
    if (!(pitch > 0)) pitch = std::numeric_limits<double>::denorm_min();
    double shift = random_.unit(index, 2) * pitch;
    if (!(shift < pitch)) shift = 0;  // rounding of u * pitch up to pitch: the same bins.
    return Grid{pitch, shift};
  }

  /// Draws `first, first + 1, ..., first + count - 1` (indices modulo \f$2^{64}\f$).
  /// \throws std::invalid_argument if `count` is negative or more than a vector can hold.
  std::vector<Grid> draw(Index count, std::uint64_t first = 0) const {
    detail::require(count >= 0, "RandomBinning::draw", "count must be non-negative");
    detail::require(static_cast<std::uint64_t>(count) <= std::vector<Grid>().max_size(),
                    "RandomBinning::draw", "count exceeds the largest vector of grids");
    std::vector<Grid> grids;
    grids.reserve(static_cast<std::size_t>(count));
    for (Index t = 0; t < count; ++t)
      grids.push_back((*this)(first + static_cast<std::uint64_t>(t)));
    return grids;
  }

  double slope() const { return slope_; }
  std::uint64_t seed() const { return seed_; }

 private:
  double slope_;
  std::uint64_t seed_;
  detail::CounterRandom random_;
};

/// The deterministic partition of the paper's fixed-blocks baseline: blocks of `block_size`
/// positions starting at `shift` (an infinite block size is one block).
/// \throws std::invalid_argument unless `block_size > 0` and `shift` is finite.
inline Grid fixed_grid(double block_size, double shift = 0) {
  detail::require(block_size > 0, "fixed_grid", "block_size must be positive");
  detail::require(std::isfinite(shift), "fixed_grid", "shift must be finite");
  return Grid{block_size, std::isinf(block_size) ? 0.0 : shift};
}

/// The seed of head `head` in a multi-head kernel run with `seed`:
/// \f$\mathrm{head\_seed}(s, h) = \mathrm{mix64}(s \oplus \mathrm{mix64}(h))\f$, with mix64 the
/// SplitMix64 output function of `x + 0x9e3779b97f4a7c15`. Head `h`, draw `t` of a kernel uses
/// `RandomBinning(slopes[h], head_seed(seed, h))(t)`.
constexpr std::uint64_t head_seed(std::uint64_t seed, Index head) {
  return detail::mix64(seed ^ detail::mix64(static_cast<std::uint64_t>(head)));
}

/// The grids of a multi-head kernel: `grids[h][t]` is
/// `RandomBinning(slopes[h], head_seed(seed, h))(t)`, for heads `h < slopes.size()` and draws
/// `t < samples`. plsh_attention, its backward and KvCache partition head h with exactly these
/// grids, so a caller can reproduce or inspect their blocks.
///
/// \param slopes one per head, finite and non-negative. \param samples draws per head,
/// 1 to kMaxSamples. \param seed as PlshOptions::seed.
/// \throws std::invalid_argument for a bad slope or `samples` outside [1, kMaxSamples].
inline std::vector<std::vector<Grid>> draw_head_grids(const std::vector<double>& slopes,
                                                      Index samples, std::uint64_t seed = 0) {
  const char* function = "draw_head_grids";
  detail::require_samples(samples, function);
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    detail::require_slope(slopes[h], function, "slopes", static_cast<std::int64_t>(h));
  }
  std::vector<std::vector<Grid>> grids;
  grids.reserve(slopes.size());
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    grids.push_back(RandomBinning(slopes[h], head_seed(seed, static_cast<Index>(h))).draw(samples));
  }
  return grids;
}

}  // namespace plsh

#endif  // PLSH_SAMPLER_HPP
