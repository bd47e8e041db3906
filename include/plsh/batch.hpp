#ifndef PLSH_BATCH_HPP
#define PLSH_BATCH_HPP

/// \file batch.hpp
/// BatchedHeadsView, a strided view of a `[batch][tokens][heads][dim]` tensor, and the attention
/// kernels over a batch.
///
/// Every batched kernel checks the batch once (the same batch size everywhere, no element address
/// overflowing, outputs not overlapping each other or an input) and then runs the unbatched kernel
/// on batch elements 0, 1, ..., in order; each of those is parallel over (head, tile) and gives the
/// same result for any number of threads, so a batched call equals the loop over its elements bit
/// for bit. Cost: the sum of the elements' costs.
///
/// Tested in tests/test_batch.cpp against the loop over the batch (1 and 2 threads, strided and
/// packed layouts) and for every argument check.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/options.hpp"
#include "attention/plsh_attention.hpp"
#include "detail/check.hpp"
#include "detail/parallel.hpp"
#include "detail/validate.hpp"
#include "tensor.hpp"

namespace plsh {

/// A non-owning view of a batch of token-major tensors, `[batch][tokens][heads][dim]` (the layout
/// FlashAttention trains on): element (b, t, h, e) is
/// `data[b * batch_stride + t * token_stride + h * head_stride + e]`, and batch element b is the
/// HeadsView `view[b]`.
///
/// Built from the view of batch element 0, the batch size and the distance between elements:
/// \code
/// std::vector<float> q(batch * n * heads * dim);   // packed [batch][n][heads][dim]
/// plsh::BatchedHeadsView<const float> view(batch, {q.data(), n, heads, dim});
/// // batch_stride = n * heads * dim; view[b] is the HeadsView of element b
/// \endcode
/// A `BatchedHeadsView<T>` converts to a `BatchedHeadsView<const T>`.
template <class Scalar>
struct BatchedHeadsView {
  Scalar* data;
  Index batch;
  Index tokens;
  Index heads;
  Index dim;
  Index batch_stride;
  Index token_stride;
  Index head_stride;

  /// `batch` elements, element b starting `b * batch_stride` elements after `first.data`, each
  /// laid out like `first`.
  BatchedHeadsView(Index batch, const HeadsView<Scalar>& first, Index batch_stride)
      : data(first.data),
        batch(batch),
        tokens(first.tokens),
        heads(first.heads),
        dim(first.dim),
        batch_stride(batch_stride),
        token_stride(first.token_stride),
        head_stride(first.head_stride) {}

  /// As above with consecutive elements: `batch_stride = max(tokens * token_stride, heads *
  /// head_stride)`, which is `tokens * heads * dim` for packed elements (token-major or
  /// head-major).
  BatchedHeadsView(Index batch, const HeadsView<Scalar>& first)
      : BatchedHeadsView(
            batch, first,
            std::max(first.tokens * first.token_stride, first.heads * first.head_stride)) {}

  /// Batch element `b` (not checked against `batch`).
  HeadsView<Scalar> operator[](Index b) const {
    return HeadsView<Scalar>{
        data + b * batch_stride, tokens, heads, dim, token_stride, head_stride};
  }

