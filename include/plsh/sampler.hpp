#ifndef PLSH_SAMPLER_HPP
#define PLSH_SAMPLER_HPP

/// \file sampler.hpp
/// Random Binning Features (Rahimi and Recht, 2007) for the Laplacian kernel on the line.

#include <Eigen/Core>
#include <array>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "detail/check.hpp"
#include "detail/random.hpp"
#include "limits.hpp"
#include "options.hpp"

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

/// The Random Binning grid of slope \f$m\f$ from three uniforms in (0, 1): pitch
/// \f$\delta = (-\log u_1 - \log u_2)/m\f$, shift \f$u_3\,\delta\f$ (slope 0: one bin).
inline Grid binning_grid(double slope, double u1, double u2, double u3) {
  if (slope == 0) return Grid{std::numeric_limits<double>::infinity(), 0.0};
  const double exponentials = -std::log(u1) - std::log(u2);
  double pitch = exponentials / slope;
  // A huge slope can underflow the pitch to 0; any pitch <= 1 gives the same blocks (one
  // position each), and the grid stays valid.
  if (!(pitch > 0)) pitch = std::numeric_limits<double>::denorm_min();
  double shift = u3 * pitch;
  if (!(shift < pitch)) shift = 0;  // rounding of u * pitch up to pitch: the same bins.
  return Grid{pitch, shift};
}

/// A uniformly random permutation of 0, ..., count - 1 (Fisher and Yates): step i = count - 1,
/// ..., 1 swaps i with j uniform on [0, i], taken from `random.word(i, lane)` by rejection
/// (a word below \f$2^{64} \bmod (i + 1)\f$ is replaced by the word at lane + `lane_stride`),
/// so every permutation has probability exactly 1/count!.
inline std::vector<Index> random_permutation(const CounterRandom& random, Index count,
                                             std::uint64_t lane, std::uint64_t lane_stride) {
  std::vector<Index> permutation(static_cast<std::size_t>(count));
  for (Index i = 0; i < count; ++i) permutation[static_cast<std::size_t>(i)] = i;
  for (Index i = count - 1; i > 0; --i) {
    const auto bound = static_cast<std::uint64_t>(i) + 1;
    const std::uint64_t rejected_below = (0 - bound) % bound;  // 2^64 mod bound
    std::uint64_t word = random.word(static_cast<std::uint64_t>(i), lane);
    for (std::uint64_t attempt = 1; word < rejected_below; ++attempt) {
      word = random.word(static_cast<std::uint64_t>(i), lane + attempt * lane_stride);
    }
    std::swap(permutation[static_cast<std::size_t>(i)],
              permutation[static_cast<std::size_t>(word % bound)]);
  }
  return permutation;
}

/// The uniforms of latin_hypercube_grids: element t holds \f$u_c = (\pi_c(t) + V_{t,c})/s\f$,
/// c = 0, 1, 2, for `count` = s >= 1 draws, with \f$V_{t,c}\f$ = `CounterRandom(seed).unit(t, c)`
/// and \f$\pi_c\f$ = `random_permutation(CounterRandom(seed), s, 3 + c, 3)`.
inline std::vector<std::array<double, 3>> latin_hypercube_uniforms(std::uint64_t seed,
                                                                   Index count) {
  const CounterRandom random(seed);
  constexpr std::uint64_t kUniforms = 3;
  std::vector<std::array<double, 3>> uniforms(static_cast<std::size_t>(count));
  const double s = static_cast<double>(count);
  for (std::uint64_t c = 0; c < kUniforms; ++c) {
    const std::vector<Index> strata = random_permutation(random, count, kUniforms + c, kUniforms);
    for (Index t = 0; t < count; ++t) {
      const auto k = static_cast<std::size_t>(t);
      const double u =
          (static_cast<double>(strata[k]) + random.unit(static_cast<std::uint64_t>(t), c)) / s;
      uniforms[k][c] = u < 1 ? u : 1 - 0x1p-53;  // (s - 1 + V)/s can round up to 1
    }
  }
  return uniforms;
}

