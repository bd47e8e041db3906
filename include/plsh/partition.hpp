#ifndef PLSH_PARTITION_HPP
#define PLSH_PARTITION_HPP

/// \file partition.hpp
/// Contiguous block partitions of integer positions induced by a Grid, and their 0/1 masks.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <iterator>
#include <string>
#include <vector>

#include "detail/check.hpp"
#include "limits.hpp"
#include "options.hpp"
#include "sampler.hpp"

namespace plsh {

/// Positions `[begin, end)`.
struct Block {
  Index begin;
  Index end;
  Index size() const { return end - begin; }
  bool contains(Index position) const { return begin <= position && position < end; }
};

inline bool operator==(const Block& a, const Block& b) {
  return a.begin == b.begin && a.end == b.end;
}
inline bool operator!=(const Block& a, const Block& b) { return !(a == b); }

namespace detail {

/// \f$\lfloor (p - \text{shift}) / \text{pitch} \rfloor\f$: monotone in `p` (every step is
/// correctly rounded and monotone), so every bin is a run of consecutive integers. Exact in `p` for
/// \f$|p| \le\f$ kMaxPosition.
inline double bin_index(const Grid& grid, Index position) {
  return std::floor((static_cast<double>(position) - grid.shift) / grid.pitch);
}

/// Whether positions `i` and `j` fall in the same bin of `grid`, a grid accepted by
/// detail::require_grid (callers check it).
inline bool same_bin(const Grid& grid, Index i, Index j) {
  if (std::isinf(grid.pitch)) return true;
  if (grid.pitch <= 1) return i == j;
  return bin_index(grid, i) == bin_index(grid, j);
}

/// Positions `[first, last)` of a partition: `-kMaxPosition <= first <= last <= kMaxPosition`.
inline void require_position_range(Index first, Index last, const char* function) {
  require(first <= last, function, "first must not exceed last");
  require(first >= -kMaxPosition && last <= kMaxPosition, function,
          "positions must lie in [-kMaxPosition, kMaxPosition] (kMaxPosition = 2^53)");
}

/// A non-empty list of grids accepted by require_grid.
inline void require_grids(const std::vector<Grid>& grids, const char* function) {
  require(!grids.empty(), function, "grids must not be empty");
  for (const Grid& grid : grids) require_grid(grid, function, "every grid's");
}

/// The smallest `p` in `[low, high]` with `holds(p)`, for a predicate monotone in `p` (false, then
/// true) that holds at `high`. Starts at `hint` and doubles its steps, then bisects: O(log(1 +
/// |answer - hint|)) evaluations, at most about 110 over positions bounded by kMaxPosition.
template <class Predicate>
Index first_true(Index low, Index high, Index hint, Predicate&& holds) {
  hint = std::min(std::max(hint, low), high);
  Index lo = low;  // the answer lies in [lo, hi] and holds(hi)
  Index hi = high;
  if (holds(hint)) {
    hi = hint;
    for (Index step = 1; hi > low; step *= 2) {
      const Index probe = hint - low > step ? hint - step : low;
      if (!holds(probe)) {
        lo = probe + 1;
        break;
      }
      hi = probe;
    }
  } else {
    lo = hint + 1;
    for (Index step = 1; lo < high; step *= 2) {
      const Index probe = high - hint > step ? hint + step : high;
      if (holds(probe)) {
        hi = probe;
        break;
      }
      lo = probe + 1;
    }
  }
  while (lo < hi) {
    const Index middle = lo + (hi - lo) / 2;
    if (holds(middle)) {
      hi = middle;
    } else {
      lo = middle + 1;
    }
  }
  return lo;
}

/// \f$\lceil x \rceil\f$ clamped to `[low, high]` in double before the conversion (NaN gives
/// `low`), so the cast is always defined.
inline Index clamped_ceil(double x, Index low, Index high) {
  const double c = std::ceil(x);
  if (!(c > static_cast<double>(low))) return low;
  if (c >= static_cast<double>(high)) return high;
  return static_cast<Index>(c);
}

}  // namespace detail

/// The block of the partition of `[first, last)` that holds `position`: the integers of
/// `[first, last)` that share the bin of `position`. Requires `first <= position < last` and
/// \f$|\text{first}|, |\text{last}| \le\f$ kMaxPosition.
///
/// O(1) for every grid: the bin edges \f$\lceil \text{shift} + k\,\text{pitch} \rceil\f$ are
/// only hints, from which a doubling search over detail::bin_index finds the true edges, so that
/// rounding can never split or merge blocks differently from the bin test itself, and a grid
/// whose edges cannot be computed accurately (a huge pitch or shift) still costs at most about a
/// hundred bin evaluations.
/// \throws std::invalid_argument for a grid with a non-positive or NaN pitch or a non-finite
/// shift, or positions out of range.
inline Block grid_block(const Grid& grid, Index position, Index first, Index last) {
  const char* function = "grid_block";
  detail::require_grid(grid, function);
  detail::require_position_range(first, last, function);
  detail::require(first <= position && position < last, function,
                  "position must lie in [first, last)");
  if (std::isinf(grid.pitch)) return Block{first, last};
  // A bin no longer than 1 holds at most one integer; (p - shift) / pitch could overflow.
  if (grid.pitch <= 1) return Block{position, position + 1};
  const auto bin = [&](Index p) { return detail::bin_index(grid, p); };
  const double k = bin(position);
  // Bin k is the run of positions p with bin(p) == k: from the first p with bin(p) >= k to the
  // first p with bin(p) > k (or last).
  const Index begin = detail::first_true(
      first, position, detail::clamped_ceil(grid.shift + k * grid.pitch, first, position),
      [&](Index p) { return bin(p) >= k; });
  const Index end = detail::first_true(
      position + 1, last,
      detail::clamped_ceil(grid.shift + (k + 1) * grid.pitch, position + 1, last),
      [&](Index p) { return p == last || bin(p) > k; });
  return Block{begin, end};
}

namespace detail {

/// `grid_block(grid, position, position, last)` for a grid accepted by require_grid and `position
/// < last`: the block of `[position, last)` that holds `position`, as KvCache looks up the next
/// block of a draw when the position passes the end of its block. The end's hint is accepted when
/// the bins at it and before it show a change there: two bin evaluations that do not depend on
/// each other, and one branch that goes the same way nearly always. Only where the hint is off
/// (rounding at a bin edge, an ill-conditioned grid) does grid_block search.
inline Block block_starting_at(const Grid& grid, Index position, Index last) {
  if (grid.pitch > 1 && !std::isinf(grid.pitch)) {
    const double k = bin_index(grid, position);
    const Index end = clamped_ceil(grid.shift + (k + 1) * grid.pitch, position + 1, last);
    if ((end == last || bin_index(grid, end) > k) &&
        (end - 1 == position || !(bin_index(grid, end - 1) > k))) {
      return Block{position, end};
    }
  }
  return grid_block(grid, position, position, last);
}

/// Positions covered by queries or keys: every partition is cut to this range. Cutting does not
/// change which queries and keys share a block, so any covering range gives the same result.
struct PositionRange {
  Index first;
  Index last;
};

/// The range of positions a call of queries `q` and keys `k` covers.
template <class View>
PositionRange position_range(const View& q, const View& k, const AttentionOptions& options) {
  return PositionRange{
      std::min(options.query_position, options.key_position),
      std::max(options.query_position + q.tokens, options.key_position + k.tokens)};
}

}  // namespace detail

/// The partition of positions `[first, last)` into the non-empty bins of a Grid: contiguous
/// blocks, in increasing order, with no gap or overlap. `first > 0` describes a chunk of a longer
/// sequence: blocks are those of the whole sequence, cut at `first` and `last`.
///
/// Memory O(number of blocks); `block_of` is O(log blocks); iteration yields Block values.
class BlockPartition {
 public:
  /// \throws std::invalid_argument if `first > last`, a position lies beyond kMaxPosition in
  /// absolute value, or the grid has a non-positive or NaN pitch or a non-finite shift.
  BlockPartition(const Grid& grid, Index first, Index last) : grid_(grid) {
    detail::require_grid(grid, "BlockPartition");
    detail::require_position_range(first, last, "BlockPartition");
    for (Index p = first; p < last; p = grid_block(grid, p, first, last).end) bounds_.push_back(p);
    bounds_.push_back(last);
  }

