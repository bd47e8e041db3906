// Tests of error_norms.hpp: the matrix-free products K x and K_hat x, the exact max norm and the
// Lanczos spectral norm of E = K_hat - K, against dense matrices (metrics.hpp, partition.hpp) for
// n up to 2000, several slopes, s = 1 and s = 50, and offset positions.

#include <catch2/catch.hpp>

#include <Eigen/Eigenvalues>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/analysis.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

#include "fill.hpp"
#include "skip.hpp"

namespace test_error_norms {

namespace {

using plsh::Grid;
using plsh::Index;

constexpr double kEpsilon = std::numeric_limits<double>::epsilon();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// E = (1/s) sum_t M_t - K on positions [first, first + n), the masks from dense_mask of each
/// draw's BlockPartition: integer counts (exact in double) divided by s once.
Eigen::MatrixXd dense_error(Index n, double slope, const std::vector<Grid>& grids, Index first) {
  Eigen::MatrixXd counts = Eigen::MatrixXd::Zero(n, n);
  for (const Grid& grid : grids)
    counts += plsh::dense_mask(plsh::BlockPartition(grid, first, first + n));
  return counts / static_cast<double>(grids.size()) - plsh::laplacian_kernel<double>(n, slope);
}

Eigen::VectorXd test_vector(Index n, std::uint64_t seed) {
  const std::vector<double> values =
      plsh_test::uniform_values<double>(static_cast<std::size_t>(n), seed);
  return Eigen::Map<const Eigen::VectorXd>(values.data(), n);
}

struct Case {
  Index n;
  double slope;
  Index samples;
  Index first;
};

/// The largest n of the dense references. Under the sanitizers (PLSH_TEST_SANITIZED) a dense
/// eigensolver of n = 2000 takes most of a minute; the Release build runs those cases.
#ifdef PLSH_TEST_SANITIZED
constexpr Index kLargestDense = 700;
#else
constexpr Index kLargestDense = 2000;
#endif

/// Slopes of the standard list and beyond it (a pitch below 1: one position per block), s = 1 and
/// s = 50, positions from 0, negative, and far from 0; n at most kLargestDense.
const std::vector<Case>& cases() {
  static const std::vector<Case> list{
      {1, 0.5, 1, 0},
      {2, 0.5, 50, 0},
      {37, 0.5, 1, 0},
      {37, 0.5, 50, -20},
      {300, 1.0 / 16, 1, 0},
      {300, 1.0 / 16, 50, 1000},
      {300, 3.0, 50, 7},
      {300, 0.0, 5, 0},
      {700, 1.0 / 256, 50, -350},
      {700, 1.0 / 256, 1, Index(1) << 40},
      {2000, 1.0 / 32, 50, 0},
      {2000, 1.0 / 4, 1, 123457},
  };
  static const std::vector<Case> kept = [] {
    std::vector<Case> result;
    for (const Case& c : list) {
      if (c.n <= kLargestDense) result.push_back(c);
    }
    return result;
  }();
  return kept;
}

std::vector<Grid> draws(const Case& c, Index number) {
  return plsh::RandomBinning(c.slope, plsh::head_seed(11, number)).draw(c.samples);
}

}  // namespace

TEST_CASE("laplacian_product and mean_mask_product equal the dense matrices", "[error_norms]") {
  Index number = 0;
  for (const Case& c : cases()) {
    if (c.n > 700) continue;
    const std::vector<Grid> grids = draws(c, number++);
    const Eigen::VectorXd x = test_vector(c.n, 3 + static_cast<std::uint64_t>(number));
    INFO("n=" << c.n << " slope=" << c.slope << " s=" << c.samples << " first=" << c.first);

    Eigen::VectorXd kernel_x(c.n);
    plsh::laplacian_product(c.slope, x, kernel_x);
    const Eigen::VectorXd kernel_reference = plsh::laplacian_kernel<double>(c.n, c.slope) * x;
    // Every term is non-negative times x: rounding is at most a few eps * sum |x| per entry.
    CHECK((kernel_x - kernel_reference).cwiseAbs().maxCoeff() <= 8 * kEpsilon * x.lpNorm<1>());

    Eigen::VectorXd mask_x(c.n);
    plsh::mean_mask_product(grids, c.first, x, mask_x);
    const Eigen::MatrixXd error = dense_error(c.n, c.slope, grids, c.first);
    const Eigen::VectorXd mask_reference =
        (error + plsh::laplacian_kernel<double>(c.n, c.slope)) * x;
    // Block sums from prefix sums: each within about n eps sum |x|.
    CHECK((mask_x - mask_reference).cwiseAbs().maxCoeff() <=
          4 * static_cast<double>(c.n) * kEpsilon * x.lpNorm<1>());

    Eigen::VectorXd error_x(c.n);
    plsh::MaskErrorOperator(c.n, c.slope, grids, c.first).perform_op(x.data(), error_x.data());
    CHECK((error_x - error * x).cwiseAbs().maxCoeff() <=
          8 * static_cast<double>(c.n) * kEpsilon * x.lpNorm<1>());
  }
}

TEST_CASE("mask_max_error equals the dense max norm", "[error_norms]") {
  Index number = 0;
  for (const Case& c : cases()) {
    const std::vector<Grid> grids = draws(c, number++);
    INFO("n=" << c.n << " slope=" << c.slope << " s=" << c.samples << " first=" << c.first);
    const double dense = dense_error(c.n, c.slope, grids, c.first).cwiseAbs().maxCoeff();
    const double measured = plsh::mask_max_error(c.n, c.slope, grids, c.first);
    // Both evaluate count / s - exp(-m|i - j|) the same way: equal up to the rounding of exp.
    CHECK(std::abs(measured - dense) <= 1e-15);
    if (c.first == 0) {
      // mask_error sums s weights 1/s: within (s + 1) eps of count / s.
      CHECK(std::abs(measured - plsh::mask_error(c.n, c.slope, grids).max) <=
            static_cast<double>(c.samples + 1) * kEpsilon);
    }
  }
}

TEST_CASE("mask_max_error of a single block and of single positions", "[error_norms]") {
  // One block holding everything: K_hat = 1, the largest error is 1 - exp(-m (n - 1)), at the
  // corners.
  const Index n = 50;
  const double slope = 0.1;
  CHECK(plsh::mask_max_error(n, slope, {plsh::fixed_grid(1e9, -5e8)}) ==
        Approx(1 - std::exp(-slope * (n - 1))).epsilon(1e-14));
  // Blocks of one position: K_hat = I, the largest error is exp(-m), next to the diagonal.
  CHECK(plsh::mask_max_error(n, slope, {plsh::fixed_grid(0.5)}, 10) ==
        Approx(std::exp(-slope)).epsilon(1e-14));
  // n = 1: K_hat = K = 1.
  CHECK(plsh::mask_max_error(1, slope, {plsh::fixed_grid(3)}) == 0);
}

#ifdef PLSH_HAS_SPECTRA

TEST_CASE("mask_spectral_error equals the dense spectral norm", "[error_norms][spectra]") {
  Index number = 0;
  for (const Case& c : cases()) {
    const std::vector<Grid> grids = draws(c, number++);
    INFO("n=" << c.n << " slope=" << c.slope << " s=" << c.samples << " first=" << c.first);
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(
        dense_error(c.n, c.slope, grids, c.first), Eigen::EigenvaluesOnly);
    const double dense = solver.eigenvalues().cwiseAbs().maxCoeff();
    const plsh::SpectralNorm measured = plsh::mask_spectral_error(c.n, c.slope, grids, c.first);
    INFO("dense " << dense << ", Lanczos " << measured.value << " after " << measured.products
                  << " products");
    REQUIRE(measured.converged);
    // Lanczos tolerance 1e-10 relative; the rounding of the products and the dense solver's
    // backward error, n eps (||K_hat||_2 + ||K||_2) with both norms at most coth(m/2) (n for m =
    // 0).
    const double kernel_norm = c.slope == 0
                                   ? static_cast<double>(c.n)
                                   : std::min(static_cast<double>(c.n), 1 / std::tanh(c.slope / 2));
    const double rounding = 4 * static_cast<double>(c.n) * kEpsilon * (1 + dense + kernel_norm);
    CHECK(std::abs(measured.value - dense) <= 1e-9 * dense + rounding);
    if (c.first == 0) {
      const double reference = plsh::mask_error(c.n, c.slope, grids).spectral;
      CHECK(std::abs(measured.value - reference) <= 1e-9 * reference + rounding);
    }
    // LanczosOptions::tolerance is the relative accuracy of the norm (to first order).
    plsh::LanczosOptions loose;
    loose.tolerance = 1e-6;
    const plsh::SpectralNorm coarse =
        plsh::mask_spectral_error(c.n, c.slope, grids, c.first, loose);
    INFO("tolerance 1e-6: " << coarse.value << " after " << coarse.products << " products");
    REQUIRE(coarse.converged);
    CHECK(std::abs(coarse.value - dense) <= 1.01e-6 * dense + rounding);
  }
}

namespace {

/// A symmetric operator seen through largest_singular_value's interface, so that the norm of a
/// mask error can be computed a second way: Spectra's Lanczos on E^T E = E^2.
struct AsGeneral {
  const plsh::MaskErrorOperator* op;
  Index rows() const { return op->rows(); }
  Index cols() const { return op->cols(); }
  void product(const double* x, double* y) const { op->perform_op(x, y); }
  void transpose_product(const double* x, double* y) const { op->perform_op(x, y); }
};

}  // namespace

TEST_CASE("mask_spectral_error converges on a clustered spectrum", "[error_norms][spectra]") {
  // A mean of 20 masks of slope 1/16 at n = 2 10^4: the top of the spectrum is a cluster of
  // nearly equal eigenvalues (blocks of equal size), where restarted Lanczos on E^2 took about
  // 700 products. The norm by Lanczos on E agrees with Spectra's on E^T E to the tolerance.
  const Index n = 20000;
  const double slope = 1.0 / 16;
  const std::vector<Grid> grids = plsh::RandomBinning(slope, plsh::head_seed(2024, 4)).draw(20);
  plsh::LanczosOptions options;
  options.basis_size = 30;
  options.tolerance = 1e-6;
  const plsh::SpectralNorm lanczos = plsh::mask_spectral_error(n, slope, grids, 0, options);
  const plsh::MaskErrorOperator op(n, slope, grids);
  const plsh::SpectralNorm gram = plsh::largest_singular_value(AsGeneral{&op}, options);
  INFO("Lanczos on E: " << lanczos.value << " after " << lanczos.products
                        << " products; on E^T E: " << gram.value << " after " << gram.products);
  REQUIRE(lanczos.converged);
  REQUIRE(gram.converged);
  CHECK(std::abs(lanczos.value - gram.value) <= 2.02e-6 * gram.value);
}

TEST_CASE("MaskErrorOperator products are repeatable", "[error_norms]") {
  // The operator keeps its workspaces between products: a second product of the same x, after a
  // product of another vector, is bit for bit the first.
  const Case c{2000, 1.0 / 32, 50, 0};
  const std::vector<Grid> grids = draws(c, 99);
  const plsh::MaskErrorOperator op(c.n, c.slope, grids, c.first);
  const Eigen::VectorXd x = test_vector(c.n, 5), other = test_vector(c.n, 6);
  Eigen::VectorXd first(c.n), between(c.n), second(c.n);
  op.perform_op(x.data(), first.data());
  op.perform_op(other.data(), between.data());
  op.perform_op(x.data(), second.data());
  CHECK(std::memcmp(first.data(), second.data(), sizeof(double) * static_cast<std::size_t>(c.n)) ==
        0);
}

namespace {

/// Eigenvalues 1, 2, ..., n - 1 and -n: the largest magnitude is the negative one.
struct Diagonal {
  using Scalar = double;
  Index n;
  Index rows() const { return n; }
  Index cols() const { return n; }
  void perform_op(const double* x, double* y) const {
    for (Index i = 0; i < n - 1; ++i) y[i] = static_cast<double>(i + 1) * x[i];
    y[n - 1] = -static_cast<double>(n) * x[n - 1];
  }
};

}  // namespace

TEST_CASE("symmetric_spectral_norm of a diagonal operator with eigenvalues of both signs",
          "[error_norms][spectra]") {
  for (const Index n : {1, 5, 40, 500}) {
    INFO("n=" << n);
    const plsh::SpectralNorm norm = plsh::symmetric_spectral_norm(Diagonal{n});
    REQUIRE(norm.converged);
    CHECK(norm.value == Approx(static_cast<double>(n)).epsilon(1e-10));
  }
}

namespace {

/// Eigenvalues `scale` (1 - k 10^-5) for k = 0, 1, ..., n/2 - 1 and - `scale` (1 - (k + 1/2)
/// 10^-5): tight clusters at both ends of the spectrum, the top one at + `scale`.
struct TwoClusters {
  using Scalar = double;
  Index n;
  double scale;
  Index rows() const { return n; }
  Index cols() const { return n; }
  double eigenvalue(Index i) const {
    const double k = static_cast<double>(i / 2);
    return i % 2 == 0 ? scale * (1 - k * 1e-5) : -scale * (1 - (k + 0.5) * 1e-5);
  }
  void perform_op(const double* x, double* y) const {
    for (Index i = 0; i < n; ++i) y[i] = eigenvalue(i) * x[i];
  }
};

/// The zero operator.
struct Zero {
  using Scalar = double;
  Index n;
  Index rows() const { return n; }
  Index cols() const { return n; }
  void perform_op(const double*, double* y) const {
    for (Index i = 0; i < n; ++i) y[i] = 0;
  }
};

}  // namespace

TEST_CASE("symmetric_spectral_norm of clusters at both ends, of any scale",
          "[error_norms][spectra]") {
  // Lanczos on E sees both clusters, at +||E|| and just inside -||E||, in one Krylov space. The
  // value is the top eigenvalue to the tolerance (relative), whatever the scale.
  for (const double scale : {1.0, 1e-20, 1e20}) {
    const TwoClusters op{400, scale};
    for (const double tolerance : {1e-6, 1e-10}) {
      plsh::LanczosOptions options;
      options.tolerance = tolerance;
      const plsh::SpectralNorm norm = plsh::symmetric_spectral_norm(op, options);
      INFO("scale " << scale << " tolerance " << tolerance << ": " << norm.value << " after "
                    << norm.products << " products");
      REQUIRE(norm.converged);
      CHECK(norm.finite);
      CHECK(std::abs(norm.value - scale) <= 1.01 * tolerance * scale);
      CHECK(norm.products > 0);
    }
  }
  // The zero operator has the norm 0, converged: the start vector is a Ritz vector of residual 0.
  const plsh::SpectralNorm zero = plsh::symmetric_spectral_norm(Zero{100});
  CHECK(zero.value == 0);
  CHECK(zero.converged);
  CHECK(zero.finite);
}

TEST_CASE("the spectral norms reject invalid options", "[error_norms][spectra]") {
  const std::vector<Grid> grids{plsh::fixed_grid(4)};
  plsh::LanczosOptions options;
  options.basis_size = 1;
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(100, 0.1, grids, 0, options),
                      Catch::Contains("mask_spectral_error") && Catch::Contains("basis_size"));
  options = plsh::LanczosOptions{};
  options.max_restarts = 0;
  REQUIRE_THROWS_AS(plsh::mask_spectral_error(100, 0.1, grids, 0, options), std::invalid_argument);
  options = plsh::LanczosOptions{};
  options.tolerance = kNaN;
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(100, 0.1, grids, 0, options),
                      Catch::Contains("tolerance"));
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(0, 0.1, grids),
                      Catch::Contains("mask_spectral_error") && Catch::Contains("n must"));
  options = plsh::LanczosOptions{};
  options.basis_size = 1;
  REQUIRE_THROWS_WITH(plsh::symmetric_spectral_norm(Diagonal{10}, options),
                      Catch::Contains("symmetric_spectral_norm") && Catch::Contains("basis_size"));
}

