#ifndef PLSH_ATTENTION_PLSH_ATTENTION_HPP
#define PLSH_ATTENTION_PLSH_ATTENTION_HPP

/// \file plsh_attention.hpp
/// ALiBi attention through Positional LSH: the factor matrix \f$K_{ij} = e^{-m|p_i - p_j|}\f$ is
/// replaced by the mean of \f$s\f$ random block masks, \f$\hat K = \frac1s\sum_t M_t\f$:
/// \f[ o_i = \frac{\sum_j \hat K_{ij} e^{S_{ij}} v_j}{\sum_j \hat K_{ij} e^{S_{ij}}},
///     \qquad S_{ij} = \text{scale}\; q_i \cdot k_j. \f]
/// Head h, draw t partitions the absolute positions with
/// `RandomBinning(slopes[h], head_seed(seed, h))(t)`.
///
/// Two evaluations of the same function:
/// - Kernel::Passes, the faithful form: for every draw and block, regular attention of the
///   block's queries against the block's keys (causal inside the block when causal), giving
///   \f$(o_t, \mathrm{lse}_t)\f$; the passes merge as \f$o = \sum_t e^{\mathrm{lse}_t} o_t /
///   \sum_t e^{\mathrm{lse}_t}\f$. Cost \f$\sum_t \sum_{\text{blocks}} b^2 (d + d_v)\f$. The inner
///   kernel is pluggable.
/// - Kernel::Fused: with \f$c_{ij}\f$ the number of draws in which i and j share a block,
///   \f$o_i = \sum_j c_{ij} e^{S_{ij}} v_j / \sum_j c_{ij} e^{S_{ij}}\f$ over the union of the
///   blocks of i, an interval of width about \f$\ln(s)/m\f$: each score is computed once,
///   whatever s. Per tile of query rows (height from the slope), one product \f$QK^\top\f$ over
///   the tile's union, \f$\log c_{ij}\f$ added to the logits (detail::BlockCounts, shared with
///   the backward: a 2-D difference array over the draws' blocks, or per-row segments of
///   constant count for wide unions), one online softmax and one product \f$PV\f$. Cost about
///   \f$(\ln(s)/m + \text{tile})(d + d_v)\f$ per query and head, plus O(s) per block of the
///   tile.
///
/// Parallelism: one OpenMP region per call, over (batch element, head, query tile) for the fused
/// kernel and (batch element, head) for the passes; the draws are made once per call and shared
/// by the batch elements (the batched overloads of batch.hpp; an unbatched call is a batch of
/// one). Every job writes its own rows: the result is identical for any number of threads.
///
/// Storage: float, double, or Eigen::bfloat16 / Eigen::half computed in float (detail::Compute):
/// the fused kernel converts its query tile and each key and value chunk once, the pass kernel
/// each block's rows, and both round their output once (detail/storage.hpp).
///
/// Tested against plsh::reference::mask_attention (dense \f$D^{-1}(e^S\circ\hat K)V\f$ in
/// double, same grids) in tests/test_plsh_attention.cpp; fused against passes there too; the
/// 16-bit types against the float kernels in tests/test_fused_half.cpp.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/check.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validate.hpp"
#include "../partition.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "online_softmax.hpp"
#include "options.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Rows `[begin, begin + count)` of a head map, as a map of the same type.
template <class Map>
Map map_rows(Map map, Index begin, Index count) {
  return Map(map.data() + begin * map.outerStride(), count, map.cols(),
             Eigen::OuterStride<>(map.outerStride()));
}

/// Positions covered by queries or keys: every partition is cut to this range. Cutting does not
/// change which queries and keys share a block, so any covering range gives the same result.
struct PositionRange {
  Index first;
  Index last;
};

template <class View>
PositionRange position_range(const View& q, const View& k, const AttentionOptions& options) {
  return PositionRange{
      std::min(options.query_position, options.key_position),
      std::max(options.query_position + q.tokens, options.key_position + k.tokens)};
}

