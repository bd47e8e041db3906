// Shared fixture of the attention tests: owning [tokens][heads][dim] buffers filled from
// plsh::detail::CounterRandom (fill.hpp), problems of a given shape and layout, and error measures.

#ifndef PLSH_TESTS_ATTENTION_FIXTURE_HPP
#define PLSH_TESTS_ATTENTION_FIXTURE_HPP

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <ostream>
#include <sstream>
#include <string>
#include <vector>

#include <plsh/detail/random.hpp>
#include <plsh/options.hpp>
#include <plsh/tensor.hpp>

#include "brute_force.hpp"
#include "fill.hpp"

namespace plsh_test {

using plsh::Index;

/// How a buffer lays out its [tokens][heads][dim] elements.
enum class Layout {
  Packed,      ///< the HeadsView defaults: token_stride = heads * dim, head_stride = dim
  HeadMajor,   ///< [heads][tokens][dim]: head_stride = tokens * dim, token_stride = dim
  PaddedRows,  ///< token-major with gaps: head_stride = dim + 3, token_stride = heads * (dim + 3) +
               ///< 5
};

inline std::ostream& operator<<(std::ostream& stream, Layout layout) {
  switch (layout) {
    case Layout::Packed:
      return stream << "packed";
    case Layout::HeadMajor:
      return stream << "head-major";
    case Layout::PaddedRows:
      return stream << "padded rows";
  }
  return stream;
}

/// An owning buffer and the view of its [tokens][heads][dim] elements. Elements outside the view
/// (padding) hold `kPadding`, so that a kernel reading or writing padding shows up in the values.
template <class Scalar>
struct Buffer {
  static constexpr Scalar kPadding = Scalar(-12345);

  std::vector<Scalar> storage;
  plsh::HeadsView<Scalar> view{nullptr, 0, 1, 1};

  Buffer() = default;
  Buffer(Index tokens, Index heads, Index dim, Layout layout = Layout::Packed) {
    Index token_stride = heads * dim;
    Index head_stride = dim;
    Index size = tokens * heads * dim;
    if (layout == Layout::HeadMajor) {
      token_stride = dim;
      head_stride = tokens * dim;
    } else if (layout == Layout::PaddedRows) {
      head_stride = dim + 3;
      token_stride = heads * head_stride + 5;
      size = tokens * token_stride;
    }
    // At least one element, so that `data` is never null even for zero tokens.
    storage.assign(static_cast<std::size_t>(std::max<Index>(size, 1)), kPadding);
    view = plsh::HeadsView<Scalar>{storage.data(), tokens, heads, dim, token_stride, head_stride};
  }

  Buffer(const Buffer& other) : storage(other.storage), view(other.view) {
    view.data = storage.data();
  }
  Buffer& operator=(const Buffer& other) {
    storage = other.storage;
    view = other.view;
    view.data = storage.data();
    return *this;
  }

  Scalar& at(Index t, Index h, Index e) {
    return view.data[t * view.token_stride + h * view.head_stride + e];
  }
  Scalar at(Index t, Index h, Index e) const {
    return view.data[t * view.token_stride + h * view.head_stride + e];
  }

  plsh::HeadsView<const Scalar> in() const { return view; }

  /// Every element of the view set to `value`, the padding left alone.
  void fill(Scalar value) {
    for (Index t = 0; t < view.tokens; ++t)
      for (Index h = 0; h < view.heads; ++h)
        for (Index e = 0; e < view.dim; ++e) at(t, h, e) = value;
  }

  /// Element (t, h, e) = uniform_value(CounterRandom(seed), flat index, amplitude) (fill.hpp):
  /// the same values whatever the layout.
  void fill_random(std::uint64_t seed, double amplitude = 1.0) {
    const plsh::detail::CounterRandom random(seed);
    for (Index t = 0; t < view.tokens; ++t)
      for (Index h = 0; h < view.heads; ++h)
        for (Index e = 0; e < view.dim; ++e) {
          const auto flat = static_cast<std::uint64_t>((t * view.heads + h) * view.dim + e);
          at(t, h, e) = static_cast<Scalar>(uniform_value(random, flat, amplitude));
        }
  }