TEST_CASE("mask_spectral_error checks its arguments before it allocates",
          "[error_norms][spectra]") {
  // n, then the options, then the sizes of the solver's buffers are checked before the operator
  // sizes its O(n) vectors: a negative n reached Eigen's resize (an assertion failure without
  // NDEBUG) and n = 2^40 threw std::bad_alloc. One block per draw for the large n, so that nothing
  // here can take long.
  const std::vector<Grid> grids{plsh::fixed_grid(std::numeric_limits<double>::infinity())};
  for (const Index n : {Index(-5), Index(0), Index(1) << 40, plsh::kMaxPosition + 1}) {
    INFO("n=" << n);
    REQUIRE_THROWS_AS(plsh::MaskErrorOperator(n, 0.1, grids), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mask_spectral_error(n, 0.1, grids), std::invalid_argument);
  }
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(-5, 0.1, grids),
                      Catch::Contains("mask_spectral_error") && Catch::Contains("n must"));
  REQUIRE_THROWS_WITH(plsh::MaskErrorOperator(Index(1) << 40, 0.1, grids),
                      Catch::Contains("MaskErrorOperator") && Catch::Contains("2^32"));
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(Index(1) << 40, 0.1, grids),
                      Catch::Contains("mask_spectral_error") && Catch::Contains("2^32"));

  // The largest n the operator takes, with options whose buffers cannot be sized (a dense n x n
  // matrix, 2^67 bytes) or that are invalid, all reported before the operator's 32 GiB of
  // products are allocated. (Lanczos on a symmetric E keeps no basis: basis_size only sets how
  // often convergence is tested.)
  const Index n = (Index(1) << 32) - 1;
  plsh::LanczosOptions options;
  options.dense_below = plsh::kMaxPosition;
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(n, 0.1, grids, 0, options),
                      Catch::Contains("mask_spectral_error") && Catch::Contains("dense_below"));
  options = plsh::LanczosOptions{};
  options.max_restarts = 0;
  REQUIRE_THROWS_WITH(plsh::mask_spectral_error(n, 0.1, grids, 0, options),
                      Catch::Contains("mask_spectral_error") && Catch::Contains("max_restarts"));
}

