// Tests of attention/regular.hpp: regular (unbiased) attention of one head with its log-sum-exp,
// against plsh::reference::factor_attention with factor 1 (log-factor 0) and a dense log-sum-exp.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/attention/regular.hpp>
#include <plsh/reference.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_regular {

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

constexpr double kInfinity = std::numeric_limits<double>::infinity();

/// \f$\mathrm{lse}_i = \log \sum_{j \text{ visible}} e^{\text{scale}\, q_i \cdot k_j}\f$ from the
/// definition in long double, head 0; \f$-\infty\f$ for a row without a visible key.
template <class Scalar>
std::vector<double> dense_lse(const Problem<Scalar>& problem,
                              const plsh::AttentionOptions& options) {
  const double scale =
      options.scale != 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(problem.shape.dim));
  std::vector<double> lse(static_cast<std::size_t>(problem.shape.n_q), -kInfinity);
  for (Index i = 0; i < problem.shape.n_q; ++i) {
    std::vector<long double> logits;
    for (Index j = 0; j < problem.shape.n_k; ++j) {
      if (options.causal && options.key_position + j > options.query_position + i) continue;
      long double dot = 0;
      for (Index e = 0; e < problem.shape.dim; ++e) {
        dot += static_cast<long double>(problem.q.at(i, 0, e)) * problem.k.at(j, 0, e);
      }
      logits.push_back(scale * dot);
    }
    if (logits.empty()) continue;
    long double high = -kInfinity;
    for (const long double logit : logits) high = std::max(high, logit);
    long double total = 0;
    for (const long double logit : logits) total += std::exp(logit - high);
    lse[static_cast<std::size_t>(i)] = static_cast<double>(high + std::log(total));
  }
  return lse;
}

/// regular_attention on head 0 of the problem, into `out` (packed) and `lse`.
template <class Scalar>
void run_regular(const Problem<Scalar>& problem, const plsh::AttentionOptions& options,
                 Buffer<Scalar>& out, std::vector<Scalar>& lse) {
  lse.assign(static_cast<std::size_t>(problem.shape.n_q), Scalar(-777));
  plsh::regular_attention<Scalar>(problem.q.in().head(0), problem.k.in().head(0),
                                  problem.v.in().head(0), options, out.view.head(0),
                                  plsh::LseMap<Scalar>(lse.data(), problem.shape.n_q));
}

/// Reference output: factor 1 on every visible key.
template <class Scalar>
Buffer<Scalar> reference_output(const Problem<Scalar>& problem,
                                const plsh::AttentionOptions& options) {
  Buffer<Scalar> expected = problem.output();
  plsh::reference::factor_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                    options, [](Index, Index, Index) { return 0.0; });
  return expected;
}

template <class Scalar>
void check_against_reference(const Shape& shape, const plsh::AttentionOptions& options,
                             std::uint64_t seed) {
  const Problem<Scalar> problem(shape, seed);
  Buffer<Scalar> out = problem.output();
  std::vector<Scalar> lse;
  run_regular(problem, options, out, lse);
  const Buffer<Scalar> expected = reference_output(problem, options);
  const std::vector<double> expected_lse = dense_lse(problem, options);
  const double tolerance = plsh_test::reference_tolerance<Scalar>();

  INFO(shape << ", " << plsh_test::describe(options) << ", "
             << (sizeof(Scalar) == 4 ? "float" : "double"));
  const double regular_error = plsh_test::max_abs_difference(out.in(), expected.in());
  INFO("regular_error = " << plsh_test::scientific(regular_error));
  CHECK(regular_error <= tolerance);
  Index empty_rows = 0;
  for (Index i = 0; i < shape.n_q; ++i) {
    const double got = static_cast<double>(lse[static_cast<std::size_t>(i)]);
    const double want = expected_lse[static_cast<std::size_t>(i)];
    INFO("row " << i << ": lse " << got << ", dense log-sum-exp " << want);
    if (want == -kInfinity) {
      ++empty_rows;
      CHECK(got == -kInfinity);
      for (Index e = 0; e < shape.value_dim; ++e) CHECK(out.at(i, 0, e) == Scalar(0));
    } else {
      // Rounding of a log-sum-exp is relative to its size.
      CHECK(std::abs(got - want) <= tolerance * std::max(1.0, std::abs(want)));
    }
  }
  // Rows whose position precedes every key position see nothing under causal masking.
  const Index expected_empty =
      options.causal
          ? std::min(shape.n_q, std::max<Index>(0, options.key_position - options.query_position))
          : (shape.n_k == 0 ? shape.n_q : 0);
  CHECK(empty_rows == expected_empty);

  INFO("the RegularAttention functor computes the same, bit for bit");
  Buffer<Scalar> functor_out = problem.output();
  std::vector<Scalar> functor_lse(static_cast<std::size_t>(shape.n_q));
  plsh::RegularAttention{}(problem.q.in().head(0), problem.k.in().head(0), problem.v.in().head(0),
                           options, functor_out.view.head(0),
                           plsh::LseMap<Scalar>(functor_lse.data(), shape.n_q));
  CHECK(functor_out.storage == out.storage);
  CHECK(std::memcmp(functor_lse.data(), lse.data(), lse.size() * sizeof(Scalar)) == 0);
}

