#ifndef PLSH_ATTENTION_BLOCK_COUNTS_HPP
#define PLSH_ATTENTION_BLOCK_COUNTS_HPP

/// \file block_counts.hpp
/// The counts of Positional LSH for a tile of query rows of one head:
/// \f[ c_{ij} = \#\{t < s : p_i \text{ and } p_j \text{ lie in one block of draw } t\}, \f]
/// 0 after the query's position when causal. The fused forward weighs its scores by them
/// (\f$c_{ij} e^{S_{ij}}\f$, fused_rows.hpp) and the backward adds \f$\log c_{ij}\f$ to its
/// logits (backward.hpp): one implementation serves both. With a near field (near_field.hpp) the
/// keys within its reach of a row take the index of the weight \f$s e^{-m d}\f$ instead of their
/// count, in a table of the distances that occur within the chunk (LogWeights).
///
/// Per tile, the draws' blocks become runs of rows that share a block (tile_block_runs: O(s)
/// block look-ups and O(s rows) bin tests), sorted into events by row (O(runs + rows)); a chunk
/// of `cols` keys is then walked row by row in O(rows * cols) plus the events' widths, whatever
/// s and the width of the union. Memory O(runs + rows + cols) per tile.
///
/// Tested through the fused forward against plsh::reference::mask_attention (dense mean of the
/// same block masks, in double) in tests/test_plsh_attention.cpp, and through the backward
/// against plsh::reference::plsh_attention_backward in tests/test_backward.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <vector>

#include "../partition.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "near_field.hpp"
#include "online_softmax.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Query rows per tile of BlockCounts (fused kernel and backward) for a head of slope m: 32 for
/// the steep slopes
/// (\f$1/m < 32\f$), whose tiles mostly go row by row without the AVX-512 walk
/// (fused_row_by_row: a row's work does not grow with the tile, the tile's costs, the draws'
/// blocks, are spread over more rows; with it, the causal triangle of a narrow union stays small),
/// kQueryTile beyond, where the blocked products' packing is spread over more rows while the
/// union grows by the extra rows only.
inline Index fused_tile_rows(double slope) {
  if (slope == 0) return kQueryTile;
  return 1.0 / slope < 32 ? 32 : kQueryTile;
}

/// Rows `[row_begin, row_end)` of a tile share one block of a draw: they see keys from
/// `begin` to `end` (and, when causal, up to their own position).
struct BlockRun {
  Index row_begin;
  Index row_end;
  Index begin;
  Index end;
};

/// The blocks of every draw over the query positions `[first_position, first_position + rows)`
/// of one head: one BlockRun per draw and block (keys cut to `[key_begin, key_end)`, runs whose
/// rows see no key left out), appended to `runs`. Returns the union of the keys the rows see,
/// empty (`begin == end`) when they see none.
///
/// Per draw, grid_block finds the block of the first row; the blocks that start inside the tile
/// end where the bin test (detail::same_bin, the test grid_block itself applies) first fails,
/// found position by position up to the last row, and only the last block's end past the tile
/// takes another grid_block when not causal (when causal no row sees a key after the last row,
/// so that end is cut to the last row + 1, which changes no count). O(s) calls of grid_block and
/// O(s rows) bin tests.
inline Block tile_block_runs(const std::vector<Grid>& grids, const PositionRange& range,
                             Index first_position, Index rows, Index key_begin, Index key_end,
                             bool causal, std::vector<BlockRun>& runs) {
  const Index last_position = first_position + rows - 1;
  Index union_begin = std::numeric_limits<Index>::max();
  Index union_end = std::numeric_limits<Index>::min();
  // Rows [row_first, row_last] in block [begin, end).
  const auto add_run = [&](Index row_first, Index row_last, Index begin, Index end) {
    const Index run_begin = std::max(begin, key_begin);
    const Index run_end = std::min(end, key_end);
    // The last row of the run sees the most keys: [begin, min(end, its position + 1)).
    const Index visible_end = causal ? std::min(run_end, row_last + 1) : run_end;
    if (run_begin < visible_end) {
      runs.push_back(
          BlockRun{row_first - first_position, row_last + 1 - first_position, run_begin, run_end});
      union_begin = std::min(union_begin, run_begin);
      union_end = std::max(union_end, visible_end);
    }
  };
  for (const Grid& grid : grids) {
    Block block = grid_block(grid, first_position, range.first, range.last);
    Index position = first_position;
    while (block.end <= last_position) {
      add_run(position, block.end - 1, block.begin, block.end);
      position = block.end;
      Index end = position + 1;
      // same_bin(grid, position, end) with the bin of `position` computed once (the pitch is
      // finite here: an infinite one makes one block; one of at most 1 makes blocks of one).
      if (grid.pitch > 1) {
        const double bin = bin_index(grid, position);
        while (end <= last_position && bin_index(grid, end) == bin) ++end;
      }
      if (end > last_position) {
        end = causal ? last_position + 1 : grid_block(grid, position, range.first, range.last).end;
      }
      block = Block{position, end};
    }
    add_run(position, last_position, block.begin, block.end);
  }
  if (union_begin >= union_end) return Block{key_begin, key_begin};
  return Block{union_begin, union_end};
}

