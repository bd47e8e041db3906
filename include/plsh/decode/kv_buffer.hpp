#ifndef PLSH_DECODE_KV_BUFFER_HPP
#define PLSH_DECODE_KV_BUFFER_HPP

/// \file kv_buffer.hpp
/// KvBuffer: the keys and values that a KvCache stores, one region per key/value head, each
/// holding the rows of positions `oldest() .. oldest() + resident() - 1` contiguously.
///
/// Appending n rows copies n rows per head; evicting moves no row (the window's start advances).
/// When a region's end is reached the resident rows move to its front, and the buffer grows to
/// twice what is needed when they would fill more than half of it, so each row moved is paid for
/// by at least as many appended rows: amortised O(1) copies per appended row.
///
/// Tested through KvCache in tests/test_kv_cache*.cpp (eviction bounds, growth, views).

#include <algorithm>
#include <cstddef>

#include "../detail/storage.hpp"
#include "../tensor.hpp"

namespace plsh {
namespace detail {

/// Key and value rows of one cache: `[kv_head][capacity][dim]` and
/// `[kv_head][capacity][value_dim]`, rows `[start, start + resident)` of each head's region holding
/// positions `oldest()` on.
template <class Scalar>
class KvBuffer {
 public:
  KvBuffer(Index kv_heads, Index dim, Index value_dim, Index first_position)
      : kv_heads_(kv_heads), dim_(dim), value_dim_(value_dim), oldest_(first_position) {}

  /// Tokens stored.
  Index resident() const { return resident_; }
  /// Absolute position of the oldest stored token.
  Index oldest() const { return oldest_; }
  /// Absolute position after the newest stored token.
  Index end() const { return oldest_ + resident_; }
  /// Rows that each head's region holds, resident or not: no query reaches more keys.
  Index capacity() const { return capacity_; }

  /// The stored keys, `[resident][kv_heads][dim]` (each head's rows contiguous).
  HeadsView<const Scalar> keys() const {
    return HeadsView<const Scalar>{
        keys_.data() + start_ * dim_, resident_, kv_heads_, dim_, dim_, capacity_ * dim_};
  }

  /// The stored values, `[resident][kv_heads][value_dim]`.
  HeadsView<const Scalar> values() const {
    return HeadsView<const Scalar>{values_.data() + start_ * value_dim_,
                                   resident_,
                                   kv_heads_,
                                   value_dim_,
                                   value_dim_,
                                   capacity_ * value_dim_};
  }

  /// The key row of stored position `position` in head `kv_head`; the rows of later positions
  /// follow it, `dim` entries apart.
  const Scalar* key_row(Index kv_head, Index position) const {
    return keys_.data() + (kv_head * capacity_ + start_ + position - oldest_) * dim_;
  }

  /// The value row of stored position `position` in head `kv_head` (as key_row).
  const Scalar* value_row(Index kv_head, Index position) const {
    return values_.data() + (kv_head * capacity_ + start_ + position - oldest_) * value_dim_;
  }

  /// The whole key buffer as one view (for overlap checks: appended rows land in it, or in a new
  /// buffer that nothing given by the caller can overlap).
  HeadsView<const Scalar> key_buffer() const { return whole(keys_, dim_); }
  /// The whole value buffer as one view (as key_buffer).
  HeadsView<const Scalar> value_buffer() const { return whole(values_, value_dim_); }

  /// Bytes of the key and value buffers.
  std::size_t bytes() const { return (keys_.size() + values_.size()) * sizeof(Scalar); }

  /// Drops the stored tokens before absolute position `position`.
  void evict_before(Index position) {
    const Index dropped = std::min(resident_, std::max<Index>(0, position - oldest_));
    start_ += dropped;
    resident_ -= dropped;
    oldest_ += dropped;
  }

  /// Stores the rows of `k` and `v` (`[n][kv_heads][dim]`, `[n][kv_heads][value_dim]`, shapes
  /// checked by the caller) after the resident ones.
  void append(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
    reserve(k.tokens);
    const Index first_row = start_ + resident_;
    for (Index g = 0; g < kv_heads_; ++g) {
      for (Index t = 0; t < k.tokens; ++t) {
        std::copy_n(k.data + t * k.token_stride + g * k.head_stride, dim_,
                    keys_.data() + (g * capacity_ + first_row + t) * dim_);
        std::copy_n(v.data + t * v.token_stride + g * v.head_stride, value_dim_,
                    values_.data() + (g * capacity_ + first_row + t) * value_dim_);
      }
    }
    resident_ += k.tokens;
  }

 private:
  static HeadsView<const Scalar> whole(const AlignedVector<Scalar>& buffer, Index width) {
    return HeadsView<const Scalar>{buffer.data(), static_cast<Index>(buffer.size()) / width, 1,
                                   width};
  }

  /// Room for `count` more rows after the resident ones (file comment).
  void reserve(Index count) {
    const Index capacity = capacity_;
    const Index needed = resident_ + count;
    if (start_ + needed <= capacity) return;
    const Index new_capacity = 2 * needed > capacity ? 2 * needed : capacity;
    // Per key/value head g, rows [start_, start_ + resident_) of its region move to the front of
    // its region (of new_capacity rows).
    const auto move = [&](AlignedVector<Scalar>& buffer, Index width) {
      const auto rows = [&](AlignedVector<Scalar>& b, Index g, Index size, Index row) {
        return b.begin() + (g * size + row) * width;
      };
      if (new_capacity == capacity) {
        // Here start_ > capacity - needed >= needed > 0: the rows move towards the front, which
        // std::copy allows within one buffer.
        for (Index g = 0; g < kv_heads_; ++g) {
          std::copy(rows(buffer, g, capacity, start_),
                    rows(buffer, g, capacity, start_ + resident_), rows(buffer, g, capacity, 0));
        }
      } else {
        AlignedVector<Scalar> grown(static_cast<std::size_t>(new_capacity * kv_heads_ * width));
        for (Index g = 0; g < kv_heads_; ++g) {
          std::copy(rows(buffer, g, capacity, start_),
                    rows(buffer, g, capacity, start_ + resident_), rows(grown, g, new_capacity, 0));
        }
        buffer.swap(grown);
      }
    };
    move(keys_, dim_);
    move(values_, value_dim_);
    capacity_ = new_capacity;
    start_ = 0;
  }

  Index kv_heads_;
  Index dim_;
  Index value_dim_;
  AlignedVector<Scalar> keys_;
  AlignedVector<Scalar> values_;
  Index capacity_ = 0;  // rows per head region
  Index start_ = 0;     // the row of the oldest stored token in each region
  Index resident_ = 0;
  Index oldest_;
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_KV_BUFFER_HPP
