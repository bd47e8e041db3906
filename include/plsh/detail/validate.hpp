#ifndef PLSH_DETAIL_VALIDATE_HPP
#define PLSH_DETAIL_VALIDATE_HPP

/// \file validate.hpp
/// The argument checks of every attention entry point, in one place. Each throws
/// std::invalid_argument naming the function the user called, and none builds a string or
/// allocates when it passes (tests/test_bounds.cpp counts). Includes nothing above
/// plsh/options.hpp: a number of draws is checked by check.hpp (require_samples), grids by
/// partition.hpp (require_grids).

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../limits.hpp"
#include "../options.hpp"
#include "../tensor.hpp"
#include "check.hpp"
#include "storage.hpp"

namespace plsh {
namespace detail {

/// One past the last element a view can touch, as an offset from `data`; false when that offset,
/// in elements or in bytes, overflows.
template <class Scalar>
bool checked_view_extent(const HeadsView<Scalar>& view, Index& extent) {
  extent = 0;
  if (view.tokens == 0 || view.heads == 0 || view.dim == 0) return true;
  Index tokens_span = 0;
  Index heads_span = 0;
  return checked_multiply(view.tokens - 1, view.token_stride, tokens_span) &&
         checked_multiply(view.heads - 1, view.head_stride, heads_span) &&
         checked_add(tokens_span, heads_span, extent) && checked_add(extent, view.dim, extent) &&
         extent <= std::numeric_limits<Index>::max() / static_cast<Index>(sizeof(Scalar));
}

/// One past the last element of a view accepted by require_view (which rules out overflow).
template <class Scalar>
Index view_extent(const HeadsView<Scalar>& view) {
  Index extent = 0;
  checked_view_extent(view, extent);
  return extent;
}

template <class Scalar>
void require_view(const HeadsView<Scalar>& view, const char* function, const char* name) {
  require(view.tokens >= 0, function, name, ".tokens must be non-negative");
  require(view.heads >= 1, function, name, ".heads must be at least 1");
  require(view.dim >= 1, function, name, ".dim must be at least 1");
  require(view.token_stride >= 0 && view.head_stride >= 0, function, name,
          " strides must be non-negative");
  Index extent = 0;
  require(checked_view_extent(view, extent), function, name,
          ": the offset of its last element overflows (sizes or strides too large)");
  require(view.data != nullptr || view.tokens == 0, function, name, ".data is null");
}

/// Whether distinct (token, head) rows of a view accepted by require_view share no element: rows
/// start at \f$t\,s_t + h\,s_h\f$ and hold `dim` elements, so every two starts must lie at least
/// `dim` apart. A view without tokens has no rows (a head-major view of 0 tokens has
/// head_stride 0). Exact: for each difference \f$\Delta x \ge 0\f$ along the axis with fewer rows,
/// the closest start along the other axis is at the rounded quotient (O(min(tokens, heads)),
/// after an O(1) test that accepts the usual layouts).
template <class Scalar>
bool rows_disjoint(const HeadsView<Scalar>& view) {
  if (view.tokens == 0 || (view.tokens == 1 && view.heads == 1)) return true;
  if (view.heads == 1) return view.token_stride >= view.dim;
  if (view.tokens <= 1) return view.head_stride >= view.dim;
  // Axis x has the fewer rows, axis y the other.
  const bool tokens_fewer = view.tokens <= view.heads;
  const Index count_x = tokens_fewer ? view.tokens : view.heads;
  const Index stride_x = tokens_fewer ? view.token_stride : view.head_stride;
  const Index count_y = tokens_fewer ? view.heads : view.tokens;
  const Index stride_y = tokens_fewer ? view.head_stride : view.token_stride;
  if (stride_x < view.dim || stride_y < view.dim) return false;  // rows along one axis overlap
  // Nested layout: the rows along the smaller stride fit between two steps of the larger one.
  // Spans are at most the view's extent, so nothing here overflows.
  if (stride_y >= (count_x - 1) * stride_x + view.dim ||
      stride_x >= (count_y - 1) * stride_y + view.dim) {
    return true;
  }
  for (Index dx = 1; dx < count_x; ++dx) {
    const Index offset = dx * stride_x;
    const Index quotient = offset / stride_y;
    for (const Index dy : {std::min(quotient, count_y - 1), std::min(quotient + 1, count_y - 1)}) {
      const Index distance = offset - dy * stride_y;
      if ((distance < 0 ? -distance : distance) < view.dim) return false;
    }
  }
  return true;
}

/// How the memory checks read the views of a call. `Extents`: the views describe memory that
/// exists, every element their strides reach. `Starts`: the views are the element of an empty
/// batch, checked for its shapes like a batch of one, but no element exists and no memory is
/// touched; two views then overlap only when they start at the same address (an output passed
/// as an input), and an output's strides are not checked.
enum class Memory { Extents, Starts };

/// How the memory of a batch is checked: `Starts` when it has no element.
template <class Scalar>
Memory memory_of(const BatchedHeadsView<Scalar>& view) {
  return view.batch > 0 ? Memory::Extents : Memory::Starts;
}

/// One past the last element a batched view can touch, as an offset from `data`; false when the
/// offset of some element does not fit in an Index. The view of element 0 must pass
/// require_view.
template <class Scalar>
bool checked_view_extent(const BatchedHeadsView<Scalar>& view, Index& extent) {
  extent = 0;
  if (view.batch == 0 || view.tokens == 0) return true;
  constexpr Index kMax = std::numeric_limits<Index>::max();
  const std::pair<Index, Index> terms[] = {{view.batch - 1, view.batch_stride},
                                           {view.tokens - 1, view.token_stride},
                                           {view.heads - 1, view.head_stride},
                                           {1, view.dim}};
  for (const auto& term : terms) {
    if (term.second != 0 && term.first > (kMax - extent) / term.second) return false;
    extent += term.first * term.second;
  }
  return true;
}

/// One past the last element of a batched view accepted by require_batched_view.
template <class Scalar>
Index view_extent(const BatchedHeadsView<Scalar>& view) {
  Index extent = 0;
  checked_view_extent(view, extent);
  return extent;
}

/// A batched view well formed: batch and its stride non-negative, the view of element 0 accepted
/// by require_view, and no element's offset overflowing an Index.
template <class Scalar>
void require_batched_view(const BatchedHeadsView<Scalar>& view, const char* function,
                          const char* name) {
  require(view.batch >= 0, function, name, ".batch must be non-negative");
  require(view.batch_stride >= 0, function, name, ".batch_stride must be non-negative");
  require_view(view[0], function, name);
  Index extent = 0;
  require(checked_view_extent(view, extent), function, name, " strides overflow the index type");
}

/// Whether no two distinct (batch, token, head, element) positions of a batched view share
/// memory. Sufficient condition (exact for the usual layouts, and for any permutation of the
/// axes): with the axes of more than one position sorted by stride, each stride exceeds the
/// extent spanned by the smaller ones. O(1).
template <class Scalar>
bool elements_disjoint(const BatchedHeadsView<Scalar>& view) {
  if (view.batch == 0 || view.tokens == 0) return true;  // no elements: nothing can overlap
  std::pair<Index, Index> axes[4];                       // (stride, size)
  int count = 0;
  const std::pair<Index, Index> all[] = {{view.batch_stride, view.batch},
                                         {view.token_stride, view.tokens},
                                         {view.head_stride, view.heads},
                                         {1, view.dim}};
  for (const auto& axis : all) {
    if (axis.second <= 1) continue;
    // Insertion by (stride, size): at most four axes.
    int at = count++;
    for (; at > 0 && axis < axes[at - 1]; --at) axes[at] = axes[at - 1];
    axes[at] = axis;
  }
  Index spanned = 0;  // largest offset reachable through the smaller axes
  for (int a = 0; a < count; ++a) {
    if (axes[a].first <= spanned) return false;
    spanned += (axes[a].second - 1) * axes[a].first;
  }
  return true;
}

/// Whether an output view writes each element once, and the message when it does not: distinct
/// (token, head) rows of a HeadsView (rows_disjoint), distinct elements of a batched view
/// (elements_disjoint).
template <class Scalar>
bool injective(const HeadsView<Scalar>& view) {
  return rows_disjoint(view);
}
template <class Scalar>
constexpr const char* injective_failure(const HeadsView<Scalar>&) {
  return " strides make rows overlap";
}
template <class Scalar>
bool injective(const BatchedHeadsView<Scalar>& view) {
  return elements_disjoint(view);
}
template <class Scalar>
constexpr const char* injective_failure(const BatchedHeadsView<Scalar>&) {
  return " strides make elements overlap";
}

/// An output view must write each element once (unless `memory` is Starts: no memory exists).
template <class View>
void require_injective(const View& view, const char* function, const char* name,
                       Memory memory = Memory::Extents) {
  require(memory == Memory::Starts || injective(view), function, name, injective_failure(view));
}

/// Whether `View` is a BatchedHeadsView.
template <class View>
struct is_batched : std::false_type {};
template <class Scalar>
struct is_batched<BatchedHeadsView<Scalar>> : std::true_type {};

/// Whether two views (HeadsView or BatchedHeadsView) accepted by their checks share memory, as
/// byte ranges `[data, data + extent)`; with Memory::Starts, whether they start at one address.
template <class A, class B>
bool views_overlap(const A& a, const B& b, Memory memory = Memory::Extents) {
  using ElementA = std::remove_pointer_t<decltype(a.data)>;
  using ElementB = std::remove_pointer_t<decltype(b.data)>;
  const auto begin_a = reinterpret_cast<std::uintptr_t>(a.data);
  const auto begin_b = reinterpret_cast<std::uintptr_t>(b.data);
  if (memory == Memory::Starts) return begin_a == begin_b;
  const Index extent_a = view_extent(a);
  const Index extent_b = view_extent(b);
  // A batched view without elements touches nothing; an empty HeadsView still has a start, which
  // must not lie inside the other view.
  if (is_batched<A>::value && (extent_a == 0 || extent_b == 0)) return false;
  const auto end_a = begin_a + static_cast<std::uintptr_t>(extent_a) * sizeof(ElementA);
  const auto end_b = begin_b + static_cast<std::uintptr_t>(extent_b) * sizeof(ElementB);
  return begin_a < end_b && begin_b < end_a;
}

/// The memory check of every entry point, the one implementation: each output writes each of its
/// elements once (require_injective) and overlaps neither an input nor an earlier output
/// ("out overlaps q", "dk overlaps dq"). Views are HeadsView or BatchedHeadsView, already
/// accepted by require_view or require_batched_view; `memory` as Memory says. Builds no string
/// when it passes. O(inputs * outputs + outputs^2) plus the injectivity tests.
template <class Input, class Output, std::size_t Inputs, std::size_t Outputs>
void require_separate(const char* function, const Input (&inputs)[Inputs],
                      const char* const (&input_names)[Inputs], const Output (&outputs)[Outputs],
                      const char* const (&output_names)[Outputs], Memory memory = Memory::Extents) {
  for (std::size_t o = 0; o < Outputs; ++o) {
    require_injective(outputs[o], function, output_names[o], memory);
    for (std::size_t i = 0; i < Inputs; ++i) {
      require(!views_overlap(outputs[o], inputs[i], memory), function,
              [&] { return std::string(output_names[o]) + " overlaps " + input_names[i]; });
    }
    for (std::size_t other = 0; other < o; ++other) {
      require(!views_overlap(outputs[o], outputs[other], memory), function,
              [&] { return std::string(output_names[o]) + " overlaps " + output_names[other]; });
    }
  }
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

/// The logit scale actually used: `options.scale`, or \f$1/\sqrt{d}\f$ when it is 0.
inline double resolved_scale(const AttentionOptions& options, Index dim) {
  return options.scale != 0 ? options.scale : 1.0 / std::sqrt(static_cast<double>(dim));
}

/// The resolved scale must be finite and non-zero in the type the kernels compute in for views of
/// `Scalar` (a double of 1e300 is infinite as a float, 1e-300 is zero; bfloat16 and half views
/// compute in float).
template <class Scalar>
void validate_scale(const char* function, const AttentionOptions& options, Index dim) {
  using Arithmetic = Compute<Scalar>;
  require(std::isfinite(options.scale), function, "options.scale must be finite");
  const double scale = std::abs(resolved_scale(options, dim));
  require(scale <= static_cast<double>(Eigen::NumTraits<Arithmetic>::highest()) &&
              scale >= static_cast<double>(std::numeric_limits<Arithmetic>::denorm_min()),
          function,
          "options.scale must be finite and non-zero in the compute type (float for float, "
          "bfloat16 and half views)");
}

/// `position + tokens` within [0, kMaxPosition] for both the query and the key rows.
inline void validate_positions(const char* function, const AttentionOptions& options,
                               Index query_tokens, Index key_tokens) {
  require(options.query_position >= 0 && options.query_position <= kMaxPosition - query_tokens,
          function, "options.query_position + q.tokens must lie in [0, kMaxPosition = 2^53]");
  require(options.key_position >= 0 && options.key_position <= kMaxPosition - key_tokens, function,
          "options.key_position + k.tokens must lie in [0, kMaxPosition = 2^53]");
}

/// Options of an attention over `query_tokens` queries and `key_tokens` keys of size `dim`.
template <class Scalar>
void validate_options(const char* function, const AttentionOptions& options, Index query_tokens,
                      Index key_tokens, Index dim) {
  validate_positions(function, options, query_tokens, key_tokens);
  validate_scale<Scalar>(function, options, dim);
}

/// Rejects, at compile time, a view type the kernels cannot read.
template <class Scalar>
constexpr void require_storage_type() {
  static_assert(is_storage_type<Scalar>,
                "plsh: the views must hold float, double, Eigen::bfloat16 or Eigen::half");
}

/// The checks shared by every attention entry point: a storage type (at compile time),
/// validate_inputs, validate_output_shape, out not overlapping itself or an input (as `memory`
/// says), validate_options.
template <class Scalar>
void validate_attention(const char* function, const HeadsView<const Scalar>& q,
                        const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                        const HeadsView<Scalar>& out, const AttentionOptions& options,
                        Memory memory = Memory::Extents) {
  require_storage_type<Scalar>();
  validate_inputs(function, q, k, v);
  validate_output_shape(function, out, q, v);
  const HeadsView<const Scalar> inputs[] = {q, k, v};
  const char* const input_names[] = {"q", "k", "v"};
  const HeadsView<Scalar> outputs[] = {out};
  const char* const output_names[] = {"out"};
  require_separate(function, inputs, input_names, outputs, output_names, memory);
  validate_options<Scalar>(function, options, q.tokens, k.tokens, q.dim);
}

/// One slope per head (`heads_name` says where the count comes from), each finite and
/// non-negative.
inline void validate_slopes(const char* function, const std::vector<double>& slopes, Index heads,
                            const char* heads_name = "q.heads") {
  require(static_cast<Index>(slopes.size()) == heads, function, [&] {
    return "slopes.size() (" + std::to_string(slopes.size()) + ") must equal " + heads_name + " (" +
           std::to_string(heads) + ")";
  });
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    require_slope(slopes[h], function, "slopes", static_cast<std::int64_t>(h));
  }
}

/// Checks of plsh_attention: validate_attention, validate_slopes, samples in [1, kMaxSamples].
template <class Scalar>
void validate_plsh(const char* function, const HeadsView<const Scalar>& q,
                   const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                   const HeadsView<Scalar>& out, const std::vector<double>& slopes,
                   const PlshOptions& options, Memory memory = Memory::Extents) {
  validate_attention(function, q, k, v, out, options, memory);
  validate_slopes(function, slopes, q.heads);
  require_samples(options.samples, function, "options.samples");
}

/// `view` has the shape of `like`: dout like out, dq like q, dk like k, dv like v.
template <class A, class B>
void require_same_shape(const char* function, const HeadsView<A>& view, const char* name,
                        const HeadsView<B>& like, const char* like_name) {
  if (view.tokens != like.tokens) {
    fail(function, std::string(name) + ".tokens must equal " + like_name + ".tokens");
  }
  if (view.heads != like.heads) {
    fail(function, std::string(name) + ".heads must equal " + like_name + ".heads");
  }
  if (view.dim != like.dim) {
    fail(function, std::string(name) + ".dim must equal " + like_name + ".dim");
  }
}

/// Checks of the backward entry points: a storage type (at compile time); q, k, v, out as the
/// forward; dout like out, dq like q, dk like k, dv like v; no gradient view overlapping itself,
/// an input or another gradient (as `memory` says).
template <class Scalar>
void validate_backward(const char* function, const HeadsView<const Scalar>& q,
                       const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                       const HeadsView<const Scalar>& out, const HeadsView<const Scalar>& dout,
                       const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                       const HeadsView<Scalar>& dv, const AttentionOptions& options,
                       Memory memory = Memory::Extents) {
  require_storage_type<Scalar>();
  validate_inputs(function, q, k, v);
  validate_output_shape(function, out, q, v);
  require_view(dout, function, "dout");
  require_view(dq, function, "dq");
  require_view(dk, function, "dk");
  require_view(dv, function, "dv");
  require_same_shape(function, dout, "dout", out, "out");
  require_same_shape(function, dq, "dq", q, "q");
  require_same_shape(function, dk, "dk", k, "k");
  require_same_shape(function, dv, "dv", v, "v");
  const HeadsView<const Scalar> inputs[] = {q, k, v, out, dout};
  const char* const input_names[] = {"q", "k", "v", "out", "dout"};
  const HeadsView<Scalar> gradients[] = {dq, dk, dv};
  const char* const gradient_names[] = {"dq", "dk", "dv"};
  require_separate(function, inputs, input_names, gradients, gradient_names, memory);
  validate_options<Scalar>(function, options, q.tokens, k.tokens, q.dim);
}

/// As above for plsh_attention_backward: also `options.samples` in [1, kMaxSamples].
template <class Scalar>
void validate_backward(const char* function, const HeadsView<const Scalar>& q,
                       const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                       const HeadsView<const Scalar>& out, const HeadsView<const Scalar>& dout,
                       const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                       const HeadsView<Scalar>& dv, const PlshOptions& options,
                       Memory memory = Memory::Extents) {
  validate_backward(function, q, k, v, out, dout, dq, dk, dv,
                    static_cast<const AttentionOptions&>(options), memory);
  require_samples(options.samples, function, "options.samples");
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_VALIDATE_HPP