/// The pass kernel: per batch element and head, per grid, per block, `kernel` on the block's
/// queries and keys, merged into `out` by log-sum-exp. `grids[h]` are the partitions of head h,
/// shared by the batch elements. Parallel over (batch element, head) in one parallel region.
/// Storage S is read and written through the compute type C = Compute<S>: each block's rows are
/// converted once (compute_rows) and `kernel` gets `ConstHeadMap<C>` maps; the merged output of a
/// head is kept in C and rounded to S at the end (OutputRows, a head of scratch per thread when
/// S is a 16-bit type).
template <class Storage, class RegularKernel>
void pass_attention(const BatchedHeadsView<const Storage>& q,
                    const BatchedHeadsView<const Storage>& k,
                    const BatchedHeadsView<const Storage>& v, const BatchedHeadsView<Storage>& out,
                    const std::vector<std::vector<Grid>>& grids, const AttentionOptions& options,
                    RegularKernel&& kernel) {
  using Scalar = Compute<Storage>;
  if (q.batch == 0 || q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  const PositionRange range = position_range(q, k, options);
  const Index query_end = options.query_position + q.tokens;
  const Index key_end = options.key_position + k.tokens;
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  parallel_for(q.batch * q.heads, work, [&](Index job) {
    const Index b = job / q.heads;
    const Index h = job % q.heads;
    const ConstHeadMap<Storage> q_head = q[b].head(h);
    const ConstHeadMap<Storage> k_head = k[b].head(h / group);
    const ConstHeadMap<Storage> v_head = v[b].head(h / group);
    OutputRows<Storage> output;
    HeadMap<Scalar> out_head = output.bind(out[b].head(h));
    out_head.setZero();
    Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse =
        Eigen::Matrix<Scalar, Eigen::Dynamic, 1>::Constant(
            q.tokens, -std::numeric_limits<Scalar>::infinity());
    std::vector<Scalar> pass_out;
    std::vector<Scalar> pass_lse;
    AlignedVector<Scalar> query_rows, key_rows, value_rows;
    for (const Grid& grid : grids[static_cast<std::size_t>(h)]) {
      // Only blocks that hold a query matter: visiting them costs O(q.tokens) per draw, whatever
      // the distance between the query and key ranges.
      Block block{options.query_position, options.query_position};
      for (Index p = options.query_position; p < query_end; p = block.end) {
        block = grid_block(grid, p, range.first, range.last);
        const Index query_begin = std::max(block.begin, options.query_position);
        const Index query_stop = std::min(block.end, query_end);
        const Index key_begin = std::max(block.begin, options.key_position);
        const Index key_stop = std::min(block.end, key_end);
        if (query_begin >= query_stop || key_begin >= key_stop) continue;
        if (options.causal && key_begin >= query_stop) continue;  // every key after every query
        const Index rows = query_stop - query_begin;
        const Index first_row = query_begin - options.query_position;
        const Index first_key = key_begin - options.key_position;
        const Index keys = key_stop - key_begin;
        pass_out.resize(static_cast<std::size_t>(rows * v.dim));
        pass_lse.resize(static_cast<std::size_t>(rows));
        HeadMap<Scalar> block_out(pass_out.data(), rows, v.dim, Eigen::OuterStride<>(v.dim));
        AttentionOptions block_options = resolved;
        block_options.query_position = query_begin;
        block_options.key_position = key_begin;
        kernel(compute_rows(map_rows(q_head, first_row, rows), query_rows),
               compute_rows(map_rows(k_head, first_key, keys), key_rows),
               compute_rows(map_rows(v_head, first_key, keys), value_rows), block_options,
               block_out, LseMap<Scalar>(pass_lse.data(), rows));
        online_softmax_merge(out_head.middleRows(first_row, rows), lse.segment(first_row, rows),
                             block_out, pass_lse);
      }
    }
    output.store();
  });
}

/// pass_attention on one element (a batch of one), as the KV cache's decoding step calls it.
template <class Scalar, class RegularKernel>
void pass_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<std::vector<Grid>>& grids, const AttentionOptions& options,
                    RegularKernel&& kernel) {
  pass_attention(batch_of_one(q), batch_of_one(k), batch_of_one(v), batch_of_one(out), grids,
                 options, kernel);
}

/// Query rows per tile of the fused kernel for a head of slope m: about the mean block radius
/// \f$1/m\f$, so that a tile's key interval is not much wider than one row's.
inline Index fused_tile_rows(double slope) {
  if (slope == 0) return kQueryTile;
  Index rows = 8;
  while (rows < kQueryTile && static_cast<double>(2 * rows) <= 1.0 / slope) rows *= 2;
  return rows;
}

