// Tests of include/plsh/batch.hpp: BatchedHeadsView, and every batched kernel equal bit for bit to
// the loop over its batch elements (1 and 2 threads, three layouts, grouped heads, a batch whose
// elements alone stay below the parallel threshold), and the batch checks.

#include <plsh/batch.hpp>

#include <catch2/catch.hpp>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace test_batch {

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
  passes.near_field = 0;  // block masks only
  visit("exact_alibi_attention", [&](const auto& q, const auto& k, const auto& v, const auto& o) {
    plsh::exact_alibi_attention<Scalar>(q, k, v, o, slopes, options);
  });
  visit("windowed_alibi_attention",
        [&](const auto& q, const auto& k, const auto& v, const auto& o) {
          plsh::windowed_alibi_attention<Scalar>(q, k, v, o, slopes, 1e-3, options);
        });
  visit("truncated_alibi_attention",
        [&](const auto& q, const auto& k, const auto& v, const auto& o) {
          plsh::truncated_alibi_attention<Scalar>(q, k, v, o, slopes, 0.05, options);
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

/// Calls `visit(name, kernel)` for every backward kernel, where `kernel(q, k, v, out, dout, dq, dk,
/// dv)` takes either HeadsViews or BatchedHeadsViews.
template <class Scalar, class Visit>
void for_each_backward(const std::vector<double>& slopes, const plsh::PlshOptions& options,
                       Visit&& visit) {
  visit("exact_alibi_attention_backward", [&](const auto& q, const auto& k, const auto& v,
                                              const auto& out, const auto& dout, const auto& dq,
                                              const auto& dk, const auto& dv) {
    plsh::exact_alibi_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, slopes, options);
  });
  visit("truncated_alibi_attention_backward",
        [&](const auto& q, const auto& k, const auto& v, const auto& out, const auto& dout,
            const auto& dq, const auto& dk, const auto& dv) {
          plsh::truncated_alibi_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, slopes,
                                                           0.05, options);
        });
  visit("plsh_attention_backward",
        [&](const auto& q, const auto& k, const auto& v, const auto& out, const auto& dout,
            const auto& dq, const auto& dk, const auto& dv) {
          plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, slopes, options);
        });
  visit("fixed_block_attention_backward",
        [&](const auto& q, const auto& k, const auto& v, const auto& out, const auto& dout,
            const auto& dq, const auto& dk, const auto& dv) {
          plsh::fixed_block_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, 16, options);
        });
}

const Shape kShape{70, 70, 4, 2, 8, 6};
const Index kBatch = 3;

