// Tests of metrics.hpp: mask_error against a brute-force computation and closed forms, and the
// s^(-1/2) decay of the spectral and max-norm errors of the mean mask.

#include <catch2/catch.hpp>

#include <Eigen/SVD>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/analysis.hpp>
#include <plsh/sampler.hpp>

namespace test_metrics {

namespace {

using plsh::Grid;
using plsh::Index;

constexpr double kEpsilon = std::numeric_limits<double>::epsilon();
constexpr double kInfinity = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

bool same_bin(const Grid& grid, Index p, Index q) {
  if (std::isinf(grid.pitch)) return true;
  return std::floor((static_cast<double>(p) - grid.shift) / grid.pitch) ==
         std::floor((static_cast<double>(q) - grid.shift) / grid.pitch);
}

/// E = (1/s) sum_t M_t - K, built entry by entry from the bin test and exp(-m|i-j|).
Eigen::MatrixXd brute_force_error(Index n, double slope, const std::vector<Grid>& grids) {
  Eigen::MatrixXd error(n, n);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < n; ++j) {
      Index together = 0;
      for (const Grid& grid : grids) together += same_bin(grid, i, j) ? 1 : 0;
      error(i, j) = static_cast<double>(together) / static_cast<double>(grids.size()) -
                    std::exp(-slope * static_cast<double>(i > j ? i - j : j - i));
    }
  }
  return error;
}

/// Least-squares slope of log(y) against log(x).
double log_log_slope(const std::vector<double>& x, const std::vector<double>& y) {
  const double count = static_cast<double>(x.size());
  double sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t k = 0; k < x.size(); ++k) {
    const double lx = std::log(x[k]);
    const double ly = std::log(y[k]);
    sx += lx;
    sy += ly;
    sxx += lx * lx;
    sxy += lx * ly;
  }
  return (count * sxy - sx * sy) / (count * sxx - sx * sx);
}

}  // namespace

TEST_CASE("mask_error matches a brute-force computation", "[metrics]") {
  const Index n = 40;
  Index head = 0;
  for (const double slope : {0.05, 0.2, 1.5}) {
    for (const Index samples : {1, 7, 30}) {
      const std::vector<Grid> grids =
          plsh::RandomBinning(slope, plsh::head_seed(5, head++)).draw(samples);
      const Eigen::MatrixXd error = brute_force_error(n, slope, grids);
      const double max_abs = error.cwiseAbs().maxCoeff();
      const Eigen::JacobiSVD<Eigen::MatrixXd> svd(error);
      const double largest_singular_value = svd.singularValues()(0);
      const plsh::MaskError measured = plsh::mask_error(n, slope, grids);

      // The library sums s weights 1/s where the reference divides a count by s: entries differ by
      // at most (s + 1) eps. By Weyl's inequality the norms then differ by at most n (s + 1) eps,
      // plus the backward error of the two symmetric solvers, n eps ||E||_2 each.
      const double s = static_cast<double>(samples);
      const double entry_tolerance = (s + 1) * kEpsilon;
      const double spectral_tolerance =
          static_cast<double>(n) * entry_tolerance +
          2 * static_cast<double>(n) * kEpsilon * largest_singular_value;
      INFO("slope " << slope << ", s = " << samples << ": max " << measured.max << " vs " << max_abs
                    << ", spectral " << measured.spectral << " vs " << largest_singular_value);
      CHECK(std::abs(measured.max - max_abs) <= entry_tolerance);
      CHECK(std::abs(measured.spectral - largest_singular_value) <= spectral_tolerance);
      // For a symmetric matrix ||E||_2 >= max |E_ij|, and here both are positive.
      CHECK(measured.max > 0);
      CHECK(measured.spectral >= measured.max);
    }
  }
}

TEST_CASE("mask_error closed forms", "[metrics]") {
  const Index n = 33;
  {
    INFO("slope 0 and one block holding everything: no error");
    const plsh::MaskError zero = plsh::mask_error(n, 0.0, {plsh::fixed_grid(kInfinity)});
    CHECK(zero.spectral == 0);
    CHECK(zero.max == 0);
    const plsh::MaskError sampled = plsh::mask_error(n, 0.0, plsh::RandomBinning(0.0, 3).draw(5));
    CHECK(sampled.spectral == 0);
    CHECK(sampled.max == 0);
  }
  {
    // E = I - 1 1^T has eigenvalues 1 - n (eigenvector 1) and 1 (n - 1 times).
    INFO("slope 0 and blocks of size 1: E = I - 11^T, ||E||_2 = n - 1, max 1");
    const plsh::MaskError error = plsh::mask_error(n, 0.0, {plsh::fixed_grid(1)});
    const double spectral = static_cast<double>(n - 1);
    CHECK(std::abs(error.spectral - spectral) <= static_cast<double>(n) * kEpsilon * spectral);
    CHECK(error.max == 1);
  }
  {
    INFO("n = 1: the mean mask and the kernel are both [1]");
    const plsh::MaskError one = plsh::mask_error(1, 0.7, plsh::RandomBinning(0.7, 1).draw(3));
    CHECK(one.spectral == 0);
    CHECK(one.max == 0);
  }
}