/// Keys per chunk of the fused kernel: wide enough to amortise the products' packing.
constexpr Index kFusedKeyTile = 256;

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
      while (end <= last_position && same_bin(grid, position, end)) ++end;
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

/// Splits the keys of one row into segments of constant \f$c_{ij} = \#\{t: b_t \le j\} -
/// \#\{t: e_t \le j\}\f$, from its draws' intervals \f$[b_t, e_t)\f$, starting at
/// `union_begin`; segment k is `[start[k], start[k + 1])` with value \f$\log c\f$ (the last one,
/// to the end of the union, has c = 0). A narrow row counts with a difference array, O(s + width);
/// a wide one sorts the interval ends, O(s log s). Returns the number of segments.
template <class Scalar>
Index count_segments(Index* begins, Index* ends, Index intervals, Index union_begin,
                     const std::vector<Scalar>& log_count, std::vector<int>& difference,
                     Index* start, Scalar* value) {
  Index segments = 0;
  start[0] = union_begin;
  value[0] = log_count[0];
  const auto open_segment = [&](Index position, int count) {
    if (position != start[segments]) ++segments;
    start[segments] = position;
    value[segments] = log_count[static_cast<std::size_t>(count)];
  };
  if (intervals == 0) return 1;
  const Index low = *std::min_element(begins, begins + intervals);
  const Index high = *std::max_element(ends, ends + intervals);
  if (high - low <= 4 * intervals) {
    difference.assign(static_cast<std::size_t>(high - low + 1), 0);
    for (Index t = 0; t < intervals; ++t) {
      ++difference[static_cast<std::size_t>(begins[t] - low)];
      --difference[static_cast<std::size_t>(ends[t] - low)];
    }
    int count = 0;
    for (Index j = low; j <= high; ++j) {
      const int change = difference[static_cast<std::size_t>(j - low)];
      if (change != 0) open_segment(j, count += change);
    }
    return segments + 1;
  }
  std::sort(begins, begins + intervals);
  std::sort(ends, ends + intervals);
  int count = 0;
  for (Index b = 0, e = 0; b < intervals || e < intervals;) {
    const Index next = (b < intervals && begins[b] < ends[e]) ? begins[b] : ends[e];
    for (; b < intervals && begins[b] == next; ++b) ++count;
    for (; e < intervals && ends[e] == next; ++e) --count;
    open_segment(next, count);
  }
  return segments + 1;
}

/// The counts \f$c_{ij}\f$ of a tile of query rows of one head, the number of draws in which
/// query i and key j share a block (0 after the query's position when causal): the one
/// implementation of the fused forward and of the Positional LSH backward.
///
/// prepare() finds the tile's block runs and their union (tile_block_runs). A union of at most
/// kFusedKeyTile keys is counted per chunk of logits by a two-dimensional difference array over
/// the runs, each run adding 1 on a rectangle of (rows, keys): O(runs + rows * cols) whatever s.
/// A wider one is split per row into segments of constant count (count_segments), so that its
/// cost does not grow with the width.
template <class Scalar>
class BlockCounts {
 public:
  /// Prepares the tile of `rows` query rows from `first_position`, keys `[key_begin, key_end)`;
  /// returns the union of the keys they see.
  Block prepare(const std::vector<Grid>& grids, const PositionRange& range, Index first_position,
                Index rows, Index key_begin, Index key_end, bool causal) {
    const Index samples = static_cast<Index>(grids.size());
    if (static_cast<Index>(log_count_.size()) != samples + 1) {
      log_count_.resize(static_cast<std::size_t>(samples + 1));
      log_count_[0] = -std::numeric_limits<Scalar>::infinity();
      for (Index c = 1; c <= samples; ++c) {
        log_count_[static_cast<std::size_t>(c)] = std::log(static_cast<Scalar>(c));
      }
    }
    first_position_ = first_position;
    rows_ = rows;
    causal_ = causal;
    runs_.clear();
    union_ = tile_block_runs(grids, range, first_position, rows, key_begin, key_end, causal, runs_);
    narrow_ = union_.end - union_.begin <= kFusedKeyTile;
    if (!narrow_) prepare_segments(samples);
    return union_;
  }

