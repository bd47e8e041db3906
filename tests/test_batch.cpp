// Tests of include/plsh/batch.hpp: BatchedHeadsView, and every batched kernel equal bit for bit to
// the loop over its batch elements (1 and 2 threads, three layouts), and the batch checks.

#include <plsh/batch.hpp>

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <plsh/alibi.hpp>

#include "attention_fixture.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using plsh::BatchedHeadsView;
using plsh::HeadsView;
using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::Problem;
using plsh_test::Shape;

/// The buffer's tokens as `batch` consecutive elements of `tokens / batch` tokens each.
template <class Scalar>
BatchedHeadsView<Scalar> batched(const HeadsView<Scalar>& view, Index batch) {
  const Index tokens = view.tokens / batch;
  return BatchedHeadsView<Scalar>(batch, view.slice(0, tokens), tokens * view.token_stride);
}

/// A batch of `batch` problems of `shape`: Problem with the token counts multiplied by `batch`.
template <class Scalar>
Problem<Scalar> batch_problem(const Shape& shape, Index batch, Layout layout) {
  Shape whole = shape;
  whole.n_q *= batch;
  whole.n_k *= batch;
  return Problem<Scalar>(whole, 17, layout);
}

/// Runs `body` with 1 and 2 threads (once without OpenMP), restoring the thread count.
template <class Body>
void for_thread_counts(Body&& body) {
#if defined(_OPENMP)
  const int saved_threads = omp_get_max_threads();
  for (const int threads : {1, 2}) {
    INFO("threads = " << threads);
    omp_set_num_threads(threads);
    body();
  }
  omp_set_num_threads(saved_threads);
#else
  body();
#endif
}

/// Calls `visit(name, kernel)` for every forward kernel, where `kernel(q, k, v, out)` takes either
/// HeadsViews (one element) or BatchedHeadsViews (the batched overload).
template <class Scalar, class Visit>
void for_each_forward(const std::vector<double>& slopes, const plsh::AttentionOptions& options,
                      Visit&& visit) {
  plsh::PlshOptions fused;
  static_cast<plsh::AttentionOptions&>(fused) = options;
  fused.samples = 5;
  fused.seed = 3;
  plsh::PlshOptions passes = fused;
  passes.kernel = plsh::Kernel::Passes;
  visit("exact_alibi_attention", [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    plsh::exact_alibi_attention<Scalar>(q, k, v, o, slopes, options);
  });
  visit("windowed_alibi_attention",
        [&](const auto& q, const auto& k, const auto& v, const auto& o) {
          plsh::windowed_alibi_attention<Scalar>(q, k, v, o, slopes, 1e-3, options);
        });
  visit("plsh_attention (fused)", [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    plsh::plsh_attention<Scalar>(q, k, v, o, slopes, fused);
  });
  visit("plsh_attention (passes)", [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    plsh::plsh_attention<Scalar>(q, k, v, o, slopes, passes);
  });
  visit("fixed_block_attention", [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    plsh::fixed_block_attention<Scalar>(q, k, v, o, 16, options);
  });
}

const Shape kShape{70, 70, 4, 2, 8, 6};
const Index kBatch = 3;

}  // namespace

TEST_CASE("BatchedHeadsView: elements, default batch stride, const view", "[batch]") {
  std::vector<float> storage(2 * 5 * 3 * 4);
  const HeadsView<float> packed{storage.data(), 5, 3, 4};
  const BatchedHeadsView<float> view(2, packed);
  CHECK(view.batch_stride == 5 * 3 * 4);
  CHECK(view[1].data == storage.data() + 60);
  CHECK(view[1].token_stride == 12);
  CHECK(view[1].head_stride == 4);
  const HeadsView<float> head_major{storage.data(), 5, 3, 4, 4, 20};
  CHECK(BatchedHeadsView<float>(2, head_major).batch_stride == 60);
  const BatchedHeadsView<const float> constant = view;
  CHECK(constant[1].data == storage.data() + 60);
  CHECK(constant.tokens == 5);
  CHECK(constant.heads == 3);
  CHECK(constant.dim == 4);
}