/// The batch shapes: grouped heads (2 and 4 query heads per key/value head); elements whose work
/// alone is below the parallel threshold while the batch's is above (the batched call runs on
/// several threads, the loop on one); and a batch too small to run in parallel at all.
const Shape kShapes[] = {kShape, {100, 100, 4, 1, 8, 6}, {5, 3, 2, 1, 4, 3}};

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
  for (const Shape& shape : kShapes) {
    const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
    for (const Layout layout : {Layout::Packed, Layout::HeadMajor, Layout::PaddedRows}) {
      for (const bool causal : {true, false}) {
        plsh::AttentionOptions options;
        options.causal = causal;
        options.query_position = 5;
        options.key_position = 2;
        const Problem<Scalar> problem = batch_problem<Scalar>(shape, kBatch, layout);
        for_each_forward<Scalar>(slopes, options, [&](const char* name, const auto& kernel) {
          INFO(name << ", " << shape << ", " << layout << ", " << plsh_test::describe(options)
                    << ", " << plsh_test::type_name<Scalar>());
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
}

TEMPLATE_TEST_CASE("Batched backward kernels equal the loop over the batch bit for bit", "[batch]",
                   float, double) {
  using Scalar = TestType;
  for (const Shape& shape : kShapes) {
    const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
    for (const Layout layout : {Layout::Packed, Layout::HeadMajor, Layout::PaddedRows}) {
      plsh::PlshOptions options;
      options.query_position = 5;
      options.key_position = 2;
      options.samples = 5;
      options.seed = 9;
      Problem<Scalar> problem = batch_problem<Scalar>(shape, kBatch, layout);
      problem.out.fill_random(41);  // any out and dout exercise the same arithmetic
      Buffer<Scalar> dout = problem.out;
      dout.fill_random(43);
      const auto q = batched(problem.q.in(), kBatch);
      const auto k = batched(problem.k.in(), kBatch);
      const auto v = batched(problem.v.in(), kBatch);
      const auto out = batched(problem.out.in(), kBatch);
      const auto dout_view = batched(dout.in(), kBatch);
      for_each_backward<Scalar>(slopes, options, [&](const char* name, const auto& kernel) {
        INFO(name << ", " << shape << ", " << layout << ", " << plsh_test::type_name<Scalar>());
        Buffer<Scalar> dq = problem.q, dk = problem.k, dv = problem.v;
        const auto dq_looped = batched(dq.view, kBatch);
        const auto dk_looped = batched(dk.view, kBatch);
        const auto dv_looped = batched(dv.view, kBatch);
        for (Index b = 0; b < kBatch; ++b) {
          kernel(q[b], k[b], v[b], out[b], dout_view[b], dq_looped[b], dk_looped[b], dv_looped[b]);
        }
        REQUIRE(plsh_test::all_finite(dq.view));
        REQUIRE(plsh_test::all_finite(dk.view));
        for_thread_counts([&] {
          Buffer<Scalar> dq_batch = problem.q, dk_batch = problem.k, dv_batch = problem.v;
          kernel(q, k, v, out, dout_view, batched(dq_batch.view, kBatch),
                 batched(dk_batch.view, kBatch), batched(dv_batch.view, kBatch));
          CHECK(dq_batch.storage == dq.storage);
          CHECK(dk_batch.storage == dk.storage);
          CHECK(dv_batch.storage == dv.storage);
        });
      });
    }
  }
}

TEST_CASE("Batched kernels: the threshold shape straddles the parallel threshold", "[batch]") {
  const Shape& shape = kShapes[1];
  std::vector<float> storage(static_cast<std::size_t>(shape.n_q * shape.heads * shape.dim));
  const HeadsView<const float> q{storage.data(), shape.n_q, shape.heads, shape.dim};
  const HeadsView<const float> k{storage.data(), shape.n_k, shape.kv_heads, shape.dim};
  const HeadsView<const float> v{storage.data(), shape.n_k, shape.kv_heads, shape.value_dim};
  const double element_work = plsh::detail::attention_work(q, k, v);
  CHECK(element_work < plsh::detail::kMinParallelWork);
  CHECK(static_cast<double>(kBatch) * element_work >= plsh::detail::kMinParallelWork);
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

TEST_CASE("Batched kernels: elements without query tokens give an empty output", "[batch]") {
  // Views of 0 query tokens (and 0 keys), with the default batch stride and with batch stride 0,
  // which is what an array of no elements may carry.
  const Shape shape{0, 0, 4, 2, 8, 6};
  std::vector<float> storage(8, 1.0f);  // never read: a valid, non-null address
  const HeadsView<float> q_element{storage.data(), 0, shape.heads, shape.dim};
  const HeadsView<float> k_element{storage.data(), 0, shape.kv_heads, shape.dim};
  const HeadsView<float> v_element{storage.data(), 0, shape.kv_heads, shape.value_dim};
  std::vector<float> out_storage(8, 7.0f);
  const std::vector<float> untouched = out_storage;
  const HeadsView<float> out_element{out_storage.data(), 0, shape.heads, shape.value_dim};
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  plsh::PlshOptions options;
  options.samples = 3;
  for (const Index batch_stride : {Index(-1), Index(0)}) {
    const auto batch = [&](const HeadsView<float>& element) {
      return batch_stride < 0 ? BatchedHeadsView<float>(2, element)
                              : BatchedHeadsView<float>(2, element, batch_stride);
    };
    const BatchedHeadsView<const float> q = batch(q_element), k = batch(k_element),
                                        v = batch(v_element);
    const BatchedHeadsView<float> out = batch(out_element);
    for_each_forward<float>(slopes, options, [&](const char* name, const auto& kernel) {
      INFO(name << ", batch stride " << batch_stride);
      REQUIRE_NOTHROW(kernel(q, k, v, out));
    });
    for_each_backward<float>(slopes, options, [&](const char* name, const auto& kernel) {
      INFO(name << ", batch stride " << batch_stride);
      REQUIRE_NOTHROW(
          kernel(q, k, v, out, out, batch(q_element), batch(k_element), batch(v_element)));
    });
  }
  CHECK(out_storage == untouched);
}

TEST_CASE("Batched kernels: an empty batch is checked like a batch of one", "[batch]") {
  // Each case fails the checks of an element; with 0 elements the same message as with 1.
  Problem<float> problem(kShape, 5);
  const std::vector<double> slopes = plsh::alibi_slopes(kShape.heads);
  const auto batch_of = [](const auto& view, Index batch) {
    using View = std::decay_t<decltype(view)>;
    return BatchedHeadsView<std::remove_pointer_t<decltype(View::data)>>(batch, view);
  };
  for (const Index batch : {Index(1), Index(0)}) {
    INFO("batch " << batch);
    const auto q = batch_of(problem.q.in(), batch);
    const auto k = batch_of(problem.k.in(), batch);
    const auto v = batch_of(problem.v.in(), batch);
    Buffer<float> out_buffer = problem.out;
    const auto out = batch_of(out_buffer.view, batch);
    const HeadsView<const float> k_view = problem.k.in();
    const auto narrow_k =
        batch_of(HeadsView<const float>{k_view.data, k_view.tokens, k_view.heads, k_view.dim - 1,
                                        k_view.token_stride, k_view.head_stride},
                 batch);
    REQUIRE_THROWS_WITH(plsh::exact_alibi_attention<float>(q, narrow_k, v, out, slopes),
                        "exact_alibi_attention: k.dim must equal q.dim");
    const HeadsView<const float> q_view = problem.q.in();
    const auto odd_q = batch_of(HeadsView<const float>{q_view.data, q_view.tokens, 3, q_view.dim,
                                                       q_view.token_stride, q_view.head_stride},
                                batch);
    const HeadsView<float> out_view = out_buffer.view;
    const auto odd_out = batch_of(HeadsView<float>{out_view.data, out_view.tokens, 3, out_view.dim,
                                                   out_view.token_stride, out_view.head_stride},
                                  batch);
    REQUIRE_THROWS_WITH(
        plsh::exact_alibi_attention<float>(odd_q, k, v, odd_out, plsh::alibi_slopes(3)),
        "exact_alibi_attention: q.heads must be a multiple of k.heads");
    std::vector<double> nan_slopes = slopes;
    nan_slopes[1] = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_AS(plsh::windowed_alibi_attention<float>(q, k, v, out, nan_slopes),
                      std::invalid_argument);
    plsh::PlshOptions no_samples;
    no_samples.samples = 0;
    REQUIRE_THROWS_AS(plsh::plsh_attention<float>(q, k, v, out, slopes, no_samples),
                      std::invalid_argument);
    plsh::AttentionOptions nan_scale;
    nan_scale.scale = std::numeric_limits<double>::quiet_NaN();
    REQUIRE_THROWS_WITH(plsh::fixed_block_attention<float>(q, k, v, out, 16, nan_scale),
                        "fixed_block_attention: options.scale must be finite");
    plsh::PlshOptions before_start;
    before_start.query_position = -100;
    REQUIRE_THROWS_AS(
        plsh::plsh_attention_backward<float>(q, k, v, out, out, batch_of(problem.q.view, batch),
                                             batch_of(problem.k.view, batch),
                                             batch_of(problem.v.view, batch), slopes, before_start),
        std::invalid_argument);
    // out on q's memory (q has the output's shape here: d = d_v would be needed, so alias the
    // first rows of q's buffer with a view of out's shape).
    Buffer<float> shared = problem.q;
    const auto q_shared = batch_of(HeadsView<const float>(shared.view), batch);
    const auto out_on_q =
        batch_of(HeadsView<float>{shared.view.data, kShape.n_q, kShape.heads, kShape.value_dim,
                                  shared.view.token_stride, shared.view.head_stride},
                 batch);
    REQUIRE_THROWS_WITH(plsh::exact_alibi_attention<float>(q_shared, k, v, out_on_q, slopes),
                        "exact_alibi_attention: out overlaps q");
  }
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
    REQUIRE_THROWS_AS(plsh::truncated_alibi_attention<float>(q, k, v, one_out, slopes, 0.05),
                      std::invalid_argument);
    REQUIRE_THROWS_WITH(plsh::truncated_alibi_attention<float>(q, k, v, one_out, slopes, 0.05),
                        "truncated_alibi_attention: out.batch (1) must equal q.batch (2)");
    REQUIRE_THROWS_WITH(plsh::truncated_alibi_attention<float>(q, k, v, out, slopes, -1.0),
                        "truncated_alibi_attention: factor_tolerance must lie in [0, 1]");
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
    Buffer<float> dq = problem.q, dk = problem.k, dv = problem.v;
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
    REQUIRE_THROWS_AS(plsh::truncated_alibi_attention_backward<float>(
                          q, k, v, dout, dout, dq_view, dk_on_dq, dv_view, slopes, 0.05),
                      std::invalid_argument);
    REQUIRE_THROWS_WITH(plsh::truncated_alibi_attention_backward<float>(
                            q, k, v, dout, dout, dq_view, dk_on_dq, dv_view, slopes, 0.05),
                        "truncated_alibi_attention_backward: dk overlaps dq");
    REQUIRE_THROWS_WITH(
        plsh::truncated_alibi_attention_backward<float>(q, k, v, dout, dout, dq_view,
                                                        batched(dk.view, 2), dv_view, slopes, 2.0),
        "truncated_alibi_attention_backward: factor_tolerance must lie in [0, 1]");
    REQUIRE_THROWS_AS(plsh::fixed_block_attention_backward<float>(q, k, v, dout, dout, dq_view,
                                                                  dk_on_dq, dv_view, 16),
                      std::invalid_argument);
    REQUIRE_THROWS_WITH(plsh::fixed_block_attention_backward<float>(q, k, v, dout, dout, dq_view,
                                                                    dk_on_dq, dv_view, 16),
                        "fixed_block_attention_backward: dk overlaps dq");
    REQUIRE_THROWS_WITH(plsh::fixed_block_attention_backward<float>(
                            q, k, v, dout, dout, dq_view, batched(dk.view, 2), dv_view, 0),
                        "fixed_block_attention_backward: block_size must be at least 1");
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

}  // namespace test_batch
