#ifndef PLSH_BATCH_HPP
#define PLSH_BATCH_HPP

/// \file batch.hpp
/// The attention kernels over a batch of BatchedHeadsView (batched_heads_view.hpp), a strided
/// `[batch][tokens][heads][dim]` tensor, FlashAttention's layout.
///
/// Every batched kernel checks the batch once (the same batch size everywhere, no element address
/// overflowing, outputs not overlapping each other or an input), then the shapes and options of
/// one element, and runs the kernel's job list over all the elements in one parallel region:
/// jobs (batch element, head, query tile) for the tiled forwards and backward sweep 1, (batch
/// element, head) for the Positional LSH passes, (batch element, key/value head, key tile) for
/// backward sweep 2. The draws of Positional LSH are made once per call and shared by the
/// elements. An unbatched call is the same code with a batch of one, every job computes what it
/// computes there, and every output row is written by one job, so a batched call equals the loop
/// over its elements bit for bit, for any number of threads. Cost: the sum of the elements' costs
/// (one draw of the grids, one parallel region); work estimate for the parallel threshold:
/// batch times one element's.
///
/// Tested in tests/test_batch.cpp against the loop over the batch (1 and 2 threads, strided and
/// packed layouts, grouped heads, a batch too small to run in parallel) and for every argument
/// check; the bfloat16 and half overloads in tests/test_half.cpp.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/options.hpp"
#include "attention/plsh_attention.hpp"
#include "batched_heads_view.hpp"
#include "detail/check.hpp"
#include "detail/validate.hpp"
#include "tensor.hpp"

