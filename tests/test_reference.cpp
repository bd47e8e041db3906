// Tests of attention/reference.hpp, the oracles of the other tests: the forward and backward
// references against closed forms computed by hand in long double, where every ALiBi factor
// underflows in linear space (slope * distance > 745), and the input contract (masked keys
// contribute nothing, NaN among the visible logits gives NaN, no visible key gives zeros).

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/reference.hpp>

#include "attention_fixture.hpp"

namespace test_reference {

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

/// A window of every key position: the windowed reference is then exact ALiBi.
const auto every_key = [](Index, Index) {
  return plsh::Block{-plsh::kMaxPosition, plsh::kMaxPosition + 1};
};

/// One query of one head against every key, causal, the query `distance` positions after the last
/// key: every factor e^{-slope (distance + n_k - 1 - j)} underflows to 0 in double.
struct FarQuery {
  static constexpr Index kKeys = 8;
  static constexpr Index kDistance = 800;
  Problem<double> problem{Shape{1, kKeys, 1, 1, 4, 3}, 31};
  plsh::AttentionOptions options;
  std::vector<double> slopes{1.0};

  FarQuery() {
    options.causal = true;
    options.key_position = 0;
    options.query_position = kKeys - 1 + kDistance;
  }

  /// Softmax weights over S_j - slope * |p_i - p_j|, by hand in long double.
  std::vector<long double> weights() const {
    const long double scale = 1.0L / std::sqrt(4.0L);
    std::vector<long double> logits(kKeys);
    long double max_logit = -std::numeric_limits<long double>::infinity();
    for (Index j = 0; j < kKeys; ++j) {
      long double dot = 0;
      for (Index e = 0; e < 4; ++e) dot += problem.q.at(0, 0, e) * problem.k.at(j, 0, e);
      logits[static_cast<std::size_t>(j)] =
          scale * dot - static_cast<long double>(options.query_position - j);
      max_logit = std::max(max_logit, logits[static_cast<std::size_t>(j)]);
    }
    long double total = 0;
    for (long double& logit : logits) {
      logit = std::exp(logit - max_logit);
      total += logit;
    }
    for (long double& logit : logits) logit /= total;
    return logits;
  }
};

}  // namespace

