#ifndef PLSH_KV_CACHE_HPP
#define PLSH_KV_CACHE_HPP

/// \file kv_cache.hpp
/// KvCache: incremental (causal) Positional LSH decoding with a key/value cache that forgets the
/// keys no later query can reach.
///
/// The partitions live on absolute positions, so a query at position p sees, in head h and draw
/// t, only keys of its block, which starts at \f$b_{h,t}(p) \le p\f$. The keys any query at
/// position \f$\ge p\f$ can reach start at \f$E(p) = \min_{h,t} b_{h,t}(p)\f$, which never
/// decreases with p: everything before \f$E\f$ of the first position of the newest chunk is
/// evicted. The cache therefore holds at most \f$\max_p (p - E(p) + 1) + c - 1\f$ tokens for
/// chunks of c tokens: about the largest block pitch of the draws, which for s draws of the
/// flattest head (slope \f$m_{\min}\f$) is near \f$(\ln s + \ln\ln s)/m_{\min}\f$, whatever the
/// sequence length.
///
/// Cost per appended token: amortised O(1) copies (the resident rows slide to the front of their
/// buffer when it is full) plus O(1) amortised block look-ups per (head, draw). `attend` is the
/// fused kernel of plsh_attention on the resident keys: per query about
/// \f$(d + d_v)\f$ times the width of the union of its blocks.
///
/// Tested in tests/test_kv_cache.cpp against plsh_attention over the whole sequence (every chunk
/// size, grouped heads), and for the resident bound computed from the partitions.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "attention/plsh_attention.hpp"
#include "attention/regular.hpp"
#include "detail/check.hpp"
#include "detail/validate.hpp"
#include "limits.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

namespace plsh {

/// Key/value cache for incremental causal Positional LSH attention.
///
/// Contract: `append` stores the keys and values of the next positions; `attend` computes the
/// outputs of queries at the newest positions, `position() - q.tokens .. position() - 1`, where
/// `q.tokens` may not exceed the number of tokens of the last `append`. The outputs equal those
/// rows of plsh_attention over the whole sequence with the same slopes and options (to rounding):
/// eviction at an append uses the first position of the appended chunk, and no query at or after
/// that position can reach an evicted key.
///
/// \code
/// plsh::PlshOptions options;  // causal, s = 20, seed 0
/// plsh::KvCache<float> cache(heads, kv_heads, dim, dim, plsh::alibi_slopes(heads), options);
/// for (Index step = 0; step < steps; ++step) {
///   // ... compute q, k, v of one token: [1][heads][dim], [1][kv_heads][dim] ...
///   cache.append(k_view, v_view);
///   cache.attend(q_view, out_view);   // out: [1][heads][dim]
/// }
/// \endcode
///
/// \tparam Scalar element type of keys, values, queries and outputs.
template <class Scalar>
class KvCache {
 public:
  /// \param heads query heads H, \param kv_heads key/value heads (H a multiple of it),
  /// \param dim key and query size d, \param value_dim value size d_v,
  /// \param slopes one per query head, \param options causal must be true; `key_position` is the
  /// absolute position of the first appended token, `query_position` is ignored (queries are at
  /// the newest positions); samples, seed and kernel as plsh_attention.
  /// \throws std::invalid_argument for non-positive sizes, H not a multiple of kv_heads, a bad
  /// slope, `samples` outside [1, kMaxSamples], `causal == false`, a key_position outside
  /// [0, kMaxPosition], or a scale that is not finite and non-zero in Scalar.
  KvCache(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
          PlshOptions options = {})
      : heads_(heads),
        kv_heads_(kv_heads),
        dim_(dim),
        value_dim_(value_dim),
        slopes_(std::move(slopes)),
        options_(options) {
    const char* function = "KvCache";
    detail::require(heads >= 1, function, "heads must be at least 1");
    detail::require(kv_heads >= 1, function, "kv_heads must be at least 1");
    detail::require(heads % kv_heads == 0, function, "heads must be a multiple of kv_heads");
    detail::require(dim >= 1, function, "dim must be at least 1");
    detail::require(value_dim >= 1, function, "value_dim must be at least 1");
    detail::validate_slopes(function, slopes_, heads, "heads");
    detail::require_samples(options.samples, function, "options.samples");
    detail::require(options.causal, function,
                    "options.causal must be true (a cache serves causal decoding)");
    detail::require(options.key_position >= 0 && options.key_position <= kMaxPosition, function,
                    "options.key_position must lie in [0, kMaxPosition = 2^53]");
    detail::validate_scale<Scalar>(function, options, dim);
    grids_ = detail::kernel_grids(slopes_, options, function);
    position_ = options.key_position;
    oldest_ = options.key_position;
    // No block is known yet: the first append looks up every (head, draw).
    blocks_.assign(static_cast<std::size_t>(heads * options.samples), Block{0, 0});
  }

