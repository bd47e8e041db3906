#ifndef PLSH_DECODE_PINNED_KEYS_HPP
#define PLSH_DECODE_PINNED_KEYS_HPP

/// \file pinned_keys.hpp
/// PinnedKeys: the keys of one key/value head that an AlibiKvCache keeps after they leave its
/// window (attention sinks): at most `capacity` of them, the largest norms among the keys that
/// have left the window, sorted by position.
///
/// A key leaving the window is offered; while there is room it stays. When the pins are full it
/// replaces the pin of smallest norm if its own norm is larger (of equal norms the older pin
/// goes), otherwise it is dropped itself: the keys dropped are then never larger than a pinned
/// one. Cost: O(capacity) to find the smallest norm, and a move of up to `capacity` rows when a
/// pin is replaced. Tested through AlibiKvCache in tests/test_alibi_kv_cache.cpp.

#include <algorithm>
#include <cstddef>
#include <vector>

#include "../detail/storage.hpp"
#include "../tensor.hpp"

namespace plsh {
namespace detail {

/// Pinned key and value rows of one key/value head, sorted by position.
template <class Scalar>
class PinnedKeys {
 public:
  /// What an offer drops: nothing (`dropped` false), the offered key, or an older pin.
  struct Offer {
    bool dropped;
    Index position;
    double norm;
  };

  PinnedKeys(Index capacity, Index dim, Index value_dim)
      : capacity_(capacity), dim_(dim), value_dim_(value_dim) {}

  Index size() const { return static_cast<Index>(positions_.size()); }
  Index position(Index i) const { return positions_[static_cast<std::size_t>(i)]; }
  const Scalar* key_row(Index i) const { return keys_.data() + i * dim_; }
  const Scalar* value_row(Index i) const { return values_.data() + i * value_dim_; }
  const std::vector<Index>& positions() const { return positions_; }

  /// Bytes of the pinned rows.
  std::size_t bytes() const { return (keys_.capacity() + values_.capacity()) * sizeof(Scalar); }

  /// The whole key and value storage as views (for overlap checks).
  HeadsView<const Scalar> key_storage() const { return whole(keys_, dim_); }
  HeadsView<const Scalar> value_storage() const { return whole(values_, value_dim_); }

  /// Offers the key at `position` (after every pinned one) of norm `norm`, with its rows.
  Offer offer(Index position, double norm, const Scalar* key, const Scalar* value) {
    if (capacity_ == 0) return Offer{true, position, norm};
    if (size() == capacity_) {
      const auto smallest = std::min_element(norms_.begin(), norms_.end());
      if (!(norm > *smallest)) return Offer{true, position, norm};
      const std::size_t i = static_cast<std::size_t>(smallest - norms_.begin());
      const Offer replaced{true, positions_[i], norms_[i]};
      positions_.erase(positions_.begin() + static_cast<std::ptrdiff_t>(i));
      norms_.erase(norms_.begin() + static_cast<std::ptrdiff_t>(i));
      keys_.erase(keys_.begin() + static_cast<std::ptrdiff_t>(i) * dim_,
                  keys_.begin() + static_cast<std::ptrdiff_t>(i + 1) * dim_);
      values_.erase(values_.begin() + static_cast<std::ptrdiff_t>(i) * value_dim_,
                    values_.begin() + static_cast<std::ptrdiff_t>(i + 1) * value_dim_);
      store(position, norm, key, value);
      return replaced;
    }
    store(position, norm, key, value);
    return Offer{false, 0, 0};
  }

  /// Calls `visit(first, count)` for each run of pins `[first, first + count)` whose positions
  /// follow one another, oldest first.
  template <class Visit>
  void for_each_run(Visit&& visit) const {
    const Index pins = size();
    for (Index first = 0; first < pins;) {
      Index end = first + 1;
      while (end < pins && position(end) == position(end - 1) + 1) ++end;
      visit(first, end - first);
      first = end;
    }
  }

 private:
  static HeadsView<const Scalar> whole(const AlignedVector<Scalar>& rows, Index width) {
    return HeadsView<const Scalar>{rows.data(), static_cast<Index>(rows.size()) / width, 1, width};
  }

  void store(Index position, double norm, const Scalar* key, const Scalar* value) {
    positions_.push_back(position);
    norms_.push_back(norm);
    keys_.insert(keys_.end(), key, key + dim_);
    values_.insert(values_.end(), value, value + value_dim_);
  }

  Index capacity_;
  Index dim_;
  Index value_dim_;
  std::vector<Index> positions_;
  std::vector<double> norms_;
  AlignedVector<Scalar> keys_;    // [pin][dim]
  AlignedVector<Scalar> values_;  // [pin][value_dim]
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_PINNED_KEYS_HPP