TEST_CASE("the dense references are exact when every ALiBi factor underflows", "[reference]") {
  FarQuery far;
  INFO("every factor is below e^-800, which is 0 in double: the references work in log space");
  REQUIRE(std::exp(-static_cast<double>(FarQuery::kDistance)) == 0.0);
  const std::vector<long double> p = far.weights();

  SECTION("forward") {
    std::vector<long double> expected(3, 0.0L);
    for (Index j = 0; j < FarQuery::kKeys; ++j)
      for (Index e = 0; e < 3; ++e)
        expected[static_cast<std::size_t>(e)] +=
            p[static_cast<std::size_t>(j)] * far.problem.v.at(j, 0, e);
    Buffer<double> out = far.problem.output();
    plsh::reference::alibi_attention(far.problem.q.in(), far.problem.k.in(), far.problem.v.in(),
                                     out.view, far.slopes, far.options);
    Buffer<double> windowed = far.problem.output();
    plsh::reference::windowed_alibi_attention(far.problem.q.in(), far.problem.k.in(),
                                              far.problem.v.in(), windowed.view, far.slopes,
                                              every_key, far.options);
    for (Index e = 0; e < 3; ++e) {
      INFO("output element " << e);
      CHECK(out.at(0, 0, e) ==
            Approx(static_cast<double>(expected[static_cast<std::size_t>(e)])).margin(1e-14));
      CHECK(windowed.at(0, 0, e) == out.at(0, 0, e));
    }
  }

  SECTION("backward") {
    // D = dO . o, dV_j = P_j dO, dQ = scale sum_j P_j (dO . v_j - D) k_j,
    // dK_j = scale P_j (dO . v_j - D) q.
    Buffer<double> dout = far.problem.output();
    dout.fill_random(77);
    const long double scale = 0.5L;
    long double delta = 0;
    for (Index j = 0; j < FarQuery::kKeys; ++j)
      for (Index e = 0; e < 3; ++e)
        delta += p[static_cast<std::size_t>(j)] * far.problem.v.at(j, 0, e) * dout.at(0, 0, e);
    Buffer<double> dq(1, 1, 4), dk(FarQuery::kKeys, 1, 4), dv(FarQuery::kKeys, 1, 3);
    plsh::reference::alibi_attention_backward(far.problem.q.in(), far.problem.k.in(),
                                              far.problem.v.in(), dout.in(), dq.view, dk.view,
                                              dv.view, far.slopes, far.options);
    std::vector<long double> expected_dq(4, 0.0L);
    for (Index j = 0; j < FarQuery::kKeys; ++j) {
      const long double pj = p[static_cast<std::size_t>(j)];
      long double dp = 0;
      for (Index e = 0; e < 3; ++e) {
        dp += dout.at(0, 0, e) * far.problem.v.at(j, 0, e);
        INFO("dv(" << j << ", " << e << ")");
        CHECK(dv.at(j, 0, e) == Approx(static_cast<double>(pj * dout.at(0, 0, e))).margin(1e-14));
      }
      const long double score_gradient = pj * (dp - delta);
      for (Index e = 0; e < 4; ++e) {
        expected_dq[static_cast<std::size_t>(e)] +=
            scale * score_gradient * far.problem.k.at(j, 0, e);
        INFO("dk(" << j << ", " << e << ")");
        CHECK(dk.at(j, 0, e) ==
              Approx(static_cast<double>(scale * score_gradient * far.problem.q.at(0, 0, e)))
                  .margin(1e-14));
      }
    }
    for (Index e = 0; e < 4; ++e) {
      INFO("dq element " << e);
      CHECK(dq.at(0, 0, e) ==
            Approx(static_cast<double>(expected_dq[static_cast<std::size_t>(e)])).margin(1e-14));
    }
  }
}

TEST_CASE("the dense references keep the input contract", "[reference]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Problem<double> problem(Shape{6, 6, 1, 1, 4, 3}, 5);
  plsh::AttentionOptions options;  // causal, queries and keys at positions 0..5
  const std::vector<double> slopes{0.5};
  Buffer<double> clean = problem.output();
  plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), clean.view,
                                   slopes, options);

  SECTION("a key no query can see changes nothing, whatever its values") {
    for (Index e = 0; e < 3; ++e) problem.v.at(5, 0, e) = nan;
    for (Index e = 0; e < 4; ++e) problem.k.at(5, 0, e) = std::numeric_limits<double>::infinity();
    Buffer<double> out = problem.output();
    plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                     slopes, options);
    for (Index i = 0; i < 5; ++i)
      for (Index e = 0; e < 3; ++e) {
        INFO("row " << i << " cannot see key 5");
        CHECK(out.at(i, 0, e) == clean.at(i, 0, e));
      }
    Buffer<double> dout = problem.output();
    dout.fill_random(3);
    for (Index e = 0; e < 3; ++e) dout.at(5, 0, e) = 0;  // the row that sees key 5 adds nothing
    Buffer<double> dq(6, 1, 4), dk(6, 1, 4), dv(6, 1, 3);
    plsh::reference::alibi_attention_backward(problem.q.in(), problem.k.in(), problem.v.in(),
                                              dout.in(), dq.view, dk.view, dv.view, slopes,
                                              options);
    INFO("rows 0..4 have finite gradients");
    for (Index i = 0; i < 5; ++i)
      for (Index e = 0; e < 4; ++e) CHECK(std::isfinite(dq.at(i, 0, e)));
  }

  SECTION("a NaN query makes its row NaN, not zero") {
    problem.q.at(2, 0, 1) = nan;
    Buffer<double> out = problem.output();
    plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                     slopes, options);
    for (Index e = 0; e < 3; ++e) {
      CHECK(std::isnan(out.at(2, 0, e)));
      CHECK(out.at(1, 0, e) == clean.at(1, 0, e));
    }
  }

  SECTION("a row without a visible key is zero") {
    options.key_position = 3;  // queries 0..2 precede every key
    Buffer<double> out = problem.output();
    plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                     slopes, options);
    for (Index i = 0; i < 3; ++i)
      for (Index e = 0; e < 3; ++e) CHECK(out.at(i, 0, e) == 0.0);
    CHECK(out.at(3, 0, 0) != 0.0);
  }
}

