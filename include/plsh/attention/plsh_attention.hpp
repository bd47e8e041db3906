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
///   whatever s. Per tile of query rows (height from the slope), the counts row by row
///   (detail::BlockCounts, shared with the backward: the draws' blocks as events by row, each row's
///   counts those of the row before plus the blocks that start there, minus those that end).
///   A tile takes, per chunk of kFusedKeyTile keys, one product \f$QK^\top\f$, one walk per row
///   (logits \f$S_{ij} + \log c_{ij}\f$, \f$-\infty\f$ where \f$c_{ij} = 0\f$, maximum,
///   exponentials: OnlineSoftmax::update_counted) and one product \f$PV\f$; in builds without the
///   AVX-512 walk (below) a tile whose union holds at most kRowByRowKeys keys goes row by row
///   instead, each row's scores and weighted sum by matrix-vector products over its own keys
///   only (detail::fused_row_by_row), which spares the steep heads Eigen's packing. Either way a
///   row's largest weight is \f$e^0 = 1\f$. Cost about \f$(\ln(s)/m +
///   \text{tile})(d + d_v)\f$ per query and head, plus O(s) per block of the tile.
///   Compiled for AVX-512 (`__AVX512F__`, e.g. `-march=native` on such a processor), a float
///   chunk takes each row's walk in two vectorised passes and the product \f$PV\f$ by register
///   blocks of 6 rows by 64 columns over each block's visible keys, without packing
///   (online_softmax.hpp), narrow tiles too; \f$QK^\top\f$ stays Eigen's, except for bfloat16
///   storage with AVX-512 BF16 as well (kBf16Scores: `vdpbf16ps` on the bfloat16 query rows and
///   keys, detail/bf16_scores.hpp; the float sums in another order). There too, the causal
///   rows of heads with \f$1/m <\f$ kCausalRowsReach go row by row (detail::fused_causal_rows):
///   a causal row's counts are \f$c_{ij} = \#\{t : b_t \le j\}\f$ from its draws' block starts
///   \f$b_t\f$, carried from row to row, so each row computes the scores of its own keys only
///   (5 to 50 of them) instead of its tile's union. Other builds and types take Eigen's products
///   and the portable walk; both are tested (test_plsh_attention and
///   test_plsh_attention_avx512).
///
/// Parallelism: one OpenMP region per call, over (batch element, span of up to kFusedSpanRows
/// query rows, head) for the fused kernel (the keys and values a span sees are first
/// packed when strided, and their values tested for finiteness once, fused_span) and (batch
/// element, head) for the passes; the draws are made once per call and shared by the batch elements
/// (the batched overloads of batch.hpp; an unbatched call is a batch of one). Every job writes its
/// own rows: the result is identical for any number of threads.
///
/// Storage: float, double, or Eigen::bfloat16 / Eigen::half computed in float (detail::Compute):
/// the fused kernel converts each query row once and the key and value rows a span of query rows
/// may see once (fused_span; when they are read in place, each chunk or row converts its own),
/// the pass kernel each block's rows, and both round their output once (detail/storage.hpp).
/// With kBf16Scores, a bfloat16 tile's scores come from its query rows and each chunk's keys in
/// bfloat16 instead, summed in float by `vdpbf16ps`.
///
/// Tested against plsh::reference::mask_attention (dense \f$D^{-1}(e^S\circ\hat K)V\f$ in
/// double, same grids) in tests/test_plsh_attention.cpp; fused against passes there too; the
/// 16-bit types against the float kernels in tests/test_fused_half.cpp.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/bf16_scores.hpp"
#include "../detail/check.hpp"
#include "../detail/decode_simd.hpp"
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

