#ifndef PLSH_BATCHED_HEADS_VIEW_HPP
#define PLSH_BATCHED_HEADS_VIEW_HPP

/// \file batched_heads_view.hpp
/// BatchedHeadsView, a strided view of a `[batch][tokens][heads][dim]` tensor: the argument of the
/// batched kernels (batch.hpp) and the internal form of every kernel's inputs and outputs (an
/// unbatched call is a batch of one).

#include <algorithm>
#include <type_traits>

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

/// `view` as a batch of one element.
template <class Scalar>
BatchedHeadsView<Scalar> batch_of_one(const HeadsView<Scalar>& view) {
  return BatchedHeadsView<Scalar>(1, view, 0);
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_BATCHED_HEADS_VIEW_HPP
