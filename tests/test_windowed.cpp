// Tests of windowed_alibi_attention (attention/detail/windowed.hpp, alibi_attention.hpp): the
// certificate (the exact-ALiBi weight of the keys a row drops, from dense double weights, is at
// most the tolerance), the output against the dense reference over the keys the kernel kept, and
// the guarantee against exact ALiBi, on edge shapes, grouped heads, offsets, slopes 0 and steep,
// and an attention sink that a window from the ALiBi factor alone would drop.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <utility>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/batch.hpp>
#include <plsh/reference.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_windowed {

namespace {

using plsh::Block;
using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::Problem;
using plsh_test::Shape;
using plsh_test::type_name;

/// The key rows each (head, query tile) of one call visited, from the kernel.
template <class Scalar>
std::vector<Block> kept_rows(const Problem<Scalar>& problem, const std::vector<double>& slopes,
                             double tolerance, const plsh::AttentionOptions& options) {
  std::vector<Block> kept;
  plsh::detail::batched_windowed_alibi_attention<Scalar>(
      plsh::detail::batch_of_one(problem.q.in()), plsh::detail::batch_of_one(problem.k.in()),
      plsh::detail::batch_of_one(problem.v.in()), nullptr, slopes, tolerance, options, {}, &kept);
  return kept;
}

/// The kept rows as the reference's window: key positions of row position `p` of head h.
struct KeptWindow {
  const std::vector<Block>& kept;
  Index tiles;
  plsh::AttentionOptions options;

  Block operator()(Index h, Index p) const {
    const Index tile = (p - options.query_position) / plsh::detail::kQueryTile;
    const Block rows = kept[static_cast<std::size_t>(h * tiles + tile)];
    return Block{options.key_position + rows.begin, options.key_position + rows.end};
  }
};

/// What one call checked, for the tests that need the kernel to have dropped keys.
struct Dropped {
  Index keys = 0;      // (row, key) pairs visible but not visited
  double largest = 0;  // largest exact weight of a row's dropped keys
};

/// Runs windowed_alibi_attention at `tolerance` and checks (1) every row's dropped keys weigh at
/// most `tolerance` under exact ALiBi (dense, double), (2) the output equals the dense reference
/// over the kept keys, (3) the output is within 2 tolerance max|v| of exact ALiBi.
template <class Scalar>
Dropped check_windowed(const Problem<Scalar>& problem, const std::vector<double>& slopes,
                       double tolerance, const plsh::AttentionOptions& options) {
  const Shape& shape = problem.shape;
  INFO(shape << ", " << plsh_test::describe(options) << ", " << type_name<Scalar>()
             << ", tolerance " << tolerance);
  const double rounding = plsh_test::reference_tolerance<Scalar>();
  const std::vector<Block> kept = kept_rows(problem, slopes, tolerance, options);
  const Index tiles = (shape.n_q + plsh::detail::kQueryTile - 1) / plsh::detail::kQueryTile;
  const KeptWindow window{kept, tiles, options};

  Dropped dropped;
  const double scale = plsh::detail::resolved_scale(options, shape.dim);
  const auto log_factor = plsh::reference::alibi_row_log_factor(slopes, options, shape.n_k);
  std::vector<Index> visible;
  std::vector<double> weights;
  const Index group = shape.heads / shape.kv_heads;
  for (Index h = 0; h < shape.heads; ++h) {
    const Eigen::MatrixXd q = problem.q.in().head(h).template cast<double>();
    const Eigen::MatrixXd k = problem.k.in().head(h / group).template cast<double>();
    for (Index i = 0; i < shape.n_q; ++i) {
      plsh::detail::row_probabilities(q, k, i, h, scale, options, log_factor, visible, weights);
      const Block rows = window(h, options.query_position + i);
      double weight = 0;
      for (std::size_t n = 0; n < visible.size(); ++n) {
        const Index position = options.key_position + visible[n];
        if (position < rows.begin || position >= rows.end) {
          weight += weights[n];
          ++dropped.keys;
        }
      }
      dropped.largest = std::max(dropped.largest, weight);
      INFO("head " << h << ", row " << i << ": dropped weight " << plsh_test::scientific(weight));
      REQUIRE(weight <= tolerance * (1 + 1e-4));
    }
  }

  Problem<Scalar> run = problem;
  plsh::windowed_alibi_attention<Scalar>(run.q.in(), run.k.in(), run.v.in(), run.out.view, slopes,
                                         tolerance, options);
  CHECK(run.out.touched_padding() == 0);
  Buffer<Scalar> expected = problem.output();
  plsh::reference::windowed_alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(),
                                            expected.view, slopes, window, options);
  const double kernel_error = plsh_test::max_abs_difference(run.out.in(), expected.in());
  INFO("against the reference over the kept keys: " << plsh_test::scientific(kernel_error));
  CHECK(kernel_error <= rounding);

  plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                   slopes, options);
  double largest_value = 0;
  for (Index t = 0; t < shape.n_k; ++t)
    for (Index g = 0; g < shape.kv_heads; ++g)
      for (Index e = 0; e < shape.value_dim; ++e)
        largest_value = std::max(largest_value, std::abs(double(problem.v.at(t, g, e))));
  const double exact_error = plsh_test::max_abs_difference(run.out.in(), expected.in());
  INFO("against exact ALiBi: " << plsh_test::scientific(exact_error));
  CHECK(exact_error <= 2 * tolerance * largest_value + rounding);
  return dropped;
}

template <class Scalar>
void sweep_shapes() {
  std::uint64_t seed = 3000;
  for (const double tolerance : {1e-1, 1e-3, 1e-6}) {
    for (const bool causal : {true, false}) {
      plsh::AttentionOptions options;
      options.causal = causal;
      for (const Index n : plsh_test::edge_lengths()) {
        check_windowed(Problem<Scalar>(Shape{n, n, 4, 2, 16, 12}, ++seed), plsh::alibi_slopes(4),
                       tolerance, options);
      }
      check_windowed(Problem<Scalar>(Shape{65, 65, 8, 2, 8, 12}, ++seed), plsh::alibi_slopes(8),
                     tolerance, options);
      check_windowed(Problem<Scalar>(Shape{130, 130, 8, 1, 8, 3}, ++seed, Layout::HeadMajor),
                     plsh::alibi_slopes(8), tolerance, options);
      check_windowed(Problem<Scalar>(Shape{65, 257, 4, 4, 5, 9}, ++seed, Layout::PaddedRows),
                     plsh::alibi_slopes(4), tolerance, options);
      // Slope 0 (never certified before the last key), steep slopes, an explicit scale.
      options.scale = causal ? -0.3 : 0.0;
      check_windowed(Problem<Scalar>(Shape{300, 300, 4, 2, 16, 8}, ++seed),
                     std::vector<double>{0.0, 0.5, 2.0, 50.0}, tolerance, options);
    }
  }
}

}  // namespace

TEST_CASE("windowed ALiBi certifies its dropped keys on edge shapes", "[windowed]") {
  SECTION("double") { sweep_shapes<double>(); }
  SECTION("float") { sweep_shapes<float>(); }
}

TEST_CASE("windowed ALiBi certifies its dropped keys with query and key positions apart",
          "[windowed]") {
  std::uint64_t seed = 3100;
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        const Shape shape{c.n_q, c.n_k, 4, 2, 8, 6};
        for (const double tolerance : {1e-2, 1e-5}) {
          check_windowed(Problem<double>(shape, ++seed), plsh::alibi_slopes(4), tolerance, options);
          check_windowed(Problem<float>(shape, ++seed), plsh::alibi_slopes(4), tolerance, options);
        }
      });
}

TEST_CASE("windowed ALiBi drops keys where the certificate allows", "[windowed]") {
  // Without dropped keys the checks above would hold for exact ALiBi too: on rows longer than the
  // steep heads' reach the kernel must drop a good part of the keys (about a third here), and
  // still certify them.
  Problem<double> problem(Shape{1100, 1100, 4, 2, 16, 8}, 3200);
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    const Dropped dropped = check_windowed(problem, plsh::alibi_slopes(4), 1e-3, options);
    INFO((causal ? "causal" : "bidirectional")
         << ": dropped " << dropped.keys << " (row, key) pairs");
    const Index visible = causal ? 4 * 1100 * 1101 / 2 : 4 * 1100 * 1100;
    CHECK(dropped.keys > visible / 4);
    CHECK(dropped.largest > 1e-9);
  }
}