/// Query rows per tile of the fused kernel for a head of slope m: 32 for the steep slopes
/// (\f$1/m < 32\f$), whose tiles mostly go row by row without the AVX-512 walk
/// (fused_row_by_row: a row's work does not grow with the tile, the tile's costs, the draws'
/// blocks, are spread over more rows; with it, the causal triangle of a narrow union stays small),
/// kQueryTile beyond, where the blocked products' packing is spread over more rows while the
/// union grows by the extra rows only.
inline Index fused_tile_rows(double slope) {
  if (slope == 0) return kQueryTile;
  return 1.0 / slope < 32 ? 32 : kQueryTile;
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
/// \f$c_{ij} e^{S_{ij}}\f$), the backward adds their logarithms to its logits (add_log_counts).
template <class Scalar>
class BlockCounts {
 public:
  /// Prepares the tile of `rows` query rows from `first_position`, keys `[key_begin, key_end)`;
  /// returns the union of the keys they see.
  Block prepare(const std::vector<Grid>& grids, const PositionRange& range, Index first_position,
                Index rows, Index key_begin, Index key_end, bool causal) {
    const Index samples = static_cast<Index>(grids.size());
    fill_log_counts(log_count_, samples);
    first_position_ = first_position;
    causal_ = causal;
    runs_.clear();
    union_ = tile_block_runs(grids, range, first_position, rows, key_begin, key_end, causal, runs_);
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
  /// next_row() then gives the counts of rows 0, 1, ... in turn. A row's events change the
  /// counts either directly on their keys or, when the tile's events are many and short (steep
  /// slopes), as +-1 at the ends of their keys in a difference vector that each row prefix-sums:
  /// whichever touches fewer entries of the chunk, the same counts either way.
  void start_chunk(Index chunk_begin, Index cols) {
    chunk_begin_ = chunk_begin;
    counts_.assign(static_cast<std::size_t>(cols), 0);
    Index direct = 0;  // entries the events touch directly, plus a loop's overhead each
    for (const Event& event : events_) {
      direct += 8 + std::max<Index>(0, std::min(event.end - chunk_begin, cols) -
                                           std::max<Index>(event.begin - chunk_begin, 0));
    }
    const Index rows = static_cast<Index>(event_start_.size()) - 2;
    prefix_ = direct > rows * cols + 2 * static_cast<Index>(events_.size());
    if (prefix_) difference_.assign(static_cast<std::size_t>(cols + 1), 0);
  }

  /// The counts \f$c_{ij}\f$ of row `r` (the rows of a chunk in increasing order, from 0) over
  /// the chunk's keys, valid until the next call; `limit` is set to the number of leading keys
  /// the row may see (causal), the counts past it are to be taken as 0.
  const int* next_row(Index r, Index& limit) {
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
    limit = causal_ ? std::clamp<Index>(first_position_ + r + 1 - chunk_begin_, 0, cols) : cols;
    return count;
  }

  /// \f$\log c\f$ for c = 0 .. s (\f$-\infty\f$ for 0), after prepare().
  const Scalar* log_counts() const { return log_count_.data(); }

  /// Adds \f$\log c_{ij}\f$ to a chunk of logits of the prepared rows whose keys are
  /// `[chunk_begin, chunk_begin + cols)`; entries with \f$c_{ij} = 0\f$ become \f$-\infty\f$,
  /// whatever the score was. Chunks may come in any order.
  void add_log_counts(Eigen::Map<RowMatrix<Scalar>>& scores, Index chunk_begin) {
    constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
    const Index cols = scores.cols();
    start_chunk(chunk_begin, cols);
    const Scalar* log_count = log_count_.data();
    for (Index r = 0; r < scores.rows(); ++r) {
      Index limit = 0;
      const int* count = next_row(r, limit);
      Scalar* row = scores.row(r).data();
      for (Index c = 0; c < limit; ++c) {
        row[c] = count[c] == 0 ? kMinusInfinity : row[c] + log_count[count[c]];
      }
      for (Index c = limit; c < cols; ++c) row[c] = kMinusInfinity;
    }
  }

 private:
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
  std::vector<Scalar> log_count_;   // log(c) for c = 0..s, log(0) = -inf
  Index chunk_begin_ = 0;
  bool prefix_ = false;          // the chunk's counts are prefix sums of difference_
  std::vector<int> difference_;  // [cols + 1]: the rows' events so far as +-1 at their ends
};

/// Per-thread scratch of the fused kernel on storage type `Storage`: O(tile) whatever n.
template <class Storage>
struct FusedWorkspace {
  using Scalar = Compute<Storage>;
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
  BlockCounts<Scalar> counts;
  AlignedVector<Scalar> scores;
  RowMatrix<Scalar> query;
  OnlineSoftmax<Scalar> softmax;
  AlignedVector<Scalar> query_rows;  // a tile's rows in the compute type (16-bit storage only)
  AlignedVector<Scalar> key_rows;
  AlignedVector<Scalar> value_rows;
  OutputRows<Storage> output;
  Vector logits;  // one row's scores (fused_row_by_row)
  Eigen::Array<Scalar, Eigen::Dynamic, 1> exponentials;
  Eigen::Matrix<Scalar, 1, Eigen::Dynamic> sum;  // one row's weighted sum of values
  std::vector<Index> bad;                        // value rows with a non-finite entry
  AlignedVector<std::uint32_t> query_pairs;      // a tile's query rows (kBf16Scores)
  AlignedVector<std::uint32_t> key_panels;       // a chunk's keys (kBf16Scores)
};

#if defined(PLSH_DECODE_AVX512_BF16) && defined(PLSH_FUSED_AVX512)
/// Whether fused_rows computes the scores of `Storage` tiles by `vdpbf16ps` (bf16_scores.hpp):
/// bfloat16 storage in AVX-512 BF16 builds.
template <class Storage>
constexpr bool kBf16Scores = std::is_same<Storage, Eigen::bfloat16>::value;
#else
template <class Storage>
constexpr bool kBf16Scores = false;
#endif

/// Unions of at most this many keys take fused_row_by_row, except where update_counted takes the
/// AVX-512 walk (kVectorWalk): below it, Eigen's packing for the blocked products and the
/// per-tile passes cost more than a product per row.
constexpr Index kRowByRowKeys = 80;

/// The fused kernel on a tile of `query` rows (scaled, compute type) whose union of keys is
/// narrow: per row, its scores \f$S_{ij}\f$ over the keys from its first to its last with
/// \f$c_{ij} > 0\f$ by one matrix-vector product, the logits \f$l_{ij} = S_{ij} + \log c_{ij}\f$
/// (\f$-\infty\f$ where \f$c_{ij} = 0\f$), the weights \f$w_{ij} = e^{l_{ij} - \max_j l_{ij}}\f$
/// (exactly 0 where the logit is \f$-\infty\f$) and \f$o_i = \sum_j w_{ij} v_j / \sum_j
/// w_{ij}\f$ by another product: a row that sees one key gets its value exactly. Non-finite
/// inputs as the online softmax (online_softmax.hpp): a value row with a non-finite entry is
/// added, term by term, only to the rows whose logit for it is above \f$-\infty\f$.
template <class Storage>
void fused_row_by_row(FusedWorkspace<Storage>& workspace, const RowMatrix<Compute<Storage>>& query,
                      const ConstHeadMap<Compute<Storage>>& key_rows,
                      const ConstHeadMap<Compute<Storage>>& value_rows, Index first_key,
                      HeadMap<Compute<Storage>> out, bool finite_values) {
  using Scalar = Compute<Storage>;
  constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
  const Index width = key_rows.rows();
  if (finite_values) {
    workspace.bad.clear();
  } else {
    find_nonfinite_rows(value_rows, workspace.bad);
  }
  workspace.counts.start_chunk(first_key, width);
  for (Index r = 0; r < query.rows(); ++r) {
    Index limit = 0;
    const int* count = workspace.counts.next_row(r, limit);
    Index first = 0;
    while (first < limit && count[first] == 0) ++first;
    Index last = limit;
    while (last > first && count[last - 1] == 0) --last;
    auto out_row = out.row(r);
    if (first == last) {
      out_row.setZero();
      continue;
    }
    const Index n = last - first;
    workspace.logits.resize(n);
    workspace.logits.noalias() = key_rows.middleRows(first, n) * query.row(r).transpose();
    Scalar* logit = workspace.logits.data();
    const int* row_count = count + first;
    const Scalar* log_count = workspace.counts.log_counts();
    for (Index c = 0; c < n; ++c) {
      logit[c] = row_count[c] == 0 ? kMinusInfinity : logit[c] + log_count[row_count[c]];
    }
    const Scalar high = workspace.logits.maxCoeff();
    if (!(high > kMinusInfinity)) {
      // Nothing visible weighs anything, unless a NaN hid from (or is) the maximum.
      if (std::isnan(high) || workspace.logits.hasNaN()) {
        out_row.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
      } else {
        out_row.setZero();
      }
      continue;
    }
    workspace.exponentials = (workspace.logits.array() - high).exp();
    Scalar* weight = workspace.exponentials.data();
    for (Index c = 0; c < n; ++c) weight[c] = logit[c] == kMinusInfinity ? Scalar(0) : weight[c];
    const Scalar sum = workspace.exponentials.sum();
    const bool reached = std::any_of(workspace.bad.begin(), workspace.bad.end(),
                                     [&](Index c) { return c >= first && c < last; });
    if (!reached) {
      workspace.sum.noalias() =
          workspace.exponentials.matrix().transpose() * value_rows.middleRows(first, n);
    } else {
      // Term by term over the keys whose logit is above -inf: a masked key adds nothing
      // whatever its value, a visible key's non-finite value reaches the row even at weight 0.
      workspace.sum.setZero(value_rows.cols());
      for (Index c = 0; c < n; ++c) {
        if (logit[c] != kMinusInfinity) workspace.sum += weight[c] * value_rows.row(first + c);
      }
    }
    if (sum != 0) {  // NaN: seen, and poisoned
      out_row = workspace.sum / sum;
    } else {
      out_row.setZero();
    }
  }
}

/// Fused kernel for query rows `[row_begin, row_end)` of one head: weights \f$c_{ij}
/// e^{S_{ij}}\f$ over the union of the rows' blocks (BlockCounts), row by row
/// (fused_row_by_row) for a union of at most kRowByRowKeys keys (see kVectorWalk), else one
/// online softmax in chunks of kFusedKeyTile keys (OnlineSoftmax::update_counted). The key and
/// value rows are stored as `Storage` or already in the compute type (fused_span's packed
/// copies). The query tile and each key and value chunk not yet in the compute type are
/// converted once; the output rows are rounded back once. With kBf16Scores the scores come from
/// the query tile's bfloat16 pairs and each chunk's key panels (avx512::bf16_scores) instead.
template <class Storage, class KeyStorage>
void fused_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<KeyStorage>& k,
                const ConstHeadMap<KeyStorage>& v, const std::vector<Grid>& grids,
                const AttentionOptions& options, const PositionRange& range, Index row_begin,
                Index row_end, HeadMap<Storage>& out, bool finite_values = false) {
  using Scalar = Compute<Storage>;
  static thread_local FusedWorkspace<Storage> workspace;
  const Index rows = row_end - row_begin;
  const Block keys = workspace.counts.prepare(grids, range, options.query_position + row_begin,
                                              rows, options.key_position,
                                              options.key_position + k.rows(), options.causal);
  if (!kVectorWalk<Scalar> && keys.begin < keys.end && keys.end - keys.begin <= kRowByRowKeys) {
    workspace.query.noalias() = compute_rows(map_rows(q, row_begin, rows), workspace.query_rows) *
                                static_cast<Scalar>(options.scale);
    const Index first_key = keys.begin - options.key_position;
    const Index width = keys.end - keys.begin;
    fused_row_by_row(workspace, workspace.query,
                     compute_rows(map_rows(k, first_key, width), workspace.key_rows),
                     compute_rows(map_rows(v, first_key, width), workspace.value_rows), keys.begin,
                     workspace.output.bind(map_rows(out, row_begin, rows)), finite_values);
    workspace.output.store();
    return;
  }
  workspace.softmax.reset(rows, v.cols());
  if (keys.begin < keys.end) {
    if constexpr (kBf16Scores<Storage>) {
#if defined(PLSH_DECODE_AVX512_BF16) && defined(PLSH_FUSED_AVX512)
      avx512::pack_query_pairs(q.data() + row_begin * q.outerStride(), rows, q.cols(),
                               q.outerStride(), workspace.query_pairs);
#endif
    } else {
      workspace.query.noalias() = compute_rows(map_rows(q, row_begin, rows), workspace.query_rows) *
                                  static_cast<Scalar>(options.scale);
    }
    workspace.scores.resize(static_cast<std::size_t>(rows * kFusedKeyTile));
    for (Index c0 = keys.begin; c0 < keys.end; c0 += kFusedKeyTile) {
      const Index cols = std::min(kFusedKeyTile, keys.end - c0);
      const Index first_key = c0 - options.key_position;
      Eigen::Map<RowMatrix<Scalar>> scores(workspace.scores.data(), rows, cols);
      if constexpr (kBf16Scores<Storage>) {
#if defined(PLSH_DECODE_AVX512_BF16) && defined(PLSH_FUSED_AVX512)
        avx512::pack_key_panels(k.data() + first_key * k.outerStride(), cols, k.cols(),
                                k.outerStride(), workspace.key_panels);
        avx512::bf16_scores(workspace.query_pairs.data(), rows, workspace.key_panels.data(), cols,
                            avx512::bf16_pairs(k.cols()), static_cast<float>(options.scale),
                            scores.data(), cols);
#endif
      } else {
        multiply_transposed(workspace.query,
                            compute_rows(map_rows(k, first_key, cols), workspace.key_rows), scores);
      }
      workspace.counts.start_chunk(c0, cols);
      workspace.softmax.update_counted(
          scores, compute_rows(map_rows(v, first_key, cols), workspace.value_rows),
          [&](Index r, Index& limit) { return workspace.counts.next_row(r, limit); },
          workspace.counts.log_counts(), static_cast<Index>(grids.size()), finite_values);
    }
  }
  workspace.softmax.finish(workspace.output.bind(map_rows(out, row_begin, rows)), nullptr);
  workspace.output.store();
}

/// fused_span takes fused_causal_rows (AVX-512 builds, kCausalRows) for the causal rows of heads
/// of slope m with 1/m below this (with s = 20 draws their rows see 5 to 50 keys): at 1/m = 16,
/// where the rows see 33 to 88 (5th percentile to maximum), the tiles' blocked products were
/// faster.
constexpr double kCausalRowsReach = 16;

/// Rows per tile of fused_causal_rows: the rows whose block starts are found before their keys
/// are computed.
constexpr Index kCausalTileRows = 32;

/// A tile of fused_causal_rows with a row that sees more keys than this goes to fused_rows.
constexpr Index kCausalRowKeys = 128;

#if defined(PLSH_FUSED_AVX512) && defined(PLSH_DECODE_AVX512)
/// Whether fused_span takes fused_causal_rows for the causal rows of steep heads (AVX-512,
/// float compute type).
template <class Scalar>
constexpr bool kCausalRows = std::is_same<Scalar, float>::value;

/// Per-thread scratch of fused_causal_rows; the draws padded to a multiple of 8 (a vector of
/// doubles) with grids that never start a block and starts past every position.
struct CausalRowsWorkspace {
  AlignedVector<double> pitch, shift;  // [draw]
  AlignedVector<double> bin;           // [draw]: bin index of the current row
  AlignedVector<std::int64_t> begin;   // [draw]: start of the block that holds the current row
  AlignedVector<std::int64_t> tile;    // [row of the tile][draw]: each row's starts
  std::vector<Index> smallest;         // [row of the tile]: each row's smallest start
  std::vector<float> log_count;        // log(c) for c = 0..s
  AlignedVector<float> query;          // the tile's query rows in float, scaled
  AlignedVector<float> weights;        // one row's scores, then weights
  AlignedVector<float> sum;            // one row's weighted sum of values
  std::vector<Index> bad;              // positions of value rows with a non-finite entry
};

/// The fused kernel on causal query rows `[row_begin, row_end)` of a steep head, row by row,
/// with the AVX-512 code of the walk and of decoding. Row i at position p sees the keys from its
/// draws' smallest block start to p, with \f$c_{ij} = \#\{t : b_t \le j\}\f$ (a causal block
/// that holds p starts at \f$b_t\f$ and reaches p). The starts are carried from row to row, all
/// draws at once: a draw's block changes where its bin does (the bin test of tile_block_runs, in
/// vectors of 8 draws; the first row's blocks by grid_block). Per row, 16 keys at a time in
/// registers: the scores (avx512::score_block), the counts (one vector compare per draw), the
/// logits \f$S + \log c\f$ and their maximum \f$\mu\f$; then the weights \f$e^{l - \mu}\f$ and
/// their sum as the walk's counted_weights computes them (the largest weight is exactly 1, so a
/// row that sees one key gets its value exactly; a logit \f$-\infty\f$ weighs exactly 0; a NaN
/// makes the row NaN), and the weighted sum of values by avx512::weighted_sum. A tile of
/// kCausalTileRows rows with a row wider than kCausalRowKeys keys goes to fused_rows, and so does a
/// row that sees a non-finite value (unless `finite_values`, the value rows are scanned for them
/// first). Key and value rows in float or, read in place, in a 16-bit type (converted in registers:
/// the same floats as fused_span's packed copy).
template <class Storage, class KeyStorage>
void fused_causal_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<KeyStorage>& k,
                       const ConstHeadMap<KeyStorage>& v, const std::vector<Grid>& grids,
                       const AttentionOptions& options, const PositionRange& range, Index row_begin,
                       Index row_end, HeadMap<Storage>& out, bool finite_values) {
  static thread_local CausalRowsWorkspace scratch;
  const Index samples = static_cast<Index>(grids.size());
  const Index draws = (samples + 7) / 8 * 8;
  const Index dim = q.cols();
  const Index value_dim = v.cols();
  const Index key_begin = options.key_position;
  const Index key_end = options.key_position + k.rows();
  fill_log_counts(scratch.log_count, samples);
  const LogCountLookup log_count(scratch.log_count.data(), samples);
  for (auto* vector : {&scratch.pitch, &scratch.shift, &scratch.bin}) {
    vector->resize(static_cast<std::size_t>(draws));
  }
  scratch.begin.resize(static_cast<std::size_t>(draws));
  scratch.tile.resize(static_cast<std::size_t>(kCausalTileRows * draws));
  scratch.smallest.resize(static_cast<std::size_t>(kCausalTileRows));
  scratch.query.resize(static_cast<std::size_t>(kCausalTileRows * dim));
  scratch.weights.resize(static_cast<std::size_t>(kCausalRowKeys + 16));
  scratch.sum.resize(static_cast<std::size_t>(value_dim));
  const Index first_position = options.query_position + row_begin;
  for (Index t = 0; t < draws; ++t) {
    const auto i = static_cast<std::size_t>(t);
    if (t < samples) {
      const Grid& grid = grids[i];
      scratch.pitch[i] = grid.pitch;
      scratch.shift[i] = grid.shift;
      scratch.begin[i] = grid_block(grid, first_position, range.first, range.last).begin;
      scratch.bin[i] =
          std::isfinite(grid.pitch) && grid.pitch > 1 ? bin_index(grid, first_position) : 0;
    } else {
      scratch.pitch[i] = std::numeric_limits<double>::infinity();
      scratch.shift[i] = 0;
      scratch.begin[i] = std::numeric_limits<std::int64_t>::max();
      scratch.bin[i] = 0;
    }
  }
  // Position p's block starts from p - 1's: a draw whose bin changes (or whose pitch is at most
  // 1: blocks of one position) starts a block at p. Returns the smallest start.
  const auto advance = [&](Index p) {
    const __m512d position = _mm512_set1_pd(static_cast<double>(p));
    __m512i smallest = _mm512_set1_epi64(std::numeric_limits<std::int64_t>::max());
    for (Index t = 0; t < draws; t += 8) {
      const __m512d pitch = _mm512_load_pd(scratch.pitch.data() + t);
      const __m512d bin = _mm512_roundscale_pd(
          _mm512_div_pd(_mm512_sub_pd(position, _mm512_load_pd(scratch.shift.data() + t)), pitch),
          _MM_FROUND_TO_NEG_INF | _MM_FROUND_NO_EXC);
      const __mmask8 starts =
          _mm512_cmp_pd_mask(bin, _mm512_load_pd(scratch.bin.data() + t), _CMP_NEQ_UQ) |
          _mm512_cmp_pd_mask(pitch, _mm512_set1_pd(1.0), _CMP_LE_OQ);
      _mm512_store_pd(scratch.bin.data() + t, bin);
      const __m512i begin = _mm512_mask_blend_epi64(
          starts, _mm512_load_si512(scratch.begin.data() + t), _mm512_set1_epi64(p));
      _mm512_store_si512(scratch.begin.data() + t, begin);
      smallest = _mm512_min_epi64(smallest, begin);
    }
    return static_cast<Index>(_mm512_reduce_min_epi64(smallest));
  };
  Index smallest = *std::min_element(scratch.begin.begin(), scratch.begin.end());
  // The positions of the value rows with a non-finite entry among the keys the rows may see
  // (from the first row's smallest start on): a row that sees one goes to fused_rows, so that
  // the rows that see none are those of clean values, bit for bit.
  scratch.bad.clear();
  if (!finite_values) {
    const Index low = std::max(smallest, key_begin);
    const Index high = std::min(options.query_position + row_end, key_end);
    for (Index j = low; j < high; ++j) {
      if (!all_finite(v.row(j - key_begin).template cast<float>())) scratch.bad.push_back(j);
    }
  }
  const float scale = static_cast<float>(options.scale);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i one = _mm512_set1_epi32(1);
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (Index r0 = row_begin; r0 < row_end; r0 += kCausalTileRows) {
    const Index r1 = std::min(row_end, r0 + kCausalTileRows);
    Index widest = 0;
    for (Index r = r0; r < r1; ++r) {
      const Index p = options.query_position + r;
      if (r != row_begin) smallest = advance(p);
      std::copy(scratch.begin.begin(), scratch.begin.end(),
                scratch.tile.begin() + static_cast<std::ptrdiff_t>((r - r0) * draws));
      scratch.smallest[static_cast<std::size_t>(r - r0)] = smallest;
      widest = std::max(widest, std::min(p + 1, key_end) - std::max(smallest, key_begin));
    }
    if (widest > kCausalRowKeys) {
      fused_rows<Storage>(q, k, v, grids, options, range, r0, r1, out, finite_values);
      continue;
    }
    // The tile's query rows first, in one loop of independent loads.
    Eigen::Map<RowMatrix<float>> queries(scratch.query.data(), r1 - r0, dim);
    if constexpr (std::is_same<Storage, float>::value) {
      queries = q.middleRows(r0, r1 - r0) * scale;
    } else {
      for (Index r = r0; r < r1; ++r) {
        convert_to_compute(q.data() + r * q.outerStride(), dim,
                           scratch.query.data() + (r - r0) * dim);
      }
      queries *= scale;
    }
    for (Index r = r0; r < r1; ++r) {
      const Index p = options.query_position + r;
      const std::int64_t* begins = &scratch.tile[static_cast<std::size_t>((r - r0) * draws)];
      const Index first = std::max(scratch.smallest[static_cast<std::size_t>(r - r0)], key_begin);
      const Index count = std::min(p + 1, key_end) - first;
      auto out_row = out.row(r);
      if (count <= 0) {
        out_row.setZero();
        continue;
      }
      const auto bad = std::lower_bound(scratch.bad.begin(), scratch.bad.end(), first);
      if (bad != scratch.bad.end() && *bad < first + count) {
        fused_rows<Storage>(q, k, v, grids, options, range, r, r + 1, out, false);
        continue;
      }
      // Pass 1, 16 keys at a time in registers: the logits S + log c_j, c_j = #{t : b_t <=
      // first + j} (at least 1: the keys start at the smallest start), their maximum, whether a
      // NaN is among them.
      const KeyStorage* keys = k.data() + (first - key_begin) * k.outerStride();
      const float* query = scratch.query.data() + (r - r0) * dim;
      __m512 best = minus_infinity;
      __mmask16 nan = 0;
      for (Index j = 0; j < count; j += 16) {
        const __mmask16 valid = lanes_below(count - j);
        const __m512i offset = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j)));
        __m512i counts = _mm512_setzero_si512();
        for (Index t = 0; t < samples; ++t) {
          const Index start = std::clamp<Index>(begins[t] - first, -1, kCausalRowKeys);
          counts = _mm512_mask_add_epi32(
              counts, _mm512_cmpge_epi32_mask(offset, _mm512_set1_epi32(static_cast<int>(start))),
              counts, one);
        }
        const __m512 logit = _mm512_add_ps(
            avx512::score_block(keys, j, count, dim, k.outerStride(), query), log_count(counts));
        nan |= _mm512_mask_cmp_ps_mask(valid, logit, logit, _CMP_UNORD_Q);
        best = _mm512_mask_max_ps(best, valid, logit, best);
        _mm512_store_ps(scratch.weights.data() + j, logit);
      }
      const float max = _mm512_reduce_max_ps(best);
      if (nan != 0 || max == -std::numeric_limits<float>::infinity()) {
        // A NaN poisons the row; a row whose scores are all -inf sees nothing (fused_rows).
        out_row.setConstant(nan != 0 ? static_cast<Storage>(std::numeric_limits<float>::quiet_NaN())
                                     : Storage(0));
        continue;
      }
      // Pass 2: the weights e^(l - max) (the largest exactly 1) and their sum.
      const __m512 shift = _mm512_set1_ps(max);
      __m512 totals = _mm512_setzero_ps();
      for (Index j = 0; j < count; j += 16) {
        const __mmask16 valid = lanes_below(count - j);
        const __m512 logit = _mm512_load_ps(scratch.weights.data() + j);
        // Exactly 0 for a logit -inf (the vectorised exp gives a tiny subnormal there).
        const __mmask16 weighs = _mm512_mask_cmp_ps_mask(valid, logit, minus_infinity, _CMP_NEQ_OQ);
        const __m512 weight = _mm512_maskz_mov_ps(
            weighs, Eigen::internal::pexp<Eigen::internal::Packet16f>(_mm512_sub_ps(logit, shift)));
        _mm512_store_ps(scratch.weights.data() + j, weight);
        totals = _mm512_add_ps(totals, weight);
      }
      const float total = _mm512_reduce_add_ps(totals);
      avx512::weighted_sum(v.data() + (first - key_begin) * v.outerStride(), count, value_dim,
                           v.outerStride(), scratch.weights.data(), scratch.sum.data());
      Eigen::Map<Eigen::Matrix<float, 1, Eigen::Dynamic>> sum(scratch.sum.data(), value_dim);
      if constexpr (std::is_same<Storage, float>::value) {
        out_row = sum / total;
      } else {
        sum /= total;
        convert_from_compute(scratch.sum.data(), value_dim, out_row.data());
      }
    }
  }
}
#else
template <class Scalar>
constexpr bool kCausalRows = false;
#endif

