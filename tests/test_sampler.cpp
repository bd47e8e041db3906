// Tests of sampler.hpp: the distribution of the RandomBinning draws (Gamma(2, 1/m) pitch, uniform
// shift), the co-membership law exp(-m r) it exists for, determinism of the counter-based draws,
// head_seed, fixed_grid, and every rejected argument. The law tests and the unbiased mean mask
// run for both samplings (Sampling::Independent and Sampling::LatinHypercube, whose single draws
// have the same law); what only the Latin hypercube draws do is tested in
// test_latin_hypercube.cpp.
//
// Statistical checks use fixed seeds and bounds derived from the known distribution: a sample
// mean must lie within 4 standard errors of its expectation (sampler_checks.hpp), and a
// Kolmogorov-Smirnov statistic below its critical value at level alpha = 1e-3.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <set>
#include <stdexcept>
#include <vector>

#include <plsh/detail/random.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

#include "sampler_checks.hpp"

namespace test_sampler {

namespace {

using plsh::Grid;
using plsh::Index;
using plsh_test::bits;
using plsh_test::kStandardErrors;
using plsh_test::mean_of;
using plsh_test::same_bits;
using plsh_test::variance_of;

constexpr double kInfinity = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// Draws per joint set of the Latin hypercube in the law tests.
constexpr Index kJointDraws = 20;

const char* sampling_name(plsh::Sampling sampling) {
  return sampling == plsh::Sampling::Independent ? "independent draws" : "Latin hypercube draws";
}

/// `count` mutually independent draws of slope `slope`, each with the law of one draw of
/// `sampling`: RandomBinning(slope, seed).draw(count), or draw t % 20 of
/// latin_hypercube_grids(slope, head_seed(mix64(seed), t), 20) for t < count (one draw of each of
/// `count` independent joint sets, the draw's position varying).
std::vector<Grid> marginal_draws(plsh::Sampling sampling, double slope, std::uint64_t seed,
                                 std::size_t count) {
  if (sampling == plsh::Sampling::Independent) {
    return plsh::RandomBinning(slope, seed).draw(static_cast<Index>(count));
  }
  std::vector<Grid> draws;
  for (std::size_t t = 0; t < count; ++t) {
    const std::vector<Grid> joint = plsh::latin_hypercube_grids(
        slope, plsh::head_seed(plsh::detail::mix64(seed), static_cast<Index>(t)), kJointDraws);
    draws.push_back(joint[t % static_cast<std::size_t>(kJointDraws)]);
  }
  return draws;
}

/// Kolmogorov-Smirnov statistic sup_x |F_N(x) - F(x)| of a sample against the CDF `cdf`.
template <class Cdf>
double kolmogorov_smirnov(std::vector<double> sample, Cdf cdf) {
  std::sort(sample.begin(), sample.end());
  const double n = static_cast<double>(sample.size());
  double statistic = 0;
  for (std::size_t i = 0; i < sample.size(); ++i) {
    const double f = cdf(sample[i]);
    statistic =
        std::max({statistic, f - static_cast<double>(i) / n, static_cast<double>(i + 1) / n - f});
  }
  return statistic;
}

/// Asymptotic critical value of the one-sample KS statistic at level alpha:
/// P(sqrt(N) D_N > c) -> 2 sum_k (-1)^(k-1) exp(-2 k^2 c^2) ~ 2 exp(-2 c^2), so
/// c = sqrt(-log(alpha / 2) / 2) (1.95 for alpha = 1e-3).
double kolmogorov_smirnov_critical(double alpha, std::size_t n) {
  return std::sqrt(-0.5 * std::log(alpha / 2)) / std::sqrt(static_cast<double>(n));
}

}  // namespace

TEST_CASE("pitch is Gamma(2, 1/slope), independent and Latin hypercube draws", "[sampler]") {
  const plsh::Sampling sampling =
      GENERATE(plsh::Sampling::Independent, plsh::Sampling::LatinHypercube);
  const std::size_t draws = 100000;
  Index head = 0;  // an independent stream per slope, seeded as the heads of a kernel run
  for (const double slope : {1.0 / 16, 1.0, 3.0}) {
    std::vector<double> pitch;
    std::vector<double> fraction;  // shift / pitch
    for (const Grid& grid : marginal_draws(sampling, slope, plsh::head_seed(7, head++), draws)) {
      pitch.push_back(grid.pitch);
      fraction.push_back(grid.shift / grid.pitch);
    }
    const double n = static_cast<double>(draws);
    const double theta = 1 / slope;  // Gamma scale
    INFO(sampling_name(sampling) << ", slope = " << slope << ", " << draws << " draws");

    // Gamma(k = 2, theta): mean 2 theta, variance 2 theta^2; the sample mean has standard error
    // sqrt(2 theta^2 / N).
    const double mean = mean_of(pitch);
    const double mean_bound = kStandardErrors * std::sqrt(2 * theta * theta / n);
    INFO("pitch mean " << mean << ", expected " << 2 * theta << ", bound " << mean_bound);
    CHECK(std::abs(mean - 2 * theta) <= mean_bound);

    // Sample variance: Var(s^2) ~ (mu4 - sigma^4) / N, with the fourth central moment of
    // Gamma(k, theta) mu4 = 3k(k + 2) theta^4 = 24 theta^4 and sigma^4 = 4 theta^4.
    const double variance = variance_of(pitch);
    const double variance_bound = kStandardErrors * std::sqrt((24 - 4) * std::pow(theta, 4) / n);
    INFO("pitch variance " << variance << ", expected " << 2 * theta * theta << ", bound "
                           << variance_bound);
    CHECK(std::abs(variance - 2 * theta * theta) <= variance_bound);

    // The whole law: Gamma(2, theta) has CDF 1 - (1 + x/theta) exp(-x/theta).
    const double statistic = kolmogorov_smirnov(pitch, [theta](double x) {
      return -std::expm1(-x / theta) - (x / theta) * std::exp(-x / theta);
    });
    const double critical = kolmogorov_smirnov_critical(1e-3, draws);
    INFO("KS statistic of the pitch against Gamma(2, 1/slope): " << statistic << ", critical "
                                                                 << critical);
    CHECK(statistic < critical);

    // Independence of pitch and shift / pitch: the sample correlation of independent variables
    // has standard error 1 / sqrt(N).
    const double fraction_mean = mean_of(fraction);
    double covariance = 0;
    for (std::size_t t = 0; t < draws; ++t) {
      covariance += (pitch[t] - mean) * (fraction[t] - fraction_mean);
    }
    covariance /= n - 1;
    const double correlation = covariance / std::sqrt(variance * variance_of(fraction));
    INFO("correlation of pitch and shift / pitch " << correlation);
    CHECK(std::abs(correlation) <= kStandardErrors / std::sqrt(n));
  }
}

TEST_CASE("shift is uniform on [0, pitch), independent and Latin hypercube draws", "[sampler]") {
  const plsh::Sampling sampling =
      GENERATE(plsh::Sampling::Independent, plsh::Sampling::LatinHypercube);
  const std::size_t draws = 100000;
  Index head = 0;
  for (const double slope : {1.0 / 64, 0.5, 2.0}) {
    std::vector<double> fraction;
    std::size_t outside = 0;
    for (const Grid& grid : marginal_draws(sampling, slope, plsh::head_seed(11, head++), draws)) {
      if (!(grid.shift >= 0 && grid.shift < grid.pitch)) ++outside;
      fraction.push_back(grid.shift / grid.pitch);
    }
    INFO(sampling_name(sampling) << ", slope = " << slope << ", " << draws << " draws");
    INFO("every shift lies in [0, pitch)");
    CHECK(outside == 0);

    // U[0, 1): mean 1/2, variance 1/12, so the sample mean has standard error sqrt(1/12/N).
    const double mean = mean_of(fraction);
    const double bound = kStandardErrors * std::sqrt(1.0 / 12 / static_cast<double>(draws));
    INFO("mean of shift / pitch " << mean << ", bound " << bound);
    CHECK(std::abs(mean - 0.5) <= bound);

    const double statistic = kolmogorov_smirnov(fraction, [](double x) { return x; });
    const double critical = kolmogorov_smirnov_critical(1e-3, draws);
    INFO("KS statistic of shift / pitch against U[0, 1): " << statistic << ", critical "
                                                           << critical);
    CHECK(statistic < critical);
  }
}

TEST_CASE("x and x + r share a bin with probability exp(-slope r), both samplings", "[sampler]") {
  // Per draw, positions x and x + r share a bin with probability max(0, 1 - r / pitch) given the
  // pitch; over the Gamma(2, 1/m) pitch this is exp(-m r). The indicator is Bernoulli(p) with
  // standard error sqrt(p (1 - p) / N); the conditional probability lies in [0, 1] with mean p,
  // so its variance is at most p (1 - p) as well. Distances are limited to m r <= 4 so that
  // N p >= 300 and the normal approximation holds.
  const plsh::Sampling sampling =
      GENERATE(plsh::Sampling::Independent, plsh::Sampling::LatinHypercube);
  INFO(sampling_name(sampling));
  const std::size_t draws = 20000;
  const double n = static_cast<double>(draws);
  Index head = 0;
  for (const double slope : {1.0 / 16, 1.0 / 4, 1.0}) {
    const std::vector<Grid> grids =
        marginal_draws(sampling, slope, plsh::head_seed(3, head++), draws);
    for (const Index x : {Index{0}, Index{987654321}}) {
      for (const Index r : {1, 2, 4, 8, 16, 32, 64}) {
        if (slope * static_cast<double>(r) > 4) continue;
        std::size_t together = 0;
        std::size_t disagreements = 0;
        double conditional = 0;
        for (const Grid& grid : grids) {
          const plsh::Block block = plsh::grid_block(grid, x, x, x + r + 1);
          const bool shared = block.contains(x + r);
          const bool shared_in_partition = plsh::BlockPartition(grid, x, x + r + 1).size() == 1;
          if (shared != shared_in_partition) ++disagreements;
          if (shared) ++together;
          conditional += std::max(0.0, 1 - static_cast<double>(r) / grid.pitch);
        }
        const double p = std::exp(-slope * static_cast<double>(r));
        const double bound = kStandardErrors * std::sqrt(p * (1 - p) / n);
        const double frequency = static_cast<double>(together) / n;
        conditional /= n;
        INFO("slope = " << slope << ", x = " << x << ", r = " << r << ": exp(-m r) = " << p
                        << ", frequency " << frequency << ", mean of max(0, 1 - r/pitch) "
                        << conditional << ", bound " << bound);
        CHECK(disagreements == 0);
        CHECK(std::abs(frequency - p) <= bound);
        CHECK(std::abs(conditional - p) <= bound);
      }
    }
  }
}

TEST_CASE("RandomBinning block boundaries occur at rate 1 - exp(-slope) per position",
          "[sampler]") {
  // Positions p - 1 and p fall in different blocks with probability 1 - exp(-m), so a partition of
  // L positions has (L - 1)(1 - exp(-m)) boundaries in expectation, which tends to m (L - 1), the
  // expected number of bin edges, as m -> 0. (The count of bin edges on the real line itself,
  // about L / pitch, has infinite variance since E[pitch^-2] diverges for shape 2, so it is not
  // a usable test statistic; the count on integers is bounded by L - 1.) The bound is 4 standard
  // errors of the mean count, with the per-draw variance estimated from the sample.
  const Index length = 256;
  const Index first = 1000000;
  const std::size_t draws = 8000;
  Index head = 0;
  for (const double slope : {1.0 / 32, 1.0 / 4, 1.0, 4.0}) {
    const plsh::RandomBinning sampler(slope, plsh::head_seed(5, head++));
    std::vector<double> boundaries;
    for (const Grid& grid : sampler.draw(static_cast<Index>(draws))) {
      const plsh::BlockPartition partition(grid, first, first + length);
      boundaries.push_back(static_cast<double>(partition.size() - 1));
    }
    const double expected = static_cast<double>(length - 1) * -std::expm1(-slope);
    const double mean = mean_of(boundaries);
    const double bound =
        kStandardErrors * std::sqrt(variance_of(boundaries) / static_cast<double>(draws));
    INFO("slope = " << slope << ": mean boundaries " << mean << ", expected " << expected
                    << ", bound " << bound << "; per adjacent pair " << mean / (length - 1)
                    << ", 1 - exp(-m) = " << -std::expm1(-slope));
    CHECK(bound > 0);
    CHECK(std::abs(mean - expected) <= bound);
  }
}

TEST_CASE("RandomBinning draws are pure functions of (slope, seed, index)", "[sampler]") {
  const double slope = 0.37;
  const std::uint64_t seed = 123456789;
  const plsh::RandomBinning a(slope, seed);
  const plsh::RandomBinning b(slope, seed);
  CHECK(a.slope() == slope);
  CHECK(a.seed() == seed);

  const std::uint64_t indices[] = {0, 1, 2, 1000, 1ULL << 32, (1ULL << 63) + 5, ~0ULL - 1, ~0ULL};
  for (const std::uint64_t index : indices) {
    INFO("index " << index << ": two samplers with the same slope and seed give the same bits");
    CHECK(same_bits(a(index), b(index)));
    CHECK(same_bits(a(index), a(index)));
    CHECK(a(index).pitch > 0);
    CHECK(std::isfinite(a(index).pitch));
  }

  {
    INFO("draw(count, first) equals the individual draws first .. first + count - 1");
    const std::vector<Grid> grids = a.draw(50, 1000);
    REQUIRE(grids.size() == 50);
    for (std::size_t t = 0; t < grids.size(); ++t) {
      INFO("draw " << t);
      CHECK(same_bits(grids[t], a(1000 + t)));
    }
    const std::vector<Grid> from_zero = a.draw(3);
    REQUIRE(from_zero.size() == 3);
    CHECK(same_bits(from_zero[2], a(2)));
    CHECK(a.draw(0).empty());
  }

  {
    INFO("draws taken out of order equal draws taken in order");
    std::vector<Grid> backwards;
    for (std::uint64_t t = 20; t-- > 0;) backwards.push_back(a(t));
    const std::vector<Grid> forwards = a.draw(20);
    for (std::size_t t = 0; t < 20; ++t) CHECK(same_bits(forwards[t], backwards[19 - t]));
  }

  {
    INFO("different indices give different pitches");
    std::set<std::uint64_t> pitches_over_indices;
    for (const Grid& grid : a.draw(200)) pitches_over_indices.insert(bits(grid.pitch));
    CHECK(pitches_over_indices.size() == 200);
  }
}

TEST_CASE("RandomBinning streams of different seeds share no draws", "[sampler]") {
  // A seed selects an independent stream: over seeds 0..63 and draws 0..15, no pitch and no
  // shift fraction may repeat (1024 values each; a chance coincidence of two doubles carrying 53
  // random bits has probability about 1024^2 / 2^54 < 1e-10).
  const double slope = 0.37;
  std::set<std::uint64_t> pitches;
  std::set<std::uint64_t> fractions;
  for (std::uint64_t seed = 0; seed < 64; ++seed) {
    for (const Grid& grid : plsh::RandomBinning(slope, seed).draw(16)) {
      pitches.insert(bits(grid.pitch));
      fractions.insert(bits(grid.shift / grid.pitch));
    }
  }
  INFO("distinct pitches " << pitches.size() << " and shift fractions " << fractions.size()
                           << " of 1024 draws");
  CHECK(pitches.size() == 1024);
  CHECK(fractions.size() == 1024);
  INFO("draw 0 of seeds 0 and 1: pitches " << plsh::RandomBinning(slope, 0)(0).pitch << ", "
                                           << plsh::RandomBinning(slope, 1)(0).pitch);
  CHECK(plsh::RandomBinning(slope, 0)(0).pitch != plsh::RandomBinning(slope, 1)(0).pitch);
}

TEST_CASE("RandomBinning draws whose indices differ by 2^62 are different draws", "[sampler]") {
  // The index is a full 64-bit counter: draw t and draw t + 2^62 must not be the same grid.
  const plsh::RandomBinning sampler(0.25, 9);
  const std::uint64_t offset = 1ULL << 62;
  for (const std::uint64_t t : {0ULL, 1ULL, 12345ULL}) {
    INFO("draws " << t << " and " << t + offset << ": pitches " << sampler(t).pitch << ", "
                  << sampler(t + offset).pitch);
    CHECK_FALSE(same_bits(sampler(t), sampler(t + offset)));
  }
}

TEST_CASE("RandomBinning with slope 0 has an infinite pitch", "[sampler]") {
  const plsh::RandomBinning sampler(0.0, 4);
  for (const Grid& grid : sampler.draw(10)) {
    INFO("every draw is one bin holding everything");
    CHECK(std::isinf(grid.pitch));
    CHECK(grid.pitch > 0);
    CHECK(grid.shift == 0);
  }
}

TEST_CASE("head_seed is the documented SplitMix64 mix", "[sampler]") {
  {
    // Published SplitMix64 outputs for the seed 0 stream (states 0, gamma, 2 gamma).
    INFO("detail::mix64 reproduces the SplitMix64 reference outputs");
    CHECK(plsh::detail::mix64(0) == 0xe220a8397b1dcdafULL);
    CHECK(plsh::detail::mix64(0x9e3779b97f4a7c15ULL) == 0x6e789e6aa1b965f4ULL);
    CHECK(plsh::detail::mix64(0x3c6ef372fe94f82aULL) == 0x06c45d188009454fULL);
  }
  {
    INFO("head_seed(s, h) = mix64(s ^ mix64(h)), literal values");
    static_assert(plsh::head_seed(0, 0) == 0xa706dd2f4d197e6fULL, "head_seed is constexpr");
    CHECK(plsh::head_seed(0, 0) == 0xa706dd2f4d197e6fULL);
    CHECK(plsh::head_seed(0, 1) == 0x5e41ab087439611eULL);
    CHECK(plsh::head_seed(42, 3) == 0x43aa8652ad94b3a2ULL);
    CHECK(plsh::head_seed(~0ULL, 31) == 0xd4e473ad1da233e7ULL);
  }
  {
    INFO("deterministic, and distinct over heads and over seeds");
    CHECK(plsh::head_seed(77, 5) == plsh::head_seed(77, 5));
    std::set<std::uint64_t> over_heads;
    for (Index h = 0; h < 1024; ++h) over_heads.insert(plsh::head_seed(77, h));
    CHECK(over_heads.size() == 1024);
    std::set<std::uint64_t> over_seeds;
    for (std::uint64_t s = 0; s < 1024; ++s) over_seeds.insert(plsh::head_seed(s, 5));
    CHECK(over_seeds.size() == 1024);
  }
}

TEST_CASE("fixed_grid values", "[sampler]") {
  const Grid plain = plsh::fixed_grid(8);
  CHECK(plain.pitch == 8);
  CHECK(plain.shift == 0);
  const Grid shifted = plsh::fixed_grid(8, 3.5);
  CHECK(shifted.pitch == 8);
  CHECK(shifted.shift == 3.5);
  const Grid fractional = plsh::fixed_grid(2.5, -1);
  CHECK(fractional.pitch == 2.5);
  CHECK(fractional.shift == -1);
  INFO("an infinite block size is one block, whatever the shift");
  const Grid everything = plsh::fixed_grid(kInfinity, 7);
  CHECK(std::isinf(everything.pitch));
  CHECK(everything.shift == 0);
}

TEST_CASE("sampler functions reject invalid arguments", "[sampler]") {
  {
    INFO("RandomBinning: negative, NaN and infinite slopes");
    REQUIRE_THROWS_AS(plsh::RandomBinning(-1.0), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::RandomBinning(-1e-300, 3), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::RandomBinning(kNaN), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::RandomBinning(kInfinity), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::RandomBinning(-kInfinity), std::invalid_argument);
  }
  {
    INFO("RandomBinning::draw with a negative count");
    const plsh::RandomBinning sampler(0.5, 1);
    REQUIRE_THROWS_AS(sampler.draw(-1), std::invalid_argument);
    REQUIRE_THROWS_AS(sampler.draw(-1, 10), std::invalid_argument);
  }
  {
    INFO("fixed_grid: non-positive or NaN block size");
    REQUIRE_THROWS_AS(plsh::fixed_grid(0), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::fixed_grid(-4), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::fixed_grid(-kInfinity), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::fixed_grid(kNaN), std::invalid_argument);
  }
  {
    INFO("fixed_grid: non-finite shift");
    REQUIRE_THROWS_AS(plsh::fixed_grid(4, kNaN), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::fixed_grid(4, kInfinity), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::fixed_grid(4, -kInfinity), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::fixed_grid(kInfinity, kNaN), std::invalid_argument);
  }
}

TEST_CASE("the mean mask over seeds equals exp(-slope |i - j|), both samplings",
          "[sampler][latin_hypercube]") {
  // E[K^] = K: average the mean masks of N = 2000 seeds and compare every entry with
  // p = exp(-m|i - j|). Independent draws: Var(K^_ij) = p (1 - p) / s. Latin hypercube draws: at
  // most s / (s - 1) times that (Owen, 1997: a Latin hypercube of s points has at most
  // s / (s - 1) times the variance of s independent points, for any square-integrable function).
  // The average over seeds has standard error sqrt(Var / N); every entry must lie within 4 of
  // them. Pairs are limited to m |i - j| <= 4, so that N s p >= 180 and the normal
  // approximation holds.
  const plsh::Sampling sampling =
      GENERATE(plsh::Sampling::Independent, plsh::Sampling::LatinHypercube);
  const Index n = 40;
  const int seeds = 2000;
  Index head = 0;
  for (const double slope : {1.0 / 16, 1.0 / 4, 1.0}) {
    for (const Index samples : {5, 20}) {
      plsh::PlshOptions options;
      options.samples = samples;
      options.sampling = sampling;
      Eigen::MatrixXd mean = Eigen::MatrixXd::Zero(n, n);
      for (int seed = 0; seed < seeds; ++seed) {
        options.seed = plsh::head_seed(41, head++);
        mean += plsh::mean_mask<double>(n, plsh::kernel_grids({slope}, options)[0]);
      }
      mean /= seeds;
      const double s = static_cast<double>(samples);
      const double inflation = sampling == plsh::Sampling::Independent ? 1 : s / (s - 1);
      Index checked = 0;
      Index outside = 0;
      double worst = 0;  // largest |mean - p| in standard errors
      for (Index i = 0; i < n; ++i) {
        for (Index j = 0; j < n; ++j) {
          const double r = static_cast<double>(i > j ? i - j : j - i);
          if (slope * r > 4) continue;
          const double p = std::exp(-slope * r);
          const double standard_error = std::sqrt(inflation * p * (1 - p) / s / seeds);
          const double deviation = std::abs(mean(i, j) - p);
          // The diagonal is exactly 1 up to the rounding of s additions of 1/s.
          if (i == j) {
            if (deviation > 1e-12) ++outside;
          } else {
            if (deviation > kStandardErrors * standard_error) ++outside;
            worst = std::max(worst, deviation / standard_error);
          }
          ++checked;
        }
      }
      INFO(sampling_name(sampling)
           << ", slope " << slope << ", s = " << samples << ": " << checked
           << " entries, largest deviation " << worst << " standard errors");
      CHECK(checked > n);
      CHECK(outside == 0);
    }
  }
}

}  // namespace test_sampler
