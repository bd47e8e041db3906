// Tests of attention_error.hpp: the dense attention matrices against the reference kernels, the
// kernel products of AttentionErrorOperator against the dense error matrix, and the row-by-row and
// matrix-free norms against the dense ones, over the offset cases of the attention fixture.

#include <catch2/catch.hpp>

#include <Eigen/SVD>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/analysis.hpp>
#include <plsh/reference.hpp>
#include <plsh/sampler.hpp>

#include "attention_fixture.hpp"
#include "fill.hpp"
#include "kernel_instances.hpp"
#include "skip.hpp"

namespace test_attention_error {

namespace {

using plsh::Grid;
using plsh::Index;
using plsh_test::Problem;
using plsh_test::Shape;

constexpr double kTolerance = 1e-12;

/// One head: q [n_q][1][d], k [n_k][1][d], v [n_k][1][3].
Problem<double> head_problem(Index n_q, Index n_k, std::uint64_t seed) {
  return Problem<double>(Shape{n_q, n_k, 1, 1, 8, 3}, seed);
}

/// The slope and grids of the NaN cases (nan_problem, unseen_nan_problem).
constexpr double kNanSlope = 1.0 / 8;
std::vector<Grid> nan_grids() { return plsh::RandomBinning(kNanSlope, 5).draw(10); }

/// A 40 x 40 head problem with a NaN in q (or k) at token 17, element 3: visible scores use it.
Problem<double> nan_problem(bool in_query) {
  Problem<double> problem = head_problem(40, 40, 23);
  (in_query ? problem.q : problem.k).view.data[17 * 8 + 3] =
      std::numeric_limits<double>::quiet_NaN();
  return problem;
}

/// `clean`, 40 queries and 50 keys, and `problem`, the same with a NaN in key 45: causal, no query
/// sees it.
struct UnseenNan {
  Problem<double> clean = head_problem(40, 50, 29);
  Problem<double> problem = clean;
  plsh::AttentionOptions options;
  UnseenNan() {
    problem.k.view.data[45 * 8 + 1] = std::numeric_limits<double>::quiet_NaN();
    options.causal = true;
  }