TEST_CASE("windowed ALiBi keeps a far attention sink that exact ALiBi weighs", "[windowed]") {
  // Key 0 is a sink: every query scores it about 30 above the other keys. At distance d its
  // exact-ALiBi logit is 30 - m d, which for the head of slope 1/64 dominates up to d ~ 1900,
  // although its factor e^{-d/64} is below 1e-6 beyond d = 884 (the window of the factor alone).
  const Index n = 1500;
  const Index dim = 16;
  Problem<double> problem(Shape{n, n, 4, 4, dim, 4}, 3300);
  for (Index t = 0; t < n; ++t)
    for (Index h = 0; h < 4; ++h) problem.q.at(t, h, 0) = 2.0;
  for (Index h = 0; h < 4; ++h) problem.k.at(0, h, 0) = 60.0;  // scale 1/4: 30 above
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
#ifndef PLSH_TEST_SANITIZED
    // The dense references at 1500 tokens, in the Release build (the sanitizer build runs the
    // kernel's certificate below).
    check_windowed(problem, plsh::alibi_slopes(4), 1e-6, options);
#endif
    const std::vector<Block> kept = kept_rows(problem, plsh::alibi_slopes(4), 1e-6, options);
    const Index tiles = (n + 63) / 64;
    INFO("the last query tile of head 2 (slope 1/64) keeps the sink at key 0");
    CHECK(kept[static_cast<std::size_t>(2 * tiles + tiles - 1)].begin == 0);
  }
}

TEST_CASE("windowed ALiBi keeps its guarantee on adversarial inputs", "[windowed]") {
  // Large logits (q and k scaled by 3), keys of equal norm (the bound is tight for none of them),
  // zero keys (every score 0: only the distance decays), and a sink key far back, at tolerances
  // from 1e-1 to 1e-8.
  const Index n = 400;
  const Shape shape{n, n, 2, 1, 8, 4};
  const std::vector<double> slopes{0.25, 1.0 / 64};
  std::vector<std::pair<const char*, Problem<double>>> cases;
  cases.emplace_back("q, k scaled by 3", Problem<double>(shape, 3410, Layout::Packed, 9.0, 3.0));
  Problem<double> equal(shape, 3411);
  for (Index t = 0; t < n; ++t) {
    double norm = 0;
    for (Index e = 0; e < 8; ++e) norm += equal.k.at(t, 0, e) * equal.k.at(t, 0, e);
    for (Index e = 0; e < 8; ++e) equal.k.at(t, 0, e) *= 4 / std::sqrt(norm);
  }
  cases.emplace_back("keys of equal norm", equal);
  Problem<double> zero(shape, 3412);
  zero.k.fill(0.0);
  cases.emplace_back("zero keys", zero);
  Problem<double> sink(shape, 3413, Layout::Packed, 1.0, 1.0);
  for (Index t = 0; t < n; ++t)
    for (Index h = 0; h < 2; ++h) sink.q.at(t, h, 0) = 2.0;
  sink.k.at(0, 0, 0) = 15.0 * std::sqrt(8.0);  // scores 30
  cases.emplace_back("a sink at key 0", sink);
  for (const auto& [name, problem] : cases) {
    INFO(name);
    for (const double tolerance : {1e-1, 1e-2, 1e-4, 1e-6, 1e-8}) {
      for (const bool causal : {true, false}) {
        plsh::AttentionOptions options;
        options.causal = causal;
        check_windowed(problem, slopes, tolerance, options);
      }
    }
  }
  // Float: the same large logits rounded, at the tolerances float can tell apart.
  const Problem<float> rounded(shape, 3410, Layout::Packed, 9.0, 3.0);
  for (const double tolerance : {1e-1, 1e-3, 1e-5}) {
    check_windowed(rounded, slopes, tolerance, plsh::AttentionOptions{});
  }
}

TEST_CASE("windowed ALiBi with tolerance 0 is the exact kernel, bit for bit", "[windowed]") {
  Problem<float> problem(Shape{257, 257, 4, 2, 16, 8}, 3400);
  Buffer<float> exact = problem.output();
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(), exact.view,
                                       plsh::alibi_slopes(4), options);
    plsh::windowed_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                          problem.out.view, plsh::alibi_slopes(4), 0.0, options);
    CHECK(plsh_test::max_abs_difference(problem.out.in(), exact.in()) == 0.0);
  }
}

