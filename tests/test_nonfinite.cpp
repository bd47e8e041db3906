// Non-finite inputs through every kernel (the contract of online_softmax.hpp): keys a query
// cannot see add nothing to its row whatever their k and v; a NaN or +inf visible logit makes the
// row NaN; Fused equals Passes; far absolute positions keep float ALiBi accurate; the backward
// gives keys no query sees gradients of exactly zero; fixed_block_attention_backward.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <string>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/reference.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_nonfinite {

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

/// A forward kernel on a problem's inputs, writing `out`.
template <class Scalar>
using Forward = std::function<void(const Problem<Scalar>&, Buffer<Scalar>&)>;

template <class Scalar>
std::vector<std::pair<std::string, Forward<Scalar>>> forward_kernels(bool causal) {
  const std::vector<double> slopes{0.5, 0.05};
  plsh::AttentionOptions options;
  options.causal = causal;
  plsh::PlshOptions passes;
  passes.causal = causal;
  passes.samples = 7;
  passes.kernel = plsh::Kernel::Passes;
  passes.near_field = 0;  // block masks only
  plsh::PlshOptions fused = passes;
  fused.kernel = plsh::Kernel::Fused;
  return {
      {"exact",
       [=](const Problem<Scalar>& p, Buffer<Scalar>& out) {
         plsh::exact_alibi_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), out.view, slopes,
                                             options);
       }},
      {"windowed",
       [=](const Problem<Scalar>& p, Buffer<Scalar>& out) {
         plsh::windowed_alibi_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), out.view, slopes,
                                                1e-3, options);
       }},
      {"passes",
       [=](const Problem<Scalar>& p, Buffer<Scalar>& out) {
         plsh::plsh_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), out.view, slopes, passes);
       }},
      {"fused",
       [=](const Problem<Scalar>& p, Buffer<Scalar>& out) {
         plsh::plsh_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), out.view, slopes, fused);
       }},
      {"fixed blocks",
       [=](const Problem<Scalar>& p, Buffer<Scalar>& out) {
         plsh::fixed_block_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), out.view, 16, options);
       }},
  };
}

/// Tokens `[begin, end)` of two buffers of one shape hold the same bits.
template <class Scalar>
bool same_bits(const Buffer<Scalar>& a, const Buffer<Scalar>& b, Index begin, Index end) {
  for (Index t = begin; t < end; ++t)
    for (Index h = 0; h < a.view.heads; ++h)
      for (Index e = 0; e < a.view.dim; ++e) {
        const Scalar x = a.at(t, h, e);
        const Scalar y = b.at(t, h, e);
        if (std::memcmp(&x, &y, sizeof(Scalar)) != 0) return false;
      }
  return true;
}

template <class Scalar>
bool all_nan(const Buffer<Scalar>& a, Index t, Index h) {
  for (Index e = 0; e < a.view.dim; ++e)
    if (!std::isnan(a.at(t, h, e))) return false;
  return true;
}

template <class Scalar>
void set_row(Buffer<Scalar>& buffer, Index t, Scalar value) {
  for (Index h = 0; h < buffer.view.heads; ++h)
    for (Index e = 0; e < buffer.view.dim; ++e) buffer.at(t, h, e) = value;
}

template <class Scalar>
std::vector<Scalar> poisons() {
  return {std::numeric_limits<Scalar>::quiet_NaN(), std::numeric_limits<Scalar>::infinity(),
          -std::numeric_limits<Scalar>::infinity()};
}

template <class Scalar>
void check_masked_poison_forward() {
  const Shape shape{40, 40, 2, 1, 8, 8};
  for (const auto& kernel : forward_kernels<Scalar>(true)) {
    const Problem<Scalar> clean(shape, 3);
    Buffer<Scalar> clean_out = clean.output();
    kernel.second(clean, clean_out);
    for (const Scalar poison : poisons<Scalar>()) {
      for (const bool poison_key : {false, true}) {
        INFO(plsh_test::type_name<Scalar>() << " " << kernel.first << " poison " << poison
                                            << (poison_key ? " in k" : " in v") << " row 30");
        Problem<Scalar> poisoned = clean;
        set_row(poison_key ? poisoned.k : poisoned.v, 30, poison);
        Buffer<Scalar> out = poisoned.output();
        kernel.second(poisoned, out);
        // Rows 0..29 cannot see key 30.
        CHECK(same_bits(out, clean_out, 0, 30));
        if (!poison_key) {
          // Row 30 sees its own key with a positive weight: its non-finite value shows.
          CHECK_FALSE(row_finite(out, 30, 0));
        }
      }
    }
  }
}