  /// Number of storage elements outside the view that no longer hold kPadding.
  Index touched_padding() const {
    return ::touched_padding(view, storage.size(),
                             [&](std::size_t i) { return !(storage[i] == kPadding); });
  }
};

/// Sizes of an attention problem: q [n_q][H][d], k [n_k][H_kv][d], v [n_k][H_kv][d_v].
struct Shape {
  Index n_q;
  Index n_k;
  Index heads;
  Index kv_heads;
  Index dim;
  Index value_dim;
};

inline std::ostream& operator<<(std::ostream& stream, const Shape& shape) {
  return stream << "n_q=" << shape.n_q << " n_k=" << shape.n_k << " H=" << shape.heads
                << " H_kv=" << shape.kv_heads << " d=" << shape.dim << " d_v=" << shape.value_dim;
}

/// "causal query_position=… key_position=… scale=…", for INFO lines.
inline std::string describe(const plsh::AttentionOptions& options) {
  std::ostringstream stream;
  stream << (options.causal ? "causal" : "bidirectional")
         << " query_position=" << options.query_position << " key_position=" << options.key_position
         << " scale=" << options.scale;
  return stream.str();
}

/// Inputs and an output buffer of one problem. Queries carry `query_amplitude` so that the logits
/// scale * q.k spread over a few units and the softmax is far from uniform; keys carry
/// `key_amplitude`, values 1.
template <class Scalar>
struct Problem {
  Shape shape;
  Buffer<Scalar> q, k, v, out;

  Problem(const Shape& problem_shape, std::uint64_t seed, Layout layout = Layout::Packed,
          double query_amplitude = 3.0, double key_amplitude = 1.0)
      : shape(problem_shape),
        q(shape.n_q, shape.heads, shape.dim, layout),
        k(shape.n_k, shape.kv_heads, shape.dim, layout),
        v(shape.n_k, shape.kv_heads, shape.value_dim, layout),
        out(shape.n_q, shape.heads, shape.value_dim, layout) {
    q.fill_random(plsh::detail::mix64(seed * 4 + 0), query_amplitude);
    k.fill_random(plsh::detail::mix64(seed * 4 + 1), key_amplitude);
    v.fill_random(plsh::detail::mix64(seed * 4 + 2));
  }

