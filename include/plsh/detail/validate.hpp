#ifndef PLSH_DETAIL_VALIDATE_HPP
#define PLSH_DETAIL_VALIDATE_HPP

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "../attention/options.hpp"
#include "../tensor.hpp"
#include "check.hpp"

namespace plsh {
namespace detail {

/// One past the last element a view can touch, as an offset from `data`.
template <class Scalar>
Index view_extent(const HeadsView<Scalar>& view) {
  if (view.tokens == 0 || view.heads == 0 || view.dim == 0) return 0;
  return (view.tokens - 1) * view.token_stride + (view.heads - 1) * view.head_stride + view.dim;
}

template <class Scalar>
void require_view(const HeadsView<Scalar>& view, const char* function, const std::string& name) {
  require(view.tokens >= 0, function, name + ".tokens must be non-negative");
  require(view.heads >= 1, function, name + ".heads must be at least 1");
  require(view.dim >= 1, function, name + ".dim must be at least 1");
  require(view.token_stride >= 0 && view.head_stride >= 0, function,
          name + " strides must be non-negative");
  require(view.data != nullptr || view.tokens == 0, function, name + ".data is null");
}

/// Distinct (token, head) rows of an output view must not share elements: either layout order
/// (token-major or head-major) must leave room for a whole row.
template <class Scalar>
void require_injective(const HeadsView<Scalar>& view, const char* function,
                       const std::string& name) {
  const bool token_major =
      (view.heads == 1 || view.head_stride >= view.dim) &&
      (view.tokens <= 1 || view.token_stride >= view.heads * view.head_stride ||
       (view.heads == 1 && view.token_stride >= view.dim));
  const bool head_major = (view.tokens <= 1 || view.token_stride >= view.dim) &&
                          (view.heads == 1 || view.head_stride >= view.tokens * view.token_stride);
  require(token_major || head_major, function, name + " strides make rows overlap");
}

template <class A, class B>
bool views_overlap(const HeadsView<A>& a, const HeadsView<B>& b) {
  const auto begin_a = reinterpret_cast<std::uintptr_t>(a.data);
  const auto begin_b = reinterpret_cast<std::uintptr_t>(b.data);
  const auto end_a = begin_a + static_cast<std::uintptr_t>(view_extent(a)) * sizeof(A);
  const auto end_b = begin_b + static_cast<std::uintptr_t>(view_extent(b)) * sizeof(B);
  return begin_a < end_b && begin_b < end_a;
}

/// Shapes of the inputs: q [n_q][H][d], k [n_k][H_kv][d], v [n_k][H_kv][d_v], H a multiple of
/// H_kv.
template <class Scalar>
void validate_inputs(const char* function, const HeadsView<const Scalar>& q,
                     const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
  require_view(q, function, "q");
  require_view(k, function, "k");
  require_view(v, function, "v");
  require(k.dim == q.dim, function, "k.dim must equal q.dim");
  require(v.tokens == k.tokens, function, "v.tokens must equal k.tokens");
  require(v.heads == k.heads, function, "v.heads must equal k.heads");
  require(q.heads % k.heads == 0, function, "q.heads must be a multiple of k.heads");
}

/// The shape of an attention output: out [n_q][H][d_v].
template <class Out, class Scalar>
void validate_output_shape(const char* function, const HeadsView<Out>& out,
                           const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& v) {
  require_view(out, function, "out");
  require(out.tokens == q.tokens, function, "out.tokens must equal q.tokens");
  require(out.heads == q.heads, function, "out.heads must equal q.heads");
  require(out.dim == v.dim, function, "out.dim must equal v.dim");
}

inline void validate_options(const char* function, const AttentionOptions& options) {
  require(options.query_position >= 0, function, "options.query_position must be non-negative");
  require(options.key_position >= 0, function, "options.key_position must be non-negative");
  require(std::isfinite(options.scale), function, "options.scale must be finite");
}

/// The checks shared by every attention entry point: validate_inputs, validate_output_shape,
/// out not overlapping itself or an input, validate_options.
template <class Scalar>
void validate_attention(const char* function, const HeadsView<const Scalar>& q,
                        const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                        const HeadsView<Scalar>& out, const AttentionOptions& options) {
  validate_inputs(function, q, k, v);
  validate_output_shape(function, out, q, v);
  require_injective(out, function, "out");
  require(!views_overlap(out, q), function, "out overlaps q");
  require(!views_overlap(out, k), function, "out overlaps k");
  require(!views_overlap(out, v), function, "out overlaps v");
  validate_options(function, options);
}

inline void validate_slopes(const char* function, const std::vector<double>& slopes, Index heads) {
  require(static_cast<Index>(slopes.size()) == heads, function,
          "slopes.size() (" + std::to_string(slopes.size()) + ") must equal q.heads (" +
              std::to_string(heads) + ")");
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    require_slope(slopes[h], function, ("slopes[" + std::to_string(h) + "]").c_str());
  }
}

/// The logit scale actually used: `options.scale`, or \f$1/\sqrt{d}\f$ when it is 0.
inline double resolved_scale(const AttentionOptions& options, Index dim) {
  return options.scale != 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(dim));
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_VALIDATE_HPP