/// Query rows per job of the fused kernel, at most (a multiple of every tile height).
constexpr Index kFusedSpanRows = 1024;

/// Query rows per job of the fused kernel for `elements` (batch element, head) pairs of `tokens`
/// rows each: kFusedSpanRows, halved (down to 64 rows) while that makes fewer than 32 jobs, so
/// that small calls still spread over the threads. A function of the shapes only: the results do
/// not depend on the number of threads.
inline Index fused_span_rows(Index elements, Index tokens) {
  Index rows = kFusedSpanRows;
  while (rows > 64 && elements * ((tokens + rows - 1) / rows) < 32) rows /= 2;
  return rows;
}

/// The widest key range a job of the fused kernel packs by default (see fused_span); a wider one
/// is read in place. Bounds the per-thread scratch at kFusedSpanKeys key and value rows.
constexpr Index kFusedSpanKeys = 8192;

/// Per-thread copies of the key and value rows of one job, packed (row stride = the row's width)
/// in the compute type.
template <class Scalar>
struct SpanKeys {
  AlignedVector<Scalar> k, v;
};

/// The keys that query rows `[row_begin, row_end)` of a head may see: from the first row's
/// earliest block start to the last row's latest block end (to the last row itself when
/// causal), cut to the keys `[key_begin, key_end)`. Every row's blocks lie inside, blocks
/// being intervals in the order of the positions. O(s) calls of grid_block.
inline Block span_keys(const std::vector<Grid>& grids, const PositionRange& range,
                       Index first_position, Index last_position, Index key_begin, Index key_end,
                       bool causal) {
  Index begin = last_position + 1;
  Index end = causal ? last_position + 1 : first_position;
  for (const Grid& grid : grids) {
    begin = std::min(begin, grid_block(grid, first_position, range.first, range.last).begin);
    if (!causal) end = std::max(end, grid_block(grid, last_position, range.first, range.last).end);
  }
  begin = std::max(begin, key_begin);
  end = std::min(end, key_end);
  return begin < end ? Block{begin, end} : Block{key_begin, key_begin};
}