TEST_CASE("mask errors decay like s^(-1/2), independent and Latin hypercube draws", "[metrics]") {
  // E = (1/s) sum_t (M_t - K) is a mean of s zero-mean matrices, so both norms fall like
  // s^(-1/2): independent draws, or Latin hypercube draws, which remove the additive part of the
  // variance but leave the rest at order 1/s. Averaged over 16 independent seeds, the errors must
  // fall strictly from one s to the next and the fitted log-log slope must lie within 0.15 of
  // -1/2.
  const plsh::Sampling sampling =
      GENERATE(plsh::Sampling::Independent, plsh::Sampling::LatinHypercube);
  INFO((sampling == plsh::Sampling::Independent ? "independent" : "Latin hypercube") << " draws");
  const Index n = 256;
  const double slope = 1.0 / 16;
  const std::vector<Index> sample_counts = {4, 16, 64, 256};
  const int seeds = 16;
  std::vector<double> spectral(sample_counts.size(), 0.0);
  std::vector<double> max(sample_counts.size(), 0.0);
  for (int seed = 0; seed < seeds; ++seed) {
    const plsh::RandomBinning sampler(slope, plsh::head_seed(2024, seed));
    std::uint64_t first = 0;  // disjoint draws for every s
    for (std::size_t k = 0; k < sample_counts.size(); ++k) {
      // Latin hypercube: an independent joint set for every s, seeded as head k of the seed.
      const std::vector<Grid> grids =
          sampling == plsh::Sampling::Independent
              ? sampler.draw(sample_counts[k], first)
              : plsh::latin_hypercube_grids(
                    slope, plsh::head_seed(plsh::head_seed(2024, seed), static_cast<Index>(k)),
                    sample_counts[k]);
      const plsh::MaskError error = plsh::mask_error(n, slope, grids);
      first += static_cast<std::uint64_t>(sample_counts[k]);
      spectral[k] += error.spectral / seeds;
      max[k] += error.max / seeds;
    }
  }
  std::vector<double> s(sample_counts.begin(), sample_counts.end());
  const double spectral_slope = log_log_slope(s, spectral);
  const double max_slope = log_log_slope(s, max);
  for (std::size_t k = 0; k < s.size(); ++k) {
    INFO("s = " << s[k] << ": mean spectral error " << spectral[k] << ", mean max error "
                << max[k]);
    CHECK(spectral[k] >= max[k]);
    if (k > 0) {
      CHECK(spectral[k] < spectral[k - 1]);
      CHECK(max[k] < max[k - 1]);
    }
  }
  INFO("fitted log-log slopes: spectral " << spectral_slope << ", max " << max_slope);
  CHECK(spectral_slope >= -0.65);
  CHECK(spectral_slope <= -0.35);
  CHECK(max_slope >= -0.65);
  CHECK(max_slope <= -0.35);
}

TEST_CASE("mask_error rejects invalid arguments", "[metrics]") {
  const std::vector<Grid> grids = plsh::RandomBinning(0.5, 1).draw(3);
  {
    INFO("n < 1");
    REQUIRE_THROWS_AS(plsh::mask_error(0, 0.5, grids), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mask_error(-3, 0.5, grids), std::invalid_argument);
  }
  {
    INFO("no grids");
    REQUIRE_THROWS_AS(plsh::mask_error(8, 0.5, {}), std::invalid_argument);
  }
  {
    INFO("negative or non-finite slope");
    REQUIRE_THROWS_AS(plsh::mask_error(8, -0.5, grids), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mask_error(8, kNaN, grids), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mask_error(8, kInfinity, grids), std::invalid_argument);
  }
  {
    INFO("an invalid grid");
    REQUIRE_THROWS_AS(plsh::mask_error(8, 0.5, {Grid{-1.0, 0.0}}), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mask_error(8, 0.5, {Grid{2.0, kNaN}}), std::invalid_argument);
  }
  {
    // Checked before anything is allocated (it threw std::bad_alloc from Eigen's resize).
    INFO("n whose dense n x n matrix of doubles cannot be sized");
    REQUIRE_THROWS_WITH(plsh::mask_error(Index(1) << 40, 0.5, grids),
                        Catch::Contains("mask_error") && Catch::Contains("n x n"));
    REQUIRE_THROWS_AS(plsh::mask_error(plsh::kMaxPosition, 0.5, grids), std::invalid_argument);
  }
}

}  // namespace test_metrics