  /// Number of (non-empty) blocks.
  Index size() const { return static_cast<Index>(bounds_.size()) - 1; }
  Index first() const { return bounds_.front(); }
  Index last() const { return bounds_.back(); }
  const Grid& grid() const { return grid_; }

  /// Block number `k`, `0 <= k < size()`.
  Block operator[](Index k) const {
    if (k < 0 || k >= size()) {
      detail::fail("BlockPartition::operator[]",
                   "block index " + std::to_string(k) + " out of range");
    }
    const auto i = static_cast<std::size_t>(k);
    return Block{bounds_[i], bounds_[i + 1]};
  }

  /// The block that holds `position`, `first() <= position < last()`.
  Block block_of(Index position) const {
    if (position < first() || position >= last()) {
      detail::fail("BlockPartition::block_of",
                   "position " + std::to_string(position) + " outside [first, last)");
    }
    const auto next = std::upper_bound(bounds_.begin(), bounds_.end(), position);
    return Block{*(next - 1), *next};
  }

  class const_iterator {
   public:
    using iterator_category = std::forward_iterator_tag;
    using value_type = Block;
    using difference_type = std::ptrdiff_t;
    using pointer = void;
    using reference = Block;

    explicit const_iterator(std::vector<Index>::const_iterator bound) : bound_(bound) {}
    Block operator*() const { return Block{*bound_, *(bound_ + 1)}; }
    const_iterator& operator++() {
      ++bound_;
      return *this;
    }
    const_iterator operator++(int) {
      const_iterator before = *this;
      ++bound_;
      return before;
    }
    bool operator==(const const_iterator& other) const { return bound_ == other.bound_; }
    bool operator!=(const const_iterator& other) const { return bound_ != other.bound_; }