TEMPLATE_TEST_CASE("Batched forward kernels equal the loop over the batch bit for bit", "[batch]",
                   float, double) {
  using Scalar = TestType;
  const std::vector<double> slopes = plsh::alibi_slopes(kShape.heads);
  for (const Layout layout : {Layout::Packed, Layout::HeadMajor, Layout::PaddedRows}) {
    for (const bool causal : {true, false}) {
      plsh::AttentionOptions options;
      options.causal = causal;
      options.query_position = 5;
      options.key_position = 2;
      const Problem<Scalar> problem = batch_problem<Scalar>(kShape, kBatch, layout);
      for_each_forward<Scalar>(slopes, options, [&](const char* name, const auto& kernel) {
        INFO(name << ", " << layout << ", " << plsh_test::describe(options) << ", "
                  << plsh_test::type_name<Scalar>());
        Buffer<Scalar> looped = problem.out;
        const auto q = batched(problem.q.in(), kBatch);
        const auto k = batched(problem.k.in(), kBatch);
        const auto v = batched(problem.v.in(), kBatch);
        const auto looped_out = batched(looped.view, kBatch);
        for (Index b = 0; b < kBatch; ++b) kernel(q[b], k[b], v[b], looped_out[b]);
        REQUIRE(plsh_test::all_finite(looped.view));
        for_thread_counts([&] {
          Buffer<Scalar> together = problem.out;
          kernel(q, k, v, batched(together.view, kBatch));
          CHECK(together.storage == looped.storage);  // padding included: untouched
        });
      });
    }
  }
}

TEMPLATE_TEST_CASE("Batched backward kernels equal the loop over the batch bit for bit", "[batch]",
                   float, double) {
  using Scalar = TestType;
  const std::vector<double> slopes = plsh::alibi_slopes(kShape.heads);
  for (const Layout layout : {Layout::Packed, Layout::HeadMajor, Layout::PaddedRows}) {
    plsh::PlshOptions options;
    options.query_position = 5;
    options.key_position = 2;
    options.samples = 5;
    options.seed = 9;
    Problem<Scalar> problem = batch_problem<Scalar>(kShape, kBatch, layout);
    problem.out.fill_random(41);  // any out and dout exercise the same arithmetic
    Buffer<Scalar> dout = problem.out;
    dout.fill_random(43);
    const auto q = batched(problem.q.in(), kBatch);
    const auto k = batched(problem.k.in(), kBatch);
    const auto v = batched(problem.v.in(), kBatch);
    const auto out = batched(problem.out.in(), kBatch);
    const auto dout_view = batched(dout.in(), kBatch);
    for (const bool exact : {true, false}) {
      INFO((exact ? "exact_alibi_attention_backward" : "plsh_attention_backward")
           << ", " << layout << ", " << plsh_test::type_name<Scalar>());
      const auto run = [&](Buffer<Scalar>& dq, Buffer<Scalar>& dk, Buffer<Scalar>& dv,
                           bool together) {
        const auto dq_view = batched(dq.view, kBatch);
        const auto dk_view = batched(dk.view, kBatch);
        const auto dv_view = batched(dv.view, kBatch);
        if (together && exact) {
          plsh::exact_alibi_attention_backward<Scalar>(q, k, v, out, dout_view, dq_view, dk_view,
                                                       dv_view, slopes, options);
        } else if (together) {
          plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout_view, dq_view, dk_view, dv_view,
                                                slopes, options);
        } else {
          for (Index b = 0; b < kBatch; ++b) {
            if (exact) {
              plsh::exact_alibi_attention_backward<Scalar>(q[b], k[b], v[b], out[b], dout_view[b],
                                                           dq_view[b], dk_view[b], dv_view[b],
                                                           slopes, options);
            } else {
              plsh::plsh_attention_backward<Scalar>(q[b], k[b], v[b], out[b], dout_view[b],
                                                    dq_view[b], dk_view[b], dv_view[b], slopes,
                                                    options);
            }
          }
        }
      };
      Buffer<Scalar> dq = problem.q, dk = problem.k, dv = problem.v;
      run(dq, dk, dv, false);
      REQUIRE(plsh_test::all_finite(dq.view));
      for_thread_counts([&] {
        Buffer<Scalar> dq_batch = problem.q, dk_batch = problem.k, dv_batch = problem.v;
        run(dq_batch, dk_batch, dv_batch, true);
        CHECK(dq_batch.storage == dq.storage);
        CHECK(dk_batch.storage == dk.storage);
        CHECK(dv_batch.storage == dv.storage);
      });
    }
  }
}

TEST_CASE("Batched kernels: a batch of zero elements does nothing", "[batch]") {
  Problem<float> problem(kShape, 5);
  const auto q = BatchedHeadsView<const float>(0, problem.q.in());
  const auto k = BatchedHeadsView<const float>(0, problem.k.in());
  const auto v = BatchedHeadsView<const float>(0, problem.v.in());
  Buffer<float> out = problem.out;
  plsh::exact_alibi_attention<float>(q, k, v, BatchedHeadsView<float>(0, out.view),
                                     plsh::alibi_slopes(kShape.heads));
  CHECK(out.storage == problem.out.storage);
}

