#ifndef PLSH_ATTENTION_BACKWARD_HPP
#define PLSH_ATTENTION_BACKWARD_HPP

/// \file backward.hpp
/// Gradients of exact, truncated and windowed ALiBi attention, of Positional LSH attention and of
/// fixed blocks with respect to q, k, v.
///
/// All the forwards are softmax attention with logits \f$l_{ij}\f$: exact ALiBi
/// \f$l_{ij} = S_{ij} - m|p_i - p_j|\f$ (truncated and windowed ALiBi: the same, masked outside
/// the keys they keep), Positional LSH \f$l_{ij} = S_{ij} + \log c_{ij}\f$ with
/// \f$c_{ij}\f$ the number of draws in which i and j share a block (\f$c = 0\f$: masked), and
/// \f$S_{ij} = \text{scale}\; q_i\cdot k_j\f$. With \f$P_{ij} = e^{l_{ij} - \mathrm{lse}_i}\f$,
/// \f$o_i = \sum_j P_{ij} v_j\f$ and the gradient \f$dO\f$ of a loss with respect to the output:
/// \f[ D_i = dO_i\cdot o_i,\quad dV_j = \sum_i P_{ij}\, dO_i,\quad dP_{ij} = dO_i\cdot v_j,\quad
///     dS_{ij} = P_{ij}(dP_{ij} - D_i), \f]
/// \f[ dQ_i = \text{scale}\sum_j dS_{ij} k_j,\qquad dK_j = \text{scale}\sum_i dS_{ij} q_i. \f]
/// Query heads of a group (H a multiple of H_kv) add their dK, dV into their shared head.
///
/// Cost: FlashAttention-style recomputation, nothing \f$n\times n\f$. Two paths; uses_one_sweep
/// picks one from the number of key/value heads against the processors (never from the number of
/// threads or the batch size, so the result does not change with either):
/// - One sweep (backward_group; FlashAttention-2's backward), when an element has at least as
///   many key/value heads as there are processors: parallel over (batch element, key/value
///   head). A job visits the group's query heads in order, each head's query tiles in order and
///   each tile's visible keys in chunks: the logits, \f$P = e^{l - \mathrm{lse}}\f$, dP and dS
///   once per visible score, added to the tile's dQ and to the chunk's rows of dK and dV, which
///   the job alone writes. Five products, about \f$6d + 4d_v\f$ flops per visible score; without
///   the forward's lse, a pass over (batch element, head, query tile) first computes it from the
///   logits alone (logits_lse, \f$2d\f$ more).
/// - Two sweeps, for fewer key/value heads (one head; grouped heads with one key/value head),
///   parallel over tiles. Sweep 1, over (batch element, head, query tile): the logits of the
///   visible keys and dQ (without the forward's lse, with a running log-sum-exp: dQ's accumulator
///   is rescaled on a new row maximum, like the forward's output). Sweep 2, over (batch element,
///   key/value head, key tile): the logits again, P from the lse, dV and dK, with the query heads
///   of the group and their query tiles visited in a fixed order. Seven products, about \f$8d +
///   6d_v\f$ flops per visible score.
///
/// The forward: \f$2d + 2d_v\f$. The forward's row lse (RowLse, row_lse.hpp, FlashAttention's
/// `softmax_lse`) is read after the row constant of ALiBi's logits (regular.hpp's
/// apply_linear_bias: nonzero for a query beyond the last key or before the first) is added to a
/// copy of it; given the windowed forward's kept keys (KeptKeys, kept_keys.hpp), the windowed
/// backward does not run the certificate. Each sweep is one OpenMP region for the whole batch
/// (batch.hpp; an unbatched call is a batch of one), and the draws are made once per call.
/// Memory: lse and D, \f$2BHn_q\f$ scalars, plus one tile workspace per thread (the one sweep
/// with 16-bit storage: a head of dK and dV in float). Every output row is written by one job and
/// every sum runs in a fixed order: the result is identical for any number of threads. The
/// Positional LSH visible set and counts of a tile of rows come from BlockCounts, the fused
/// forward's own.
///
/// Storage types (detail/storage.hpp): q, k, v, out, dout and the gradients may be float, double,
/// Eigen::bfloat16 or Eigen::half; the sweeps compute in `Compute<S>` (float for the 16-bit
/// types), lse and D included. A 16-bit tile of an input is converted to float once per use
/// (compute_rows: a query tile's q, out, dout rows and each of its key chunks' k, v; sweep 2 the
/// key tile's k, v and each query tile's q, dout) and the gradient rows are rounded back once
/// (OutputRows). For float and double nothing is copied.
///
/// Masked keys: the logits are \f$-\infty\f$, their weights exactly 0 (the forward's masked
/// exp), and every product skips the terms of a zero weight, so a key no query sees gets
/// \f$dK = dV = 0\f$ and a non-finite k or v of a masked key changes no other gradient.
///
/// Tested in tests/test_backward.cpp against central finite differences of
/// exact_alibi_attention, truncated_alibi_attention and plsh_attention, and against the dense
/// double references plsh::reference::alibi_attention_backward,
/// plsh::reference::truncated_alibi_attention_backward and
/// plsh::reference::plsh_attention_backward (reference.hpp), and the one sweep against the two
/// sweeps and on 1 and 2 threads; the windowed backward in
/// tests/test_windowed.cpp; bfloat16 and half storage in tests/test_half.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/check.hpp"
#include "../detail/parallel.hpp"
#include "../detail/scratch.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../partition.hpp"
#include "../row_lse.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "alibi_attention.hpp"
#include "block_counts.hpp"
#include "kept_keys.hpp"
#include "near_field.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Per-thread scratch of the backward sweeps.
template <class Scalar>
struct BackwardWorkspace {
  RowMatrix<Scalar> query;              // scaled query rows of a tile
  AlignedVector<Scalar> scores;         // logits, then weights or P, then dS
  AlignedVector<Scalar> value_scores;   // dP = dO v^T
  OnlineSoftmax<Scalar> softmax;        // sweep 1: running lse, dQ as its accumulator
  RowMatrix<Scalar> accumulator;        // dK of a key tile (sweep 1 with a given lse: dQ)
  RowMatrix<Scalar> value_accumulator;  // dV of a key tile
  std::vector<Index> nonfinite;         // rows of a product's operand with a non-finite entry
  RowMatrix<Scalar> clean;              // that operand with those rows zeroed
  Block window;                         // key positions of the tile last prepared (windowed)
  BlockCounts<Scalar> block_counts;     // c_ij of the Positional LSH logits
  Eigen::Array<Scalar, 1, Eigen::Dynamic> offsets;  // 0, 1, ..., for apply_linear_bias

  /// Room for `elements` entries in scores and value_scores (they only grow).
  void reserve_tile(std::size_t elements) {
    if (scores.size() < elements) scores.resize(elements);
    if (value_scores.size() < elements) value_scores.resize(elements);
  }
};

/// The calling thread's BackwardWorkspace for the lease's lifetime (detail/scratch.hpp).
template <class Scalar>
using BackwardWorkspaceLease = ScratchLease<BackwardWorkspace<Scalar>>;