   private:
    std::vector<Index>::const_iterator bound_;
  };

  const_iterator begin() const { return const_iterator(bounds_.begin()); }
  const_iterator end() const { return const_iterator(bounds_.end() - 1); }

 private:
  Grid grid_;
  std::vector<Index> bounds_;  // block k is [bounds_[k], bounds_[k + 1])
};

/// The 0/1 co-membership matrix of a partition of `[first, last)`: entry (i, j) is 1 when
/// positions `first + i` and `first + j` share a block. Block-diagonal with all-ones blocks.
template <class Scalar = double>
Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> dense_mask(const BlockPartition& partition) {
  const Index n = partition.last() - partition.first();
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> mask =
      Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>::Zero(n, n);
  for (const Block block : partition) {
    const Index offset = block.begin - partition.first();
    mask.block(offset, offset, block.size(), block.size()).setOnes();
  }
  return mask;
}

/// \f$\hat K = \frac1s \sum_t M_t\f$: the mean of the masks of `grids` on positions 0..n-1, an
/// unbiased estimate of the Laplacian kernel when the grids come from RandomBinning.
/// \throws std::invalid_argument if `n` lies outside [0, kMaxPosition], `grids` is empty or holds
/// an invalid grid.
template <class Scalar = double>
Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> mean_mask(Index n,
                                                                const std::vector<Grid>& grids) {
  detail::require(n >= 0 && n <= kMaxPosition, "mean_mask", "n must lie in [0, kMaxPosition]");
  detail::require_grids(grids, "mean_mask");
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> mean =
      Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic>::Zero(n, n);
  const Scalar weight = Scalar(1) / static_cast<Scalar>(grids.size());
  for (const Grid& grid : grids) {
    for (const Block block : BlockPartition(grid, 0, n)) {
      mean.block(block.begin, block.begin, block.size(), block.size()).array() += weight;
    }
  }
  return mean;
}

}  // namespace plsh

#endif  // PLSH_PARTITION_HPP