  /// The dense errors of the clean problem: what the NaN must not change.
  plsh::AttentionError expected(double slope, const std::vector<Grid>& grids) const {
    return plsh::dense_attention_error<double>(clean.q.view, clean.k.view, slope, grids, options);
  }
};

Eigen::VectorXd test_vector(Index n, std::uint64_t seed) {
  const std::vector<double> values =
      plsh_test::uniform_values<double>(static_cast<std::size_t>(n), seed);
  return Eigen::Map<const Eigen::VectorXd>(values.data(), n);
}

/// The head's output as an n_q x d_v matrix.
Eigen::MatrixXd as_matrix(const plsh::HeadsView<double>& view) { return view.head(0); }

/// Slopes of the standard list of 8 heads (first, middle and last) and a slope 0.
const std::vector<double>& test_slopes() {
  static const std::vector<double> slopes{0.5, 1.0 / 16, 1.0 / 256, 0.0};
  return slopes;
}

}  // namespace

TEST_CASE("the dense attention matrices equal the reference kernels", "[attention_error]") {
  std::uint64_t seed = 0;
  plsh_test::for_each_offset_case(plsh_test::offset_cases(), [&](const plsh_test::OffsetCase& c,
                                                                 plsh::AttentionOptions options) {
    for (const double slope : test_slopes()) {
      for (const Index samples : {Index(1), Index(20)}) {
        const Problem<double> problem = head_problem(c.n_q, c.n_k, ++seed);
        const std::vector<Grid> grids = plsh::RandomBinning(slope, seed).draw(samples);
        INFO(plsh_test::describe(options)
             << " n_q=" << c.n_q << " n_k=" << c.n_k << " slope=" << slope << " s=" << samples);
        const Eigen::MatrixXd v = problem.v.view.head(0);

        const Eigen::MatrixXd alibi =
            plsh::alibi_attention_matrix<double>(problem.q.view, problem.k.view, slope, options);
        auto out = problem.output();
        plsh::reference::alibi_attention<double>(problem.q.view, problem.k.view, problem.v.view,
                                                 out.view, {slope}, options);
        CHECK((alibi * v - as_matrix(out.view)).cwiseAbs().maxCoeff() <= kTolerance);

        const Eigen::MatrixXd plsh =
            plsh::plsh_attention_matrix<double>(problem.q.view, problem.k.view, grids, options);
        plsh::reference::mask_attention<double>(problem.q.view, problem.k.view, problem.v.view,
                                                out.view, {grids}, options);
        CHECK((plsh * v - as_matrix(out.view)).cwiseAbs().maxCoeff() <= kTolerance);

        // Rows sum to 1, or are zero when the query sees no key (Positional LSH: no key in any
        // of its blocks, as for a query beyond the last key).
        for (Index i = 0; i < c.n_q; ++i) {
          const bool sees_keys =
              !options.causal || options.key_position <= options.query_position + i;
          CHECK(alibi.row(i).sum() == Approx(sees_keys ? 1.0 : 0.0).margin(1e-14));
          const double plsh_sum = plsh.row(i).sum();
          CHECK((plsh_sum == 0 || std::abs(plsh_sum - 1) <= 1e-14));
          if (!sees_keys) CHECK(plsh_sum == 0);
        }
      }
    }
  });
}

TEST_CASE("AttentionErrorOperator products equal the dense error matrix", "[attention_error]") {
  std::uint64_t seed = 100;
  plsh_test::for_each_offset_case(plsh_test::offset_cases(), [&](const plsh_test::OffsetCase& c,
                                                                 plsh::AttentionOptions options) {
    for (const double slope : test_slopes()) {
      const Problem<double> problem = head_problem(c.n_q, c.n_k, ++seed);
      const std::vector<Grid> grids = plsh::RandomBinning(slope, seed).draw(20);
      INFO(plsh_test::describe(options)
           << " n_q=" << c.n_q << " n_k=" << c.n_k << " slope=" << slope);
      const Eigen::MatrixXd error =
          plsh::plsh_attention_matrix<double>(problem.q.view, problem.k.view, grids, options) -
          plsh::alibi_attention_matrix<double>(problem.q.view, problem.k.view, slope, options);
      const plsh::AttentionErrorOperator op(problem.q.view, problem.k.view, slope, grids, options);
      REQUIRE(op.rows() == c.n_q);
      REQUIRE(op.cols() == c.n_k);
      const Eigen::VectorXd x = test_vector(c.n_k, seed);
      Eigen::VectorXd y(c.n_q);
      op.product(x.data(), y.data());
      CHECK((y - error * x).cwiseAbs().maxCoeff() <= kTolerance);
      const Eigen::VectorXd u = test_vector(c.n_q, seed + 7);
      Eigen::VectorXd z(c.n_k);
      op.transpose_product(u.data(), z.data());
      CHECK((z - error.transpose() * u).cwiseAbs().maxCoeff() <= kTolerance);
    }
  });
}

TEST_CASE("attention_entry_error equals the dense max and Frobenius norms", "[attention_error]") {
  std::uint64_t seed = 200;
  for (const double slope : test_slopes()) {
    for (const Index samples : {Index(1), Index(50)}) {
      const Problem<double> problem = head_problem(150, 150, ++seed);
      const std::vector<Grid> grids = plsh::RandomBinning(slope, seed).draw(samples);
      INFO("slope=" << slope << " s=" << samples);
      const Eigen::MatrixXd error =
          plsh::plsh_attention_matrix<double>(problem.q.view, problem.k.view, grids) -
          plsh::alibi_attention_matrix<double>(problem.q.view, problem.k.view, slope);
      const plsh::AttentionError dense =
          plsh::dense_attention_error<double>(problem.q.view, problem.k.view, slope, grids);
      const plsh::AttentionError rows =
          plsh::attention_entry_error<double>(problem.q.view, problem.k.view, slope, grids);
      CHECK(dense.max == error.cwiseAbs().maxCoeff());
      CHECK(dense.frobenius == Approx(error.norm()).epsilon(1e-14));
      CHECK(dense.spectral ==
            Approx(Eigen::JacobiSVD<Eigen::MatrixXd>(error).singularValues()[0]).epsilon(1e-12));
      CHECK(rows.max == dense.max);
      CHECK(rows.frobenius == Approx(dense.frobenius).epsilon(1e-14));
      CHECK(rows.spectral == 0);
      // Slope 0 with one block holding everything would be exact; a slope 0 sampler draws one
      // infinite pitch, so both matrices are plain attention.
      if (slope == 0) CHECK(dense.max <= 1e-15);
    }
  }
}

#ifdef PLSH_HAS_SPECTRA

TEST_CASE("attention_error equals the dense norms", "[attention_error][spectra]") {
  std::uint64_t seed = 300;
  plsh_test::for_each_offset_case(plsh_test::offset_cases(), [&](const plsh_test::OffsetCase& c,
                                                                 plsh::AttentionOptions options) {
    for (const double slope : {0.5, 1.0 / 16}) {
      const Problem<double> problem = head_problem(c.n_q, c.n_k, ++seed);
      const std::vector<Grid> grids = plsh::RandomBinning(slope, seed).draw(10);
      INFO(plsh_test::describe(options)
           << " n_q=" << c.n_q << " n_k=" << c.n_k << " slope=" << slope);
      const plsh::AttentionError dense = plsh::dense_attention_error<double>(
          problem.q.view, problem.k.view, slope, grids, options);
      const plsh::AttentionErrorNorms measured =
          plsh::attention_error<double>(problem.q.view, problem.k.view, slope, grids, options);
      REQUIRE(measured.spectral.converged);
      CHECK(measured.spectral.finite);
      // The norm to the Lanczos tolerance 1e-10 (relative, LanczosOptions), plus the rounding of
      // the kernels' products, ~1e-15 relative to the entries.
      CHECK(measured.spectral.value == Approx(dense.spectral).epsilon(1e-9).margin(1e-12));
      CHECK(measured.max == dense.max);
      CHECK(measured.frobenius == Approx(dense.frobenius).epsilon(1e-14));
    }
  });
}

TEST_CASE("attention_error with float inputs and a trained-model shape",
          "[attention_error][spectra]") {
  // Float q and k are converted to double once; the norms equal those of the double copies.
  Problem<float> problem(Shape{300, 300, 1, 1, 12, 1}, 7);
  Problem<double> copy(Shape{300, 300, 1, 1, 12, 1}, 7);
  copy.q.view.head(0) = problem.q.view.head(0).cast<double>();
  copy.k.view.head(0) = problem.k.view.head(0).cast<double>();
  const std::vector<Grid> grids = plsh::RandomBinning(1.0 / 32, 9).draw(30);
  const plsh::AttentionErrorNorms from_float =
      plsh::attention_error<float>(problem.q.view, problem.k.view, 1.0 / 32, grids);
  const plsh::AttentionError dense =
      plsh::dense_attention_error<double>(copy.q.view, copy.k.view, 1.0 / 32, grids);
  REQUIRE(from_float.spectral.converged);
  CHECK(from_float.spectral.value == Approx(dense.spectral).epsilon(1e-9));
  CHECK(from_float.max == Approx(dense.max).epsilon(1e-14));
}

TEST_CASE("attention_error reports a Lanczos solver that did not converge",
          "[attention_error][spectra]") {
  // One restart of a basis of 2 cannot reach 1e-14: the value is then a Rayleigh quotient, a lower
  // bound of the norm, and the status says so (the value used to come back as a double beside an
  // optional flag, documented as 0).
  const Problem<double> problem = head_problem(150, 150, 41);
  const double slope = 1.0 / 16;
  const std::vector<Grid> grids = plsh::RandomBinning(slope, 41).draw(5);
  plsh::LanczosOptions lanczos;
  lanczos.basis_size = 2;
  lanczos.max_restarts = 1;
  lanczos.tolerance = 1e-14;
  const plsh::AttentionErrorNorms measured =
      plsh::attention_error<double>(problem.q.view, problem.k.view, slope, grids, {}, lanczos);
  const plsh::AttentionError dense =
      plsh::dense_attention_error<double>(problem.q.view, problem.k.view, slope, grids);
  INFO("Ritz value " << measured.spectral.value << ", norm " << dense.spectral);
  REQUIRE_FALSE(measured.spectral.converged);
  CHECK(measured.spectral.finite);
  CHECK(measured.spectral.products >= 1);
  CHECK(measured.spectral.value > 0);
  CHECK(measured.spectral.value <= dense.spectral * (1 + 1e-12));
  CHECK(measured.max == dense.max);
  CHECK(measured.frobenius == Approx(dense.frobenius).epsilon(1e-14));
  const plsh::SpectralNorm alone = plsh::attention_spectral_error<double>(
      problem.q.view, problem.k.view, slope, grids, {}, lanczos);
  CHECK_FALSE(alone.converged);
  CHECK(alone.value == measured.spectral.value);
}

#endif  // PLSH_HAS_SPECTRA

TEST_CASE("the attention error functions reject bad input", "[attention_error]") {
  const Problem<double> problem = head_problem(10, 10, 1);
  const Problem<double> two_heads(Shape{10, 10, 2, 2, 8, 3}, 2);
  const Problem<double> other_dim(Shape{10, 10, 1, 1, 4, 3}, 3);
  const std::vector<Grid> grids{plsh::fixed_grid(4)};
  const auto q = problem.q.view;
  const auto k = problem.k.view;
  REQUIRE_THROWS_WITH(plsh::alibi_attention_matrix<double>(two_heads.q.view, two_heads.k.view, 0.1),
                      Catch::Contains("alibi_attention_matrix") && Catch::Contains("one head"));
  REQUIRE_THROWS_WITH(plsh::alibi_attention_matrix<double>(q, other_dim.k.view, 0.1),
                      Catch::Contains("k.dim"));
  REQUIRE_THROWS_WITH(plsh::alibi_attention_matrix<double>(q, k, -1.0), Catch::Contains("slope"));
  REQUIRE_THROWS_WITH(plsh::plsh_attention_matrix<double>(q, k, {}),
                      Catch::Contains("plsh_attention_matrix") && Catch::Contains("grids"));
  plsh::AttentionOptions options;
  options.query_position = -1;
  REQUIRE_THROWS_WITH(plsh::plsh_attention_matrix<double>(q, k, grids, options),
                      Catch::Contains("query_position"));
  REQUIRE_THROWS_WITH(plsh::dense_attention_error<double>(q, k, 0.1, {}),
                      Catch::Contains("dense_attention_error") && Catch::Contains("grids"));
  REQUIRE_THROWS_AS(plsh::dense_attention_error<double>(q, k, std::nan(""), grids),
                    std::invalid_argument);
  REQUIRE_THROWS_WITH(plsh::attention_entry_error<double>(q, k, 0.1, {Grid{0, 0}}),
                      Catch::Contains("attention_entry_error") && Catch::Contains("pitch"));
  REQUIRE_THROWS_WITH(plsh::AttentionErrorOperator(two_heads.q.view, two_heads.k.view, 0.1, grids),
                      Catch::Contains("AttentionErrorOperator") && Catch::Contains("one head"));
  const plsh::HeadsView<double> null_view{nullptr, 10, 1, 8};
  REQUIRE_THROWS_AS(plsh::AttentionErrorOperator(null_view, k, 0.1, grids), std::invalid_argument);
}

TEST_CASE("the attention error functions check sizes before they allocate", "[attention_error]") {
  // Views with token_stride 0 repeat one row: valid inputs whose dense matrices or double copies
  // cannot be sized. Each threw std::bad_alloc from Eigen before its checks; now the checks run
  // before any allocation.
  const std::vector<double> row(1024, 0.25);
  const std::vector<Grid> grids{plsh::fixed_grid(4)};
  // 2^31 tokens: the n_q x n_k matrix has 2^62 entries, 2^65 bytes.
  const plsh::HeadsView<const double> wide{row.data(), Index(1) << 31, 1, 8, 0, 8};
  REQUIRE_THROWS_WITH(
      plsh::alibi_attention_matrix<double>(wide, wide, 0.1),
      Catch::Contains("alibi_attention_matrix") && Catch::Contains("q.tokens x k.tokens"));
  REQUIRE_THROWS_WITH(
      plsh::plsh_attention_matrix<double>(wide, wide, grids),
      Catch::Contains("plsh_attention_matrix") && Catch::Contains("q.tokens x k.tokens"));
  REQUIRE_THROWS_WITH(
      plsh::dense_attention_error<double>(wide, wide, 0.1, grids),
      Catch::Contains("dense_attention_error") && Catch::Contains("q.tokens x k.tokens"));
  // 2^52 tokens of 1024 entries: the copies of q and k to double have 2^62 entries.
  const plsh::HeadsView<const double> deep{row.data(), Index(1) << 52, 1, 1024, 0, 1024};
  REQUIRE_THROWS_WITH(plsh::attention_entry_error<double>(deep, deep, 0.1, grids),
                      Catch::Contains("attention_entry_error") && Catch::Contains("tokens x dim"));
  REQUIRE_THROWS_WITH(plsh::AttentionErrorOperator(deep, deep, 0.1, grids),
                      Catch::Contains("AttentionErrorOperator") && Catch::Contains("tokens x dim"));
}

TEST_CASE("a NaN in q or k gives NaN norms, not an exception", "[attention_error]") {
  // The contract of attention_error.hpp: a NaN that a visible score uses makes rows of both
  // attention matrices NaN (online_softmax.hpp); every norm is then NaN and the spectral status
  // says so. A NaN that no visible score uses changes nothing.
  const double slope = kNanSlope;
  const std::vector<Grid> grids = nan_grids();
  for (const bool in_query : {true, false}) {
    INFO((in_query ? "NaN in q" : "NaN in k"));
    const Problem<double> problem = nan_problem(in_query);
    const plsh::AttentionError dense =
        plsh::dense_attention_error<double>(problem.q.view, problem.k.view, slope, grids);
    CHECK(std::isnan(dense.spectral));
    CHECK(std::isnan(dense.max));
    CHECK(std::isnan(dense.frobenius));
    const plsh::AttentionError rows =
        plsh::attention_entry_error<double>(problem.q.view, problem.k.view, slope, grids);
    CHECK(std::isnan(rows.max));
    CHECK(std::isnan(rows.frobenius));
  }
  {
    INFO("NaN in a key no query sees");
    const UnseenNan unseen;
    const plsh::AttentionError expected = unseen.expected(slope, grids);
    const plsh::AttentionError dense = plsh::dense_attention_error<double>(
        unseen.problem.q.view, unseen.problem.k.view, slope, grids, unseen.options);
    CHECK(dense.max == expected.max);
    CHECK(dense.frobenius == expected.frobenius);
    CHECK(dense.spectral == Approx(expected.spectral).epsilon(1e-14));
  }
}

#ifdef PLSH_HAS_SPECTRA

TEST_CASE("the spectral attention error checks sizes and options before it allocates",
          "[attention_error][spectra]") {
  // As "the attention error functions check sizes before they allocate", for the functions that
  // run the Lanczos solver.
  const std::vector<double> row(1024, 0.25);
  const std::vector<Grid> grids{plsh::fixed_grid(4)};
  const plsh::HeadsView<const double> wide{row.data(), Index(1) << 31, 1, 8, 0, 8};
  const plsh::HeadsView<const double> deep{row.data(), Index(1) << 52, 1, 1024, 0, 1024};
  REQUIRE_THROWS_WITH(
      plsh::attention_spectral_error<double>(deep, deep, 0.1, grids),
      Catch::Contains("attention_spectral_error") && Catch::Contains("tokens x dim"));
  REQUIRE_THROWS_WITH(plsh::attention_error<double>(deep, deep, 0.1, grids),
                      Catch::Contains("attention_error") && Catch::Contains("tokens x dim"));
  // The Lanczos buffers of the 2^31 x 2^31 error, and invalid options, before the operator copies
  // q and k (256 GiB here).
  plsh::LanczosOptions lanczos;
  lanczos.basis_size = Index(1) << 31;
  REQUIRE_THROWS_WITH(plsh::attention_spectral_error<double>(wide, wide, 0.1, grids, {}, lanczos),
                      Catch::Contains("attention_spectral_error") && Catch::Contains("basis"));
  lanczos = plsh::LanczosOptions{};
  lanczos.dense_below = Index(1) << 40;
  REQUIRE_THROWS_WITH(plsh::attention_error<double>(wide, wide, 0.1, grids, {}, lanczos),
                      Catch::Contains("attention_error") && Catch::Contains("dense_below"));
  lanczos = plsh::LanczosOptions{};
  lanczos.tolerance = -1;
  REQUIRE_THROWS_WITH(plsh::attention_error<double>(wide, wide, 0.1, grids, {}, lanczos),
                      Catch::Contains("attention_error") && Catch::Contains("tolerance"));
}

TEST_CASE("a NaN in q or k gives a NaN spectral norm and a status, not an exception",
          "[attention_error][spectra]") {
  // The spectral part of "a NaN in q or k gives NaN norms, not an exception".
  const double slope = kNanSlope;
  const std::vector<Grid> grids = nan_grids();
  for (const bool in_query : {true, false}) {
    INFO((in_query ? "NaN in q" : "NaN in k"));
    const Problem<double> problem = nan_problem(in_query);
    plsh::SpectralNorm spectral;
    REQUIRE_NOTHROW(spectral = plsh::attention_spectral_error<double>(
                        problem.q.view, problem.k.view, slope, grids));
    CHECK(std::isnan(spectral.value));
    CHECK_FALSE(spectral.converged);
    CHECK_FALSE(spectral.finite);
    plsh::AttentionErrorNorms norms;
    REQUIRE_NOTHROW(
        norms = plsh::attention_error<double>(problem.q.view, problem.k.view, slope, grids));
    CHECK(std::isnan(norms.spectral.value));
    CHECK_FALSE(norms.spectral.converged);
    CHECK_FALSE(norms.spectral.finite);
    CHECK(std::isnan(norms.max));
    CHECK(std::isnan(norms.frobenius));
  }
  {
    INFO("NaN in a key no query sees");
    const UnseenNan unseen;
    const plsh::AttentionError expected = unseen.expected(slope, grids);
    const plsh::AttentionErrorNorms norms = plsh::attention_error<double>(
        unseen.problem.q.view, unseen.problem.k.view, slope, grids, unseen.options);
    REQUIRE(norms.spectral.converged);
    CHECK(norms.spectral.finite);
    CHECK(norms.spectral.value == Approx(expected.spectral).epsilon(1e-9));
    CHECK(norms.max == expected.max);
  }
}

#else

TEST_CASE("the matrix-free attention spectral norm needs Spectra", "[attention_error][spectra]") {
  plsh_test::skip_executable(
      "Spectra not found (Debian: libspectra-dev): the matrix-free attention spectral norm tests "
      "did not run");
}

#endif  // PLSH_HAS_SPECTRA

}  // namespace test_attention_error