  /// Adds \f$\log c_{ij}\f$ to a chunk of logits of the prepared rows whose keys are
  /// `[chunk_begin, chunk_begin + cols)`; entries with \f$c_{ij} = 0\f$ become \f$-\infty\f$,
  /// whatever the score was. Chunks of a wide union must come in increasing order.
  void add_log_counts(Eigen::Map<RowMatrix<Scalar>>& scores, Index chunk_begin) {
    if (narrow_) {
      add_log_counts_narrow(scores, chunk_begin);
    } else {
      add_log_counts_wide(scores, chunk_begin);
    }
  }

 private:
  void add_log_counts_narrow(Eigen::Map<RowMatrix<Scalar>>& scores, Index chunk_begin) {
    const Index rows = scores.rows();
    const Index cols = scores.cols();
    const Index stride = cols + 1;
    difference_.assign(static_cast<std::size_t>((rows + 1) * stride), 0);
    const auto at = [&](Index r, Index c) -> int& {
      return difference_[static_cast<std::size_t>(r * stride + c)];
    };
    for (const BlockRun& run : runs_) {
      const Index begin = std::max<Index>(run.begin - chunk_begin, 0);
      const Index end = std::min(run.end - chunk_begin, cols);
      if (begin >= end) continue;
      ++at(run.row_begin, begin);
      --at(run.row_begin, end);
      --at(run.row_end, begin);
      ++at(run.row_end, end);
    }
    counts_.assign(static_cast<std::size_t>(cols), 0);
    for (Index r = 0; r < rows; ++r) {
      // counts[c] = sum of difference rows 0..r, prefix-summed along c.
      int running = 0;
      for (Index c = 0; c < cols; ++c) {
        running += at(r, c);
        counts_[static_cast<std::size_t>(c)] += running;
      }
      const Index limit =
          causal_ ? std::clamp<Index>(first_position_ + r + 1 - chunk_begin, 0, cols) : cols;
      Scalar* row = scores.row(r).data();
      for (Index c = 0; c < cols; ++c) {
        const int count = c < limit ? counts_[static_cast<std::size_t>(c)] : 0;
        if (count == 0) {
          row[c] = -std::numeric_limits<Scalar>::infinity();
        } else {
          row[c] += log_count_[static_cast<std::size_t>(count)];
        }
      }
    }
  }

  /// Per row, the non-empty intervals [begin, end) of keys sharing its block, split into
  /// segments of constant count.
  void prepare_segments(Index samples) {
    const Index rows = rows_;
    max_segments_ = 2 * samples + 1;
    const std::size_t cells = static_cast<std::size_t>(rows * samples);
    begins_.resize(cells);
    ends_.resize(cells);
    segment_start_.resize(static_cast<std::size_t>(rows * max_segments_));
    segment_value_.resize(static_cast<std::size_t>(rows * max_segments_));
    segment_count_.assign(static_cast<std::size_t>(rows), 0);
    cursor_.assign(static_cast<std::size_t>(rows), 0);
    intervals_.assign(static_cast<std::size_t>(rows), 0);
    for (const BlockRun& run : runs_) {
      for (Index r = run.row_begin; r < run.row_end; ++r) {
        const Index end = causal_ ? std::min(run.end, first_position_ + r + 1) : run.end;
        if (run.begin >= end) continue;
        const std::size_t cell =
            static_cast<std::size_t>(r * samples + intervals_[static_cast<std::size_t>(r)]++);
        begins_[cell] = run.begin;
        ends_[cell] = end;
      }
    }
    for (Index r = 0; r < rows; ++r) {
      const std::size_t first = static_cast<std::size_t>(r * samples);
      const std::size_t segments = static_cast<std::size_t>(r * max_segments_);
      segment_count_[static_cast<std::size_t>(r)] = count_segments(
          &begins_[first], &ends_[first], intervals_[static_cast<std::size_t>(r)], union_.begin,
          log_count_, difference_, &segment_start_[segments], &segment_value_[segments]);
    }
  }