TEST_CASE("batched windowed ALiBi equals the unbatched calls", "[windowed][batch]") {
  const Index batch = 3;
  const Shape shape{200, 200, 4, 2, 8, 8};
  std::vector<Problem<float>> problems;
  for (Index b = 0; b < batch; ++b) problems.emplace_back(shape, 3500 + b);
  // One buffer per operand, [B][n][H][d], filled from the problems.
  const auto stack = [&](auto member, Index heads, Index dim) {
    std::vector<float> data(static_cast<std::size_t>(batch * shape.n_q * heads * dim));
    for (Index b = 0; b < batch; ++b)
      for (Index t = 0; t < shape.n_q; ++t)
        for (Index h = 0; h < heads; ++h)
          for (Index e = 0; e < dim; ++e)
            data[static_cast<std::size_t>(((b * shape.n_q + t) * heads + h) * dim + e)] =
                (problems[static_cast<std::size_t>(b)].*member).at(t, h, e);
    return data;
  };
  std::vector<float> q = stack(&Problem<float>::q, shape.heads, shape.dim);
  std::vector<float> k = stack(&Problem<float>::k, shape.kv_heads, shape.dim);
  std::vector<float> v = stack(&Problem<float>::v, shape.kv_heads, shape.value_dim);
  std::vector<float> out(
      static_cast<std::size_t>(batch * shape.n_q * shape.heads * shape.value_dim));
  const auto view = [&](std::vector<float>& data, Index heads, Index dim) {
    return plsh::BatchedHeadsView<float>(batch, {data.data(), shape.n_q, heads, dim});
  };
  plsh::AttentionOptions options;
  options.causal = true;
  plsh::windowed_alibi_attention<float>(
      view(q, shape.heads, shape.dim), view(k, shape.kv_heads, shape.dim),
      view(v, shape.kv_heads, shape.value_dim), view(out, shape.heads, shape.value_dim),
      plsh::alibi_slopes(4), 1e-4, options);
  for (Index b = 0; b < batch; ++b) {
    Problem<float>& p = problems[static_cast<std::size_t>(b)];
    plsh::windowed_alibi_attention<float>(p.q.in(), p.k.in(), p.v.in(), p.out.view,
                                          plsh::alibi_slopes(4), 1e-4, options);
    for (Index t = 0; t < shape.n_q; ++t)
      for (Index h = 0; h < shape.heads; ++h)
        for (Index e = 0; e < shape.value_dim; ++e)
          REQUIRE(out[static_cast<std::size_t>(
                      ((b * shape.n_q + t) * shape.heads + h) * shape.value_dim + e)] ==
                  p.out.at(t, h, e));
  }
}

// ---------------------------------------------------------------------------------------------
// The backward: gradients of the forward as computed, with the keys it kept.
// ---------------------------------------------------------------------------------------------

namespace {

/// A problem with its output gradient and gradient buffers (filled with garbage: the backward
/// must overwrite them).
template <class Scalar>
struct GradientProblem : Problem<Scalar> {
  Buffer<Scalar> dout, dq, dk, dv;

  GradientProblem(const Shape& s, std::uint64_t seed)
      : Problem<Scalar>(s, seed),
        dout(this->output()),
        dq(s.n_q, s.heads, s.dim),
        dk(s.n_k, s.kv_heads, s.dim),
        dv(s.n_k, s.kv_heads, s.value_dim) {
    dout.fill_random(plsh::detail::mix64(seed * 4 + 3));
    dq.fill(Scalar(7));
    dk.fill(Scalar(7));
    dv.fill(Scalar(7));
  }

  void forward(const std::vector<double>& slopes, double tolerance,
               const plsh::AttentionOptions& options) {
    plsh::windowed_alibi_attention<Scalar>(this->q.in(), this->k.in(), this->v.in(), this->out.view,
                                           slopes, tolerance, options);
  }