/// Logits of exact ALiBi: \f$S_{ij} - m_h|p_i - p_j|\f$, causal keys masked; with a
/// `factor_tolerance` above 0, those of truncated_alibi_attention: the keys outside head h's band
/// \f$|p_i - p_j| \le W_h\f$ = factor_window(m_h, factor_tolerance) masked too.
template <class Scalar>
class AlibiLogits {
 public:
  AlibiLogits(const std::vector<double>& slopes, const AttentionOptions& options, Index queries,
              Index keys, double factor_tolerance = 0)
      : slopes_(slopes),
        options_(options),
        query_end_(options.query_position + queries),
        key_end_(options.key_position + keys),
        factor_tolerance_(factor_tolerance) {}

  Index query_tile(Index) const { return kQueryTile; }
  Index key_tile(Index, Index) const { return kKeyTile; }

  /// Key positions that query positions `[first_query, first_query + rows)` of batch element b
  /// and head h may see.
  Block prepare_rows(Index, Index h, Index first_query, Index rows,
                     BackwardWorkspace<Scalar>&) const {
    const Index window = band(h);
    const Index last_query = first_query + rows - 1;
    const Index begin = std::max(options_.key_position, first_query - window);
    const Index end = std::min(key_end_, (options_.causal ? last_query : last_query + window) + 1);
    return Block{begin, std::max(begin, end)};
  }

  /// Query positions that may see a key of `[first_key, first_key + cols)`.
  Block queries_of_keys(Index h, Index first_key, Index cols) const {
    const Index window = band(h);
    const Index earliest = options_.causal ? first_key : first_key - window;
    const Index begin = std::max(options_.query_position, earliest);
    const Index end = std::min(query_end_, first_key + cols + window);
    return Block{begin, std::max(begin, end)};
  }

  /// Adds the bias to a tile of scores whose first row and column are at the given positions.
  void apply(Index h, BackwardWorkspace<Scalar>& workspace, Eigen::Map<RowMatrix<Scalar>>& scores,
             Index first_query, Index first_key) const {
    if (workspace.offsets.size() < scores.cols()) {
      workspace.offsets =
          Eigen::Array<Scalar, 1, Eigen::Dynamic>::LinSpaced(kKeyTile, 0, kKeyTile - 1);
    }
    apply_linear_bias(scores, first_query - first_key, options_.causal,
                      LinearBias{slopes_[static_cast<std::size_t>(h)], band(h)},
                      key_span(first_query), workspace.offsets);
  }

  /// The lse of these logits of head h's rows `[first_query, first_query + rows)` in place of the
  /// lse of the true logits (the forward's, given to the backward): these carry the row constant
  /// \f$m_h r_i\f$ of apply_linear_bias.
  void shift_given_lse(Index h, Index first_query, Index rows, Scalar* lse) const {
    shift_lse(lse, rows, slopes_[static_cast<std::size_t>(h)], key_span(first_query));
  }

 private:
  /// The same key span as the forward (attend_rows): the logits carry the same row shift.
  KeySpan key_span(Index first_query) const {
    return KeySpan{first_query - options_.key_position, first_query - (key_end_ - 1)};
  }

  /// \f$W_h\f$: kNoWindow for exact ALiBi.
  Index band(Index h) const {
    return factor_window(slopes_[static_cast<std::size_t>(h)], factor_tolerance_);
  }

  const std::vector<double>& slopes_;
  AttentionOptions options_;
  Index query_end_;
  Index key_end_;
  double factor_tolerance_;
};

/// Logits of windowed_alibi_attention as computed: exact ALiBi over the key rows `kept` that each
/// query tile of kQueryTile rows visited in the forward (batched_windowed_alibi_attention's
/// `kept`), the other keys masked.
template <class Scalar>
class WindowedLogits : public AlibiLogits<Scalar> {
 public:
  WindowedLogits(const std::vector<double>& slopes, const AttentionOptions& options, Index heads,
                 Index queries, Index keys, const std::vector<Block>& kept)
      : AlibiLogits<Scalar>(slopes, options, queries, keys),
        options_(options),
        heads_(heads),
        tiles_((queries + kQueryTile - 1) / kQueryTile),
        query_end_(options.query_position + queries),
        kept_(kept) {
    // The farthest any tile's kept key lies from the tile's rows: bounds queries_of_keys.
    for (std::size_t i = 0; i < kept_.size(); ++i) {
      const Block rows = kept_[i];
      if (rows.begin >= rows.end) continue;
      const Index first = options.query_position + static_cast<Index>(i) % tiles_ * kQueryTile;
      const Index last = std::min(first + kQueryTile, query_end_) - 1;
      reach_ = std::max({reach_, first - (options.key_position + rows.begin),
                         options.key_position + rows.end - 1 - last});
    }
  }

  /// The key positions the tile starting at `first_query` kept (the rows given are part of it).
  Block prepare_rows(Index b, Index h, Index first_query, Index,
                     BackwardWorkspace<Scalar>& workspace) const {
    const Index tile = (first_query - options_.query_position) / kQueryTile;
    const Block rows = kept_[static_cast<std::size_t>((b * heads_ + h) * tiles_ + tile)];
    workspace.window = Block{options_.key_position + rows.begin, options_.key_position + rows.end};
    return workspace.window;
  }

  /// Query positions whose tiles may have kept a key of `[first_key, first_key + cols)`, from the
  /// first row of a tile.
  Block queries_of_keys(Index h, Index first_key, Index cols) const {
    const Block alibi = AlibiLogits<Scalar>::queries_of_keys(h, first_key, cols);
    if (alibi.begin >= alibi.end) return alibi;
    Index begin = std::max(alibi.begin, first_key - reach_);
    begin -= (begin - options_.query_position) % kQueryTile;
    const Index end = std::min(alibi.end, first_key + cols + reach_ + kQueryTile);
    return Block{begin, std::max(begin, end)};
  }

  /// The ALiBi logits, \f$-\infty\f$ outside the tile's kept keys (from the last prepare_rows).
  void apply(Index h, BackwardWorkspace<Scalar>& workspace, Eigen::Map<RowMatrix<Scalar>>& scores,
             Index first_query, Index first_key) const {
    AlibiLogits<Scalar>::apply(h, workspace, scores, first_query, first_key);
    const Index cols = scores.cols();
    const Index lo = std::clamp<Index>(workspace.window.begin - first_key, 0, cols);
    const Index hi = std::clamp<Index>(workspace.window.end - first_key, lo, cols);
    constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
    if (lo > 0) scores.leftCols(lo).setConstant(kMinusInfinity);
    if (hi < cols) scores.rightCols(cols - hi).setConstant(kMinusInfinity);
  }

 private:
  AttentionOptions options_;
  Index heads_;
  Index tiles_;
  Index query_end_;
  Index reach_ = 0;
  const std::vector<Block>& kept_;
};

/// Logits of the fused Positional LSH kernel: \f$S_{ij} + \log c_{ij}\f$ over the union of the
/// blocks of each row, with the draws of plsh_attention, and \f$S_{ij} + \log s - m|p_i - p_j|\f$
/// in the near field of PlshOptions::near_field `near_field` (near_field.hpp).
template <class Scalar>
class PlshLogits {
 public:
  PlshLogits(const std::vector<double>& slopes, const std::vector<std::vector<Grid>>& grids,
             const AttentionOptions& options, const PositionRange& range, Index queries, Index keys,
             double near_field = 0)
      : slopes_(slopes),
        grids_(grids),
        options_(options),
        range_(range),
        query_end_(options.query_position + queries),
        key_end_(options.key_position + keys),
        near_field_(near_field) {}

  Index query_tile(Index h) const { return fused_tile_rows(slopes_[static_cast<std::size_t>(h)]); }