TEST_CASE("a key a query cannot see changes nothing in its row, whatever its k and v",
          "[nonfinite]") {
  check_masked_poison_forward<float>();
  check_masked_poison_forward<double>();
}

template <class Scalar>
void check_nan_logit() {
  const Shape shape{40, 40, 2, 1, 8, 8};
  for (const bool causal : {true, false}) {
    for (const auto& kernel : forward_kernels<Scalar>(causal)) {
      const Problem<Scalar> clean(shape, 5);
      Buffer<Scalar> clean_out = clean.output();
      kernel.second(clean, clean_out);
      // Query 0 sees only key 0 when causal: its only visible logit is NaN.
      for (const Index row : {Index(0), Index(17)}) {
        INFO(plsh_test::type_name<Scalar>()
             << " " << kernel.first << " causal " << causal << " NaN query row " << row);
        Problem<Scalar> poisoned = clean;
        set_row(poisoned.q, row, std::numeric_limits<Scalar>::quiet_NaN());
        Buffer<Scalar> out = poisoned.output();
        kernel.second(poisoned, out);
        CHECK(all_nan(out, row, 0));
        CHECK(all_nan(out, row, 1));
        CHECK(same_bits(out, clean_out, 0, row));
        CHECK(same_bits(out, clean_out, row + 1, shape.n_q));
      }
    }
  }
}

TEST_CASE("a NaN among a row's visible logits makes the row NaN, not zero", "[nonfinite]") {
  check_nan_logit<float>();
  check_nan_logit<double>();
}

/// Fused and Passes give non-finite values in the same entries (NaN in the same entries when
/// `same_nan`: a non-finite value may come out as NaN or infinity) and agree elsewhere.
template <class Scalar>
void check_fused_equals_passes(Problem<Scalar>& problem, bool causal, bool same_nan) {
  const auto kernels = forward_kernels<Scalar>(causal);
  Buffer<Scalar> passes = problem.output();
  Buffer<Scalar> fused = problem.output();
  kernels[2].second(problem, passes);
  kernels[3].second(problem, fused);
  Index nonfinite = 0;
  for (Index t = 0; t < passes.view.tokens; ++t)
    for (Index h = 0; h < passes.view.heads; ++h)
      for (Index e = 0; e < passes.view.dim; ++e) {
        const double a = static_cast<double>(passes.at(t, h, e));
        const double b = static_cast<double>(fused.at(t, h, e));
        INFO("token " << t << " head " << h << " passes " << a << " fused " << b);
        REQUIRE(std::isfinite(a) == std::isfinite(b));
        if (same_nan) REQUIRE(std::isnan(a) == std::isnan(b));
        if (std::isfinite(a)) {
          REQUIRE(std::abs(a - b) <= 10 * plsh_test::reference_tolerance<Scalar>());
        } else {
          ++nonfinite;
        }
      }
  CHECK(nonfinite > 0);
}

template <class Scalar>
void check_fused_passes_nonfinite() {
  const Shape shape{40, 40, 2, 1, 8, 8};
  for (const bool causal : {true, false}) {
    for (const Scalar poison : poisons<Scalar>()) {
      for (const int target : {0, 1, 2}) {
        INFO(plsh_test::type_name<Scalar>()
             << " causal " << causal << " poison " << poison << " in "
             << "qkv"[target] << " row 30");
        Problem<Scalar> problem(shape, 11);
        set_row(target == 0 ? problem.q : target == 1 ? problem.k : problem.v, 30, poison);
        check_fused_equals_passes(problem, causal, target != 2);
      }
    }
  }
}

TEST_CASE("Fused equals Passes on non-finite inputs", "[nonfinite]") {
  check_fused_passes_nonfinite<float>();
  check_fused_passes_nonfinite<double>();
}

TEST_CASE("float ALiBi far from position 0 equals ALiBi at the same relative positions",
          "[nonfinite][alibi]") {
  const Shape shape{24, 40, 2, 1, 8, 8};
  const Problem<float> problem(shape, 13);
  const std::vector<double> slopes{1.0, 0.05};
  const Index far = Index(1) << 25;
  for (const bool causal : {true, false}) {
    INFO((causal ? "causal" : "bidirectional"));
    plsh::AttentionOptions near_options;
    near_options.causal = causal;
    // Queries after every key: the far case shifts every distance by the same 2^25, which the
    // softmax cancels.
    near_options.query_position = 40;
    plsh::AttentionOptions far_options = near_options;
    far_options.query_position = far + 40;
    Buffer<float> near_out = problem.output();
    Buffer<float> far_out = problem.output();
    plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                       near_out.view, slopes, near_options);
    plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(), far_out.view,
                                       slopes, far_options);
    CHECK(plsh_test::max_abs_difference(far_out.view, near_out.view) <= 1e-6);
    plsh::windowed_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                          far_out.view, slopes, 0, far_options);
    CHECK(plsh_test::max_abs_difference(far_out.view, near_out.view) <= 1e-6);
    // Queries and keys both at 2^25.
    plsh::AttentionOptions zero = near_options;
    zero.query_position = 16;
    zero.key_position = 0;
    plsh::AttentionOptions shifted = zero;
    shifted.query_position += far;
    shifted.key_position += far;
    plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                       near_out.view, slopes, zero);
    plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(), far_out.view,
                                       slopes, shifted);
    CHECK(plsh_test::max_abs_difference(far_out.view, near_out.view) <= 1e-6);
  }
}