  void add_log_counts_wide(Eigen::Map<RowMatrix<Scalar>>& scores, Index chunk_begin) {
    const Index cols = scores.cols();
    const Index c0 = chunk_begin;
    const Index c1 = c0 + cols;
    // Keys outside the union share no block with any row of the tile.
    const Index inside_begin = std::clamp(union_.begin, c0, c1);
    const Index inside_end = std::clamp(union_.end, inside_begin, c1);
    for (Index r = 0; r < scores.rows(); ++r) {
      const Index* start = &segment_start_[static_cast<std::size_t>(r * max_segments_)];
      const Scalar* value = &segment_value_[static_cast<std::size_t>(r * max_segments_)];
      const Index segments = segment_count_[static_cast<std::size_t>(r)];
      Index& j = cursor_[static_cast<std::size_t>(r)];
      auto row = scores.row(r);
      row.head(inside_begin - c0).setConstant(-std::numeric_limits<Scalar>::infinity());
      row.tail(c1 - inside_end).setConstant(-std::numeric_limits<Scalar>::infinity());
      for (; j < segments; ++j) {
        const Index segment_end = j + 1 < segments ? start[j + 1] : union_.end;
        const Index a = std::max(start[j], inside_begin);
        const Index b = std::min(segment_end, inside_end);
        if (a < b) {
          if (value[j] == -std::numeric_limits<Scalar>::infinity()) {
            row.segment(a - c0, b - a).setConstant(value[j]);
          } else {
            row.segment(a - c0, b - a).array() += value[j];
          }
        }
        if (segment_end > inside_end) break;  // the segment continues in the next chunk
      }
    }
  }

  std::vector<BlockRun> runs_;  // every draw's blocks over the tile's rows
  Block union_{0, 0};
  Index first_position_ = 0;
  Index rows_ = 0;
  bool causal_ = false;
  bool narrow_ = true;
  Index max_segments_ = 0;
  std::vector<Index> begins_;  // [row][k]: visible key intervals of the row, one per draw at most
  std::vector<Index> ends_;
  std::vector<Index> segment_start_;   // [row][k]: c_ij is constant on [start_k, start_{k+1})
  std::vector<Scalar> segment_value_;  // log c_ij on that segment, -inf where c_ij = 0
  std::vector<Index> segment_count_;   // segments per row
  std::vector<Index> cursor_;          // per row: first segment not yet fully applied
  std::vector<Index> intervals_;       // per row: number of non-empty intervals
  std::vector<int> difference_;
  std::vector<int> counts_;
  std::vector<Scalar> log_count_;  // log(c) for c = 0..s, log(0) = -inf
};

/// Per-thread scratch of the fused kernel on storage type `Storage`: O(tile) whatever n.
template <class Storage>
struct FusedWorkspace {
  using Scalar = Compute<Storage>;
  BlockCounts<Scalar> counts;
  AlignedVector<Scalar> scores;
  RowMatrix<Scalar> query;
  OnlineSoftmax<Scalar> softmax;
  AlignedVector<Scalar> query_rows;  // a tile's rows in the compute type (16-bit storage only)
  AlignedVector<Scalar> key_rows;
  AlignedVector<Scalar> value_rows;
  OutputRows<Storage> output;
};

/// Fused kernel for query rows `[row_begin, row_end)` of one head: logits
/// \f$S_{ij} + \log c_{ij}\f$ over the union of the rows' blocks (BlockCounts), one online
/// softmax, in chunks of kFusedKeyTile keys. The query tile and each key and value chunk are
/// converted to the compute type once; the output rows are rounded back once.
template <class Storage>
void fused_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                const ConstHeadMap<Storage>& v, const std::vector<Grid>& grids,
                const AttentionOptions& options, const PositionRange& range, Index row_begin,
                Index row_end, HeadMap<Storage>& out) {
  using Scalar = Compute<Storage>;
  static thread_local FusedWorkspace<Storage> workspace;
  const Index rows = row_end - row_begin;
  const Block keys = workspace.counts.prepare(grids, range, options.query_position + row_begin,
                                              rows, options.key_position,
                                              options.key_position + k.rows(), options.causal);
  workspace.softmax.reset(rows, v.cols());
  if (keys.begin < keys.end) {
    workspace.query.noalias() = compute_rows(map_rows(q, row_begin, rows), workspace.query_rows) *
                                static_cast<Scalar>(options.scale);
    workspace.scores.resize(static_cast<std::size_t>(rows * kFusedKeyTile));
    for (Index c0 = keys.begin; c0 < keys.end; c0 += kFusedKeyTile) {
      const Index cols = std::min(kFusedKeyTile, keys.end - c0);
      const Index first_key = c0 - options.key_position;
      Eigen::Map<RowMatrix<Scalar>> scores(workspace.scores.data(), rows, cols);
      multiply_transposed(workspace.query,
                          compute_rows(map_rows(k, first_key, cols), workspace.key_rows), scores);
      workspace.counts.add_log_counts(scores, c0);
      workspace.softmax.update(scores,
                               compute_rows(map_rows(v, first_key, cols), workspace.value_rows));
    }
  }
  workspace.softmax.finish(workspace.output.bind(map_rows(out, row_begin, rows)), nullptr);
  workspace.output.store();
}