template <class Scalar>
void sweep_against_reference() {
  const std::vector<Index> lengths{1, 63, 65, 129, 200};
  std::uint64_t seed = 100;
  for (const bool causal : {true, false}) {
    for (const Index n_q : lengths) {
      for (const Index n_k : lengths) {
        // d != d_v, and a one-column key dimension for the smallest case.
        const Shape shape{n_q, n_k, 1, 1, n_q == 1 ? 1 : 16, n_k == 1 ? 3 : 24};
        plsh::AttentionOptions options;
        options.causal = causal;
        check_against_reference<Scalar>(shape, options, ++seed);
      }
    }
  }
}

}  // namespace

TEST_CASE("regular_attention matches the dense reference on ragged sizes", "[regular]") {
  SECTION("double") { sweep_against_reference<double>(); }
  SECTION("float") { sweep_against_reference<float>(); }
}

TEST_CASE("regular_attention with query and key positions apart", "[regular]") {
  // Queries inside, after, straddling and before the keys; the last two rows under causal
  // masking have rows with no visible key (zero rows, lse = -inf).
  const std::vector<plsh_test::OffsetCase> cases{
      {65, 129, 64, 0},    // chunked prefill: queries are the last 65 key positions
      {63, 65, 300, 0},    // every query after every key
      {70, 65, 5, 12},     // the first 7 queries precede the first key
      {129, 63, 0, 500},   // every query precedes every key: all rows empty under causal
      {1, 200, 199, 0},    // decoding one token
      {200, 1, 0, 150},    // one key in the middle of the queries
      {129, 129, 37, 37},  // equal offsets
  };
  std::uint64_t seed = 300;
  plsh_test::for_each_offset_case(
      cases, [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        check_against_reference<double>(Shape{c.n_q, c.n_k, 1, 1, 8, 5}, options, ++seed);
        check_against_reference<float>(Shape{c.n_q, c.n_k, 1, 1, 8, 5}, options, ++seed);
      });
}

TEST_CASE("regular_attention honours an explicit scale", "[regular]") {
  for (const double scale : {0.05, 1.0, -0.7}) {
    plsh::AttentionOptions options;
    options.scale = scale;
    check_against_reference<double>(Shape{65, 130, 1, 1, 12, 7}, options, 400);
    options.causal = false;
    check_against_reference<float>(Shape{65, 130, 1, 1, 12, 7}, options, 401);
  }
}

TEST_CASE("regular_attention without keys gives zero rows, without queries does nothing",
          "[regular]") {
  const Problem<double> no_keys(Shape{5, 0, 1, 1, 4, 3}, 500);
  Buffer<double> out = no_keys.output();
  out.fill(9.0);
  std::vector<double> lse;
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    run_regular(no_keys, options, out, lse);
    INFO("n_k = 0, " << plsh_test::describe(options));
    for (Index i = 0; i < 5; ++i) {
      CHECK(lse[static_cast<std::size_t>(i)] == -kInfinity);
      for (Index e = 0; e < 3; ++e) CHECK(out.at(i, 0, e) == 0.0);
    }
  }
  const Problem<double> no_queries(Shape{0, 7, 1, 1, 4, 3}, 501);
  Buffer<double> empty_out = no_queries.output();
  run_regular(no_queries, plsh::AttentionOptions{}, empty_out, lse);
  CHECK(lse.empty());
  CHECK(empty_out.storage.size() == 1);
  CHECK(empty_out.storage[0] == Buffer<double>::kPadding);
}