/// A sampling choice must be one of the enumerators of Sampling.
inline void require_sampling(Sampling sampling, const char* function,
                             const char* name = "sampling") {
  require(sampling == Sampling::Independent || sampling == Sampling::LatinHypercube, function, [&] {
    return std::string(name) + " must be Sampling::Independent or Sampling::LatinHypercube (got " +
           std::to_string(static_cast<long long>(sampling)) + ")";
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
    return detail::binning_grid(slope_, random_.unit(index, 0), random_.unit(index, 1),
                                random_.unit(index, 2));
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

/// The s draws of one head drawn jointly as a Latin hypercube over the three uniforms of a draw
/// (McKay, Beckman and Conover, 1979): with independent uniformly random permutations
/// \f$\pi_0, \pi_1, \pi_2\f$ of \f$\{0, \dots, s-1\}\f$ and independent jitters
/// \f$V_{t,c} \sim U(0, 1)\f$, draw \f$t\f$ takes \f$u_c = (\pi_c(t) + V_{t,c})/s\f$ and
/// forms its grid as RandomBinning does: pitch \f$(-\log u_0 - \log u_1)/m\f$, shift
/// \f$u_2 \cdot \text{pitch}\f$.
///
/// Each \f$u_c\f$ alone is uniform on (0, 1) (\f$\pi_c(t)\f$ is uniform on the strata), and the
/// three of one draw are independent (independent permutations), so every draw has exactly the
/// Random Binning law and \f$E[\hat K] = K\f$ holds as for independent draws. The draws of a
/// head are dependent: each uniform takes one value in each stratum \f$[k/s, (k+1)/s)\f$, so
/// the s pitches cover the Gamma(2, 1/m) law more evenly than s independent ones, which removes
/// the additive part of the variance over the uniforms (Stein, 1987): the spectral error of the
/// mean mask and the attention output's error fall (docs/bench/accuracy.md has the figures and the
/// script that measures them).
///
/// The jitter \f$V_{t,c}\f$ is word (t, c) of detail::CounterRandom(seed) and \f$\pi_c\f$ is
/// drawn from words (i, 3 + c + 3a) (detail::random_permutation), so the draws are a pure
/// function of (slope, seed, count), identical on every platform; with count 1 the one draw
/// equals RandomBinning(slope, seed)(0). Cost O(count) time and memory.
///
/// \param slope \f$m \ge 0\f$, finite. \param seed as RandomBinning. \param count s, 1 to
/// kMaxSamples.
/// \throws std::invalid_argument for a bad slope or count.
inline std::vector<Grid> latin_hypercube_grids(double slope, std::uint64_t seed, Index count) {
  const char* function = "latin_hypercube_grids";
  detail::require_slope(slope, function);
  detail::require_samples(count, function, "count");
  std::vector<Grid> grids;
  grids.reserve(static_cast<std::size_t>(count));
  for (const auto& u : detail::latin_hypercube_uniforms(seed, count)) {
    grids.push_back(detail::binning_grid(slope, u[0], u[1], u[2]));
  }
  return grids;
}

namespace detail {

/// The grids of every head, checked and named for `function`: grids[h] holds the `samples`
/// draws of slope slopes[h] and seed head_seed(seed, h), drawn as `sampling` says.
inline std::vector<std::vector<Grid>> head_grids(const std::vector<double>& slopes, Index samples,
                                                 std::uint64_t seed, Sampling sampling,
                                                 const char* function) {
  require_samples(samples, function, "samples");
  require_sampling(sampling, function);
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    require_slope(slopes[h], function, "slopes", static_cast<std::int64_t>(h));
  }
  std::vector<std::vector<Grid>> grids;
  grids.reserve(slopes.size());
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    const std::uint64_t stream = head_seed(seed, static_cast<Index>(h));
    grids.push_back(sampling == Sampling::LatinHypercube
                        ? latin_hypercube_grids(slopes[h], stream, samples)
                        : RandomBinning(slopes[h], stream).draw(samples));
  }
  return grids;
}

/// kernel_grids with errors named for `function`, the kernel whose entry point draws them.
inline std::vector<std::vector<Grid>> kernel_grids(const std::vector<double>& slopes,
                                                   const PlshOptions& options,
                                                   const char* function) {
  require_samples(options.samples, function, "options.samples");
  require_sampling(options.sampling, function, "options.sampling");
  require(options.near_field >= 0 && options.near_field <= 1, function,
          "options.near_field must be in [0, 1] (0: no near field)");
  return head_grids(slopes, options.samples, options.seed, options.sampling, function);
}

}  // namespace detail

/// The grids of a multi-head kernel with independent draws: `grids[h][t]` is
/// `RandomBinning(slopes[h], head_seed(seed, h))(t)`, for heads `h < slopes.size()` and draws
/// `t < samples`; kernel_grids with Sampling::Independent.
///
/// \param slopes one per head, finite and non-negative. \param samples draws per head,
/// 1 to kMaxSamples. \param seed as PlshOptions::seed.
/// \throws std::invalid_argument for a bad slope or `samples` outside [1, kMaxSamples].
inline std::vector<std::vector<Grid>> draw_head_grids(const std::vector<double>& slopes,
                                                      Index samples, std::uint64_t seed = 0) {
  return detail::head_grids(slopes, samples, seed, Sampling::Independent, "draw_head_grids");
}

/// The grids plsh_attention, its backward and KvCache use with `options`: `grids[h]` holds the
/// `options.samples` draws of head h with seed `head_seed(options.seed, h)`, drawn as
/// `options.sampling` says: Sampling::Independent, `grids[h][t]` is
/// `RandomBinning(slopes[h], head_seed(options.seed, h))(t)` (draw_head_grids);
/// Sampling::LatinHypercube, `grids[h]` is
/// `latin_hypercube_grids(slopes[h], head_seed(options.seed, h), options.samples)`.
/// A caller can reproduce or inspect a kernel's blocks with them.
///
/// \param slopes one per head, finite and non-negative. \param options only `samples` (1 to
/// kMaxSamples), `seed` and `sampling` are read (and `near_field` checked: in [0, 1]).
/// \throws std::invalid_argument for a bad slope, `samples`, `sampling` or `near_field`.
inline std::vector<std::vector<Grid>> kernel_grids(const std::vector<double>& slopes,
                                                   const PlshOptions& options) {
  return detail::kernel_grids(slopes, options, "kernel_grids");
}

}  // namespace plsh

#endif  // PLSH_SAMPLER_HPP