namespace {

/// y = x with one entry replaced by `value` (NaN or an infinity): every product is non-finite.
struct NonFinite {
  using Scalar = double;
  Index n;
  double value;
  Index rows() const { return n; }
  Index cols() const { return n; }
  void perform_op(const double* x, double* y) const {
    for (Index i = 0; i < n; ++i) y[i] = x[i];
    y[n / 2] = value;
  }
};

/// An operator of no rows, with the interface of largest_singular_value.
struct Empty {
  Index rows() const { return 0; }
  Index cols() const { return 0; }
  void product(const double*, double*) const {}
  void transpose_product(const double*, double*) const {}
};

}  // namespace

TEST_CASE("a non-finite product gives a NaN norm and a status, not an exception",
          "[error_norms][spectra]") {
  // The dense path (n below dense_below) and the Lanczos path: the solver stops at the first
  // product with a NaN or an infinity, and no exception of Spectra's escapes.
  for (const Index n : {5, 100}) {
    for (const double value : {kNaN, std::numeric_limits<double>::infinity()}) {
      INFO("n=" << n << " value=" << value);
      plsh::SpectralNorm norm;
      REQUIRE_NOTHROW(norm = plsh::symmetric_spectral_norm(NonFinite{n, value}));
      CHECK(std::isnan(norm.value));
      CHECK_FALSE(norm.converged);
      CHECK_FALSE(norm.finite);
      CHECK(norm.products >= 1);
    }
  }
  // A finite operator reports finite.
  const plsh::SpectralNorm finite = plsh::symmetric_spectral_norm(Diagonal{40});
  CHECK(finite.finite);
  CHECK(finite.converged);
}