  void backward(const std::vector<double>& slopes, double tolerance,
                const plsh::AttentionOptions& options) {
    plsh::windowed_alibi_attention_backward<Scalar>(this->q.in(), this->k.in(), this->v.in(),
                                                    this->out.in(), dout.in(), dq.view, dk.view,
                                                    dv.view, slopes, tolerance, options);
  }
};

/// max |a - b| / max |b| over the views' elements (max |a - b| where b is 0).
template <class A, class B>
double relative_error(const plsh::HeadsView<A>& a, const plsh::HeadsView<B>& b) {
  double scale = 0;
  for (Index t = 0; t < b.tokens; ++t)
    for (Index h = 0; h < b.heads; ++h)
      for (Index e = 0; e < b.dim; ++e)
        scale =
            std::max(scale, std::abs(double(b.data[t * b.token_stride + h * b.head_stride + e])));
  const double error = plsh_test::max_abs_difference(a, b);
  return scale == 0 ? error : error / scale;
}

}  // namespace

TEST_CASE("windowed ALiBi's backward equals central finite differences of its forward",
          "[windowed][backward]") {
  // 260 rows: five query tiles, of which the last ones drop keys at tolerance 1e-3 with these
  // slopes; the perturbations (1e-5) are far too small to move a certificate's decision here.
  const std::vector<double> slopes{0.5, 0.125};
  const double step = 1e-5;
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    GradientProblem<double> p(Shape{260, 260, 2, 1, 2, 2}, 3600);
    p.forward(slopes, 1e-3, options);
    p.backward(slopes, 1e-3, options);
    const std::vector<Block> kept = kept_rows(p, slopes, 1e-3, options);
    CHECK(kept.back().begin > 0);  // the last tile dropped the first keys
    const auto loss = [&](GradientProblem<double>& probe) {
      probe.forward(slopes, 1e-3, options);
      double sum = 0;
      for (std::size_t i = 0; i < probe.out.storage.size(); ++i)
        sum += probe.dout.storage[i] * probe.out.storage[i];
      return sum;
    };
    GradientProblem<double> probe = p;
    // Every 7th element of each input (a few hundred per tensor, in every query tile).
    const auto check = [&](Buffer<double>& input, const Buffer<double>& gradient,
                           const char* name) {
      double largest = 0;
      double error = 0;
      for (std::size_t i = 0; i < input.storage.size(); i += 7) {
        const double original = input.storage[i];
        input.storage[i] = original + step;
        const double plus = loss(probe);
        input.storage[i] = original - step;
        const double minus = loss(probe);
        input.storage[i] = original;
        const double difference = (plus - minus) / (2 * step);
        largest = std::max(largest, std::abs(difference));
        error = std::max(error, std::abs(difference - gradient.storage[i]));
      }
      INFO((causal ? "causal " : "bidirectional ")
           << name << ": relative error " << error / largest);
      CHECK(error <= 1e-6 * largest);
    };
    check(probe.q, p.dq, "dq");
    check(probe.k, p.dk, "dk");
    check(probe.v, p.dv, "dv");
  }
}

TEST_CASE("windowed ALiBi's backward equals the dense reference over the kept keys",
          "[windowed][backward]") {
  const auto run = [](auto scalar_tag, const Shape& shape, const std::vector<double>& slopes,
                      double tolerance, const plsh::AttentionOptions& options, double bound) {
    using Scalar = decltype(scalar_tag);
    INFO(shape << ", " << plsh_test::describe(options) << ", " << type_name<Scalar>()
               << ", tolerance " << tolerance);
    GradientProblem<Scalar> p(shape, 3700);
    p.forward(slopes, tolerance, options);
    p.backward(slopes, tolerance, options);
    const std::vector<Block> kept = kept_rows(p, slopes, tolerance, options);
    const KeptWindow window{kept, (shape.n_q + 63) / 64, options};
    GradientProblem<Scalar> expected = p;
    plsh::reference::windowed_alibi_attention_backward(p.q.in(), p.k.in(), p.v.in(), p.dout.in(),
                                                       expected.dq.view, expected.dk.view,
                                                       expected.dv.view, slopes, window, options);
    const double error_q = relative_error(p.dq.in(), expected.dq.in());
    const double error_k = relative_error(p.dk.in(), expected.dk.in());
    const double error_v = relative_error(p.dv.in(), expected.dv.in());
    INFO("relative errors dq " << error_q << ", dk " << error_k << ", dv " << error_v);
    CHECK(error_q <= bound);
    CHECK(error_k <= bound);
    CHECK(error_v <= bound);
  };
  // Grouped heads, slopes from steep to 0, queries before the keys, more rows than a tile.
  const std::vector<double> slopes{0.3, 0.05, 0.0, 1.0 / 64};
  for (const double tolerance : {1e-1, 1e-4}) {
    for (const bool causal : {true, false}) {
      plsh::AttentionOptions options;
      options.causal = causal;
      run(double{}, Shape{300, 300, 4, 2, 8, 5}, slopes, tolerance, options, 1e-11);
      run(float{}, Shape{300, 300, 4, 2, 8, 5}, slopes, tolerance, options, 3e-5);
      options.query_position = 40;
      options.key_position = 7;
      run(double{}, Shape{150, 400, 4, 2, 8, 5}, slopes, tolerance, options, 1e-11);
      options.query_position = 0;
      options.key_position = 5;
      run(double{}, Shape{1, 2, 4, 1, 8, 5}, slopes, tolerance, options, 1e-11);
    }
  }
}