/// The counts \f$c_{ij}\f$ of a tile of query rows of one head, the number of draws in which
/// query i and key j share a block (0 after the query's position when causal): the one
/// implementation of the fused forward and of the Positional LSH backward.
///
/// prepare() finds the tile's block runs and their union (tile_block_runs) and sorts the runs'
/// first and past-the-end rows into a list of events by row (a counting sort, O(runs + rows)).
/// A chunk of keys is then walked row by row (start_chunk, next_row) with one vector of counts
/// over the chunk's keys: row r's counts are row r - 1's plus 1 on the keys of the runs that
/// start at r, minus 1 on those of the runs that end there. O(min(sum of the runs' widths in the
/// chunk, rows * cols) + rows * cols) per chunk of `cols` keys, whatever s and the width of the
/// union, and O(runs + rows + cols) memory. The fused forward reads the counts (weights
/// \f$c_{ij} e^{S_{ij}}\f$), the backward adds their logarithms to its logits (add_log_weights).
template <class Scalar>
class BlockCounts {
 public:
  /// Prepares the tile of `rows` query rows from `first_position`, keys `[key_begin, key_end)`,
  /// for the head's estimator `estimator` (its samples those of `grids`); returns the union of the
  /// keys they see.
  Block prepare(const std::vector<Grid>& grids, const PositionRange& range, Index first_position,
                Index rows, Index key_begin, Index key_end, bool causal,
                const Estimator& estimator) {
    estimator_ = estimator;
    const Index reach = estimator.reach();
    first_position_ = first_position;
    causal_ = causal;
    runs_.clear();
    union_ = tile_block_runs(grids, range, first_position, rows, key_begin, key_end, causal, runs_);
    if (reach >= 0) {
      // The near keys of the rows: [first - w, last + w], up to the last row when causal.
      const Index near_begin = std::max(first_position - reach, key_begin);
      const Index last_position = first_position + rows - 1;
      const Index near_end =
          std::min(causal ? last_position + 1 : last_position + reach + 1, key_end);
      if (near_begin < near_end) {
        union_ = union_.begin < union_.end
                     ? Block{std::min(union_.begin, near_begin), std::max(union_.end, near_end)}
                     : Block{near_begin, near_end};
      }
    }
    // Events by row: a run adds 1 from its first row and -1 from its past-the-end row (rows
    // past the tile are never reached).
    event_start_.assign(static_cast<std::size_t>(rows + 2), 0);
    for (const BlockRun& run : runs_) {
      ++event_start_[static_cast<std::size_t>(run.row_begin + 1)];
      if (run.row_end < rows) ++event_start_[static_cast<std::size_t>(run.row_end + 1)];
    }
    for (Index r = 0; r <= rows; ++r) {
      event_start_[static_cast<std::size_t>(r + 1)] += event_start_[static_cast<std::size_t>(r)];
    }
    events_.resize(static_cast<std::size_t>(event_start_[static_cast<std::size_t>(rows)]));
    fill_.assign(event_start_.begin(), event_start_.end() - 1);
    for (const BlockRun& run : runs_) {
      events_[static_cast<std::size_t>(fill_[static_cast<std::size_t>(run.row_begin)]++)] =
          Event{run.begin, run.end, 1};
      if (run.row_end < rows) {
        events_[static_cast<std::size_t>(fill_[static_cast<std::size_t>(run.row_end)]++)] =
            Event{run.begin, run.end, -1};
      }
    }
    return union_;
  }

  /// Starts a walk over the rows of a chunk of keys `[chunk_begin, chunk_begin + cols)`:
  /// next_row() then gives the counts of rows 0, 1, ... in turn, log_weights() their log weights.
  /// A row's events change the counts either directly on their keys or, when the tile's events
  /// are many and short (steep slopes), as +-1 at the ends of their keys in a difference vector
  /// that each row prefix-sums: whichever touches fewer entries of the chunk, the same counts
  /// either way.
  void start_chunk(Index chunk_begin, Index cols) {
    const Index rows = static_cast<Index>(event_start_.size()) - 2;
    // The near keys' weights for the distances of this chunk's rows and keys only.
    weights_.prepare(estimator_,
                     near_distances(estimator_.reach(), first_position_, first_position_ + rows - 1,
                                    chunk_begin, chunk_begin + cols - 1));
    chunk_begin_ = chunk_begin;
    counts_.assign(static_cast<std::size_t>(cols), 0);
    Index direct = 0;  // entries the events touch directly, plus a loop's overhead each
    for (const Event& event : events_) {
      direct += 8 + std::max<Index>(0, std::min(event.end - chunk_begin, cols) -
                                           std::max<Index>(event.begin - chunk_begin, 0));
    }
    prefix_ = direct > rows * cols + 2 * static_cast<Index>(events_.size());
    if (prefix_) difference_.assign(static_cast<std::size_t>(cols + 1), 0);
  }