namespace plsh {

namespace detail {

/// One past the last element a batched view can touch, as an offset from `data`; throws when the
/// offset of some element does not fit in an Index.
template <class Scalar>
Index batched_extent(const BatchedHeadsView<Scalar>& view, const char* function, const char* name) {
  require(view.batch >= 0, function, name, ".batch must be non-negative");
  require(view.batch_stride >= 0, function, name, ".batch_stride must be non-negative");
  const HeadsView<Scalar> first = view[0];
  require_view(first, function, name);
  if (view.batch == 0 || view.tokens == 0) return 0;
  constexpr Index kMax = std::numeric_limits<Index>::max();
  const std::pair<Index, Index> terms[] = {{view.batch - 1, view.batch_stride},
                                           {view.tokens - 1, view.token_stride},
                                           {view.heads - 1, view.head_stride},
                                           {1, view.dim}};
  Index extent = 0;
  for (const auto& term : terms) {
    require(term.second == 0 || term.first <= (kMax - extent) / term.second, function, name,
            " strides overflow the index type");
    extent += term.first * term.second;
  }
  return extent;
}

/// No two distinct (batch, token, head, element) positions of an output share memory. Sufficient
/// condition (exact for the usual layouts, and for any permutation of the axes): with the axes
/// of more than one position sorted by stride, each stride exceeds the extent spanned by the
/// smaller ones.
template <class Scalar>
void require_batched_injective(const BatchedHeadsView<Scalar>& view, const char* function,
                               const char* name) {
  if (view.batch == 0 || view.tokens == 0) return;  // no elements: nothing can overlap
  std::vector<std::pair<Index, Index>> axes;        // (stride, size)
  const std::pair<Index, Index> all[] = {{view.batch_stride, view.batch},
                                         {view.token_stride, view.tokens},
                                         {view.head_stride, view.heads},
                                         {1, view.dim}};
  for (const auto& axis : all) {
    if (axis.second > 1) axes.push_back(axis);
  }
  std::sort(axes.begin(), axes.end());
  Index spanned = 0;  // largest offset reachable through the smaller axes
  for (const auto& axis : axes) {
    require(axis.first > spanned, function, name, " strides make elements overlap");
    spanned += (axis.second - 1) * axis.first;
  }
}

/// The memory of two batched views, as byte ranges [begin, end), overlaps.
template <class A, class B>
bool batched_overlap(const BatchedHeadsView<A>& a, Index extent_a, const BatchedHeadsView<B>& b,
                     Index extent_b) {
  const auto begin_a = reinterpret_cast<std::uintptr_t>(a.data);
  const auto begin_b = reinterpret_cast<std::uintptr_t>(b.data);
  const auto end_a = begin_a + static_cast<std::uintptr_t>(extent_a) * sizeof(A);
  const auto end_b = begin_b + static_cast<std::uintptr_t>(extent_b) * sizeof(B);
  return extent_a > 0 && extent_b > 0 && begin_a < end_b && begin_b < end_a;
}

/// The checks of a batched call: every view well formed and free of index overflow, the same
/// batch size everywhere, each output injective and overlapping neither an input nor another
/// output. The shapes and options of an element are checked by the kernel, on the view of
/// element 0, also when the batch is empty (the kernel then returns after its checks).
template <class Scalar, std::size_t Inputs, std::size_t Outputs>
void validate_batch(const char* function, const BatchedHeadsView<const Scalar> (&inputs)[Inputs],
                    const char* const (&input_names)[Inputs],
                    const BatchedHeadsView<Scalar> (&outputs)[Outputs],
                    const char* const (&output_names)[Outputs]) {
  Index input_extents[Inputs];
  for (std::size_t i = 0; i < Inputs; ++i) {
    input_extents[i] = batched_extent(inputs[i], function, input_names[i]);
    require(inputs[i].batch == inputs[0].batch, function, [&] {
      return std::string(input_names[i]) + ".batch (" + std::to_string(inputs[i].batch) +
             ") must equal " + input_names[0] + ".batch (" + std::to_string(inputs[0].batch) + ")";
    });
  }
  Index output_extents[Outputs];
  for (std::size_t o = 0; o < Outputs; ++o) {
    output_extents[o] = batched_extent(outputs[o], function, output_names[o]);
    require(outputs[o].batch == inputs[0].batch, function, [&] {
      return std::string(output_names[o]) + ".batch (" + std::to_string(outputs[o].batch) +
             ") must equal " + input_names[0] + ".batch (" + std::to_string(inputs[0].batch) + ")";
    });
    require_batched_injective(outputs[o], function, output_names[o]);
    for (std::size_t i = 0; i < Inputs; ++i) {
      require(!batched_overlap(outputs[o], output_extents[o], inputs[i], input_extents[i]),
              function,
              [&] { return std::string(output_names[o]) + " overlaps " + input_names[i]; });
    }
    for (std::size_t other = 0; other < o; ++other) {
      require(
          !batched_overlap(outputs[o], output_extents[o], outputs[other], output_extents[other]),
          function,
          [&] { return std::string(output_names[o]) + " overlaps " + output_names[other]; });
    }
  }
}

/// validate_batch for a forward kernel (q, k, v -> out), then `run()`, which checks an element's
/// shapes and options and computes nothing for an empty batch.
template <class Scalar, class Run>
void run_forward_batch(const char* function, const BatchedHeadsView<const Scalar>& q,
                       const BatchedHeadsView<const Scalar>& k,
                       const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<Scalar>& out,
                       Run&& run) {
  const BatchedHeadsView<const Scalar> inputs[] = {q, k, v};
  const char* const input_names[] = {"q", "k", "v"};
  const BatchedHeadsView<Scalar> outputs[] = {out};
  const char* const output_names[] = {"out"};
  validate_batch(function, inputs, input_names, outputs, output_names);
  run();
}

/// validate_batch for a backward kernel (q, k, v, out, dout -> dq, dk, dv), then `run()`, as
/// run_forward_batch.
template <class Scalar, class Run>
void run_backward_batch(const char* function, const BatchedHeadsView<const Scalar>& q,
                        const BatchedHeadsView<const Scalar>& k,
                        const BatchedHeadsView<const Scalar>& v,
                        const BatchedHeadsView<const Scalar>& out,
                        const BatchedHeadsView<const Scalar>& dout,
                        const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
                        const BatchedHeadsView<Scalar>& dv, Run&& run) {
  const BatchedHeadsView<const Scalar> inputs[] = {q, k, v, out, dout};
  const char* const input_names[] = {"q", "k", "v", "out", "dout"};
  const BatchedHeadsView<Scalar> outputs[] = {dq, dk, dv};
  const char* const output_names[] = {"dq", "dk", "dv"};
  validate_batch(function, inputs, input_names, outputs, output_names);
  run();
}

}  // namespace detail

/// exact_alibi_attention on every batch element: `q [B][n_q][H][d]`, `k [B][n_k][H_kv][d]`,
/// `v [B][n_k][H_kv][d_v]`, `out [B][n_q][H][d_v]`; slopes and options as the unbatched kernel.
/// \throws std::invalid_argument as the unbatched kernel, and for batch sizes that disagree,
/// strides that overflow, or outputs overlapping an input.
template <class Scalar>
void exact_alibi_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                           const BatchedHeadsView<Scalar>& out, const std::vector<double>& slopes,
                           const AttentionOptions& options = {}) {
  detail::run_forward_batch<Scalar>("exact_alibi_attention", q, k, v, out, [&] {
    detail::batched_exact_alibi_attention<Scalar>(q, k, v, out, slopes, options);
  });
}