  template <class T = Scalar,
            class = std::enable_if_t<std::is_same<T, Scalar>::value && !std::is_const<T>::value>>
  operator BatchedHeadsView<const T>() const {  // NOLINT(google-explicit-constructor)
    return BatchedHeadsView<const T>(batch, HeadsView<const T>(operator[](0)), batch_stride);
  }
};

namespace detail {

/// One past the last element a batched view can touch, as an offset from `data`; throws when the
/// offset of some element does not fit in an Index.
template <class Scalar>
Index batched_extent(const BatchedHeadsView<Scalar>& view, const char* function,
                     const std::string& name) {
  require(view.batch >= 0, function, name + ".batch must be non-negative");
  require(view.batch_stride >= 0, function, name + ".batch_stride must be non-negative");
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
    require(term.second == 0 || term.first <= (kMax - extent) / term.second, function,
            name + " strides overflow the index type");
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
                               const std::string& name) {
  std::vector<std::pair<Index, Index>> axes;  // (stride, size)
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
    require(axis.first > spanned, function, name + " strides make elements overlap");
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
/// output. Shapes within a batch element are checked by the unbatched kernel.
template <class Scalar, std::size_t Inputs, std::size_t Outputs>
void validate_batch(const char* function, const BatchedHeadsView<const Scalar> (&inputs)[Inputs],
                    const char* const (&input_names)[Inputs],
                    const BatchedHeadsView<Scalar> (&outputs)[Outputs],
                    const char* const (&output_names)[Outputs]) {
  Index input_extents[Inputs];
  for (std::size_t i = 0; i < Inputs; ++i) {
    input_extents[i] = batched_extent(inputs[i], function, input_names[i]);
    require(inputs[i].batch == inputs[0].batch, function,
            std::string(input_names[i]) + ".batch (" + std::to_string(inputs[i].batch) +
                ") must equal " + input_names[0] + ".batch (" + std::to_string(inputs[0].batch) +
                ")");
  }
  Index output_extents[Outputs];
  for (std::size_t o = 0; o < Outputs; ++o) {
    output_extents[o] = batched_extent(outputs[o], function, output_names[o]);
    require(outputs[o].batch == inputs[0].batch, function,
            std::string(output_names[o]) + ".batch (" + std::to_string(outputs[o].batch) +
                ") must equal " + input_names[0] + ".batch (" + std::to_string(inputs[0].batch) +
                ")");
    require_batched_injective(outputs[o], function, output_names[o]);
    for (std::size_t i = 0; i < Inputs; ++i) {
      require(!batched_overlap(outputs[o], output_extents[o], inputs[i], input_extents[i]),
              function, std::string(output_names[o]) + " overlaps " + input_names[i]);
    }
    for (std::size_t other = 0; other < o; ++other) {
      require(
          !batched_overlap(outputs[o], output_extents[o], outputs[other], output_extents[other]),
          function, std::string(output_names[o]) + " overlaps " + output_names[other]);
    }
  }
}

/// validate_batch for a forward kernel (q, k, v -> out), then `run(b)` for every element.
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
  for (Index b = 0; b < q.batch; ++b) run(b);
}

/// validate_batch for a backward kernel (q, k, v, out, dout -> dq, dk, dv), then `run(b)` for
/// every element.
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
  for (Index b = 0; b < q.batch; ++b) run(b);
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
  detail::run_forward_batch<Scalar>("exact_alibi_attention", q, k, v, out, [&](Index b) {
    exact_alibi_attention<Scalar>(q[b], k[b], v[b], out[b], slopes, options);
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
  detail::run_forward_batch<Scalar>("windowed_alibi_attention", q, k, v, out, [&](Index b) {
    windowed_alibi_attention<Scalar>(q[b], k[b], v[b], out[b], slopes, tolerance, options);
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
  detail::run_forward_batch<Scalar>("plsh_attention", q, k, v, out, [&](Index b) {
    plsh_attention<Scalar>(q[b], k[b], v[b], out[b], slopes, options);
  });
}

/// fixed_block_attention on every batch element (shapes as the batched exact_alibi_attention).
template <class Scalar>
void fixed_block_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                           const BatchedHeadsView<Scalar>& out, Index block_size,
                           const AttentionOptions& options = {}) {
  detail::run_forward_batch<Scalar>("fixed_block_attention", q, k, v, out, [&](Index b) {
    fixed_block_attention<Scalar>(q[b], k[b], v[b], out[b], block_size, options);
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
  detail::run_backward_batch<Scalar>(
      "exact_alibi_attention_backward", q, k, v, out, dout, dq, dk, dv, [&](Index b) {
        exact_alibi_attention_backward<Scalar>(q[b], k[b], v[b], out[b], dout[b], dq[b], dk[b],
                                               dv[b], slopes, options);
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
  detail::run_backward_batch<Scalar>(
      "plsh_attention_backward", q, k, v, out, dout, dq, dk, dv, [&](Index b) {
        plsh_attention_backward<Scalar>(q[b], k[b], v[b], out[b], dout[b], dq[b], dk[b], dv[b],
                                        slopes, options);
      });
}

}  // namespace plsh

#endif  // PLSH_BATCH_HPP
