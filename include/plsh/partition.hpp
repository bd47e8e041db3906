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

/// \f$\lfloor (p - \text{shift}) / \text{pitch} \rfloor\f$: monotone in `p`, so every bin is a run
/// of consecutive integers.
inline double bin_index(const Grid& grid, Index position) {
  return std::floor((static_cast<double>(position) - grid.shift) / grid.pitch);
}

/// Whether positions `i` and `j` fall in the same bin of `grid`.
inline bool same_bin(const Grid& grid, Index i, Index j) {
  if (std::isinf(grid.pitch)) return true;
  if (grid.pitch <= 1) return i == j;
  return bin_index(grid, i) == bin_index(grid, j);
}

}  // namespace detail

/// The block of the partition of `[first, last)` that holds `position`, in O(1): the integers of
/// `[first, last)` that share the bin of `position`. Requires `first <= position < last`.
///
/// The bin edges \f$\lceil \text{shift} + k\,\text{pitch} \rceil\f$ are only candidates: they are
/// corrected against detail::bin_index so that rounding can never split or merge blocks
/// differently from the bin test itself.
inline Block grid_block(const Grid& grid, Index position, Index first, Index last) {
  detail::require(first <= position && position < last, "grid_block",
                  "position must lie in [first, last)");
  if (std::isinf(grid.pitch)) return Block{first, last};
  // A bin no longer than 1 holds at most one integer; (p - shift) / pitch could overflow.
  if (grid.pitch <= 1) return Block{position, position + 1};
  const auto bin = [&](Index p) { return detail::bin_index(grid, p); };
  const double k = bin(position);
  const auto clamp = [](double value, Index low, Index high) {
    return static_cast<Index>(
        std::min(std::max(value, static_cast<double>(low)), static_cast<double>(high)));
  };
  Index begin = clamp(std::ceil(grid.shift + k * grid.pitch), first, position);
  while (begin > first && bin(begin - 1) == k) --begin;
  while (bin(begin) < k) ++begin;
  Index end = clamp(std::ceil(grid.shift + (k + 1) * grid.pitch), position + 1, last);
  while (end > position + 1 && bin(end - 1) > k) --end;
  while (end < last && bin(end) == k) ++end;
  return Block{begin, end};
}

/// The partition of positions `[first, last)` into the non-empty bins of a Grid: contiguous
/// blocks, in increasing order, with no gap or overlap. `first > 0` describes a chunk of a longer
/// sequence: blocks are those of the whole sequence, cut at `first` and `last`.
///
/// Memory O(number of blocks); `block_of` is O(log blocks); iteration yields Block values.
class BlockPartition {
 public:
  /// \throws std::invalid_argument if `first > last`, or the grid has a non-positive pitch or a
  /// non-finite shift.
  BlockPartition(const Grid& grid, Index first, Index last) : grid_(grid) {
    detail::require(first <= last, "BlockPartition", "first must not exceed last");
    detail::require(grid.pitch > 0, "BlockPartition", "grid pitch must be positive");
    detail::require(std::isfinite(grid.shift), "BlockPartition", "grid shift must be finite");
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
/// \throws std::invalid_argument if `n < 0` or `grids` is empty.
template <class Scalar = double>
Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> mean_mask(Index n,
                                                                const std::vector<Grid>& grids) {
  detail::require(n >= 0, "mean_mask", "n must be non-negative");
  detail::require(!grids.empty(), "mean_mask", "grids must not be empty");
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