  /// Appends the keys and values of positions `position() .. position() + k.tokens - 1`, after
  /// evicting the keys that no query at `position()` or later can reach.
  /// \param k `[n][kv_heads][dim]`, \param v `[n][kv_heads][value_dim]`; n = 0 does nothing.
  /// \throws std::invalid_argument when the shapes disagree with the cache, or when the positions
  /// would pass kMaxPosition.
  void append(HeadsView<const Scalar> k, HeadsView<const Scalar> v) {
    const char* function = "KvCache::append";
    detail::require_view(k, function, "k");
    detail::require_view(v, function, "v");
    detail::require(k.heads == kv_heads_, function, "k.heads must equal the cache's kv_heads");
    detail::require(k.dim == dim_, function, "k.dim must equal the cache's dim");
    detail::require(v.heads == kv_heads_, function, "v.heads must equal the cache's kv_heads");
    detail::require(v.dim == value_dim_, function, "v.dim must equal the cache's value_dim");
    detail::require(v.tokens == k.tokens, function, "v.tokens must equal k.tokens");
    detail::require(k.tokens <= kMaxPosition - position_, function,
                    "position() + k.tokens must not exceed kMaxPosition = 2^53");
    if (k.tokens == 0) return;
    evict(reachable_from(position_));
    reserve(k.tokens);
    const Index first_row = start_ + resident_;
    for (Index t = 0; t < k.tokens; ++t) {
      for (Index g = 0; g < kv_heads_; ++g) {
        std::copy_n(k.data + t * k.token_stride + g * k.head_stride, dim_,
                    keys_.data() + ((first_row + t) * kv_heads_ + g) * dim_);
        std::copy_n(v.data + t * v.token_stride + g * v.head_stride, value_dim_,
                    values_.data() + ((first_row + t) * kv_heads_ + g) * value_dim_);
      }
    }
    resident_ += k.tokens;
    position_ += k.tokens;
    last_append_ = k.tokens;
  }

  /// Outputs of the queries at positions `position() - q.tokens .. position() - 1`.
  /// \param q `[n][heads][dim]`, \param out `[n][heads][value_dim]`, n at most the number of
  /// tokens of the last append (n = 0 does nothing).
  /// \throws std::invalid_argument when the shapes disagree with the cache, when n is larger than
  /// the last append, or when `out` overlaps q or the cache.
  void attend(HeadsView<const Scalar> q, HeadsView<Scalar> out) const {
    const char* function = "KvCache::attend";
    detail::require_view(q, function, "q");
    detail::require_view(out, function, "out");
    detail::require(q.heads == heads_, function, "q.heads must equal the cache's heads");
    detail::require(q.dim == dim_, function, "q.dim must equal the cache's dim");
    detail::require(q.tokens <= last_append_, function, [&] {
      return "q.tokens (" + std::to_string(q.tokens) +
             ") must not exceed the tokens of the last append (" + std::to_string(last_append_) +
             ")";
    });
    detail::require(out.tokens == q.tokens, function, "out.tokens must equal q.tokens");
    detail::require(out.heads == heads_, function, "out.heads must equal the cache's heads");
    detail::require(out.dim == value_dim_, function, "out.dim must equal the cache's value_dim");
    if (q.tokens == 0) return;
    PlshOptions options = options_;
    options.query_position = position_ - q.tokens;
    options.key_position = oldest_;
    // The same checks as plsh_attention (out against q and the cache) on the resident views.
    detail::validate_attention(function, q, keys(), values(), out, options);
    if (options.kernel == Kernel::Passes) {
      detail::pass_attention(q, keys(), values(), out, grids_, options, RegularAttention{});
    } else {
      detail::fused_attention(q, keys(), values(), out, grids_, slopes_, options);
    }
  }