/// windowed_alibi_attention on every batch element (shapes as the batched exact_alibi_attention).
template <class Scalar>
void windowed_alibi_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                              const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                              const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                              const BatchedHeadsView<Scalar>& out,
                              const std::vector<double>& slopes, double tolerance = 1e-6,
                              const AttentionOptions& options = {}) {
  detail::run_forward_batch<Scalar>("windowed_alibi_attention", q, k, v, out, [&] {
    detail::batched_windowed_alibi_attention<Scalar>(q, k, v, out, slopes, tolerance, options);
  });
}

/// plsh_attention on every batch element (shapes as the batched exact_alibi_attention). Every
/// element uses the same draws (those of `options.seed`).
template <class Scalar>
void plsh_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                    const BatchedHeadsView<Scalar>& out, const std::vector<double>& slopes,
                    const PlshOptions& options = {}) {
  detail::run_forward_batch<Scalar>("plsh_attention", q, k, v, out, [&] {
    detail::batched_plsh_attention<Scalar>(q, k, v, out, slopes, options);
  });
}

/// fixed_block_attention on every batch element (shapes as the batched exact_alibi_attention).
template <class Scalar>
void fixed_block_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                           const BatchedHeadsView<Scalar>& out, Index block_size,
                           const AttentionOptions& options = {}) {
  detail::run_forward_batch<Scalar>("fixed_block_attention", q, k, v, out, [&] {
    detail::batched_fixed_block_attention<Scalar>(q, k, v, out, block_size, options);
  });
}

/// exact_alibi_attention_backward on every batch element: inputs q, k, v, out, dout and gradients
/// dq (like q), dk (like k), dv (like v), each `[B][...]`.
template <class Scalar>
void exact_alibi_attention_backward(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
                                    const BatchedHeadsView<Scalar>& dq,
                                    const BatchedHeadsView<Scalar>& dk,
                                    const BatchedHeadsView<Scalar>& dv,
                                    const std::vector<double>& slopes,
                                    const AttentionOptions& options = {}) {
  detail::run_backward_batch<Scalar>("exact_alibi_attention_backward", q, k, v, out, dout, dq, dk,
                                     dv, [&] {
                                       detail::batched_exact_alibi_attention_backward<Scalar>(
                                           q, k, v, out, dout, dq, dk, dv, slopes, options);
                                     });
}

/// plsh_attention_backward on every batch element (shapes as the batched
/// exact_alibi_attention_backward).
template <class Scalar>
void plsh_attention_backward(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
                             const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
                             const BatchedHeadsView<Scalar>& dv, const std::vector<double>& slopes,
                             const PlshOptions& options = {}) {
  detail::run_backward_batch<Scalar>("plsh_attention_backward", q, k, v, out, dout, dq, dk, dv,
                                     [&] {
                                       detail::batched_plsh_attention_backward<Scalar>(
                                           q, k, v, out, dout, dq, dk, dv, slopes, options);
                                     });
}

/// fixed_block_attention_backward on every batch element (shapes as the batched
/// exact_alibi_attention_backward).
template <class Scalar>
void fixed_block_attention_backward(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
                                    const BatchedHeadsView<Scalar>& dq,
                                    const BatchedHeadsView<Scalar>& dk,
                                    const BatchedHeadsView<Scalar>& dv, Index block_size,
                                    const AttentionOptions& options = {}) {
  detail::run_backward_batch<Scalar>("fixed_block_attention_backward", q, k, v, out, dout, dq, dk,
                                     dv, [&] {
                                       detail::batched_fixed_block_attention_backward<Scalar>(
                                           q, k, v, out, dout, dq, dk, dv, block_size, options);
                                     });
}

}  // namespace plsh

#endif  // PLSH_BATCH_HPP