/// Query rows `[row_begin, row_end)` of one head by the fused kernel, tile by tile (height from
/// the head's slope). When the keys the rows may see (span_keys) are at most `max_packed_keys`
/// and the head's key or value rows are strided (a token-major tensor's rows of one head lie
/// `heads * dim` elements apart: few rows per page for the prefetchers, few sets of the L1 cache
/// for the rows that tile after tile reads again) or stored in a 16-bit type, those key and value
/// rows are first copied, packed and in the compute type, into per-thread scratch: each is read
/// from the tensor and converted once, in a loop whose loads are independent, instead of missing
/// the cache inside the products and being converted again by every tile that sees it. Same
/// arithmetic either way. (A tile's query rows are copied anyway, scaled, and its output rows
/// written once.) When the keys are in the compute type, the values of those keys are tested for
/// finiteness once here, and the tiles skip their own test when they are
/// (OnlineSoftmax::update_counted, fused_row_by_row).
template <class Storage>
void fused_span(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                const ConstHeadMap<Storage>& v, const std::vector<Grid>& grids, double slope,
                const AttentionOptions& options, const PositionRange& range, Index row_begin,
                Index row_end, HeadMap<Storage>& out, Index max_packed_keys) {
  using Scalar = Compute<Storage>;
  const Index height = fused_tile_rows(slope);
  const Block keys = span_keys(grids, range, options.query_position + row_begin,
                               options.query_position + row_end - 1, options.key_position,
                               options.key_position + k.rows(), options.causal);
  const Index key_count = keys.end - keys.begin;
  const auto tiles = [&](const auto& key_rows, const auto& value_rows, const AttentionOptions& at) {
    // Every tile's keys lie among the span's: their values are tested for finiteness once here
    // when they are in the compute type (16-bit rows read in place: each converted chunk).
    bool finite_values = false;
    using KeyScalar = typename std::decay_t<decltype(key_rows)>::Scalar;
    if constexpr (std::is_same<KeyScalar, Scalar>::value) {
      finite_values = key_count > 0 &&
                      all_finite(map_rows(value_rows, keys.begin - at.key_position, key_count));
    }
#if defined(PLSH_FUSED_AVX512) && defined(PLSH_DECODE_AVX512)
    if constexpr (kCausalRows<Scalar>) {
      if (at.causal && slope * kCausalRowsReach > 1) {
        fused_causal_rows<Storage>(q, key_rows, value_rows, grids, at, range, row_begin, row_end,
                                   out, finite_values);
        return;
      }
    }
#endif
    for (Index r0 = row_begin; r0 < row_end; r0 += height) {
      fused_rows<Storage>(q, key_rows, value_rows, grids, at, range, r0,
                          std::min(row_end, r0 + height), out, finite_values);
    }
  };
  const bool strided = k.outerStride() != k.cols() || v.outerStride() != v.cols();
  const bool converted = !std::is_same<Storage, Scalar>::value;
  if ((!strided && !converted) || key_count == 0 || key_count > max_packed_keys) {
    tiles(k, v, options);
    return;
  }
  static thread_local SpanKeys<Scalar> span;
  const Index first_key = keys.begin - options.key_position;
  AttentionOptions packed = options;
  packed.key_position = keys.begin;
  tiles(pack_rows<Scalar>(k, first_key, key_count, span.k),
        pack_rows<Scalar>(v, first_key, key_count, span.v), packed);
}