TEST_CASE("windowed ALiBi's backward is within the tolerance of the exact backward",
          "[windowed][backward]") {
  // Row i's kept weights differ from exact ALiBi's by at most 2 tolerance in sum (the dropped
  // mass, renormalised), so with |dO| <= 1, |v| <= 1 (entries; norms below by sqrt(d_v)):
  // |dP_ij - D_i| <= 2 |dO_i| |v|, and per row sum_j |dS_ij - dS*_ij| <= 6 tolerance |dO_i| |v|.
  // dQ_i = scale sum_j dS_ij k_j is then within 6 tolerance |scale| |dO_i| |v| max|k_j|; dK and dV
  // sum that over the n_q rows.
  const Shape shape{400, 400, 4, 2, 8, 4};
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  const double tolerance = 1e-4;
  plsh::AttentionOptions options;
  options.causal = true;
  GradientProblem<double> p(shape, 3800);
  GradientProblem<double> exact = p;
  p.forward(slopes, tolerance, options);
  p.backward(slopes, tolerance, options);
  plsh::exact_alibi_attention<double>(exact.q.in(), exact.k.in(), exact.v.in(), exact.out.view,
                                      slopes, options);
  plsh::exact_alibi_attention_backward<double>(exact.q.in(), exact.k.in(), exact.v.in(),
                                               exact.out.in(), exact.dout.in(), exact.dq.view,
                                               exact.dk.view, exact.dv.view, slopes, options);
  const double norm_v = std::sqrt(double(shape.value_dim));  // entries in [-1, 1]
  const double norm_dout = std::sqrt(double(shape.value_dim));
  const double norm_k = std::sqrt(double(shape.dim));
  const double norm_q = 3 * std::sqrt(double(shape.dim));  // the fixture's queries: amplitude 3
  const double scale = 1 / std::sqrt(double(shape.dim));
  const double row = 6 * tolerance * norm_dout * norm_v;
  CHECK(plsh_test::max_abs_difference(p.dq.in(), exact.dq.in()) <= scale * norm_k * row);
  CHECK(plsh_test::max_abs_difference(p.dk.in(), exact.dk.in()) <=
        shape.n_q * scale * norm_q * row);
  CHECK(plsh_test::max_abs_difference(p.dv.in(), exact.dv.in()) <=
        shape.n_q * 2 * tolerance * norm_dout);
  INFO("the windowed gradients differ from the exact ones: the kernel dropped keys");
  CHECK(plsh_test::max_abs_difference(p.dq.in(), exact.dq.in()) > 0);
}