  /// The weight indices of row `r` (the rows of a chunk in increasing order, from 0) over the
  /// chunk's keys, valid until the next call: the counts \f$c_{ij}\f$, except
  /// LogWeights::near_index of its distance for a key in the near field. `limit` is set to the
  /// number of leading keys the row may see (causal), the indices past it are to be taken as 0.
  const int* next_row(Index r, Index& limit) {
    const Index cols = static_cast<Index>(counts_.size());
    limit = causal_ ? std::clamp<Index>(first_position_ + r + 1 - chunk_begin_, 0, cols) : cols;
    const int* count = next_counts(r);
    const Index reach = estimator_.reach();
    if (reach < 0) return count;
    // The near keys' indices over a copy of the counts (the direct walk goes on from them): the
    // keys at distance d <= w (Estimator::near), [p - w, p + w].
    const Index position = first_position_ + r;
    const Index begin = std::clamp<Index>(position - reach - chunk_begin_, 0, cols);
    const Index end = std::clamp<Index>(position + reach + 1 - chunk_begin_, 0, cols);
    if (begin >= end) return count;
    shown_.assign(count, count + cols);
    for (Index c = begin; c < end; ++c) {
      const Index distance = std::abs(position - chunk_begin_ - c);
      shown_[static_cast<std::size_t>(c)] = static_cast<int>(weights_.near_index(distance));
    }
    return shown_.data();
  }

  /// The largest weight index of the current chunk (the last entry of log_weights()).
  Index max_index() const { return weights_.max_index(); }

  /// The logarithms of the weights by index of the current chunk (LogWeights), after start_chunk.
  const Scalar* log_weights() const { return weights_.data(); }

  /// Adds the log weights \f$\log(s \hat K_{ij})\f$ (\f$\log c_{ij}\f$ beyond the near field)
  /// to a chunk of logits of the prepared rows whose keys are `[chunk_begin, chunk_begin + cols)`;
  /// entries of weight 0 become \f$-\infty\f$, whatever the score was. Chunks may come in any
  /// order.
  void add_log_weights(Eigen::Map<RowMatrix<Scalar>>& scores, Index chunk_begin) {
    constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
    const Index cols = scores.cols();
    start_chunk(chunk_begin, cols);
    const Scalar* log_weight = weights_.data();
    for (Index r = 0; r < scores.rows(); ++r) {
      Index limit = 0;
      const int* count = next_row(r, limit);
      Scalar* row = scores.row(r).data();
      for (Index c = 0; c < limit; ++c) {
        row[c] = count[c] == 0 ? kMinusInfinity : row[c] + log_weight[count[c]];
      }
      for (Index c = limit; c < cols; ++c) row[c] = kMinusInfinity;
    }
  }

 private:
  /// The counts \f$c_{ij}\f$ of row `r` over the chunk's keys (row r - 1's plus row r's events).
  int* next_counts(Index r) {
    const Index cols = static_cast<Index>(counts_.size());
    int* count = counts_.data();
    const Index events_end = event_start_[static_cast<std::size_t>(r + 1)];
    if (prefix_) {
      int* difference = difference_.data();
      for (Index e = event_start_[static_cast<std::size_t>(r)]; e < events_end; ++e) {
        const Event& event = events_[static_cast<std::size_t>(e)];
        const Index begin = std::max<Index>(event.begin - chunk_begin_, 0);
        const Index end = std::min(event.end - chunk_begin_, cols);
        if (begin >= end) continue;
        difference[begin] += event.delta;
        difference[end] -= event.delta;
      }
      int running = 0;
      for (Index c = 0; c < cols; ++c) count[c] = running += difference[c];
    } else {
      for (Index e = event_start_[static_cast<std::size_t>(r)]; e < events_end; ++e) {
        const Event& event = events_[static_cast<std::size_t>(e)];
        const Index begin = std::max<Index>(event.begin - chunk_begin_, 0);
        const Index end = std::min(event.end - chunk_begin_, cols);
        for (Index c = begin; c < end; ++c) count[c] += event.delta;
      }
    }
    return count;
  }

  /// A run entering (delta 1) or leaving (delta -1) the rows: keys `[begin, end)`.
  struct Event {
    Index begin;
    Index end;
    int delta;
  };

  std::vector<BlockRun> runs_;  // every draw's blocks over the tile's rows
  Block union_{0, 0};
  Index first_position_ = 0;
  bool causal_ = false;
  std::vector<Event> events_;       // by row: the runs that start or end there
  std::vector<Index> event_start_;  // events of row r: [event_start_[r], event_start_[r + 1])
  std::vector<Index> fill_;         // counting-sort cursors
  std::vector<int> counts_;         // c_ij of the current row over the chunk's keys
  LogWeights<Scalar> weights_;      // log weights by index of the current chunk, log(0) = -inf
  std::vector<int> shown_;          // a row's indices with its near keys (a near field)
  Estimator estimator_;             // the head's weights: samples, slope, the near field's reach
  Index chunk_begin_ = 0;
  bool prefix_ = false;          // the chunk's counts are prefix sums of difference_
  std::vector<int> difference_;  // [cols + 1]: the rows' events so far as +-1 at their ends
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_BLOCK_COUNTS_HPP