TEST_CASE("the backward reference rejects bad gradients", "[reference]") {
  Problem<double> problem(Shape{4, 4, 2, 1, 4, 3}, 9);
  const std::vector<double> slopes{0.5, 0.25};
  Buffer<double> dout = problem.output();
  Buffer<double> dq(4, 2, 4), dk(4, 1, 4), dv(4, 1, 3);
  const auto call = [&](const plsh::HeadsView<double>& gradient_q,
                        const plsh::HeadsView<double>& gradient_v) {
    plsh::reference::alibi_attention_backward(problem.q.in(), problem.k.in(), problem.v.in(),
                                              dout.in(), gradient_q, dk.view, gradient_v, slopes);
  };
  REQUIRE_NOTHROW(call(dq.view, dv.view));
  Buffer<double> wrong(3, 2, 4);
  REQUIRE_THROWS_AS(call(wrong.view, dv.view), std::invalid_argument);
  REQUIRE_THROWS_WITH(call(wrong.view, dv.view),
                      "reference::factor_attention_backward: dq.tokens must equal q.tokens");
  plsh::HeadsView<double> aliased = dv.view;
  aliased.data = problem.v.storage.data();
  REQUIRE_THROWS_WITH(call(dq.view, aliased),
                      "reference::factor_attention_backward: dv overlaps v");
  plsh::HeadsView<double> on_dq = dv.view;
  on_dq.data = dq.storage.data();
  REQUIRE_THROWS_WITH(call(dq.view, on_dq), "reference::factor_attention_backward: dv overlaps dq");
}

TEST_CASE("the fixed-block references reject a block size below 1", "[reference][fixed]") {
  Problem<double> problem(Shape{4, 4, 2, 1, 4, 3}, 11);
  Buffer<double> out = problem.output(), dout = problem.output();
  Buffer<double> dq(4, 2, 4), dk(4, 1, 4), dv(4, 1, 3);
  for (const Index block : {Index(0), Index(-3)}) {
    REQUIRE_THROWS_AS(plsh::reference::fixed_block_attention(problem.q.in(), problem.k.in(),
                                                             problem.v.in(), out.view, block),
                      std::invalid_argument);
    REQUIRE_THROWS_WITH(plsh::reference::fixed_block_attention(problem.q.in(), problem.k.in(),
                                                               problem.v.in(), out.view, block),
                        "reference::fixed_block_attention: block_size must be at least 1");
    REQUIRE_THROWS_WITH(plsh::reference::fixed_block_attention_backward(
                            problem.q.in(), problem.k.in(), problem.v.in(), dout.in(), dq.view,
                            dk.view, dv.view, block),
                        "reference::fixed_block_attention_backward: block_size must be at least 1");
  }
}