TEST_CASE("batched windowed ALiBi's backward equals the unbatched calls", "[windowed][batch]") {
  const Index batch = 2;
  const Shape shape{150, 150, 4, 2, 8, 4};
  std::vector<GradientProblem<float>> problems;
  for (Index b = 0; b < batch; ++b) problems.emplace_back(shape, 3900 + b);
  plsh::AttentionOptions options;
  options.causal = false;
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  // [B][n][H][d] buffers, and each problem's own calls.
  const auto stack = [&](auto member) {
    std::vector<float> data;
    for (Index b = 0; b < batch; ++b) {
      const Buffer<float>& buffer = problems[static_cast<std::size_t>(b)].*member;
      data.insert(data.end(), buffer.storage.begin(), buffer.storage.end());
    }
    return data;
  };
  for (auto& p : problems) {
    p.forward(slopes, 1e-3, options);
    p.backward(slopes, 1e-3, options);
  }
  using P = GradientProblem<float>;
  std::vector<float> q = stack(&P::q), k = stack(&P::k), v = stack(&P::v), out = stack(&P::out),
                     dout = stack(&P::dout);
  std::vector<float> dq(q.size()), dk(k.size()), dv(v.size());
  const auto view = [&](std::vector<float>& data, Index tokens, Index heads, Index dim) {
    return plsh::BatchedHeadsView<float>(batch, {data.data(), tokens, heads, dim});
  };
  plsh::windowed_alibi_attention_backward<float>(
      view(q, shape.n_q, shape.heads, shape.dim), view(k, shape.n_k, shape.kv_heads, shape.dim),
      view(v, shape.n_k, shape.kv_heads, shape.value_dim),
      view(out, shape.n_q, shape.heads, shape.value_dim),
      view(dout, shape.n_q, shape.heads, shape.value_dim),
      view(dq, shape.n_q, shape.heads, shape.dim), view(dk, shape.n_k, shape.kv_heads, shape.dim),
      view(dv, shape.n_k, shape.kv_heads, shape.value_dim), slopes, 1e-3, options);
  CHECK(dq == stack(&P::dq));
  CHECK(dk == stack(&P::dk));
  CHECK(dv == stack(&P::dv));
}

TEST_CASE("the certificate holds no row that lies among the keys it bounds", "[windowed]") {
  // 1000 keys of norm 0 (the bound is the distances' alone), slope 1, key rows [400, 600)
  // visited with a sum of weights of 1.7, tolerance 1. Each segment's geometric sum bounds its
  // keys for a row on one side of it: rows 399 and 600 have all the unvisited keys on their sides
  // at distances 0, 1, ...: 1 / (1 - e^{-1}) = 1.58 on the near side, 0.93 of the sum, certified.
  // Rows 398 and 300 lie among the keys [272, 400) of the first segment: from 398 they weigh
  // 1.58 + e^{-1} = 1.95, from 300 about 2 / (1 - e^{-1}) - 1 = 2.16, above the tolerance, while
  // the one-sided sum gives 0.93 again. Rows 601 and 700 lie among those after the range.
  const Index n = 1000;
  const plsh::RowMatrix<double> zeros = plsh::RowMatrix<double>::Zero(n, 4);
  const plsh::ConstHeadMap<double> keys(zeros.data(), n, 4, Eigen::OuterStride<>(4));
  plsh::detail::KeyNormBounds bounds;
  plsh::detail::AlignedVector<double> scratch;
  bounds.build(keys, 0, n, 0.0, scratch);
  const std::vector<double> row_norm{0.0};
  const std::vector<double> shift{0.0};
  const double lse[] = {std::log(1.7)};
  const auto certified = [&](Index row) {
    return plsh::detail::window_certified(bounds, 1.0, 1.0, row, 0, 400, 600, 0, n, row_norm, lse,
                                          shift);
  };
  for (const Index row : {399, 450, 599, 600}) {
    INFO("row " << row);
    CHECK(certified(row));
  }
  for (const Index row : {300, 398, 601, 700}) {
    INFO("row " << row);
    CHECK_FALSE(certified(row));
  }
}