  Index key_tile(Index kv_head, Index group) const {
    Index tile = kKeyTile;
    for (Index h = kv_head * group; h < (kv_head + 1) * group; ++h) {
      tile = std::min(tile, query_tile(h));
    }
    return tile;
  }

  /// Prepares the counts of the rows (as the fused forward) and returns the union of their keys.
  Block prepare_rows(Index, Index h, Index first_query, Index rows,
                     BackwardWorkspace<Scalar>& workspace) const {
    return workspace.block_counts.prepare(grids_[static_cast<std::size_t>(h)], range_, first_query,
                                          rows, options_.key_position, key_end_, options_.causal,
                                          estimator(h));
  }

  /// Query positions that share a block with a key of `[first_key, first_key + cols)` in some
  /// draw, or lie within the near field's reach of one: from the block of the first key to the
  /// block of the last, over the draws, widened by the reach.
  Block queries_of_keys(Index h, Index first_key, Index cols) const {
    Index begin = std::numeric_limits<Index>::max();
    Index end = std::numeric_limits<Index>::min();
    for (const Grid& grid : grids_[static_cast<std::size_t>(h)]) {
      begin = std::min(begin, grid_block(grid, first_key, range_.first, range_.last).begin);
      end = std::max(end, grid_block(grid, first_key + cols - 1, range_.first, range_.last).end);
    }
    const Index reach = estimator(h).reach();
    if (reach >= 0) {
      begin = std::min(begin, first_key - reach);
      end = std::max(end, first_key + cols + reach);
    }
    begin = std::max(begin, options_.query_position);
    if (options_.causal) begin = std::max(begin, first_key);
    end = std::min(end, query_end_);
    return Block{begin, std::max(begin, end)};
  }

  /// Adds the log weights \f$\log(s \hat K_{ij})\f$ (\f$\log c_{ij}\f$ beyond the near field) to
  /// a tile of scores (\f$-\infty\f$ where the weight is 0), from the last prepare_rows (whose
  /// first row must be `first_query`).
  void apply(Index, BackwardWorkspace<Scalar>& workspace, Eigen::Map<RowMatrix<Scalar>>& scores,
             Index, Index first_key) const {
    workspace.block_counts.add_log_weights(scores, first_key);
  }

  /// The lse of the true logits is that of these (no row constant).
  void shift_given_lse(Index, Index, Index, Scalar*) const {}

 private:
  /// The estimator of head h (Estimator: its weights and near field).
  Estimator estimator(Index h) const {
    const std::size_t head = static_cast<std::size_t>(h);
    return head_estimator(slopes_[head], static_cast<Index>(grids_[head].size()), near_field_,
                          range_);
  }

  const std::vector<double>& slopes_;
  const std::vector<std::vector<Grid>>& grids_;
  AttentionOptions options_;
  PositionRange range_;
  Index query_end_;
  Index key_end_;
  double near_field_;
};

/// \f$dS = P\circ(dP - D)\f$ in place of the weights P (rows of a tile), exactly 0 where
/// \f$P = 0\f$: the \f$dP\f$ of a masked key is NaN when its value row is.
template <class Scalar>
void score_gradient(Eigen::Map<RowMatrix<Scalar>>& weights,
                    const Eigen::Map<RowMatrix<Scalar>>& value_scores, const Scalar* delta) {
  for (Index r = 0; r < weights.rows(); ++r) {
    if (std::isfinite(delta[r]) && value_scores.row(r).allFinite()) {
      weights.row(r).array() *= value_scores.row(r).array() - delta[r];
      continue;
    }
    for (Index c = 0; c < weights.cols(); ++c) {
      const Scalar p = weights(r, c);
      weights(r, c) = p == 0 ? Scalar(0) : p * (value_scores(r, c) - delta[r]);
    }
  }
}

/// The weights and the score gradients of a tile in one pass: the logits in `scores` become
/// \f$P_{ij} = e^{l_{ij} - \mathrm{lse}_i}\f$ (exactly 0 where \f$l_{ij} = -\infty\f$ or
/// \f$\mathrm{lse}_i = -\infty\f$), and \f$dP\f$ in `value_scores` becomes
/// \f$dS_{ij} = P_{ij}(dP_{ij} - D_i)\f$ (exactly 0 where \f$P_{ij} = 0\f$: the \f$dP\f$ of a
/// masked key is NaN when its value row is). A softmax weight is at most 1: \f$e^{l -
/// \mathrm{lse}}\f$ above 1 is the rounding of a logit computed in another tiling than the lse,
/// which at huge scales would overflow (NaN stays NaN). In Eigen's packets; the exponentials are
/// those of Eigen's vectorised `exp()` of a row: its packet exp from the row's first aligned entry,
/// std::exp before it and in the tail.
template <class Scalar>
void weights_and_score_gradient(Eigen::Map<RowMatrix<Scalar>>& scores,
                                Eigen::Map<RowMatrix<Scalar>>& value_scores, const Scalar* lse,
                                const Scalar* delta) {
  using Packet = typename Eigen::internal::packet_traits<Scalar>::type;
  namespace internal = Eigen::internal;
  constexpr Index kSize = internal::packet_traits<Scalar>::size;
  constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
  const Index cols = scores.cols();
  const auto one_entry = [](Scalar& logit, Scalar& gradient, Scalar shift, Scalar d) {
    Scalar weight = logit == kMinusInfinity ? Scalar(0) : std::exp(logit - shift);
    if (weight > Scalar(1)) weight = 1;
    gradient = weight == 0 ? Scalar(0) : weight * (gradient - d);
    logit = weight;
  };
  const Packet one = internal::pset1<Packet>(Scalar(1));
  const Packet zero = internal::pset1<Packet>(Scalar(0));
  const Packet minus_infinity = internal::pset1<Packet>(kMinusInfinity);
  for (Index r = 0; r < scores.rows(); ++r) {
    Scalar* logit = scores.row(r).data();
    Scalar* gradient = value_scores.row(r).data();
    if (lse[r] == kMinusInfinity) {
      std::fill(logit, logit + cols, Scalar(0));
      std::fill(gradient, gradient + cols, Scalar(0));
      continue;
    }
    const Index aligned_begin =
        internal::first_aligned<static_cast<int>(sizeof(Packet))>(logit, cols);
    const Index aligned_end = aligned_begin + (cols - aligned_begin) / kSize * kSize;
    for (Index c = 0; c < aligned_begin; ++c) one_entry(logit[c], gradient[c], lse[r], delta[r]);
    const Packet shift = internal::pset1<Packet>(lse[r]);
    const Packet d = internal::pset1<Packet>(delta[r]);
    for (Index c = aligned_begin; c < aligned_end; c += kSize) {
      const Packet l = internal::pload<Packet>(logit + c);
      Packet weight = internal::pexp(internal::psub(l, shift));
      weight = internal::pselect(internal::pcmp_eq(l, minus_infinity), zero, weight);
      weight = internal::pselect(internal::pcmp_lt(one, weight), one, weight);
      const Packet product =
          internal::pmul(weight, internal::psub(internal::ploadu<Packet>(gradient + c), d));
      internal::pstore(logit + c, weight);
      internal::pstoreu(gradient + c,
                        internal::pselect(internal::pcmp_eq(weight, zero), zero, product));
    }
    for (Index c = aligned_end; c < cols; ++c) one_entry(logit[c], gradient[c], lse[r], delta[r]);
  }
}