/// The fused kernel: parallel over (batch element, head, query tile) in one parallel region, tile
/// height from the head's slope; the grids are shared by the batch elements.
template <class Storage>
void fused_attention(const BatchedHeadsView<const Storage>& q,
                     const BatchedHeadsView<const Storage>& k,
                     const BatchedHeadsView<const Storage>& v, const BatchedHeadsView<Storage>& out,
                     const std::vector<std::vector<Grid>>& grids, const std::vector<double>& slopes,
                     const AttentionOptions& options) {
  if (q.batch == 0 || q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  const PositionRange range = position_range(q, k, options);
  struct Tile {
    Index head, row_begin, row_end;
  };
  std::vector<Tile> tiles;  // of one batch element
  for (Index h = 0; h < q.heads; ++h) {
    const Index height = fused_tile_rows(slopes[static_cast<std::size_t>(h)]);
    for (Index r0 = 0; r0 < q.tokens; r0 += height) {
      tiles.push_back(Tile{h, r0, std::min(q.tokens, r0 + height)});
    }
  }
  const Index element_jobs = static_cast<Index>(tiles.size());
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  parallel_for(q.batch * element_jobs, work, [&](Index job) {
    const Index b = job / element_jobs;
    const Tile& tile = tiles[static_cast<std::size_t>(job % element_jobs)];
    HeadMap<Storage> out_head = out[b].head(tile.head);
    fused_rows<Storage>(q[b].head(tile.head), k[b].head(tile.head / group),
                        v[b].head(tile.head / group), grids[static_cast<std::size_t>(tile.head)],
                        resolved, range, tile.row_begin, tile.row_end, out_head);
  });
}

/// fused_attention on one element (a batch of one), as the KV cache's decoding step calls it.
template <class Scalar>
void fused_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                     const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                     const std::vector<std::vector<Grid>>& grids, const std::vector<double>& slopes,
                     const AttentionOptions& options) {
  fused_attention(batch_of_one(q), batch_of_one(k), batch_of_one(v), batch_of_one(out), grids,
                  slopes, options);
}

/// plsh_attention on a batch whose shapes validate_batch has checked: the checks of one element,
/// the draws (once, shared by the elements), then the fused or pass kernel, or the pass kernel
/// with `kernel` when one is given.
template <class Scalar, class... RegularKernel>
void batched_plsh_attention(const BatchedHeadsView<const Scalar>& q,
                            const BatchedHeadsView<const Scalar>& k,
                            const BatchedHeadsView<const Scalar>& v,
                            const BatchedHeadsView<Scalar>& out, const std::vector<double>& slopes,
                            const PlshOptions& options, RegularKernel&&... kernel) {
  static_assert(sizeof...(RegularKernel) <= 1, "at most one regular kernel");
  validate_plsh("plsh_attention", q[0], k[0], v[0], out[0], slopes, options);
  const auto grids = kernel_grids(slopes, options, "plsh_attention");
  if constexpr (sizeof...(RegularKernel) == 1) {
    pass_attention(q, k, v, out, grids, options, kernel...);
  } else if (options.kernel == Kernel::Passes) {
    pass_attention(q, k, v, out, grids, options, RegularAttention{});
  } else {
    fused_attention(q, k, v, out, grids, slopes, options);
  }
}

/// fixed_block_attention on a checked batch: the checks of one element, then one pass of the
/// pass kernel with `fixed_grid(block_size)` for every head.
template <class Scalar>
void batched_fixed_block_attention(const BatchedHeadsView<const Scalar>& q,
                                   const BatchedHeadsView<const Scalar>& k,
                                   const BatchedHeadsView<const Scalar>& v,
                                   const BatchedHeadsView<Scalar>& out, Index block_size,
                                   const AttentionOptions& options) {
  const char* function = "fixed_block_attention";
  validate_attention(function, q[0], k[0], v[0], out[0], options);
  require(block_size >= 1, function, "block_size must be at least 1");
  const std::vector<std::vector<Grid>> grids(
      static_cast<std::size_t>(q.heads),
      std::vector<Grid>{fixed_grid(static_cast<double>(block_size))});
  pass_attention(q, k, v, out, grids, options, RegularAttention{});
}

}  // namespace detail