  /// The absolute position of the next token: `options.key_position` plus the tokens appended so
  /// far (with the default key_position 0, the number of tokens appended).
  Index position() const { return position_; }

  /// Tokens still stored.
  Index resident() const { return resident_; }

  /// Absolute position of the oldest stored token (`position() - resident()`).
  Index oldest_position() const { return oldest_; }

  /// The stored keys, `[resident()][kv_heads][dim]`, positions `oldest_position()` on. Valid until
  /// the next append.
  HeadsView<const Scalar> keys() const {
    return HeadsView<const Scalar>{keys_.data() + start_ * kv_heads_ * dim_, resident_, kv_heads_,
                                   dim_};
  }

  /// The stored values, `[resident()][kv_heads][value_dim]`. Valid until the next append.
  HeadsView<const Scalar> values() const {
    return HeadsView<const Scalar>{values_.data() + start_ * kv_heads_ * value_dim_, resident_,
                                   kv_heads_, value_dim_};
  }

  Index heads() const { return heads_; }
  Index kv_heads() const { return kv_heads_; }
  Index dim() const { return dim_; }
  Index value_dim() const { return value_dim_; }
  const std::vector<double>& slopes() const { return slopes_; }
  const PlshOptions& options() const { return options_; }

 private:
  /// \f$E(p) = \min_{h,t} b_{h,t}(p)\f$. Blocks are cached per (head, draw): p only grows, so
  /// each block is looked up once, when p enters it. The partitions are cut to
  /// `[key_position, kMaxPosition)`, which holds every position append accepts.
  Index reachable_from(Index position) {
    Index start = position;
    const Index samples = options_.samples;
    for (Index h = 0; h < heads_; ++h) {
      for (Index t = 0; t < samples; ++t) {
        Block& block = blocks_[static_cast<std::size_t>(h * samples + t)];
        if (!block.contains(position)) {
          block = grid_block(grids_[static_cast<std::size_t>(h)][static_cast<std::size_t>(t)],
                             position, options_.key_position, kMaxPosition);
        }
        start = std::min(start, block.begin);
      }
    }
    return start;
  }

  void evict(Index reachable) {
    const Index dropped = std::min(resident_, std::max<Index>(0, reachable - oldest_));
    start_ += dropped;
    resident_ -= dropped;
    oldest_ += dropped;
  }

  /// Room for `count` more rows after the resident ones. When the buffer end is reached, the
  /// resident rows move to the front; the buffer grows to twice what is needed when they would
  /// fill more than half of it. Each row moved is paid for by at least as many appended rows.
  void reserve(Index count) {
    const Index capacity = static_cast<Index>(keys_.size()) / (kv_heads_ * dim_);
    const Index needed = resident_ + count;
    if (start_ + needed <= capacity) return;
    const Index new_capacity = 2 * needed > capacity ? 2 * needed : capacity;
    const auto move = [&](std::vector<Scalar>& buffer, Index width) {
      const std::ptrdiff_t row = static_cast<std::ptrdiff_t>(kv_heads_ * width);
      const auto first = buffer.begin() + start_ * row;
      const auto last = buffer.begin() + (start_ + resident_) * row;
      if (new_capacity == capacity) {
        // Here start_ > capacity - needed >= needed > 0: the rows move towards the front, which
        // std::copy allows within one buffer.
        std::copy(first, last, buffer.begin());
      } else {
        std::vector<Scalar> grown(static_cast<std::size_t>(new_capacity * row));
        std::copy(first, last, grown.begin());
        buffer.swap(grown);
      }
    };
    move(keys_, dim_);
    move(values_, value_dim_);
    start_ = 0;
  }

  Index heads_;
  Index kv_heads_;
  Index dim_;
  Index value_dim_;
  std::vector<double> slopes_;
  PlshOptions options_;
  std::vector<std::vector<Grid>> grids_;
  std::vector<Block> blocks_;  // [head][draw]: the block of the last eviction position
  std::vector<Scalar> keys_;   // rows [start_, start_ + resident_) hold positions oldest_ on
  std::vector<Scalar> values_;
  Index start_ = 0;
  Index resident_ = 0;
  Index oldest_ = 0;
  Index position_ = 0;
  Index last_append_ = 0;
};

}  // namespace plsh

#endif  // PLSH_KV_CACHE_HPP
