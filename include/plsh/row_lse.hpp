#ifndef PLSH_ROW_LSE_HPP
#define PLSH_ROW_LSE_HPP

/// \file row_lse.hpp
/// RowLse, a view of each query row's log-sum-exp, FlashAttention's `softmax_lse`: the forwards
/// write it and the backwards (backward.hpp) take it, so that the backward does not compute it
/// again.
///
/// Every forward and backward takes it as an optional trailing argument (default: an empty view,
/// nothing written or given). A trailing default argument keeps every existing call as it is,
/// with one definition of each kernel; a pointer member of the options would put an output among
/// the values that define the function, and overloads would double the entry points.

#include <string>
#include <type_traits>

#include "detail/check.hpp"
#include "tensor.hpp"

namespace plsh {

/// A non-owning view of the row log-sum-exp of an attention call, `[batch][heads][queries]`,
/// contiguous (FlashAttention's `softmax_lse`): row i of head h of batch element b is
/// `data[(b * heads + h) * queries + i]`, \f$\mathrm{lse}_i = \log\sum_j e^{l_{ij}}\f$ over the
/// logits \f$l_{ij}\f$ of the kernel (backward.hpp's file comment), \f$-\infty\f$ for a row that
/// sees no key. In the compute type of the kernel's storage (`detail::Compute<S>`: float for
/// float, bfloat16 and half, double for double). An unbatched call is a batch of one.
///
/// \code
/// std::vector<float> lse(heads * n);
/// plsh::exact_alibi_attention<float>(q, k, v, out, slopes, options, {lse.data(), heads, n});
/// plsh::exact_alibi_attention_backward<float>(q, k, v, out, dout, dq, dk, dv, slopes, options,
///                                             {lse.data(), heads, n});
/// \endcode
/// A default-constructed view is empty: a forward then writes nothing and a backward computes
/// the log-sum-exp itself. A `RowLse<T>` converts to a `RowLse<const T>`.
template <class Scalar>
struct RowLse {
  Scalar* data = nullptr;
  Index batch = 0;
  Index heads = 0;
  Index queries = 0;

  RowLse() = default;
  /// `batch` elements of `heads` rows of `queries` entries each.
  RowLse(Scalar* data, Index batch, Index heads, Index queries)
      : data(data), batch(batch), heads(heads), queries(queries) {}
  /// One element (an unbatched call).
  RowLse(Scalar* data, Index heads, Index queries) : RowLse(data, 1, heads, queries) {}

  bool empty() const { return data == nullptr; }

  /// The `queries` entries of head h of batch element b.
  Scalar* row(Index b, Index h) const { return data + (b * heads + h) * queries; }

  template <class T = Scalar,
            class = std::enable_if_t<std::is_same<T, Scalar>::value && !std::is_const<T>::value>>
  operator RowLse<const T>() const {  // NOLINT(google-explicit-constructor)
    return RowLse<const T>(data, batch, heads, queries);
  }
};

namespace detail {

/// Checks that a non-empty `lse` (the argument `name` of `function`) is `[batch][heads][queries]`.
template <class Scalar>
void require_row_lse(const char* function, const char* name, const RowLse<Scalar>& lse, Index batch,
                     Index heads, Index queries) {
  if (lse.empty()) return;
  require(lse.batch == batch && lse.heads == heads && lse.queries == queries, function, [&] {
    return std::string(name) + " must be [" + std::to_string(batch) + "][" + std::to_string(heads) +
           "][" + std::to_string(queries) + "], not [" + std::to_string(lse.batch) + "][" +
           std::to_string(lse.heads) + "][" + std::to_string(lse.queries) + "]";
  });
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ROW_LSE_HPP