  /// A fresh, packed output buffer of this problem's output shape.
  Buffer<Scalar> output() const { return Buffer<Scalar>(shape.n_q, shape.heads, shape.value_dim); }
};

/// Whether every element of row (t, h) of a buffer is finite.
template <class Scalar>
bool row_finite(const Buffer<Scalar>& buffer, Index t, Index h) {
  for (Index e = 0; e < buffer.view.dim; ++e)
    if (!std::isfinite(buffer.at(t, h, e))) return false;
  return true;
}

/// \f$\max_{t,h,e} |a - b|\f$; infinity when the shapes differ or a value is NaN.
template <class A, class B>
double max_abs_difference(const plsh::HeadsView<A>& a, const plsh::HeadsView<B>& b) {
  if (a.tokens != b.tokens || a.heads != b.heads || a.dim != b.dim) {
    return std::numeric_limits<double>::infinity();
  }
  double largest = 0;
  for (Index t = 0; t < a.tokens; ++t)
    for (Index h = 0; h < a.heads; ++h)
      for (Index e = 0; e < a.dim; ++e) {
        const double x = static_cast<double>(a.data[t * a.token_stride + h * a.head_stride + e]);
        const double y = static_cast<double>(b.data[t * b.token_stride + h * b.head_stride + e]);
        const double difference = std::abs(x - y);
        if (!(difference <= largest))
          largest = std::isnan(difference) ? std::numeric_limits<double>::infinity() : difference;
      }
  return largest;
}

/// \f$\|a - b\|_F / \|b\|_F\f$ over all tokens and heads.
template <class A, class B>
double relative_frobenius_error(const plsh::HeadsView<A>& approximate,
                                const plsh::HeadsView<B>& exact) {
  double error = 0;
  double norm = 0;
  for (Index t = 0; t < exact.tokens; ++t)
    for (Index h = 0; h < exact.heads; ++h)
      for (Index e = 0; e < exact.dim; ++e) {
        const double x = static_cast<double>(
            approximate.data[t * approximate.token_stride + h * approximate.head_stride + e]);
        const double y =
            static_cast<double>(exact.data[t * exact.token_stride + h * exact.head_stride + e]);
        error += (x - y) * (x - y);
        norm += y * y;
      }
  return std::sqrt(error) / std::sqrt(norm);
}

/// `x` with 17 significant digits in scientific notation: INFO lines that must tell 1e-308 from 0.
inline std::string scientific(double x) {
  std::ostringstream stream;
  stream.precision(17);
  stream << std::scientific << x;
  return stream.str();
}

/// True when every element of the view is finite.
template <class Scalar>
bool all_finite(const plsh::HeadsView<Scalar>& view) {
  for (Index t = 0; t < view.tokens; ++t)
    for (Index h = 0; h < view.heads; ++h)
      for (Index e = 0; e < view.dim; ++e)
        if (!std::isfinite(view.data[t * view.token_stride + h * view.head_stride + e])) {
          return false;
        }
  return true;
}

/// The tolerance of a fast kernel against its dense double reference: 3e-5 in float (the issue's
/// bound; float rounding of the logits, of exp and of the sums is ~1e-6 relative per operation,
/// and outputs are O(1)), 1e-11 in double.
template <class Scalar>
constexpr double reference_tolerance() {
  return sizeof(Scalar) == sizeof(float) ? 3e-5 : 1e-11;
}

/// The sizes where tiles and blocks have edges: 1 token, even and odd, one below, at and above the
/// 64-row query tile, two tiles and a bit, four tiles and one.
inline const std::vector<Index>& edge_lengths() {
  static const std::vector<Index> lengths{1, 2, 63, 64, 65, 130, 257};
  return lengths;
}

/// "float" or "double", for INFO lines.
template <class Scalar>
const char* type_name() {
  return sizeof(Scalar) == sizeof(float) ? "float" : "double";
}

/// Queries and keys at different absolute positions.
struct OffsetCase {
  Index n_q, n_k, query_position, key_position;
};

/// Offsets shared by the ALiBi and Positional LSH kernel tests.
inline const std::vector<OffsetCase>& offset_cases() {
  static const std::vector<OffsetCase> cases{
      {65, 257, 192, 0},  // chunked prefill: the queries are the last 65 key positions
      {64, 130, 76, 10},  // the same with keys starting at 10
      {63, 130, 100, 3},  // queries start after the keys do, some beyond the last key
      {64, 65, 0, 50},    // the first 50 queries precede every key (empty rows when causal)
      {1, 257, 256, 0},   // decoding the next token
      {130, 2, 64, 100},  // two keys in the middle of the queries
  };
  return cases;
}

/// Calls `check(c, options)` for every case, causal and bidirectional, with the case's positions.
template <class Check>
void for_each_offset_case(const std::vector<OffsetCase>& cases, Check&& check) {
  for (const OffsetCase& c : cases) {
    for (const bool causal : {true, false}) {
      plsh::AttentionOptions options;
      options.causal = causal;
      options.query_position = c.query_position;
      options.key_position = c.key_position;
      check(c, options);
    }
  }
}

}  // namespace plsh_test

#endif  // PLSH_TESTS_ATTENTION_FIXTURE_HPP