/// The fused kernel: parallel over (batch element, span of fused_span_rows query rows, head) in
/// one parallel region (fused_span, packing at most `max_packed_keys` keys per job); the grids are
/// shared by the batch elements. Consecutive jobs take the heads of one span in turn: in a
/// token-major tensor their rows share pages, which the first job brings in.
template <class Storage>
void fused_attention(const BatchedHeadsView<const Storage>& q,
                     const BatchedHeadsView<const Storage>& k,
                     const BatchedHeadsView<const Storage>& v, const BatchedHeadsView<Storage>& out,
                     const std::vector<std::vector<Grid>>& grids, const std::vector<double>& slopes,
                     const AttentionOptions& options, Index max_packed_keys = kFusedSpanKeys) {
  if (q.batch == 0 || q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  const PositionRange range = position_range(q, k, options);
  const Index span_rows = fused_span_rows(q.batch * q.heads, q.tokens);
  const Index spans = (q.tokens + span_rows - 1) / span_rows;
  const Index element_jobs = q.heads * spans;
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  parallel_for(q.batch * element_jobs, work, [&](Index job) {
    const Index b = job / element_jobs;
    const Index h = job % q.heads;
    const Index row_begin = job % element_jobs / q.heads * span_rows;
    HeadMap<Storage> out_head = out[b].head(h);
    fused_span<Storage>(q[b].head(h), k[b].head(h / group), v[b].head(h / group),
                        grids[static_cast<std::size_t>(h)], slopes[static_cast<std::size_t>(h)],
                        resolved, range, row_begin, std::min(q.tokens, row_begin + span_rows),
                        out_head, max_packed_keys);
  });
}

/// fused_attention on one element (a batch of one), as the KV cache's decoding step and the
/// tests call it.
template <class Scalar>
void fused_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                     const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                     const std::vector<std::vector<Grid>>& grids, const std::vector<double>& slopes,
                     const AttentionOptions& options, Index max_packed_keys = kFusedSpanKeys) {
  fused_attention(batch_of_one(q), batch_of_one(k), batch_of_one(v), batch_of_one(out), grids,
                  slopes, options, max_packed_keys);
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
  validate_plsh("plsh_attention", q[0], k[0], v[0], out[0], slopes, options, memory_of(q));
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
  validate_attention(function, q[0], k[0], v[0], out[0], options, memory_of(q));
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
