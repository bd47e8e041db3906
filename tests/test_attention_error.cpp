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

#include <plsh/attention/reference.hpp>
#include <plsh/attention_error.hpp>
#include <plsh/sampler.hpp>

#include "attention_fixture.hpp"
#include "fill.hpp"

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

TEST_CASE("attention_error equals the dense norms", "[attention_error]") {
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
      bool converged = false;
      const plsh::AttentionError measured = plsh::attention_error<double>(
          problem.q.view, problem.k.view, slope, grids, options, {}, &converged);
      REQUIRE(converged);
      // The squared norm to the Lanczos tolerance 1e-10: the norm to about 5e-11, plus the
      // rounding of the kernels' products, ~1e-15 relative to the entries.
      CHECK(measured.spectral == Approx(dense.spectral).epsilon(1e-9).margin(1e-12));
      CHECK(measured.max == dense.max);
      CHECK(measured.frobenius == Approx(dense.frobenius).epsilon(1e-14));
    }
  });
}

TEST_CASE("attention_error with float inputs and a trained-model shape", "[attention_error]") {
  // Float q and k are converted to double once; the norms equal those of the double copies.
  Problem<float> problem(Shape{300, 300, 1, 1, 12, 1}, 7);
  Problem<double> copy(Shape{300, 300, 1, 1, 12, 1}, 7);
  copy.q.view.head(0) = problem.q.view.head(0).cast<double>();
  copy.k.view.head(0) = problem.k.view.head(0).cast<double>();
  const std::vector<Grid> grids = plsh::RandomBinning(1.0 / 32, 9).draw(30);
  const plsh::AttentionError from_float =
      plsh::attention_error<float>(problem.q.view, problem.k.view, 1.0 / 32, grids);
  const plsh::AttentionError dense =
      plsh::dense_attention_error<double>(copy.q.view, copy.k.view, 1.0 / 32, grids);
  CHECK(from_float.spectral == Approx(dense.spectral).epsilon(1e-9));
  CHECK(from_float.max == Approx(dense.max).epsilon(1e-14));
}

#else

TEST_CASE("the matrix-free attention spectral norm needs Spectra", "[attention_error]") {
  WARN(
      "plsh: Spectra not found (Debian: libspectra-dev): the matrix-free attention spectral norm "
      "tests are skipped");
  SUCCEED();
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
