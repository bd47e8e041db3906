// Tests of alibi.hpp: the per-head slopes of Press et al. and the Laplacian factor matrix.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/alibi.hpp>

namespace test_alibi {

namespace {

using plsh::Index;

constexpr double kEpsilon = std::numeric_limits<double>::epsilon();

/// The slope list of Press et al.'s get_slopes, written from its closed form: with
/// c = 2^floor(log2 H), the c slopes 2^(-8(h+1)/c), then the slopes at indices 0, 2, 4, ... of the
/// 2c list 2^(-8(i+1)/(2c)). `list_index` receives, for every slope, its index i in the
/// power-of-two list it comes from, and `list_size` the size of that list.
std::vector<double> closed_form_slopes(Index num_heads, std::vector<Index>& list_index,
                                       std::vector<Index>& list_size) {
  Index c = 1;
  while (2 * c <= num_heads) c *= 2;
  std::vector<double> slopes;
  list_index.clear();
  list_size.clear();
  for (Index h = 0; h < c; ++h) {
    slopes.push_back(std::exp2(-8.0 * static_cast<double>(h + 1) / static_cast<double>(c)));
    list_index.push_back(h);
    list_size.push_back(c);
  }
  for (Index i = 0; static_cast<Index>(slopes.size()) < num_heads; i += 2) {
    slopes.push_back(std::exp2(-8.0 * static_cast<double>(i + 1) / static_cast<double>(2 * c)));
    list_index.push_back(i);
    list_size.push_back(2 * c);
  }
  return slopes;
}

void check_relative(const char* what, const std::vector<double>& actual,
                    const std::vector<double>& expected, double relative_tolerance) {
  INFO(what);
  REQUIRE(actual.size() == expected.size());
  for (std::size_t h = 0; h < expected.size(); ++h) {
    INFO("head " << h << ": got " << actual[h] << ", published " << expected[h]);
    CHECK(std::abs(actual[h] - expected[h]) <= relative_tolerance * expected[h]);
  }
}

}  // namespace

TEST_CASE("alibi_slopes follows the closed form and the interleaving rule", "[alibi]") {
  for (const Index num_heads : {1, 2, 3, 5, 6, 8, 12, 16, 24, 40, 64, 112}) {
    std::vector<Index> list_index;
    std::vector<Index> list_size;
    const std::vector<double> expected = closed_form_slopes(num_heads, list_index, list_size);
    const std::vector<double> slopes = plsh::alibi_slopes(num_heads);
    INFO("num_heads = " << num_heads);
    REQUIRE(static_cast<Index>(slopes.size()) == num_heads);
    for (std::size_t h = 0; h < slopes.size(); ++h) {
      // get_slopes computes start * start^i with start = fl(2^(-8/c)). For lists of at most 8
      // heads start is a power of two and every product is exact. Otherwise the rounding of start
      // (relative error <= eps/2) is raised to the power i + 1, and pow, the product and the
      // closed form's exp2 add at most one ulp each: |error| <= ((i + 1)/2 + 3) eps.
      const double i = static_cast<double>(list_index[h]);
      const double tolerance = list_size[h] <= 8 ? 0.0 : ((i + 1) / 2 + 3) * kEpsilon;
      INFO("head " << h << " (index " << list_index[h] << " of the " << list_size[h]
                   << "-list): got " << slopes[h] << ", closed form " << expected[h]);
      CHECK(std::abs(slopes[h] - expected[h]) <= tolerance * expected[h]);
    }
    // The first c slopes are those of c heads; the slopes are positive and below 1.
    Index c = 1;
    while (2 * c <= num_heads) c *= 2;
    const std::vector<double> power_of_two = plsh::alibi_slopes(c);
    for (Index h = 0; h < num_heads; ++h) {
      INFO("head " << h);
      CHECK(slopes[static_cast<std::size_t>(h)] > 0);
      CHECK(slopes[static_cast<std::size_t>(h)] < 1);
      if (h < c) {
        CHECK(slopes[static_cast<std::size_t>(h)] == power_of_two[static_cast<std::size_t>(h)]);
      }
    }
  }
}

TEST_CASE("alibi_slopes reproduces literal values of the published get_slopes", "[alibi]") {
  // Values printed by the reference Python get_slopes (repr, 17 significant digits).
  const double published_tolerance = 1e-15;
  check_relative("H = 1: 2^-8", plsh::alibi_slopes(1), {1.0 / 256}, published_tolerance);
  check_relative("H = 2: 2^-4, 2^-8", plsh::alibi_slopes(2), {1.0 / 16, 1.0 / 256},
                 published_tolerance);
  check_relative("H = 3: 2^-4, 2^-8 of the 2-list, then index 0 of the 4-list: 2^-2",
                 plsh::alibi_slopes(3), {1.0 / 16, 1.0 / 256, 1.0 / 4}, published_tolerance);
  check_relative("H = 5: the 4-list, then index 0 of the 8-list", plsh::alibi_slopes(5),
                 {1.0 / 4, 1.0 / 16, 1.0 / 64, 1.0 / 256, 1.0 / 2}, published_tolerance);
  check_relative("H = 6: the 4-list, then indices 0, 2 of the 8-list", plsh::alibi_slopes(6),
                 {1.0 / 4, 1.0 / 16, 1.0 / 64, 1.0 / 256, 1.0 / 2, 1.0 / 8}, published_tolerance);
  check_relative("H = 8: 1/2, 1/4, ..., 1/256", plsh::alibi_slopes(8),
                 {1.0 / 2, 1.0 / 4, 1.0 / 8, 1.0 / 16, 1.0 / 32, 1.0 / 64, 1.0 / 128, 1.0 / 256},
                 published_tolerance);
  check_relative(
      "H = 12: the 8-list, then 2^-0.5, 2^-1.5, 2^-2.5, 2^-3.5", plsh::alibi_slopes(12),
      {0.5, 0.25, 0.125, 0.0625, 0.03125, 0.015625, 0.0078125, 0.00390625, 0.7071067811865476,
       0.35355339059327384, 0.17677669529663692, 0.08838834764831849},
      published_tolerance);
  check_relative(
      "H = 16: 2^-0.5, 2^-1, ..., 2^-8", plsh::alibi_slopes(16),
      {0.7071067811865476, 0.5000000000000001, 0.35355339059327384, 0.25000000000000006,
       0.17677669529663692, 0.12500000000000006, 0.08838834764831849, 0.06250000000000004,
       0.044194173824159244, 0.03125000000000002, 0.022097086912079626, 0.01562500000000001,
       0.011048543456039816, 0.007812500000000007, 0.005524271728019908, 0.003906250000000004},
      published_tolerance);

  struct Literal {
    Index num_heads;
    Index head;
    double value;
  };
  const Literal literals[] = {
      {24, 0, 0.7071067811865476},     {24, 1, 0.5000000000000001},
      {24, 15, 0.003906250000000004},  {24, 16, 0.8408964152537145},
      {24, 23, 0.07432544468767001},   {40, 0, 0.8408964152537145},
      {40, 1, 0.7071067811865475},     {40, 31, 0.003906249999999994},
      {40, 32, 0.9170040432046712},    {40, 39, 0.27262693316631437},
      {64, 0, 0.9170040432046712},     {64, 1, 0.8408964152537145},
      {64, 63, 0.0039062499999999952}, {112, 0, 0.9170040432046712},
      {112, 1, 0.8408964152537145},    {112, 63, 0.0039062499999999952},
      {112, 64, 0.9576032806985737},   {112, 111, 0.016316777850428427},
  };
  for (const Literal& literal : literals) {
    const std::vector<double> slopes = plsh::alibi_slopes(literal.num_heads);
    const double got = slopes.at(static_cast<std::size_t>(literal.head));
    INFO("H = " << literal.num_heads << ", head " << literal.head << ": got " << got
                << ", published " << literal.value);
    CHECK(std::abs(got - literal.value) <= published_tolerance * literal.value);
  }
}

TEST_CASE("alibi_slopes rejects fewer than one head", "[alibi]") {
  INFO("num_heads = 0 and -1 throw std::invalid_argument");
  REQUIRE_THROWS_AS(plsh::alibi_slopes(0), std::invalid_argument);
  REQUIRE_THROWS_AS(plsh::alibi_slopes(-1), std::invalid_argument);
}

TEST_CASE("laplacian_kernel is exp(-m|i-j|)", "[alibi]") {
  for (const double slope : {1.0 / 32, 0.5, 1.0, 7.25}) {
    const Index n = 37;
    const Eigen::MatrixXd kernel = plsh::laplacian_kernel(n, slope);
    INFO("slope = " << slope);
    REQUIRE(kernel.rows() == n);
    REQUIRE(kernel.cols() == n);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) {
        INFO("entry (" << i << ", " << j << ")");
        CHECK(kernel(i, j) == std::exp(-slope * static_cast<double>(i > j ? i - j : j - i)));
        CHECK(kernel(i, j) == kernel(j, i));
      }
      CHECK(kernel(i, i) == 1.0);
    }
    // Off the diagonal every entry lies in (0, 1) and falls strictly with the distance, as long
    // as exp(-m r) does not underflow.
    for (Index r = 1; r < n; ++r) {
      INFO("distance " << r);
      CHECK(kernel(0, r) < kernel(0, r - 1));
      CHECK(kernel(0, r) > 0);
    }
  }
}