TEST_CASE("the backward references with no keys give zero gradients", "[reference]") {
  // Grouped heads, both layouts: every q head and every k head is read, none has a row.
  for (const plsh_test::Layout layout : {plsh_test::Layout::Packed, plsh_test::Layout::HeadMajor}) {
    INFO("layout " << layout);
    const Shape shape{5, 0, 4, 2, 3, 2};
    Problem<double> problem(shape, 13, layout);
    Buffer<double> dout(shape.n_q, shape.heads, shape.value_dim, layout);
    dout.fill_random(14);
    Buffer<double> dq(shape.n_q, shape.heads, shape.dim, layout),
        dk(0, shape.kv_heads, shape.dim, layout), dv(0, shape.kv_heads, shape.value_dim, layout);
    const auto all_zero = [&] {
      for (Index t = 0; t < shape.n_q; ++t)
        for (Index h = 0; h < shape.heads; ++h)
          for (Index e = 0; e < shape.dim; ++e)
            if (dq.at(t, h, e) != 0.0) return false;
      return true;
    };
    dq.fill_random(15);
    plsh::reference::alibi_attention_backward(problem.q.in(), problem.k.in(), problem.v.in(),
                                              dout.in(), dq.view, dk.view, dv.view,
                                              std::vector<double>{0.5, 0.25, 0.125, 1.0});
    REQUIRE(all_zero());
    dq.fill_random(16);
    plsh::reference::fixed_block_attention_backward(problem.q.in(), problem.k.in(), problem.v.in(),
                                                    dout.in(), dq.view, dk.view, dv.view, 4);
    REQUIRE(all_zero());
  }
}

TEST_CASE("the ALiBi references keep the nearest keys when slope * distance overflows",
          "[reference]") {
  // Slope 1e300 at distance about 2^53: every m|p_i - p_j| is infinite in double. The softmax is
  // shift-invariant, so the true weights are those of -m(|p_i - p_j| - r_i): all on the nearest
  // key.
  const Index keys = 6;
  Problem<double> problem(Shape{2, keys, 1, 1, 4, 3}, 17);
  plsh::AttentionOptions options;
  options.causal = true;
  options.key_position = 0;
  options.query_position = plsh::kMaxPosition - 2;
  const std::vector<double> slopes{1e300};
  Buffer<double> out = problem.output(), windowed = problem.output();
  plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), out.view, slopes,
                                   options);
  plsh::reference::windowed_alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(),
                                            windowed.view, slopes, every_key, options);
  for (Index i = 0; i < 2; ++i) {
    for (Index e = 0; e < 3; ++e) {
      REQUIRE(out.at(i, 0, e) == problem.v.at(keys - 1, 0, e));
      REQUIRE(windowed.at(i, 0, e) == problem.v.at(keys - 1, 0, e));
    }
  }
  // The backward: all weight on the nearest key, so dv of that key is the sum of dout, and 0
  // elsewhere.
  Buffer<double> dout = problem.output();
  dout.fill_random(18);
  Buffer<double> dq(2, 1, 4), dk(keys, 1, 4), dv(keys, 1, 3);
  plsh::reference::alibi_attention_backward(problem.q.in(), problem.k.in(), problem.v.in(),
                                            dout.in(), dq.view, dk.view, dv.view, slopes, options);
  for (Index e = 0; e < 3; ++e) {
    REQUIRE(dv.at(keys - 1, 0, e) == dout.at(0, 0, e) + dout.at(1, 0, e));
    REQUIRE(dv.at(0, 0, e) == 0.0);
  }
}

TEST_CASE("the windowed reference sees exactly the keys of its window", "[reference]") {
  // Bidirectional, row i's window is the single key at position i + 1 (none for the last row):
  // its output is that key's value, or zero.
  Problem<double> problem(Shape{3, 3, 1, 1, 4, 3}, 19);
  Buffer<double> out = problem.output();
  plsh::AttentionOptions options;
  options.causal = false;
  plsh::reference::windowed_alibi_attention(
      problem.q.in(), problem.k.in(), problem.v.in(), out.view, std::vector<double>{0.5},
      [](Index, Index i) {
        return plsh::Block{i + 1, i + 2};
      },
      options);
  for (Index i = 0; i < 3; ++i) {
    for (Index e = 0; e < 3; ++e) {
      REQUIRE(out.at(i, 0, e) == (i + 1 < 3 ? problem.v.at(i + 1, 0, e) : 0.0));
    }
  }
}

}  // namespace test_reference