/// `accumulator += weights * operand`, where an operand row with a non-finite entry adds only
/// where `weight_of(row, operand row)` is not 0.
template <class Scalar, class Accumulator, class Weights, class Operand, class WeightOf>
void add_seen_product(BackwardWorkspace<Scalar>& workspace, Accumulator& accumulator,
                      const Weights& weights, const Operand& operand, WeightOf&& weight_of) {
  find_nonfinite_rows(operand, workspace.nonfinite);
  add_product(
      accumulator, weights, operand, workspace.nonfinite, workspace.clean, EigenProduct{false},
      [&](Index row, std::size_t i) { return weight_of(row, workspace.nonfinite[i]) != 0; });
}

/// \f$D_i = dO_i\cdot o_i\f$ of the rows `[row_begin, row_begin + rows)` of a head into
/// `delta[row_begin + r]`, given the rows' dO in the compute type.
template <class Storage>
void write_delta(const ConstHeadMap<Compute<Storage>>& dout_rows, const ConstHeadMap<Storage>& out,
                 Index row_begin, Index rows, ConvertedRows<Storage>& converted,
                 Compute<Storage>* delta) {
  const ConstHeadMap<Compute<Storage>> out_rows = compute_rows(out, row_begin, rows, converted.out);
  for (Index r = 0; r < rows; ++r) delta[row_begin + r] = dout_rows.row(r).dot(out_rows.row(r));
}

/// The logits of query rows `[row_begin, row_begin + rows)` of head h, chunk by chunk: prepares
/// the rows (logits.prepare_rows), and when they see a key, puts their scaled queries in
/// `workspace.query` and calls `chunk(scores, k_chunk, first_key)` for their visible keys in
/// chunks of kKeyTile, in order. `scores` (rows × the chunk's keys, in `workspace.scores`) holds
/// the chunk's logits, `k_chunk` its keys in the compute type and `first_key` the row of its first
/// key in `k`. The three backward loops (backward_query_rows, backward_group, logits_lse) walk the
/// scores this way.
template <class Storage, class Logits, class Chunk>
void for_each_logit_chunk(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                          const AttentionOptions& options, const Logits& logits, Index b, Index h,
                          Index row_begin, Index rows,
                          BackwardWorkspace<Compute<Storage>>& workspace,
                          ConvertedRows<Storage>& converted, Chunk&& chunk) {
  using Scalar = Compute<Storage>;
  const Index first_query = options.query_position + row_begin;
  const Block keys = logits.prepare_rows(b, h, first_query, rows, workspace);
  if (keys.begin >= keys.end) return;
  workspace.query.noalias() =
      compute_rows(q, row_begin, rows, converted.query) * static_cast<Scalar>(options.scale);
  workspace.reserve_tile(static_cast<std::size_t>(rows * kKeyTile));
  for (Index c0 = keys.begin; c0 < keys.end; c0 += kKeyTile) {
    const Index cols = std::min(kKeyTile, keys.end - c0);
    const Index first_key = c0 - options.key_position;
    Eigen::Map<RowMatrix<Scalar>> scores(workspace.scores.data(), rows, cols);
    const ConstHeadMap<Scalar> k_chunk = compute_rows(k, first_key, cols, converted.key);
    scores.noalias() = workspace.query * k_chunk.transpose();
    logits.apply(h, workspace, scores, first_query, c0);
    chunk(scores, k_chunk, first_key);
  }
}

/// Sweep 1 for query rows `[row_begin, row_end)` of head h: writes those rows of dq, and their
/// lse and D. The forward's OnlineSoftmax runs over the logits, with \f$e^{l_{ij} - \mu_i}(dP_{ij}
/// - D_i)\f$ in place of the weights and \f$k_j\f$ in place of the values: its accumulator holds
/// \f$\sum_j e^{l_{ij} - \mu_i}(dP_{ij} - D_i) k_j\f$ and its output is \f$dQ_i/\text{scale}\f$.
/// With the forward's lse given (`given_lse`, the head's rows; `lse` is then not written), no
/// running maximum: \f$P\f$ from it (weights_and_score_gradient), \f$dQ_i = \text{scale}\sum_j
/// dS_{ij} k_j\f$ summed directly.
template <class Storage, class Logits>
void backward_query_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                         const ConstHeadMap<Storage>& v, const ConstHeadMap<Storage>& out,
                         const ConstHeadMap<Storage>& dout, HeadMap<Storage>& dq,
                         const AttentionOptions& options, const Logits& logits, Index b, Index h,
                         Index row_begin, Index row_end, const Compute<Storage>* given_lse,
                         Compute<Storage>* lse, Compute<Storage>* delta) {
  using Scalar = Compute<Storage>;
  const BackwardWorkspaceLease<Scalar> workspace_lease;
  const ConvertedRowsLease<Storage> converted_lease;
  BackwardWorkspace<Scalar>& workspace = *workspace_lease;
  ConvertedRows<Storage>& converted = *converted_lease;
  const Index rows = row_end - row_begin;
  const Scalar scale = static_cast<Scalar>(options.scale);
  const ConstHeadMap<Scalar> dout_rows = compute_rows(dout, row_begin, rows, converted.dout);
  write_delta(dout_rows, out, row_begin, rows, converted, delta);
  const bool given = given_lse != nullptr;
  if (given) {
    workspace.accumulator.setZero(rows, q.cols());
  } else {
    workspace.softmax.reset(rows, q.cols());
  }
  for_each_logit_chunk(
      q, k, options, logits, b, h, row_begin, rows, workspace, converted,
      [&](Eigen::Map<RowMatrix<Scalar>>& scores, const ConstHeadMap<Scalar>& k_tile,
          Index first_key) {
        Eigen::Map<RowMatrix<Scalar>> value_scores(workspace.value_scores.data(), rows,
                                                   scores.cols());
        value_scores.noalias() =
            dout_rows * compute_rows(v, first_key, scores.cols(), converted.value).transpose();
        if (given) {
          weights_and_score_gradient(scores, value_scores, given_lse + row_begin,
                                     delta + row_begin);
          add_seen_product(workspace, workspace.accumulator, value_scores, k_tile,
                           [&](Index row, Index key) { return value_scores(row, key); });
        } else {
          workspace.softmax.exponentiate(scores);
          score_gradient(scores, value_scores, delta + row_begin);
          workspace.softmax.accumulate(scores, k_tile);
        }
      });
  if (given) {
    converted.result.bind(dq, row_begin, rows) = workspace.accumulator * scale;
  } else {
    workspace.softmax.finish(converted.result.bind(dq, row_begin, rows), lse + row_begin, &scale);
  }
  converted.result.store();
}

