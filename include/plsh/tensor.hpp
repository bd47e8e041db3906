#ifndef PLSH_TENSOR_HPP
#define PLSH_TENSOR_HPP

/// \file tensor.hpp
/// HeadsView: a strided, non-owning view of a `[tokens][heads][dim]` tensor.

#include <Eigen/Core>
#include <limits>
#include <type_traits>

namespace plsh {

using Index = Eigen::Index;

/// Row-major matrix, the layout of one head of a HeadsView.
template <class Scalar>
using RowMatrix = Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;

/// One head of a HeadsView as an Eigen matrix: `tokens x dim`, row stride `token_stride`.
template <class Scalar>
using HeadMap = Eigen::Map<RowMatrix<Scalar>, Eigen::Unaligned, Eigen::OuterStride<>>;

/// Read-only HeadMap.
template <class Scalar>
using ConstHeadMap = Eigen::Map<const RowMatrix<Scalar>, Eigen::Unaligned, Eigen::OuterStride<>>;

namespace detail {
template <class Scalar>
struct HeadMapOf {
  using type = HeadMap<Scalar>;
};
template <class Scalar>
struct HeadMapOf<const Scalar> {
  using type = ConstHeadMap<Scalar>;
};

/// `heads * dim`, the token stride of a packed view; the largest Index when the product overflows
/// (such a view is then rejected by the kernels' checks instead of wrapping around).
constexpr Index packed_token_stride(Index heads, Index dim) {
  return (heads > 0 && dim > 0 && heads > std::numeric_limits<Index>::max() / dim)
             ? std::numeric_limits<Index>::max()
             : heads * dim;
}
}  // namespace detail

/// A non-owning view of a token-major tensor, like FlashAttention's `[tokens][heads][dim]`:
/// element (t, h, e) is `data[t * token_stride + h * head_stride + e]`.
///
/// An aggregate, built with braces in member order; the strides default to a packed tensor:
/// \code
/// std::vector<float> q(n * heads * dim);
/// plsh::HeadsView<const float> view{q.data(), n, heads, dim};  // head_stride = dim,
///                                                              // token_stride = heads * dim
/// \endcode
/// Sizes and strides are checked by every function that takes a view: sizes positive (tokens may
/// be 0), strides non-negative, the offset of the last element representable, and for outputs
/// distinct (token, head) rows not sharing an element.
/// A `HeadsView<T>` converts to a `HeadsView<const T>`.
template <class Scalar>
struct HeadsView {
  Scalar* data;
  Index tokens;
  Index heads;
  Index dim;
  Index token_stride = detail::packed_token_stride(heads, dim);
  Index head_stride = dim;

  /// Head `h` as a `tokens x dim` row-major Eigen map.
  typename detail::HeadMapOf<Scalar>::type head(Index h) const {
    return typename detail::HeadMapOf<Scalar>::type(data + h * head_stride, tokens, dim,
                                                    Eigen::OuterStride<>(token_stride));
  }

  /// Tokens `[begin, begin + count)` of every head.
  HeadsView slice(Index begin, Index count) const {
    return HeadsView{data + begin * token_stride, count, heads, dim, token_stride, head_stride};
  }

  template <class T = Scalar,
            class = std::enable_if_t<std::is_same<T, Scalar>::value && !std::is_const<T>::value>>
  operator HeadsView<const T>() const {  // NOLINT(google-explicit-constructor): T* -> const T*
    return HeadsView<const T>{data, tokens, heads, dim, token_stride, head_stride};
  }
};

}  // namespace plsh

#endif  // PLSH_TENSOR_HPP