/// Gradients of one kernel.
template <class Scalar>
struct Gradients {
  Buffer<Scalar> out, dq, dk, dv;
};

template <class Scalar>
using Backward =
    std::function<void(const Problem<Scalar>&, const Buffer<Scalar>&, Gradients<Scalar>&)>;

template <class Scalar>
std::vector<std::pair<std::string, Backward<Scalar>>> backward_kernels() {
  // ALiBi's slopes, one per head of the problem.
  const auto slopes_of = [](const Problem<Scalar>& p) { return plsh::alibi_slopes(p.shape.heads); };
  plsh::AttentionOptions options;
  plsh::PlshOptions plsh_options;
  plsh_options.samples = 7;
  return {
      {"exact",
       [=](const Problem<Scalar>& p, const Buffer<Scalar>& dout, Gradients<Scalar>& g) {
         const std::vector<double> slopes = slopes_of(p);
         plsh::exact_alibi_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), g.out.view, slopes,
                                             options);
         plsh::exact_alibi_attention_backward<Scalar>(p.q.in(), p.k.in(), p.v.in(), g.out.in(),
                                                      dout.in(), g.dq.view, g.dk.view, g.dv.view,
                                                      slopes, options);
       }},
      {"plsh",
       [=](const Problem<Scalar>& p, const Buffer<Scalar>& dout, Gradients<Scalar>& g) {
         const std::vector<double> slopes = slopes_of(p);
         plsh::plsh_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), g.out.view, slopes,
                                      plsh_options);
         plsh::plsh_attention_backward<Scalar>(p.q.in(), p.k.in(), p.v.in(), g.out.in(), dout.in(),
                                               g.dq.view, g.dk.view, g.dv.view, slopes,
                                               plsh_options);
       }},
      {"fixed blocks",
       [=](const Problem<Scalar>& p, const Buffer<Scalar>& dout, Gradients<Scalar>& g) {
         plsh::fixed_block_attention<Scalar>(p.q.in(), p.k.in(), p.v.in(), g.out.view, 16, options);
         plsh::fixed_block_attention_backward<Scalar>(p.q.in(), p.k.in(), p.v.in(), g.out.in(),
                                                      dout.in(), g.dq.view, g.dk.view, g.dv.view,
                                                      16, options);
       }},
  };
}

template <class Scalar>
Gradients<Scalar> run_backward(const Backward<Scalar>& backward, const Problem<Scalar>& problem,
                               const Buffer<Scalar>& dout) {
  const Shape& s = problem.shape;
  Gradients<Scalar> g{problem.output(), Buffer<Scalar>(s.n_q, s.heads, s.dim),
                      Buffer<Scalar>(s.n_k, s.kv_heads, s.dim),
                      Buffer<Scalar>(s.n_k, s.kv_heads, s.value_dim)};
  backward(problem, dout, g);
  return g;
}

template <class Scalar>
bool zero_rows(const Buffer<Scalar>& a, Index begin, Index end) {
  for (Index t = begin; t < end; ++t)
    for (Index h = 0; h < a.view.heads; ++h)
      for (Index e = 0; e < a.view.dim; ++e)
        if (!(a.at(t, h, e) == 0)) return false;
  return true;
}