/// Sweep 2 for key rows `[col_begin, col_end)` of key/value head g of one batch element: writes
/// those rows of dk and dv, summing over the query heads of the group in order, and their query
/// tiles in order; `lse` and `delta` are the element's, `[H][n_q]`.
template <class Storage, class Logits>
void backward_key_rows(const HeadsView<const Storage>& q, const HeadsView<const Storage>& k,
                       const HeadsView<const Storage>& v, const HeadsView<const Storage>& dout,
                       const HeadsView<Storage>& dk, const HeadsView<Storage>& dv,
                       const AttentionOptions& options, const Logits& logits, Index b,
                       Index kv_head, Index col_begin, Index col_end, const Compute<Storage>* lse,
                       const Compute<Storage>* delta) {
  using Scalar = Compute<Storage>;
  const BackwardWorkspaceLease<Scalar> workspace_lease;
  const ConvertedRowsLease<Storage> converted_lease;
  BackwardWorkspace<Scalar>& workspace = *workspace_lease;
  ConvertedRows<Storage>& converted = *converted_lease;
  // An operand row with a non-finite entry adds only where the weight is not 0.
  const auto add_product = [&](RowMatrix<Scalar>& accumulator,
                               const Eigen::Map<RowMatrix<Scalar>>& weights, const auto& operand) {
    add_seen_product(workspace, accumulator, weights.transpose(), operand,
                     [&](Index key, Index query) { return weights(query, key); });
  };
  const Index group = q.heads / k.heads;
  const Index cols = col_end - col_begin;
  const Index first_key = options.key_position + col_begin;
  const Scalar scale = static_cast<Scalar>(options.scale);
  const ConstHeadMap<Scalar> k_tile = compute_rows(k.head(kv_head), col_begin, cols, converted.key);
  const ConstHeadMap<Scalar> v_tile =
      compute_rows(v.head(kv_head), col_begin, cols, converted.value);
  workspace.accumulator.setZero(cols, k.dim);
  workspace.value_accumulator.setZero(cols, v.dim);
  for (Index h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const ConstHeadMap<Storage> q_head = q.head(h);
    const ConstHeadMap<Storage> dout_head = dout.head(h);
    const Scalar* head_lse = lse + h * q.tokens;
    const Scalar* head_delta = delta + h * q.tokens;
    const Block queries = logits.queries_of_keys(h, first_key, cols);
    const Index tile = logits.query_tile(h);
    for (Index p0 = queries.begin; p0 < queries.end; p0 += tile) {
      const Index rows = std::min(tile, queries.end - p0);
      const Index row_begin = p0 - options.query_position;
      const Block keys = logits.prepare_rows(b, h, p0, rows, workspace);
      if (keys.end <= first_key || keys.begin >= first_key + cols) continue;
      workspace.reserve_tile(static_cast<std::size_t>(rows * cols));
      Eigen::Map<RowMatrix<Scalar>> scores(workspace.scores.data(), rows, cols);
      Eigen::Map<RowMatrix<Scalar>> value_scores(workspace.value_scores.data(), rows, cols);
      workspace.query.noalias() = compute_rows(q_head, row_begin, rows, converted.query) * scale;
      scores.noalias() = workspace.query * k_tile.transpose();
      logits.apply(h, workspace, scores, p0, first_key);
      const ConstHeadMap<Scalar> dout_rows =
          compute_rows(dout_head, row_begin, rows, converted.dout);
      value_scores.noalias() = dout_rows * v_tile.transpose();
      weights_and_score_gradient(scores, value_scores, head_lse + row_begin,
                                 head_delta + row_begin);
      add_product(workspace.value_accumulator, scores, dout_rows);
      add_product(workspace.accumulator, value_scores, workspace.query);
    }
  }
  converted.result.bind(dk.head(kv_head), col_begin, cols) = workspace.accumulator;
  converted.result.store();
  converted.value_result.bind(dv.head(kv_head), col_begin, cols) = workspace.value_accumulator;
  converted.value_result.store();
}

/// The one sweep for key/value head `kv_head` of one batch element: the query heads of its group
/// in order, each head's query tiles in order (the tiles of backward_query_rows), and each tile's
/// visible keys in chunks of kKeyTile in order. A chunk's logits give P (from `lse`, the given lse
/// shifted as the logits, `[H][n_q]`), dP and dS, which add to the tile's dQ and to the chunk's
/// rows of dK and dV: the job writes dq of the group's heads, their rows of `delta`, and dk and
/// dv of `kv_head`, which it alone writes, so it sums into them in place (16-bit storage: into
/// a compute-type copy of the head, rounded once at the end).
template <class Storage, class Logits>
void backward_group(const HeadsView<const Storage>& q, const HeadsView<const Storage>& k,
                    const HeadsView<const Storage>& v, const HeadsView<const Storage>& out,
                    const HeadsView<const Storage>& dout, const HeadsView<Storage>& dq,
                    const HeadsView<Storage>& dk, const HeadsView<Storage>& dv,
                    const AttentionOptions& options, const Logits& logits, Index b, Index kv_head,
                    const Compute<Storage>* lse, Compute<Storage>* delta) {
  using Scalar = Compute<Storage>;
  const BackwardWorkspaceLease<Scalar> workspace_lease;
  const ConvertedRowsLease<Storage> converted_lease;
  BackwardWorkspace<Scalar>& workspace = *workspace_lease;
  ConvertedRows<Storage>& converted = *converted_lease;
  const Index group = q.heads / k.heads;
  const Scalar scale = static_cast<Scalar>(options.scale);
  const ConstHeadMap<Storage> k_head = k.head(kv_head);
  const ConstHeadMap<Storage> v_head = v.head(kv_head);
  HeadMap<Scalar> dk_head = converted.key_result.bind(dk.head(kv_head));
  HeadMap<Scalar> dv_head = converted.value_result.bind(dv.head(kv_head));
  dk_head.setZero();
  dv_head.setZero();
  for (Index h = kv_head * group; h < (kv_head + 1) * group; ++h) {
    const Scalar* head_lse = lse + h * q.tokens;
    Scalar* head_delta = delta + h * q.tokens;
    const Index height = logits.query_tile(h);
    for (Index row_begin = 0; row_begin < q.tokens; row_begin += height) {
      const Index rows = std::min(height, q.tokens - row_begin);
      const ConstHeadMap<Scalar> dout_rows =
          compute_rows(dout.head(h), row_begin, rows, converted.dout);
      write_delta(dout_rows, out.head(h), row_begin, rows, converted, head_delta);
      workspace.accumulator.setZero(rows, q.dim);
      for_each_logit_chunk(
          q.head(h), k_head, options, logits, b, h, row_begin, rows, workspace, converted,
          [&](Eigen::Map<RowMatrix<Scalar>>& scores, const ConstHeadMap<Scalar>& k_chunk,
              Index first_key) {
            const Index cols = scores.cols();
            Eigen::Map<RowMatrix<Scalar>> value_scores(workspace.value_scores.data(), rows, cols);
            value_scores.noalias() =
                dout_rows * compute_rows(v_head, first_key, cols, converted.value).transpose();
            weights_and_score_gradient(scores, value_scores, head_lse + row_begin,
                                       head_delta + row_begin);
            // A product with the weights transposed: an operand row (a query's) with a non-finite
            // entry adds only to the keys it weighs.
            auto dv_chunk = dv_head.middleRows(first_key, cols);
            add_seen_product(workspace, dv_chunk, scores.transpose(), dout_rows,
                             [&](Index key, Index query) { return scores(query, key); });
            const auto gradient_of = [&](Index query, Index key) {
              return value_scores(query, key);
            };
            add_seen_product(workspace, workspace.accumulator, value_scores, k_chunk, gradient_of);
            auto dk_chunk = dk_head.middleRows(first_key, cols);
            add_seen_product(workspace, dk_chunk, value_scores.transpose(), workspace.query,
                             [&](Index key, Index query) { return gradient_of(query, key); });
          });
      converted.result.bind(dq.head(h), row_begin, rows) = workspace.accumulator * scale;
      converted.result.store();
    }
  }
  converted.key_result.store();
  converted.value_result.store();
}