TEST_CASE("laplacian_kernel in single precision rounds the double values", "[alibi]") {
  const Index n = 19;
  const double slope = 0.3;
  const Eigen::MatrixXf kernel = plsh::laplacian_kernel<float>(n, slope);
  const Eigen::MatrixXd reference = plsh::laplacian_kernel<double>(n, slope);
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < n; ++j) {
      INFO("entry (" << i << ", " << j << ")");
      CHECK(kernel(i, j) == static_cast<float>(reference(i, j)));
    }
  }
}

TEST_CASE("laplacian_kernel degenerate sizes and slope 0", "[alibi]") {
  {
    INFO("slope 0 gives all ones");
    const Eigen::MatrixXd ones = plsh::laplacian_kernel(9, 0.0);
    CHECK(ones.rows() == 9);
    CHECK((ones.array() == 1.0).all());
  }
  {
    INFO("n = 0 gives an empty matrix");
    const Eigen::MatrixXd empty = plsh::laplacian_kernel(0, 0.5);
    CHECK(empty.rows() == 0);
    CHECK(empty.cols() == 0);
  }
  {
    INFO("n = 1 gives the 1x1 identity");
    const Eigen::MatrixXd single = plsh::laplacian_kernel(1, 0.5);
    REQUIRE(single.rows() == 1);
    CHECK(single(0, 0) == 1.0);
  }
}

TEST_CASE("laplacian_kernel rejects bad sizes and slopes", "[alibi]") {
  const double infinity = std::numeric_limits<double>::infinity();
  const double nan = std::numeric_limits<double>::quiet_NaN();
  {
    INFO("n < 0");
    REQUIRE_THROWS_AS(plsh::laplacian_kernel(-1, 0.5), std::invalid_argument);
  }
  {
    INFO("negative, NaN and infinite slopes");
    REQUIRE_THROWS_AS(plsh::laplacian_kernel(4, -0.5), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::laplacian_kernel(4, nan), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::laplacian_kernel(4, infinity), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::laplacian_kernel(4, -infinity), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::laplacian_kernel<float>(4, -0.5), std::invalid_argument);
  }
}

}  // namespace test_alibi
