#ifndef PLSH_DECODE_BLOCK_TRACKER_HPP
#define PLSH_DECODE_BLOCK_TRACKER_HPP

/// \file block_tracker.hpp
/// BlockTracker: for every (head h, draw t) of a cache, the block \f$[b_{h,t}(p), e_{h,t}(p))\f$
/// of the newest position p, and per head the starts \f$b_{h,t}(p)\f$ sorted. From them the
/// first position any query at p or later can reach, \f$E(p) = \min_{h,t} b_{h,t}(p)\f$, which
/// never decreases with p (KvCache evicts the keys before it), and the key counts of the
/// single-query path, \f$c_j = \#\{t : b_{h,t}(p) \le j\}\f$ for \f$j \le p\f$.
///
/// Cost: positions only grow, so each block is looked up once, when p enters it; a step of one
/// position checks s blocks per head and re-sorts a head's starts by moving one entry, O(s) per
/// head. Tested through KvCache in tests/test_kv_cache*.cpp (outputs against plsh_attention over
/// the whole sequence, the resident bound computed from the partitions).

#include <algorithm>
#include <cstddef>
#include <utility>
#include <vector>

#include "../limits.hpp"
#include "../partition.hpp"
#include "../sampler.hpp"

namespace plsh {
namespace detail {

/// The blocks of the newest position of every (head, draw); see the file comment.
class BlockTracker {
 public:
  /// `grids[h][t]`: the draw t of head h, its partition cut to `[first_position, kMaxPosition)`.
  /// No block is known until the first `advance`.
  BlockTracker(std::vector<std::vector<Grid>> grids, Index samples, Index first_position)
      : grids_(std::move(grids)),
        samples_(samples),
        first_position_(first_position),
        blocks_(grids_.size() * static_cast<std::size_t>(samples), Block{0, 0}),
        begins_(blocks_.size(), 0) {}

  const std::vector<std::vector<Grid>>& grids() const { return grids_; }

  /// Makes `position` (not before the last one) the newest position and returns
  /// \f$E(\text{position})\f$.
  Index advance(Index position) {
    Index reachable = position;
    const Index heads = static_cast<Index>(grids_.size());
    for (Index h = 0; h < heads; ++h) {
      Index* begins = &begins_[static_cast<std::size_t>(h * samples_)];
      for (Index t = 0; t < samples_; ++t) {
        Block& block = blocks_[static_cast<std::size_t>(h * samples_ + t)];
        if (block.contains(position)) continue;
        const Index old_begin = block.begin;
        const Grid& grid = grids_[static_cast<std::size_t>(h)][static_cast<std::size_t>(t)];
        if (position == block.end) {
          // The position starts its draw's next block: only the end is looked up, and the begin,
          // the position, is the largest of the head's begins, so the old begin leaves the sorted
          // begins and the new one goes last.
          block = block_starting_at(grid, position, kMaxPosition);
          Index* old = std::lower_bound(begins, begins + samples_, old_begin);
          std::copy(old + 1, begins + samples_, old);
          begins[samples_ - 1] = position;
        } else {
          block = grid_block(grid, position, first_position_, kMaxPosition);
          replace_sorted(begins, samples_, old_begin, block.begin);
        }
      }
      reachable = std::min(reachable, begins[0]);
    }
    return reachable;
  }

  /// The sorted block starts of the newest position in head `head` (s of them).
  const Index* sorted_begins(Index head) const {
    return &begins_[static_cast<std::size_t>(head * samples_)];
  }

  /// The start of the block of draw `draw` of head `head` that holds `position`, for a position
  /// not after the newest one: the newest block's when it holds the position, else looked up.
  Index block_begin(Index head, Index draw, Index position) const {
    const Block& newest = blocks_[static_cast<std::size_t>(head * samples_ + draw)];
    if (newest.contains(position)) return newest.begin;
    return grid_block(grids_[static_cast<std::size_t>(head)][static_cast<std::size_t>(draw)],
                      position, first_position_, kMaxPosition)
        .begin;
  }

 private:
  /// In the sorted `values[0, count)`, one entry equal to `old_value` becomes `new_value`, the
  /// entries between moving by one place so that the range stays sorted.
  static void replace_sorted(Index* values, Index count, Index old_value, Index new_value) {
    Index i = std::lower_bound(values, values + count, old_value) - values;
    for (; i + 1 < count && values[i + 1] < new_value; ++i) values[i] = values[i + 1];
    for (; i > 0 && values[i - 1] > new_value; --i) values[i] = values[i - 1];
    values[i] = new_value;
  }

  std::vector<std::vector<Grid>> grids_;  // [head][draw]
  Index samples_;
  Index first_position_;
  std::vector<Block> blocks_;  // [head][draw]: the block of the newest position
  std::vector<Index> begins_;  // [head][]: the begins of blocks_, sorted per head
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_BLOCK_TRACKER_HPP