/// The log-sum-exp of the logits as formed here of head h's query rows `[row_begin, row_end)`,
/// written to those rows of `lse` (the head's): the forward's online softmax over the logits
/// alone, the rows' visible keys in the chunks of backward_group. Without the forward's lse, it
/// is what backward_group takes P from.
template <class Storage, class Logits>
void logits_lse(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                const AttentionOptions& options, const Logits& logits, Index b, Index h,
                Index row_begin, Index row_end, Compute<Storage>* lse) {
  using Scalar = Compute<Storage>;
  const BackwardWorkspaceLease<Scalar> workspace_lease;
  const ConvertedRowsLease<Storage> converted_lease;
  BackwardWorkspace<Scalar>& workspace = *workspace_lease;
  ConvertedRows<Storage>& converted = *converted_lease;
  const Index rows = row_end - row_begin;
  workspace.softmax.reset(rows, 0);
  for_each_logit_chunk(q, k, options, logits, b, h, row_begin, rows, workspace, converted,
                       [&](Eigen::Map<RowMatrix<Scalar>>& scores, const ConstHeadMap<Scalar>&,
                           Index) { workspace.softmax.exponentiate(scores); });
  workspace.accumulator.resize(rows, 0);
  workspace.softmax.finish(workspace.accumulator, lse + row_begin);
}

/// Which sweeps attention_backward runs: `Automatic` (uses_one_sweep decides), or one path
/// forced, as the tests that compare the two do.
enum class BackwardSweeps { Automatic, One, Two };

/// Whether attention_backward runs the one sweep (backward_group), whose jobs are the
/// \f$B H_{kv}\f$ key/value heads, rather than the two sweeps, whose jobs are tiles. The one sweep
/// does five of the two sweeps' seven products per visible score and forms the logits once, not
/// twice, but runs no more jobs at once than there are key/value heads: it is chosen when an
/// element has at least as many key/value heads as OpenMP has processors (omp_get_num_procs).
/// The choice depends neither on the number of threads nor on the batch size, so that the result
/// is the same for any number of threads and for a batch and the loop over its elements.
inline bool uses_one_sweep(Index kv_heads) { return kv_heads >= processor_count(); }

/// The backward over a batch: the one sweep or the two (`sweeps`; Automatic: uses_one_sweep),
/// each sweep one parallel region over the jobs of every batch element. `options.scale` must be
/// resolved; the logits are shared by the elements. Views in the storage type `Scalar`, lse and D
/// in its compute type. With `given_lse` (the forward's, checked) every sweep takes P from it;
/// otherwise logits_lse (one sweep) or sweep 1 (two sweeps) computes it.
template <class Scalar, class Logits>
void attention_backward(const BatchedHeadsView<const Scalar>& q,
                        const BatchedHeadsView<const Scalar>& k,
                        const BatchedHeadsView<const Scalar>& v,
                        const BatchedHeadsView<const Scalar>& out,
                        const BatchedHeadsView<const Scalar>& dout,
                        const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
                        const BatchedHeadsView<Scalar>& dv, const AttentionOptions& options,
                        const Logits& logits, const RowLse<const Compute<Scalar>>& given_lse,
                        BackwardSweeps sweeps = BackwardSweeps::Automatic) {
  if (q.batch == 0) return;
  const Index group = q.heads / k.heads;
  const Index element_rows = q.heads * q.tokens;  // lse and D of one element, [H][n_q]
  const auto rows_of_batch = static_cast<std::size_t>(q.batch * element_rows);
  // The lse of the logits as formed here: sweep 1 writes it, or it is the given lse of the true
  // logits with the logits' row constant added (Logits::shift_given_lse).
  const bool given = !given_lse.empty();
  std::vector<Compute<Scalar>> lse(rows_of_batch);
  if (given) {
    std::copy(given_lse.data, given_lse.data + rows_of_batch, lse.begin());
    for (Index b = 0; b < q.batch; ++b) {
      for (Index h = 0; h < q.heads; ++h) {
        logits.shift_given_lse(h, options.query_position, q.tokens,
                               lse.data() + b * element_rows + h * q.tokens);
      }
    }
  }
  std::vector<Compute<Scalar>> delta(rows_of_batch);
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  struct Tile {
    Index head, begin, end;
  };
  std::vector<Tile> tiles;  // of one batch element
  for (Index h = 0; h < q.heads; ++h) {
    const Index height = logits.query_tile(h);
    for (Index r0 = 0; r0 < q.tokens; r0 += height) {
      tiles.push_back(Tile{h, r0, std::min(q.tokens, r0 + height)});
    }
  }
  Index element_jobs = static_cast<Index>(tiles.size());
  const bool one_sweep = sweeps == BackwardSweeps::One ||
                         (sweeps == BackwardSweeps::Automatic && uses_one_sweep(k.heads));
  if (one_sweep) {
    if (!given) {
      parallel_for(q.batch * element_jobs, work / 2, [&](Index job) {
        const Index b = job / element_jobs;
        const Tile& tile = tiles[static_cast<std::size_t>(job % element_jobs)];
        logits_lse<Scalar>(q[b].head(tile.head), k[b].head(tile.head / group), options, logits, b,
                           tile.head, tile.begin, tile.end,
                           lse.data() + b * element_rows + tile.head * q.tokens);
      });
    }
    // Each element's key/value heads start last to first: with ALiBi's standard slopes, which
    // fall with the head index, the gentlest heads, whose rows see the most keys, start first and
    // the threads finish together. Every job writes its own rows, so the order changes no result.
    parallel_for(q.batch * k.heads, work, [&](Index job) {
      const Index b = job / k.heads;
      backward_group<Scalar>(q[b], k[b], v[b], out[b], dout[b], dq[b], dk[b], dv[b], options,
                             logits, b, k.heads - 1 - job % k.heads, lse.data() + b * element_rows,
                             delta.data() + b * element_rows);
    });
    return;
  }
  parallel_for(q.batch * element_jobs, work, [&](Index job) {
    const Index b = job / element_jobs;
    const Tile& tile = tiles[static_cast<std::size_t>(job % element_jobs)];
    HeadMap<Scalar> dq_head = dq[b].head(tile.head);
    const Index rows = b * element_rows + tile.head * q.tokens;
    backward_query_rows<Scalar>(q[b].head(tile.head), k[b].head(tile.head / group),
                                v[b].head(tile.head / group), out[b].head(tile.head),
                                dout[b].head(tile.head), dq_head, options, logits, b, tile.head,
                                tile.begin, tile.end, given ? lse.data() + rows : nullptr,
                                lse.data() + rows, delta.data() + rows);
  });
  tiles.clear();
  for (Index g = 0; g < k.heads; ++g) {
    const Index width = logits.key_tile(g, group);
    for (Index c0 = 0; c0 < k.tokens; c0 += width) {
      tiles.push_back(Tile{g, c0, std::min(k.tokens, c0 + width)});
    }
  }
  element_jobs = static_cast<Index>(tiles.size());
  parallel_for(q.batch * element_jobs, work, [&](Index job) {
    const Index b = job / element_jobs;
    const Tile& tile = tiles[static_cast<std::size_t>(job % element_jobs)];
    backward_key_rows<Scalar>(q[b], k[b], v[b], dout[b], dk[b], dv[b], options, logits, b,
                              tile.head, tile.begin, tile.end, lse.data() + b * element_rows,
                              delta.data() + b * element_rows);
  });
}