/// ALiBi attention through Positional LSH, the average of `options.samples` random block
/// partitions per head (see the file comment for the formula).
///
/// \code
/// const Index n = 4096, heads = 8, dim = 64;
/// std::vector<float> q(n * heads * dim), k(q.size()), v(q.size()), out(q.size());
/// // ... fill q, k, v ...
/// plsh::PlshOptions options;    // causal, s = 20, fused kernel
/// plsh::plsh_attention<float>({q.data(), n, heads, dim}, {k.data(), n, heads, dim},
///                             {v.data(), n, heads, dim}, {out.data(), n, heads, dim},
///                             plsh::alibi_slopes(heads), options);
/// \endcode
///
/// \tparam Scalar the storage type: float, double, Eigen::bfloat16 or Eigen::half. The 16-bit
/// types are computed in float (detail::Compute) and the output rounded once to the storage
/// type (to nearest even: relative error at most \f$2^{-8}\f$ for bfloat16, \f$2^{-11}\f$ for
/// half, against the float kernel on the same inputs).
/// \param q `[n_q][H][d]`, \param k `[n_k][H_kv][d]`, \param v `[n_k][H_kv][d_v]`,
/// \param out `[n_q][H][d_v]`; H a multiple of H_kv. \param slopes one per query head.
/// \param options causal, scale, absolute positions of the first query and key rows, samples s,
/// seed, and which kernel evaluates the estimator (Kernel::Fused and Kernel::Passes agree to
/// rounding). The result is identical for any number of threads.
/// \throws std::invalid_argument on shapes that disagree, a bad slope, `samples < 1`, `out`
/// overlapping an input, or a scale that is not finite and non-zero in the compute type.
template <class Scalar>
void plsh_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                    HeadsView<const detail::NonDeduced<Scalar>> k,
                    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                    const std::vector<double>& slopes, const PlshOptions& options = {}) {
  detail::batched_plsh_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                         detail::batch_of_one(v), detail::batch_of_one(out), slopes,
                                         options);
}

/// Positional LSH with a user-supplied regular attention kernel: always the pass kernel
/// (`options.kernel` is ignored), calling
/// `kernel(q, k, v, block_options, out, lse)` once per draw and block with, for C =
/// `detail::Compute<Scalar>` (float for Eigen::bfloat16 and Eigen::half, whose block rows are
/// converted before the call; Scalar itself otherwise), `ConstHeadMap<C>` q (`rows x d`), k
/// (`keys x d`), v (`keys x d_v`), an AttentionOptions
/// whose `scale` is resolved and whose positions are the absolute positions of the first query
/// and key rows, `HeadMap<C>` out (`rows x d_v`) and `LseMap<C>` lse (`rows`). The
/// kernel must write normalised rows and their log-sum-exp (\f$-\infty\f$ and zeros for a row
/// with no visible key), like RegularAttention. With OpenMP it is called from several threads
/// at once (one job per head and batch element).
template <class Scalar, class RegularKernel>
void plsh_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                    HeadsView<const detail::NonDeduced<Scalar>> k,
                    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                    const std::vector<double>& slopes, const PlshOptions& options,
                    RegularKernel&& kernel) {
  detail::batched_plsh_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                         detail::batch_of_one(v), detail::batch_of_one(out), slopes,
                                         options, kernel);
}

/// The fixed-blocks baseline of the paper: every head attends (regularly) within deterministic
/// blocks of `block_size` positions, `[0, b), [b, 2b), ...` on absolute positions. No bias and no
/// expectation property; one pass of the pass kernel with `fixed_grid(block_size)`. Storage
/// types as plsh_attention.
/// \throws std::invalid_argument as exact_alibi_attention, and for `block_size < 1`.
template <class Scalar>
void fixed_block_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                           HeadsView<const detail::NonDeduced<Scalar>> k,
                           HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                           Index block_size, const AttentionOptions& options = {}) {
  detail::batched_fixed_block_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                                detail::batch_of_one(v), detail::batch_of_one(out),
                                                block_size, options);
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_PLSH_ATTENTION_HPP