TEST_CASE("regular_attention rejects shapes that disagree", "[regular][validation]") {
  using Map = plsh::HeadMap<double>;
  using ConstMap = plsh::ConstHeadMap<double>;
  std::vector<double> storage(400, 0.5);
  const auto map = [&](Index offset, Index rows, Index cols) {
    return Map(storage.data() + offset, rows, cols, Eigen::OuterStride<>(cols));
  };
  const auto const_map = [&](Index offset, Index rows, Index cols) {
    return ConstMap(storage.data() + offset, rows, cols, Eigen::OuterStride<>(cols));
  };
  std::vector<double> lse(10);
  const plsh::LseMap<double> lse_map(lse.data(), 4);
  const plsh::LseMap<double> short_lse(lse.data(), 3);
  const ConstMap q = const_map(0, 4, 6);
  const ConstMap k = const_map(50, 7, 6);
  const ConstMap v = const_map(100, 7, 5);
  const plsh::AttentionOptions options;

  INFO("valid shapes do not throw");
  CHECK_NOTHROW(plsh::regular_attention<double>(q, k, v, options, map(200, 4, 5), lse_map));

  INFO("k.cols() != q.cols()");
  REQUIRE_THROWS_AS(
      plsh::regular_attention<double>(q, const_map(50, 7, 5), v, options, map(200, 4, 5), lse_map),
      std::invalid_argument);
  CHECK_THROWS_WITH(
      plsh::regular_attention<double>(q, const_map(50, 7, 5), v, options, map(200, 4, 5), lse_map),
      Catch::Contains("regular_attention") && Catch::Contains("k.cols()"));
  INFO("v.rows() != k.rows()");
  REQUIRE_THROWS_AS(
      plsh::regular_attention<double>(q, k, const_map(100, 6, 5), options, map(200, 4, 5), lse_map),
      std::invalid_argument);
  CHECK_THROWS_WITH(
      plsh::regular_attention<double>(q, k, const_map(100, 6, 5), options, map(200, 4, 5), lse_map),
      Catch::Contains("regular_attention") && Catch::Contains("v.rows()"));
  INFO("out.rows() != q.rows()");
  REQUIRE_THROWS_AS(plsh::regular_attention<double>(q, k, v, options, map(200, 3, 5), lse_map),
                    std::invalid_argument);
  CHECK_THROWS_WITH(plsh::regular_attention<double>(q, k, v, options, map(200, 3, 5), lse_map),
                    Catch::Contains("out.rows()"));
  INFO("out.cols() != v.cols()");
  REQUIRE_THROWS_AS(plsh::regular_attention<double>(q, k, v, options, map(200, 4, 6), lse_map),
                    std::invalid_argument);
  CHECK_THROWS_WITH(plsh::regular_attention<double>(q, k, v, options, map(200, 4, 6), lse_map),
                    Catch::Contains("out.cols()"));
  INFO("lse.size() != q.rows()");
  REQUIRE_THROWS_AS(plsh::regular_attention<double>(q, k, v, options, map(200, 4, 5), short_lse),
                    std::invalid_argument);
  CHECK_THROWS_WITH(plsh::regular_attention<double>(q, k, v, options, map(200, 4, 5), short_lse),
                    Catch::Contains("regular_attention") && Catch::Contains("lse.size()"));
  for (const double scale : {std::numeric_limits<double>::quiet_NaN(), kInfinity, -kInfinity}) {
    INFO("options.scale = " << scale);
    plsh::AttentionOptions bad = options;
    bad.scale = scale;
    REQUIRE_THROWS_AS(plsh::regular_attention<double>(q, k, v, bad, map(200, 4, 5), lse_map),
                      std::invalid_argument);
    CHECK_THROWS_WITH(plsh::regular_attention<double>(q, k, v, bad, map(200, 4, 5), lse_map),
                      Catch::Contains("options.scale"));
    REQUIRE_THROWS_AS(plsh::RegularAttention{}(q, k, v, bad, map(200, 4, 5), lse_map),
                      std::invalid_argument);
  }
}

}  // namespace test_regular