TEST_CASE("largest_singular_value checks its options before anything else",
          "[error_norms][spectra]") {
  plsh::LanczosOptions options;
  options.basis_size = 0;
  REQUIRE_THROWS_WITH(plsh::largest_singular_value(Empty{}, options),
                      Catch::Contains("largest_singular_value") && Catch::Contains("basis_size"));
  const plsh::SpectralNorm empty = plsh::largest_singular_value(Empty{});
  CHECK(empty.value == 0);
  CHECK(empty.converged);
}

#else

TEST_CASE("the matrix-free spectral norms need Spectra", "[error_norms][spectra]") {
  plsh_test::skip_executable(
      "Spectra not found (Debian: libspectra-dev): the matrix-free spectral norm tests did not "
      "run");
}

#endif  // PLSH_HAS_SPECTRA

TEST_CASE("the matrix-free mask norms reject bad input", "[error_norms]") {
  const std::vector<Grid> grids{plsh::fixed_grid(4)};
  const Index huge = plsh::kMaxPosition;
  REQUIRE_THROWS_WITH(plsh::mask_max_error(0, 0.1, grids),
                      Catch::Contains("mask_max_error") && Catch::Contains("n must"));
  REQUIRE_THROWS_WITH(plsh::mask_max_error(10, 0.1, grids, huge - 5),
                      Catch::Contains("mask_max_error") && Catch::Contains("first + n"));
  REQUIRE_THROWS_WITH(plsh::mask_max_error(10, 0.1, grids, -huge - 1),
                      Catch::Contains("first + n"));
  REQUIRE_THROWS_WITH(plsh::mask_max_error(10, -0.1, grids),
                      Catch::Contains("mask_max_error") && Catch::Contains("slope"));
  REQUIRE_THROWS_AS(plsh::mask_max_error(10, kNaN, grids), std::invalid_argument);
  REQUIRE_THROWS_WITH(plsh::mask_max_error(10, 0.1, {}),
                      Catch::Contains("mask_max_error") && Catch::Contains("grids"));
  REQUIRE_THROWS_WITH(plsh::mask_max_error(10, 0.1, {Grid{-1, 0}}), Catch::Contains("pitch"));
  REQUIRE_THROWS_WITH(plsh::MaskErrorOperator(10, 0.1, {}),
                      Catch::Contains("MaskErrorOperator") && Catch::Contains("grids"));
  REQUIRE_THROWS_WITH(plsh::MaskErrorOperator(10, kNaN, grids),
                      Catch::Contains("MaskErrorOperator") && Catch::Contains("slope"));

  Eigen::VectorXd x = Eigen::VectorXd::Ones(5);
  Eigen::VectorXd y(4);
  REQUIRE_THROWS_WITH(plsh::laplacian_product(0.1, x, y),
                      Catch::Contains("laplacian_product") && Catch::Contains("same size"));
  REQUIRE_THROWS_WITH(plsh::laplacian_product(-1, x, x), Catch::Contains("slope"));
  REQUIRE_THROWS_WITH(plsh::mean_mask_product(grids, 0, x, y),
                      Catch::Contains("mean_mask_product") && Catch::Contains("same size"));
  Eigen::VectorXd empty(0);
  REQUIRE_THROWS_WITH(plsh::mean_mask_product(grids, 0, empty, empty), Catch::Contains("n must"));
  Eigen::VectorXd z(5);
  REQUIRE_THROWS_WITH(plsh::mean_mask_product({}, 0, x, z), Catch::Contains("grids"));
  REQUIRE_THROWS_WITH(plsh::mean_mask_product(grids, huge, x, z), Catch::Contains("first + n"));
}

}  // namespace test_error_norms