TEST_CASE("Batched kernels: argument checks", "[batch]") {
  const std::vector<double> slopes = plsh::alibi_slopes(kShape.heads);
  Problem<float> problem = batch_problem<float>(kShape, 2, Layout::Packed);
  const auto q = batched(problem.q.in(), 2);
  const auto k = batched(problem.k.in(), 2);
  const auto v = batched(problem.v.in(), 2);
  const auto out = batched(problem.out.view, 2);
  const auto exact = [&](const BatchedHeadsView<const float>& q_view,
                         const BatchedHeadsView<const float>& k_view,
                         const BatchedHeadsView<float>& out_view) {
    plsh::exact_alibi_attention<float>(q_view, k_view, v, out_view, slopes);
  };
  SECTION("batch sizes") {
    const BatchedHeadsView<const float> one_key(1, k[0], k.batch_stride);
    REQUIRE_THROWS_AS(exact(q, one_key, out), std::invalid_argument);
    REQUIRE_THROWS_WITH(exact(q, one_key, out),
                        "exact_alibi_attention: k.batch (1) must equal q.batch (2)");
    const BatchedHeadsView<float> one_out(1, out[0], out.batch_stride);
    REQUIRE_THROWS_WITH(exact(q, k, one_out),
                        "exact_alibi_attention: out.batch (1) must equal q.batch (2)");
    const BatchedHeadsView<const float> negative(-1, q[0], q.batch_stride);
    REQUIRE_THROWS_WITH(exact(negative, k, out),
                        "exact_alibi_attention: q.batch must be non-negative");
  }
  SECTION("strides") {
    const BatchedHeadsView<const float> backwards(2, q[0], -1);
    REQUIRE_THROWS_WITH(exact(backwards, k, out),
                        "exact_alibi_attention: q.batch_stride must be non-negative");
    const BatchedHeadsView<const float> huge(3, q[0], std::numeric_limits<Index>::max() / 2 + 1);
    REQUIRE_THROWS_WITH(exact(huge, k, out),
                        "exact_alibi_attention: q strides overflow the index type");
    const BatchedHeadsView<float> shared(2, out[0], 0);
    REQUIRE_THROWS_WITH(exact(q, k, shared),
                        "exact_alibi_attention: out strides make elements overlap");
    const BatchedHeadsView<float> interleaved(2, out[0], out.token_stride / 2);
    REQUIRE_THROWS_WITH(exact(q, k, interleaved),
                        "exact_alibi_attention: out strides make elements overlap");
  }
  SECTION("outputs overlapping inputs or each other") {
    Buffer<float> aliased = problem.q;
    const auto q_alias = batched(HeadsView<const float>(aliased.view), 2);
    const BatchedHeadsView<float> out_alias(2, aliased.view.slice(0, kShape.n_q), q.batch_stride);
    REQUIRE_THROWS_WITH(exact(q_alias, k, out_alias), "exact_alibi_attention: out overlaps q");

    const auto dout = batched(problem.out.in(), 2);
    Buffer<float> dq = problem.q, dv = problem.v;
    const auto dq_view = batched(dq.view, 2);
    const auto dv_view = batched(dv.view, 2);
    // dk placed on dq's memory (dk has fewer heads, so it fits).
    const BatchedHeadsView<float> dk_on_dq(
        2, HeadsView<float>{dq.view.data, kShape.n_k, kShape.kv_heads, kShape.dim}, k.batch_stride);
    REQUIRE_THROWS_WITH(plsh::exact_alibi_attention_backward<float>(q, k, v, dout, dout, dq_view,
                                                                    dk_on_dq, dv_view, slopes),
                        "exact_alibi_attention_backward: dk overlaps dq");
    REQUIRE_THROWS_WITH(plsh::plsh_attention_backward<float>(q, k, v, dout, dout, dq_view, dk_on_dq,
                                                             dv_view, slopes),
                        "plsh_attention_backward: dk overlaps dq");
  }
  SECTION("element shapes are checked by the unbatched kernel") {
    const BatchedHeadsView<const float> narrow(
        2,
        HeadsView<const float>{problem.k.view.data, kShape.n_k, kShape.kv_heads, kShape.dim - 1,
                               problem.k.view.token_stride, problem.k.view.head_stride},
        k.batch_stride);
    REQUIRE_THROWS_WITH(exact(q, narrow, out), "exact_alibi_attention: k.dim must equal q.dim");
  }
}
