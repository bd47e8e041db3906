#ifndef PLSH_DECODE_CACHE_SHAPE_HPP
#define PLSH_DECODE_CACHE_SHAPE_HPP

/// \file cache_shape.hpp
/// CacheShape: the sizes that a KvCache or an AlibiKvCache holds, and the checks that both
/// caches make of their constructor's sizes and of the views given to append and attend.
///
/// Tested through the caches in tests/test_kv_cache*.cpp and tests/test_alibi_kv_cache.cpp (every
/// refusal by its message).

#include <vector>

#include "../detail/check.hpp"
#include "../detail/validate.hpp"
#include "../limits.hpp"
#include "../tensor.hpp"

namespace plsh {
namespace detail {

/// Query heads, key/value heads, key size and value size of a cache.
struct CacheShape {
  Index heads;
  Index kv_heads;
  Index dim;
  Index value_dim;

  /// The sizes after the checks that both caches' constructors make: positive sizes, `heads` a
  /// multiple of `kv_heads`, one valid slope per head, causal options and a first position in
  /// [0, kMaxPosition].
  static CacheShape checked(const char* function, Index heads, Index kv_heads, Index dim,
                            Index value_dim, const std::vector<double>& slopes, bool causal,
                            Index key_position) {
    require(heads >= 1, function, "heads must be at least 1");
    require(kv_heads >= 1, function, "kv_heads must be at least 1");
    require(heads % kv_heads == 0, function, "heads must be a multiple of kv_heads");
    require(dim >= 1, function, "dim must be at least 1");
    require(value_dim >= 1, function, "value_dim must be at least 1");
    validate_slopes(function, slopes, heads, "heads");
    require(causal, function, "options.causal must be true (a cache serves causal decoding)");
    require(key_position >= 0 && key_position <= kMaxPosition, function,
            "options.key_position must lie in [0, kMaxPosition = 2^53]");
    return CacheShape{heads, kv_heads, dim, value_dim};
  }

  /// append's checks of k and v, for a cache whose next position is `position`.
  template <class Scalar>
  void check_append(const char* function, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, Index position) const {
    require_view(k, function, "k");
    require_view(v, function, "v");
    require(k.heads == kv_heads, function, "k.heads must equal the cache's kv_heads");
    require(k.dim == dim, function, "k.dim must equal the cache's dim");
    require(v.heads == kv_heads, function, "v.heads must equal the cache's kv_heads");
    require(v.dim == value_dim, function, "v.dim must equal the cache's value_dim");
    require(v.tokens == k.tokens, function, "v.tokens must equal k.tokens");
    require(k.tokens <= kMaxPosition - position, function,
            "position() + k.tokens must not exceed kMaxPosition = 2^53");
  }

  /// The shapes of q and out against the cache.
  template <class Scalar>
  void check_query(const char* function, const HeadsView<const Scalar>& q,
                   const HeadsView<Scalar>& out) const {
    require_view(q, function, "q");
    require_view(out, function, "out");
    require(q.heads == heads, function, "q.heads must equal the cache's heads");
    require(q.dim == dim, function, "q.dim must equal the cache's dim");
    require(out.tokens == q.tokens, function, "out.tokens must equal q.tokens");
    require(out.heads == heads, function, "out.heads must equal the cache's heads");
    require(out.dim == value_dim, function, "out.dim must equal the cache's value_dim");
  }
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_CACHE_SHAPE_HPP