/// truncated_alibi_attention_backward on a batch whose shapes validate_batch has checked: the
/// checks of one element, then both sweeps over each head's band. Tolerance 0 is exact ALiBi:
/// exact_alibi_attention_backward is this core under its own `function` name.
template <class Scalar>
void batched_truncated_alibi_attention_backward(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<const Scalar>& out,
    const BatchedHeadsView<const Scalar>& dout, const BatchedHeadsView<Scalar>& dq,
    const BatchedHeadsView<Scalar>& dk, const BatchedHeadsView<Scalar>& dv,
    const std::vector<double>& slopes, double factor_tolerance, const AttentionOptions& options,
    const char* function = "truncated_alibi_attention_backward",
    const RowLse<const Compute<Scalar>>& lse = {}) {
  validate_backward(function, q[0], k[0], v[0], out[0], dout[0], dq[0], dk[0], dv[0], options,
                    memory_of(q));
  validate_slopes(function, slopes, q.heads);
  require_tolerance(factor_tolerance, function, "factor_tolerance");
  require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const AlibiLogits<Compute<Scalar>> logits(slopes, resolved, q.tokens, k.tokens, factor_tolerance);
  attention_backward(q, k, v, out, dout, dq, dk, dv, resolved, logits, lse);
}

/// exact_alibi_attention_backward on a checked batch: batched_truncated_alibi_attention_backward
/// with tolerance 0.
template <class Scalar>
void batched_exact_alibi_attention_backward(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<const Scalar>& out,
    const BatchedHeadsView<const Scalar>& dout, const BatchedHeadsView<Scalar>& dq,
    const BatchedHeadsView<Scalar>& dk, const BatchedHeadsView<Scalar>& dv,
    const std::vector<double>& slopes, const AttentionOptions& options,
    const RowLse<const Compute<Scalar>>& lse = {}) {
  batched_truncated_alibi_attention_backward<Scalar>(
      q, k, v, out, dout, dq, dk, dv, slopes, 0.0, options, "exact_alibi_attention_backward", lse);
}

/// windowed_alibi_attention_backward on a checked batch: the checks of one element, the forward's
/// kept keys (`kept` when given, else its certificate, run again without output), then both
/// sweeps over those keys. Tolerance 0 is exact ALiBi's backward.
template <class Scalar>
void batched_windowed_alibi_attention_backward(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<const Scalar>& out,
    const BatchedHeadsView<const Scalar>& dout, const BatchedHeadsView<Scalar>& dq,
    const BatchedHeadsView<Scalar>& dk, const BatchedHeadsView<Scalar>& dv,
    const std::vector<double>& slopes, double tolerance, const AttentionOptions& options,
    const RowLse<const Compute<Scalar>>& lse = {}, const KeptKeys* kept = nullptr) {
  const char* function = "windowed_alibi_attention_backward";
  validate_backward(function, q[0], k[0], v[0], out[0], dout[0], dq[0], dk[0], dv[0], options,
                    memory_of(q));
  validate_slopes(function, slopes, q.heads);
  require_tolerance(tolerance, function);
  require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  const std::vector<Block>* given =
      kept == nullptr ? nullptr
                      : &KeptKeysAccess::ranges(function, "kept", *kept, q.batch, q.heads, q.tokens,
                                                k.tokens, tolerance);
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  if (tolerance == 0) {
    const AlibiLogits<Compute<Scalar>> logits(slopes, resolved, q.tokens, k.tokens);
    attention_backward(q, k, v, out, dout, dq, dk, dv, resolved, logits, lse);
    return;
  }
  std::vector<Block> recomputed;
  if (given == nullptr) {
    batched_windowed_alibi_attention<Scalar>(q, k, v, nullptr, slopes, tolerance, options, {},
                                             &recomputed);
  }
  const WindowedLogits<Compute<Scalar>> logits(slopes, resolved, q.heads, q.tokens, k.tokens,
                                               given == nullptr ? recomputed : *given);
  attention_backward(q, k, v, out, dout, dq, dk, dv, resolved, logits, lse);
}

/// Both sweeps with the Positional LSH logits of `grids` (one list of draws per head) and the near
/// field `near_field` (PlshOptions::near_field); the tile heights come from `slopes`.
template <class Scalar>
void block_counts_backward(const BatchedHeadsView<const Scalar>& q,
                           const BatchedHeadsView<const Scalar>& k,
                           const BatchedHeadsView<const Scalar>& v,
                           const BatchedHeadsView<const Scalar>& out,
                           const BatchedHeadsView<const Scalar>& dout,
                           const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
                           const BatchedHeadsView<Scalar>& dv, const std::vector<double>& slopes,
                           const std::vector<std::vector<Grid>>& grids,
                           const AttentionOptions& options, double near_field = 0,
                           const RowLse<const Compute<Scalar>>& lse = {}) {
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const PlshLogits<Compute<Scalar>> logits(slopes, grids, resolved, position_range(q, k, options),
                                           q.tokens, k.tokens, near_field);
  attention_backward(q, k, v, out, dout, dq, dk, dv, resolved, logits, lse);
}

/// plsh_attention_backward on a checked batch: the checks of one element, the draws (once,
/// shared by the elements), then both sweeps.
template <class Scalar>
void batched_plsh_attention_backward(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<const Scalar>& out,
    const BatchedHeadsView<const Scalar>& dout, const BatchedHeadsView<Scalar>& dq,
    const BatchedHeadsView<Scalar>& dk, const BatchedHeadsView<Scalar>& dv,
    const std::vector<double>& slopes, const PlshOptions& options,
    const RowLse<const Compute<Scalar>>& lse = {}) {
  const char* function = "plsh_attention_backward";
  validate_backward(function, q[0], k[0], v[0], out[0], dout[0], dq[0], dk[0], dv[0], options,
                    memory_of(q));
  validate_slopes(function, slopes, q.heads);
  require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  // Both forward kernels compute the same function: its gradients do not depend on the kernel.
  const auto grids = kernel_grids(slopes, options, function);
  block_counts_backward(q, k, v, out, dout, dq, dk, dv, slopes, grids, options, options.near_field,
                        lse);
}

/// fixed_block_attention_backward on a checked batch: the checks of one element, then both
/// sweeps with one fixed grid per head.
template <class Scalar>
void batched_fixed_block_attention_backward(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<const Scalar>& out,
    const BatchedHeadsView<const Scalar>& dout, const BatchedHeadsView<Scalar>& dq,
    const BatchedHeadsView<Scalar>& dk, const BatchedHeadsView<Scalar>& dv, Index block_size,
    const AttentionOptions& options, const RowLse<const Compute<Scalar>>& lse = {}) {
  const char* function = "fixed_block_attention_backward";
  validate_backward(function, q[0], k[0], v[0], out[0], dout[0], dq[0], dk[0], dv[0], options,
                    memory_of(q));
  require(block_size >= 1, function, "block_size must be at least 1");
  require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  const std::vector<std::vector<Grid>> grids(
      static_cast<std::size_t>(q.heads),
      std::vector<Grid>{fixed_grid(static_cast<double>(block_size))});
  // The tile heights of the logits come from a slope: about one block per tile.
  const std::vector<double> slopes(static_cast<std::size_t>(q.heads),
                                   1.0 / static_cast<double>(block_size));
  block_counts_backward(q, k, v, out, dout, dq, dk, dv, slopes, grids, options, 0.0, lse);
}

}  // namespace detail

