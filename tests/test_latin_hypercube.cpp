// Tests of the Latin hypercube draws (sampler.hpp): each of the three uniforms takes one value in
// each stratum, the permutations of the strata, determinism, the seed-to-seed variance they remove
// from the mean pitch, kernel_grids under both samplings, and every rejected argument. Their single
// draws have the law of independent draws, and their mean mask the expectation exp(-m|i-j|): those
// tests run for both samplings in test_sampler.cpp.
//
// Statistical checks use fixed seeds and bounds derived from the known distribution
// (sampler_checks.hpp).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <set>
#include <stdexcept>
#include <vector>

#include <plsh/detail/random.hpp>
#include <plsh/limits.hpp>
#include <plsh/options.hpp>
#include <plsh/sampler.hpp>

#include "sampler_checks.hpp"

namespace test_latin_hypercube {

namespace {

using plsh::Grid;
using plsh::Index;
using plsh_test::kStandardErrors;
using plsh_test::same_bits;
using plsh_test::variance_of;

}  // namespace

TEST_CASE("Latin hypercube: each uniform takes one value in each stratum [k/s, (k+1)/s)",
          "[sampler][latin_hypercube]") {
  const double slope = 0.25;
  for (const Index count : {1, 2, 7, 20, 1000}) {
    for (const std::uint64_t seed : {0ULL, 5ULL, ~0ULL}) {
      INFO("s = " << count << ", seed " << seed);
      const auto uniforms = plsh::detail::latin_hypercube_uniforms(seed, count);
      REQUIRE(static_cast<Index>(uniforms.size()) == count);
      for (std::size_t c = 0; c < 3; ++c) {
        INFO("uniform " << c);
        std::vector<Index> strata;
        std::size_t outside = 0;
        for (const auto& u : uniforms) {
          if (!(u[c] > 0 && u[c] < 1)) ++outside;
          strata.push_back(static_cast<Index>(std::floor(u[c] * static_cast<double>(count))));
        }
        CHECK(outside == 0);
        std::sort(strata.begin(), strata.end());
        std::vector<Index> every_stratum(static_cast<std::size_t>(count));
        for (Index k = 0; k < count; ++k) every_stratum[static_cast<std::size_t>(k)] = k;
        CHECK(strata == every_stratum);
      }
      INFO("draw t is the Random Binning grid of its three uniforms");
      const std::vector<Grid> grids = plsh::latin_hypercube_grids(slope, seed, count);
      REQUIRE(grids.size() == uniforms.size());
      for (std::size_t t = 0; t < grids.size(); ++t) {
        const auto& u = uniforms[t];
        CHECK(grids[t].pitch == (-std::log(u[0]) - std::log(u[1])) / slope);
        CHECK(same_bits(grids[t], plsh::detail::binning_grid(slope, u[0], u[1], u[2])));
      }
    }
  }
}

TEST_CASE("Latin hypercube draws are pure functions of (slope, seed, count)",
          "[sampler][latin_hypercube]") {
  const double slope = 0.37;
  {
    INFO("the same arguments give the same bits; another seed other pitches");
    const std::vector<Grid> a = plsh::latin_hypercube_grids(slope, 99, 20);
    const std::vector<Grid> b = plsh::latin_hypercube_grids(slope, 99, 20);
    const std::vector<Grid> other = plsh::latin_hypercube_grids(slope, 100, 20);
    REQUIRE(a.size() == 20);
    std::set<std::uint64_t> pitches;
    for (std::size_t t = 0; t < a.size(); ++t) {
      CHECK(same_bits(a[t], b[t]));
      CHECK_FALSE(same_bits(a[t], other[t]));
      pitches.insert(plsh_test::bits(a[t].pitch));
    }
    CHECK(pitches.size() == 20);
  }
  {
    INFO("with s = 1 the one draw is RandomBinning draw 0 of the same seed");
    for (const std::uint64_t seed : {0ULL, 7ULL, 123456789ULL}) {
      CHECK(same_bits(plsh::latin_hypercube_grids(slope, seed, 1)[0],
                      plsh::RandomBinning(slope, seed)(0)));
    }
  }
  {
    INFO("slope 0: every draw is one bin holding everything");
    for (const Grid& grid : plsh::latin_hypercube_grids(0.0, 3, 5)) {
      CHECK(std::isinf(grid.pitch));
      CHECK(grid.shift == 0);
    }
  }
  {
    // The stratum permutations use integer arithmetic only: these values hold on every platform.
    INFO("random_permutation of CounterRandom(1), s = 10, lanes 3 and 4: literal values");
    const plsh::detail::CounterRandom random(1);
    const std::vector<Index> first = plsh::detail::random_permutation(random, 10, 3, 3);
    const std::vector<Index> second = plsh::detail::random_permutation(random, 10, 4, 3);
    CHECK(first == std::vector<Index>{7, 0, 8, 9, 6, 3, 5, 1, 2, 4});
    CHECK(second == std::vector<Index>{6, 2, 1, 8, 5, 9, 7, 3, 4, 0});
  }
}

TEST_CASE("random_permutation draws each permutation of 3 with probability 1/6",
          "[sampler][latin_hypercube]") {
  // Over N = 60000 seeds, the frequency of each of the 6 permutations has standard error
  // sqrt(p (1 - p) / N) with p = 1/6.
  const std::size_t seeds = 60000;
  std::vector<double> count(6, 0.0);
  for (std::uint64_t seed = 0; seed < seeds; ++seed) {
    const std::vector<Index> p =
        plsh::detail::random_permutation(plsh::detail::CounterRandom(seed), 3, 3, 3);
    // Lehmer code of a permutation of {0, 1, 2}: index 2 * p[0] + (p[1] > p[2]).
    count[static_cast<std::size_t>(2 * p[0] + (p[1] > p[2] ? 1 : 0))] += 1;
  }
  const double n = static_cast<double>(seeds);
  const double p = 1.0 / 6;
  const double bound = kStandardErrors * std::sqrt(p * (1 - p) / n);
  for (std::size_t k = 0; k < count.size(); ++k) {
    INFO("permutation " << k << ": frequency " << count[k] / n << ", bound " << bound);
    CHECK(std::abs(count[k] / n - p) <= bound);
  }
}

TEST_CASE("Latin hypercube draws remove the seed-to-seed variance of the mean pitch",
          "[sampler][latin_hypercube]") {
  // The mean pitch of s draws is (theta / s) sum_t (-log u1_t - log u2_t). Independent draws:
  // variance 2 theta^2 / s. Latin hypercube: each coordinate has one uniform per stratum, and
  // -log U on stratum k has variance 1 for k = 0 (log s + Exp(1)) and at most
  // log(1 + 1/k)^2 / 4 <= 1 / (4 k^2) otherwise (a variable on an interval of length L has
  // variance <= L^2 / 4), so the variance is at most 2 theta^2 (1 + pi^2/24) / s^2: about s
  // times smaller. Sample variances over N = 4000 seeds: the Latin hypercube one must stay below
  // 1.5 times its bound, the independent one above half its value.
  const double slope = 1.0 / 8;
  const double theta = 1 / slope;
  const Index samples = 20;
  const double s = static_cast<double>(samples);
  const int seeds = 4000;
  std::vector<double> independent, latin_hypercube;
  for (int seed = 0; seed < seeds; ++seed) {
    const std::uint64_t stream = plsh::head_seed(43, seed);
    const auto mean_pitch = [](const std::vector<Grid>& grids) {
      double sum = 0;
      for (const Grid& grid : grids) sum += grid.pitch;
      return sum / static_cast<double>(grids.size());
    };
    independent.push_back(mean_pitch(plsh::RandomBinning(slope, stream).draw(samples)));
    latin_hypercube.push_back(mean_pitch(plsh::latin_hypercube_grids(slope, stream, samples)));
  }
  const double pi = 3.14159265358979323846;
  const double independent_variance = 2 * theta * theta / s;
  const double latin_hypercube_bound = 2 * theta * theta * (1 + pi * pi / 24) / (s * s);
  INFO("variance of the mean pitch: independent "
       << variance_of(independent) << " (expected " << independent_variance << "), Latin hypercube "
       << variance_of(latin_hypercube) << " (bound " << latin_hypercube_bound << ")");
  CHECK(std::abs(plsh_test::mean_of(latin_hypercube) - 2 * theta) <=
        kStandardErrors * std::sqrt(latin_hypercube_bound / seeds));
  CHECK(variance_of(independent) >= 0.5 * independent_variance);
  CHECK(variance_of(latin_hypercube) <= 1.5 * latin_hypercube_bound);
}

TEST_CASE("kernel_grids: the draws of every head as PlshOptions::sampling says",
          "[sampler][latin_hypercube]") {
  const std::vector<double> slopes = {1.0, 1.0 / 16, 0.0};
  plsh::PlshOptions options;
  options.samples = 6;
  options.seed = 2026;
  CHECK(options.sampling == plsh::Sampling::LatinHypercube);  // the default
  {
    INFO("Sampling::Independent is draw_head_grids");
    options.sampling = plsh::Sampling::Independent;
    const auto grids = plsh::kernel_grids(slopes, options);
    const auto expected = plsh::draw_head_grids(slopes, 6, 2026);
    REQUIRE(grids.size() == 3);
    for (std::size_t h = 0; h < 3; ++h) {
      REQUIRE(grids[h].size() == 6);
      for (std::size_t t = 0; t < 6; ++t) CHECK(same_bits(grids[h][t], expected[h][t]));
    }
  }
  {
    INFO(
        "Sampling::LatinHypercube: head h is latin_hypercube_grids(slopes[h], head_seed(seed, h))");
    options.sampling = plsh::Sampling::LatinHypercube;
    const auto grids = plsh::kernel_grids(slopes, options);
    REQUIRE(grids.size() == 3);
    for (std::size_t h = 0; h < 3; ++h) {
      const auto expected =
          plsh::latin_hypercube_grids(slopes[h], plsh::head_seed(2026, static_cast<Index>(h)), 6);
      REQUIRE(grids[h].size() == 6);
      for (std::size_t t = 0; t < 6; ++t) CHECK(same_bits(grids[h][t], expected[t]));
    }
    CHECK(plsh::kernel_grids({}, options).empty());
  }
}

TEST_CASE("Latin hypercube functions reject invalid arguments", "[sampler][latin_hypercube]") {
  using Catch::Matchers::Contains;
  {
    INFO("latin_hypercube_grids: bad slope, count outside [1, kMaxSamples]");
    REQUIRE_THROWS_WITH(plsh::latin_hypercube_grids(-1.0, 0, 4),
                        Contains("latin_hypercube_grids: slope"));
    REQUIRE_THROWS_AS(plsh::latin_hypercube_grids(std::nan(""), 0, 4), std::invalid_argument);
    REQUIRE_THROWS_WITH(plsh::latin_hypercube_grids(0.5, 0, 0),
                        Contains("latin_hypercube_grids: count"));
    REQUIRE_THROWS_AS(plsh::latin_hypercube_grids(0.5, 0, -3), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::latin_hypercube_grids(0.5, 0, plsh::kMaxSamples + 1),
                      std::invalid_argument);
    CHECK(plsh::latin_hypercube_grids(0.5, 0, plsh::kMaxSamples).size() ==
          static_cast<std::size_t>(plsh::kMaxSamples));
  }
  {
    INFO("kernel_grids: a value outside the enumeration, bad samples, bad slopes");
    plsh::PlshOptions options;
    options.sampling = static_cast<plsh::Sampling>(2);
    REQUIRE_THROWS_WITH(plsh::kernel_grids({0.5}, options),
                        Contains("kernel_grids: options.sampling must be"));
    options.sampling = static_cast<plsh::Sampling>(-1);
    REQUIRE_THROWS_AS(plsh::kernel_grids({0.5}, options), std::invalid_argument);
    options.sampling = plsh::Sampling::LatinHypercube;
    options.samples = 0;
    REQUIRE_THROWS_WITH(plsh::kernel_grids({0.5}, options),
                        Contains("kernel_grids: options.samples"));
    options.samples = plsh::kMaxSamples + 1;
    REQUIRE_THROWS_AS(plsh::kernel_grids({0.5}, options), std::invalid_argument);
    options.samples = 3;
    REQUIRE_THROWS_WITH(plsh::kernel_grids({0.5, -2.0}, options),
                        Contains("kernel_grids: slopes[1]"));
  }
}

}  // namespace test_latin_hypercube