template <class Scalar>
void check_masked_poison_backward() {
  // One key/value head: the two sweeps; as many as processors: the one sweep (uses_one_sweep).
  const Index processors = std::max<Index>(2, plsh::detail::processor_count());
  std::vector<Shape> shapes;
  for (const Index kv_heads : {Index{1}, processors}) {
    // Causal, 30 queries at positions 0..29 and 40 keys: keys 30..39 are seen by no query.
    shapes.push_back(Shape{30, 40, 2 * kv_heads, kv_heads, 8, 8});
    // Causal self-attention: rows 0..29 cannot see key 30.
    shapes.push_back(Shape{40, 40, 2 * kv_heads, kv_heads, 8, 8});
  }
  for (const auto& kernel : backward_kernels<Scalar>()) {
    for (const Shape& shape : shapes) {
      const Problem<Scalar> clean(shape, 17);
      Buffer<Scalar> dout(shape.n_q, shape.heads, shape.value_dim);
      dout.fill_random(23);
      const Gradients<Scalar> expected = run_backward(kernel.second, clean, dout);
      const bool unseen = shape.n_q == 30;
      if (unseen) {
        INFO(plsh_test::type_name<Scalar>() << " " << kernel.first << " clean");
        CHECK(zero_rows(expected.dk, 30, 40));
        CHECK(zero_rows(expected.dv, 30, 40));
      }
      const Index key = unseen ? 35 : 30;
      for (const Scalar poison : poisons<Scalar>()) {
        for (const bool poison_key : {false, true}) {
          INFO(plsh_test::type_name<Scalar>()
               << " " << kernel.first << " " << shape << " poison " << poison
               << (poison_key ? " in k" : " in v") << " row " << key);
          Problem<Scalar> poisoned = clean;
          set_row(poison_key ? poisoned.k : poisoned.v, key, poison);
          const Gradients<Scalar> g = run_backward(kernel.second, poisoned, dout);
          CHECK(same_bits(g.dq, expected.dq, 0, 30));
          if (unseen) {
            CHECK(same_bits(g.dk, expected.dk, 0, 30));
            CHECK(same_bits(g.dv, expected.dv, 0, 30));
            CHECK(zero_rows(g.dk, 30, 40));
            CHECK(zero_rows(g.dv, 30, 40));
          }
        }
      }
    }
  }
}

TEST_CASE("backward: keys no query sees get zero gradients and change no other gradient",
          "[nonfinite][backward]") {
  check_masked_poison_backward<float>();
  check_masked_poison_backward<double>();
}

TEST_CASE("fixed_block_attention_backward equals the dense reference", "[backward][fixed]") {
  const Index block = 16;
  for (const bool causal : {true, false}) {
    for (const plsh_test::OffsetCase& c :
         std::vector<plsh_test::OffsetCase>{{70, 70, 0, 0}, {33, 70, 40, 3}}) {
      INFO("causal " << causal << " n_q " << c.n_q << " n_k " << c.n_k);
      const Shape shape{c.n_q, c.n_k, 4, 2, 8, 6};
      const Problem<double> problem(shape, 29);
      Buffer<double> dout(shape.n_q, shape.heads, shape.value_dim);
      dout.fill_random(31);
      plsh::AttentionOptions options;
      options.causal = causal;
      options.query_position = c.query_position;
      options.key_position = c.key_position;
      Buffer<double> out = problem.output();
      plsh::fixed_block_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                          block, options);
      Buffer<double> dq(shape.n_q, shape.heads, shape.dim),
          dk(shape.n_k, shape.kv_heads, shape.dim), dv(shape.n_k, shape.kv_heads, shape.value_dim);
      plsh::fixed_block_attention_backward<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                                   out.in(), dout.in(), dq.view, dk.view, dv.view,
                                                   block, options);
      Buffer<double> rq = dq, rk = dk, rv = dv;
      plsh::reference::fixed_block_attention_backward<double>(problem.q.in(), problem.k.in(),
                                                              problem.v.in(), dout.in(), rq.view,
                                                              rk.view, rv.view, block, options);
      CHECK(plsh_test::max_abs_difference(dq.view, rq.view) <= 1e-11);
      CHECK(plsh_test::max_abs_difference(dk.view, rk.view) <= 1e-11);
      CHECK(plsh_test::max_abs_difference(dv.view, rv.view) <= 1e-11);
    }
  }
}

TEST_CASE("fixed_block_attention_backward rejects a block size below 1",
          "[backward][fixed][validation]") {
  const Shape shape{8, 8, 1, 1, 4, 4};
  const Problem<float> problem(shape, 1);
  Buffer<float> out = problem.output(), dout = problem.output();
  Buffer<float> dq(8, 1, 4), dk(8, 1, 4), dv(8, 1, 4);
  REQUIRE_THROWS_WITH(plsh::fixed_block_attention_backward<float>(
                          problem.q.in(), problem.k.in(), problem.v.in(), out.in(), dout.in(),
                          dq.view, dk.view, dv.view, 0),
                      Catch::Contains("fixed_block_attention_backward") &&
                          Catch::Contains("block_size must be at least 1"));
  REQUIRE_THROWS_AS(plsh::fixed_block_attention_backward<float>(problem.q.in(), problem.k.in(),
                                                                problem.v.in(), out.in(), dout.in(),
                                                                dq.view, dk.view, dv.view, -3),
                    std::invalid_argument);
}

}  // namespace

}  // namespace test_nonfinite