/// Gradients of exact_alibi_attention with respect to q, k and v.
///
/// Given the forward's output `out` and the gradient `dout` of a loss with respect to it, writes
/// \f$dq = \partial L/\partial q\f$, \f$dk\f$, \f$dv\f$ (overwritten, not accumulated); see the
/// file comment for the formulas. Grouped heads: dk and dv of a key/value head sum over the query
/// heads that read it.
///
/// \param q, k, v, out as exact_alibi_attention (out is its result for these inputs).
/// \param dout `[n_q][H][d_v]`. \param dq like q, \param dk like k, \param dv like v.
/// \param slopes, options as the forward.
/// \param lse the forward's row log-sum-exp (row_lse.hpp), or empty: then computed here. Given,
/// \f$P = e^{l - \mathrm{lse}}\f$ comes from it, without a pass or a running maximum to compute
/// it.
/// \throws std::invalid_argument on shapes that disagree, a bad slope, a gradient view that
/// overlaps an input or another gradient, or an `lse` of another shape; the message names the
/// argument.
template <class Scalar>
void exact_alibi_attention_backward(
    HeadsView<const detail::NonDeduced<Scalar>> q, HeadsView<const detail::NonDeduced<Scalar>> k,
    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<const detail::NonDeduced<Scalar>> out,
    HeadsView<const detail::NonDeduced<Scalar>> dout, HeadsView<Scalar> dq, HeadsView<Scalar> dk,
    HeadsView<Scalar> dv, const std::vector<double>& slopes, const AttentionOptions& options = {},
    RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::batched_exact_alibi_attention_backward<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), detail::batch_of_one(dout), detail::batch_of_one(dq),
      detail::batch_of_one(dk), detail::batch_of_one(dv), slopes, options, lse);
}

/// Gradients of windowed_alibi_attention with respect to q, k and v: of the function the forward
/// computes, exact ALiBi over the keys each query tile kept (`kept`, the forward's, or else the
/// forward's certificate evaluated again here at about the cost of one forward), so they are
/// exact for that function and, for the keys it dropped, 0. `tolerance = 0` is
/// exact_alibi_attention_backward.
///
/// Arguments as exact_alibi_attention_backward, with the forward's `tolerance`; \param kept the
/// forward's kept keys, or null.
/// \throws std::invalid_argument as exact_alibi_attention_backward, for a tolerance outside
/// [0, 1], and for a `kept` that is empty or from a call of other shapes or tolerance.
template <class Scalar>
void windowed_alibi_attention_backward(
    HeadsView<const detail::NonDeduced<Scalar>> q, HeadsView<const detail::NonDeduced<Scalar>> k,
    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<const detail::NonDeduced<Scalar>> out,
    HeadsView<const detail::NonDeduced<Scalar>> dout, HeadsView<Scalar> dq, HeadsView<Scalar> dk,
    HeadsView<Scalar> dv, const std::vector<double>& slopes, double tolerance = 1e-6,
    const AttentionOptions& options = {}, RowLse<const detail::Compute<Scalar>> lse = {},
    const KeptKeys* kept = nullptr) {
  detail::batched_windowed_alibi_attention_backward<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), detail::batch_of_one(dout), detail::batch_of_one(dq),
      detail::batch_of_one(dk), detail::batch_of_one(dv), slopes, tolerance, options, lse, kept);
}

/// Gradients of truncated_alibi_attention with respect to q, k and v: exact ALiBi's over each
/// head's band \f$|p_i - p_j| \le \lfloor \ln(1/\text{factor\_tolerance}) / m_h \rfloor\f$,
/// the keys outside it masked, so they get \f$dK = dV = 0\f$ from that head and change no other
/// gradient. Key tiles outside the band are skipped, as in the forward. `factor_tolerance = 0` is
/// exact_alibi_attention_backward.
///
/// Arguments as exact_alibi_attention_backward, with the forward's `factor_tolerance`.
/// \throws std::invalid_argument as exact_alibi_attention_backward, and for a factor_tolerance
/// outside [0, 1].
template <class Scalar>
void truncated_alibi_attention_backward(
    HeadsView<const detail::NonDeduced<Scalar>> q, HeadsView<const detail::NonDeduced<Scalar>> k,
    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<const detail::NonDeduced<Scalar>> out,
    HeadsView<const detail::NonDeduced<Scalar>> dout, HeadsView<Scalar> dq, HeadsView<Scalar> dk,
    HeadsView<Scalar> dv, const std::vector<double>& slopes, double factor_tolerance,
    const AttentionOptions& options = {}, RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::batched_truncated_alibi_attention_backward<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), detail::batch_of_one(dout), detail::batch_of_one(dq),
      detail::batch_of_one(dk), detail::batch_of_one(dv), slopes, factor_tolerance, options,
      "truncated_alibi_attention_backward", lse);
}

/// Gradients of plsh_attention with respect to q, k and v: the function of the fused kernel,
/// softmax of \f$S_{ij} + \log c_{ij}\f$, with the draws of `options.seed` and the near field of
/// `options.near_field`. Kernel::Passes evaluates the same function when `near_field` is 0; with a
/// near field it is refused, as by the forward.
///
/// Arguments as exact_alibi_attention_backward, with the options of plsh_attention.
/// \throws std::invalid_argument as exact_alibi_attention_backward, for `samples < 1`, and for
/// Kernel::Passes with `options.near_field` above 0 (the forward's message).
template <class Scalar>
void plsh_attention_backward(HeadsView<const detail::NonDeduced<Scalar>> q,
                             HeadsView<const detail::NonDeduced<Scalar>> k,
                             HeadsView<const detail::NonDeduced<Scalar>> v,
                             HeadsView<const detail::NonDeduced<Scalar>> out,
                             HeadsView<const detail::NonDeduced<Scalar>> dout, HeadsView<Scalar> dq,
                             HeadsView<Scalar> dk, HeadsView<Scalar> dv,
                             const std::vector<double>& slopes, const PlshOptions& options = {},
                             RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::batched_plsh_attention_backward<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), detail::batch_of_one(dout), detail::batch_of_one(dq),
      detail::batch_of_one(dk), detail::batch_of_one(dv), slopes, options, lse);
}

/// Gradients of fixed_block_attention with respect to q, k and v: softmax over the keys of the
/// query's block of `block_size` positions (causal inside the block when causal), the logits
/// machinery of plsh_attention_backward with one fixed grid per head and counts 0 or 1.
///
/// Arguments as exact_alibi_attention_backward, with `block_size` in place of the slopes.
/// \throws std::invalid_argument as exact_alibi_attention_backward, and for `block_size < 1`.
template <class Scalar>
void fixed_block_attention_backward(
    HeadsView<const detail::NonDeduced<Scalar>> q, HeadsView<const detail::NonDeduced<Scalar>> k,
    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<const detail::NonDeduced<Scalar>> out,
    HeadsView<const detail::NonDeduced<Scalar>> dout, HeadsView<Scalar> dq, HeadsView<Scalar> dk,
    HeadsView<Scalar> dv, Index block_size, const AttentionOptions& options = {},
    RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::batched_fixed_block_attention_backward<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), detail::batch_of_one(dout), detail::batch_of_one(dq),
      detail::batch_of_one(dk), detail::batch_of_one(dv), block_size, options, lse);
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_BACKWARD_HPP