TEST_CASE("windowed ALiBi counts the tiles whose certificate fails beyond the held keys",
          "[windowed]") {
  // 200 held keys between 100 keys before and 100 after that the call does not hold (the halo of
  // mpi.hpp): with a norm bound of 100 for those, no tile can certify them, and every one of the
  // 4 query tiles of the 2 heads says so; the held keys are all visited (the output is exact
  // ALiBi over them). Without keys beyond the held ones every tile certifies.
  const Shape shape{200, 200, 2, 1, 8, 4};
  const std::vector<double> slopes{0.5, 0.05};
  Problem<double> problem(shape, 43);
  plsh::detail::UnheldKeys unheld{100, 100, {100.0}};
  const auto batched_out = plsh::detail::batch_of_one(problem.out.view);
  const Index uncertified = plsh::detail::batched_windowed_alibi_attention<double>(
      plsh::detail::batch_of_one(problem.q.in()), plsh::detail::batch_of_one(problem.k.in()),
      plsh::detail::batch_of_one(problem.v.in()), &batched_out, slopes, 1e-3, {}, unheld);
  CHECK(uncertified == 8);
  Buffer<double> exact = problem.output();
  plsh::exact_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), exact.view,
                                      slopes);
  CHECK(plsh_test::max_abs_difference(problem.out.in(), exact.in()) <= 1e-12);
  CHECK(plsh::detail::batched_windowed_alibi_attention<double>(
            plsh::detail::batch_of_one(problem.q.in()), plsh::detail::batch_of_one(problem.k.in()),
            plsh::detail::batch_of_one(problem.v.in()), &batched_out, slopes, 1e-3, {}) == 0);
}

TEST_CASE("truncated ALiBi at a denormal factor tolerance keeps its band",
          "[windowed][truncated]") {
  // One query 200 positions after one key of value 1. Slope 4 keeps |i - j| <= 178 at 1e-310 and
  // 186 at 5e-324 (-ln f / m): the key is dropped and the row, seeing no key, is 0. Slope 1/4
  // keeps it (band 2855 or 2977): the row is the key's value.
  const std::vector<double> slopes{4.0, 0.25};
  Problem<double> problem(Shape{1, 1, 2, 2, 4, 4}, 41);
  problem.v.fill(1.0);
  for (const double tolerance : {1e-310, 5e-324}) {
    for (const bool causal : {true, false}) {
      INFO("factor tolerance " << tolerance << (causal ? ", causal" : ", bidirectional"));
      plsh::AttentionOptions options;
      options.causal = causal;
      options.query_position = 200;
      Buffer<double> expected = problem.output();
      plsh::reference::truncated_alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(),
                                                 expected.view, slopes, tolerance, options);
      plsh::truncated_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                              problem.out.view, slopes, tolerance, options);
      for (Index e = 0; e < 4; ++e) {
        CHECK(problem.out.at(0, 0, e) == 0.0);
        CHECK(expected.at(0, 0, e) == 0.0);
        CHECK(problem.out.at(0, 1, e) == 1.0);
        CHECK(expected.at(0, 1, e) == 1.0);
      }
    }
  }
}

TEST_CASE("truncated ALiBi keeps the keys of its factor window, and has no guarantee",
          "[windowed][truncated]") {
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    for (const double tolerance : {0.0, 1e-3, 1e-6, 1.0}) {
      INFO((causal ? "causal" : "bidirectional") << ", factor tolerance " << tolerance);
      Problem<double> problem(Shape{257, 257, 4, 2, 16, 12}, 4000);
      Buffer<double> expected = problem.output();
      plsh::reference::truncated_alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(),
                                                 expected.view, plsh::alibi_slopes(4), tolerance,
                                                 options);
      plsh::truncated_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                              problem.out.view, plsh::alibi_slopes(4), tolerance,
                                              options);
      CHECK(plsh_test::max_abs_difference(problem.out.in(), expected.in()) <= 1e-11);
    }
  }
  // The sink of the test above: the factor window drops it, and the error is far above the
  // factor tolerance; the certified window keeps it.
  const Index n = 1500;
  Problem<double> problem(Shape{n, n, 4, 4, 16, 4}, 3300);
  for (Index t = 0; t < n; ++t)
    for (Index h = 0; h < 4; ++h) problem.q.at(t, h, 0) = 2.0;
  for (Index h = 0; h < 4; ++h) problem.k.at(0, h, 0) = 60.0;
  Buffer<double> exact = problem.output();
  plsh::exact_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), exact.view,
                                      plsh::alibi_slopes(4));
  plsh::truncated_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                          problem.out.view, plsh::alibi_slopes(4), 1e-6);
  CHECK(plsh_test::max_abs_difference(problem.out.in(), exact.in()) > 0.1);
  REQUIRE_THROWS_WITH(
      plsh::truncated_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                              problem.out.view, plsh::alibi_slopes(4), 2.0),
      Catch::Contains("truncated_alibi_attention") && Catch::Contains("factor_tolerance"));
}

}  // namespace test_windowed
