#ifndef PLSH_ATTENTION_PASS_KERNEL_HPP
#define PLSH_ATTENTION_PASS_KERNEL_HPP

/// \file pass_kernel.hpp
/// Kernel::Passes, the faithful form of Positional LSH: for every draw t and every block of its
/// partition, regular attention of the block's queries against the block's keys (causal inside
/// the block when causal), giving per row \f$(o_t, \mathrm{lse}_t)\f$; the passes merge as
/// \f[ o = \frac{\sum_t e^{\mathrm{lse}_t} o_t}{\sum_t e^{\mathrm{lse}_t}} \f]
/// by a running maximum (online_softmax_merge), every pass with unit weight, so that a pair of
/// keys weighs its count \f$c_{ij}\f$. The inner kernel is pluggable: RegularAttention by
/// default, any callable with its signature otherwise (plsh_attention's second overload).
/// Also the kernel of fixed_block_attention (one draw, `fixed_grid(b)`).
///
/// With a near field of reach w (near_field.hpp) the same merge computes the near-field
/// estimator, the fused kernel's function: the keys within the reach once per head with logits
/// \f$S_{ij} - m|p_i - p_j| + \log s\f$ (weight \f$s e^{-m d}\f$; the library's banded core,
/// never the inner kernel), then per draw and block only the pairs beyond the reach: the keys
/// beyond the reach of a whole chunk of queries by the inner kernel, the strip between by a
/// masked tile of the library's.
///
/// Cost \f$\sum_t \sum_{\text{blocks}} b^2 (d + d_v)\f$ per head, about \f$2s/m\f$ keys per
/// query, plus \f$2w + \text{tile}\f$ keys per query for a near field (blocks within the reach are
/// skipped); O(tokens) block look-ups per draw, only the blocks that hold a query being visited.
/// Parallel over (batch element, head), one OpenMP region per call; every job writes its own
/// head: the result is identical for any number of threads.
///
/// Tested against plsh::reference::mask_attention and plsh::reference::plsh_attention (dense, in
/// double, same grids, with and without a near field) and against the fused kernel in
/// tests/test_plsh_attention.cpp and tests/test_near_field.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/parallel.hpp"
#include "../detail/scratch.hpp"
#include "../detail/storage.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../partition.hpp"
#include "../row_lse.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "near_field.hpp"
#include "online_softmax.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Per-thread scratch of the pass kernel (detail/scratch.hpp), leased for a (batch element, head)
/// job, the calls of the regular kernel included: a partial result (rows in the compute type and
/// their lse) and the rows of a block converted to the compute type; with a near field also the
/// scaled query rows, a tile of scores and the running softmax of the masked strips. As large as
/// the widest block the thread has seen (the head's merged output and lse, O(n) each, belong to
/// the job).
template <class Scalar>
struct PassScratch {
  std::vector<Scalar> out, lse;
  AlignedVector<Scalar> query_rows, key_rows, value_rows;
  RowMatrix<Scalar> query;
  AlignedVector<Scalar> scores;
  OnlineSoftmax<Scalar> softmax;

  /// The partial result of `rows` rows of `cols` columns, contiguous.
  HeadMap<Scalar> partial(Index rows, Index cols) {
    out.resize(static_cast<std::size_t>(rows * cols));
    lse.resize(static_cast<std::size_t>(rows));
    return HeadMap<Scalar>(out.data(), rows, cols, Eigen::OuterStride<>(cols));
  }
  LseMap<Scalar> partial_lse(Index rows) { return LseMap<Scalar>(lse.data(), rows); }
};

/// The near band of one head (near field of reach w = `near.reach()` >= 0): for every query row i,
/// the keys j with \f$|p_i - p_j| \le w\f$ (and \f$p_j \le p_i\f$ when causal), logits
/// \f$S_{ij} - m|p_i - p_j| + \log s\f$, merged into the head's running `(out, lse)`. Relative to
/// the unit weight of a pass (a count \f$c_{ij}\f$ summed over the draws) these keys weigh
/// \f$s e^{-m|p_i - p_j|}\f$, the estimator's \f$s \hat K_{ij}\f$ within the reach. The tiled
/// core of truncated_alibi_attention (attend_rows with the band w, the same function of the
/// threshold), query tile by query tile over its keys within the reach, in the compute type.
/// Cost \f$(2w + \text{tile})(d + d_v)\f$ per query, once per head whatever s.
template <class Storage, class Scalar = Compute<Storage>>
void merge_near_band(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                     const ConstHeadMap<Storage>& v, const AttentionOptions& options,
                     const Estimator& near, Index samples, HeadMap<Scalar>& out,
                     Eigen::Matrix<Scalar, Eigen::Dynamic, 1>& lse, PassScratch<Scalar>& scratch) {
  const Scalar log_samples = static_cast<Scalar>(std::log(static_cast<double>(samples)));
  const Index key_end = options.key_position + k.rows();
  for (Index r0 = 0; r0 < q.rows(); r0 += kQueryTile) {
    const Index rows = std::min(kQueryTile, q.rows() - r0);
    const Index first = options.query_position + r0;
    const Index last = first + rows - 1;
    const Index key_begin = std::max(options.key_position, first - near.reach());
    const Index key_stop = std::min(key_end, (options.causal ? last : last + near.reach()) + 1);
    if (key_begin >= key_stop) continue;
    const Index first_key = key_begin - options.key_position;
    const Index keys = key_stop - key_begin;
    AttentionOptions band = options;
    band.query_position = first;
    band.key_position = key_begin;
    HeadMap<Scalar> band_out = scratch.partial(rows, v.cols());
    attend_rows<Scalar>(compute_rows(q, r0, rows, scratch.query_rows),
                        compute_rows(k, first_key, keys, scratch.key_rows),
                        compute_rows(v, first_key, keys, scratch.value_rows), band,
                        LinearBias{near.slope(), near.reach()}, 0, rows, band_out,
                        scratch.lse.data());
    for (Scalar& row_lse : scratch.lse) row_lse += log_samples;  // -inf and NaN stay
    online_softmax_merge(out.middleRows(r0, rows), lse.segment(r0, rows), band_out, scratch.lse);
  }
}

/// Regular attention of query rows `q` (first at position `first_query`) against the keys `k`,
/// `v` (first at `first_key`), all in the compute type, over the pairs beyond the reach
/// `reach` only: \f$|p_i - p_j| > w\f$, and \f$p_j \le p_i\f$ when causal. The pairs within
/// the reach are masked (\f$-\infty\f$) per row: the keys \f$[p_i - w, p_i + w]\f$ (to
/// \f$+\infty\f$ when causal). Returns the partial result (`scratch.partial`, its lse in
/// `scratch.lse`); kKeyTile keys at a time.
template <class Scalar>
HeadMap<Scalar> masked_far_pairs(const ConstHeadMap<Scalar>& q, const ConstHeadMap<Scalar>& k,
                                 const ConstHeadMap<Scalar>& v, const AttentionOptions& options,
                                 Index first_query, Index first_key, Index reach,
                                 PassScratch<Scalar>& scratch) {
  constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
  const Index rows = q.rows();
  scratch.softmax.reset(rows, v.cols());
  scratch.query.noalias() = q * static_cast<Scalar>(options.scale);
  const std::size_t needed = static_cast<std::size_t>(rows * kKeyTile);
  if (scratch.scores.size() < needed) scratch.scores.resize(needed);
  for (Index c0 = 0; c0 < k.rows(); c0 += kKeyTile) {
    const Index cols = std::min(kKeyTile, k.rows() - c0);
    Eigen::Map<RowMatrix<Scalar>> scores(scratch.scores.data(), rows, cols);
    multiply_transposed(scratch.query, map_rows(k, c0, cols), scores);
    const Index tile_key = first_key + c0;
    for (Index r = 0; r < rows; ++r) {
      const Index position = first_query + r;
      const Index begin = std::clamp<Index>(position - reach - tile_key, 0, cols);
      const Index end =
          options.causal ? cols : std::clamp<Index>(position + reach + 1 - tile_key, 0, cols);
      scores.row(r).segment(begin, end - begin).setConstant(kMinusInfinity);
    }
    scratch.softmax.update(scores, map_rows(v, c0, cols));
  }
  HeadMap<Scalar> partial = scratch.partial(rows, v.cols());
  scratch.softmax.finish(partial, scratch.lse.data());
  return partial;
}

/// The pairs of one block of one draw that lie beyond the reach w = `reach` >= 0 of the near
/// field, merged into the head's running `(out, lse)` (rows from `first_row`). `q`, `k`, `v` are
/// the block's query and key rows in the compute type, first at positions `query_begin` and
/// `key_begin` (`options` carries those positions). The queries go in chunks of
/// \f$C = \max(w + 1, \text{kQueryTile})\f$ rows \f$[r_0, r_1)\f$: the keys before
/// \f$r_0 - w\f$ (and, not causal, from \f$r_1 + w\f$ on) are beyond the reach of every row of
/// the chunk and go to `kernel` as two contiguous ranges; the strip between, at most \f$C + 2w\f$
/// keys, goes to masked_far_pairs tile by tile, skipped where no pair lies beyond the reach.
template <class Scalar, class RegularKernel>
void merge_far_pairs(const ConstHeadMap<Scalar>& q, const ConstHeadMap<Scalar>& k,
                     const ConstHeadMap<Scalar>& v, const AttentionOptions& options, Index reach,
                     RegularKernel& kernel, HeadMap<Scalar>& out,
                     Eigen::Matrix<Scalar, Eigen::Dynamic, 1>& lse, Index first_row,
                     PassScratch<Scalar>& scratch) {
  const Index query_begin = options.query_position;
  const Index query_stop = query_begin + q.rows();
  const Index key_begin = options.key_position;
  const Index key_stop = key_begin + k.rows();
  const auto merge = [&](Index row, const HeadMap<Scalar>& partial) {
    online_softmax_merge(out.middleRows(first_row + row, partial.rows()),
                         lse.segment(first_row + row, partial.rows()), partial, scratch.lse);
  };
  // The keys [begin, end) for the query rows [r0, r1), by the regular kernel.
  const auto far_range = [&](Index r0, Index r1, Index begin, Index end) {
    if (begin >= end) return;
    AttentionOptions at = options;
    at.query_position = r0;
    at.key_position = begin;
    const Index rows = r1 - r0;
    const HeadMap<Scalar> partial = scratch.partial(rows, v.cols());
    kernel(map_rows(q, r0 - query_begin, rows), map_rows(k, begin - key_begin, end - begin),
           map_rows(v, begin - key_begin, end - begin), at, partial, scratch.partial_lse(rows));
    merge(r0 - query_begin, partial);
  };
  const Index chunk = std::max(reach + 1, kQueryTile);
  for (Index r0 = query_begin; r0 < query_stop; r0 += chunk) {
    const Index r1 = std::min(query_stop, r0 + chunk);
    far_range(r0, r1, key_begin, std::min(key_stop, r0 - reach));
    if (!options.causal) far_range(r0, r1, std::max(key_begin, r1 + reach), key_stop);
    const Index strip_begin = std::max(key_begin, r0 - reach);
    const Index strip_stop = std::min(key_stop, options.causal ? r1 : r1 + reach);
    for (Index a0 = r0; a0 < r1; a0 += kQueryTile) {
      const Index a1 = std::min(r1, a0 + kQueryTile);
      const Index stop = options.causal ? std::min(strip_stop, a1) : strip_stop;
      // Some pair beyond the reach: the last row and the first key, or the first row and the
      // last key.
      const bool far =
          (a1 - 1) - strip_begin > reach || (!options.causal && (stop - 1) - a0 > reach);
      if (strip_begin >= stop || !far) continue;
      merge(a0 - query_begin,
            masked_far_pairs(map_rows(q, a0 - query_begin, a1 - a0),
                             map_rows(k, strip_begin - key_begin, stop - strip_begin),
                             map_rows(v, strip_begin - key_begin, stop - strip_begin), options, a0,
                             strip_begin, reach, scratch));
    }
  }
}

/// The pass kernel: per batch element and head, per grid, per block, `kernel` on the block's
/// queries and keys, merged into `out` by log-sum-exp. `grids[h]` are the partitions of head h,
/// shared by the batch elements. Parallel over (batch element, head) in one parallel region.
/// Storage S is read and written through the compute type C = Compute<S>: each block's rows are
/// converted once (compute_rows) and `kernel` gets `ConstHeadMap<C>` maps; the merged output of a
/// head is kept in C and rounded to S at the end (OutputRows, a head of scratch per thread when
/// S is a 16-bit type). The merged row lse goes to `lse_out` unless it is empty.
///
/// `near_fields` (one per head, head_estimators; empty: none) gives the near-field estimator:
/// head h's near band once (merge_near_band, weight \f$s e^{-m d}\f$), then per draw and block
/// only the pairs beyond the reach (merge_far_pairs), so that the merged result is the fused
/// kernel's function. A block whose pairs all lie within the reach is skipped.
template <class Storage, class RegularKernel>
void pass_attention(const BatchedHeadsView<const Storage>& q,
                    const BatchedHeadsView<const Storage>& k,
                    const BatchedHeadsView<const Storage>& v, const BatchedHeadsView<Storage>& out,
                    const std::vector<std::vector<Grid>>& grids,
                    const std::vector<Estimator>& near_fields, const AttentionOptions& options,
                    RegularKernel&& kernel, const RowLse<Compute<Storage>>& lse_out = {}) {
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
    const std::vector<Grid>& head_grids = grids[static_cast<std::size_t>(h)];
    const Estimator near =
        near_fields.empty() ? Estimator{} : near_fields[static_cast<std::size_t>(h)];
    OutputRows<Storage> output;
    HeadMap<Scalar> out_head = output.bind(out[b].head(h));
    out_head.setZero();
    Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse =
        Eigen::Matrix<Scalar, Eigen::Dynamic, 1>::Constant(
            q.tokens, -std::numeric_limits<Scalar>::infinity());
    // A regular kernel that calls the pass kernel again on this thread would overwrite this
    // scratch: the lease throws std::logic_error instead.
    const ScratchLease<PassScratch<Scalar>> lease;
    PassScratch<Scalar>& scratch = *lease;
    if (near.reach() >= 0) {
      merge_near_band(q_head, k_head, v_head, resolved, near, static_cast<Index>(head_grids.size()),
                      out_head, lse, scratch);
    }
    for (const Grid& grid : head_grids) {
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
        if (near.reach() >= 0) {
          // The largest distance of a visible pair of the block: within the reach, nothing left.
          const Index widest =
              std::max(query_stop - 1 - key_begin, options.causal ? 0 : key_stop - 1 - query_begin);
          if (widest <= near.reach()) continue;
        }
        const Index rows = query_stop - query_begin;
        const Index first_row = query_begin - options.query_position;
        const Index first_key = key_begin - options.key_position;
        const Index keys = key_stop - key_begin;
        AttentionOptions block_options = resolved;
        block_options.query_position = query_begin;
        block_options.key_position = key_begin;
        const ConstHeadMap<Scalar> block_q =
            compute_rows(map_rows(q_head, first_row, rows), scratch.query_rows);
        const ConstHeadMap<Scalar> block_k =
            compute_rows(map_rows(k_head, first_key, keys), scratch.key_rows);
        const ConstHeadMap<Scalar> block_v =
            compute_rows(map_rows(v_head, first_key, keys), scratch.value_rows);
        if (near.reach() >= 0) {
          merge_far_pairs(block_q, block_k, block_v, block_options, near.reach(), kernel, out_head,
                          lse, first_row, scratch);
          continue;
        }
        HeadMap<Scalar> block_out = scratch.partial(rows, v.dim);
        kernel(block_q, block_k, block_v, block_options, block_out, scratch.partial_lse(rows));
        online_softmax_merge(out_head.middleRows(first_row, rows), lse.segment(first_row, rows),
                             block_out, scratch.lse);
      }
    }
    output.store();
    if (!lse_out.empty()) std::copy(lse.data(), lse.data() + q.tokens, lse_out.row(b, h));
  });
}

/// pass_attention on one element (a batch of one), as the KV cache's decoding step calls it.
template <class Scalar, class RegularKernel>
void pass_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<std::vector<Grid>>& grids,
                    const std::vector<Estimator>& near_fields, const AttentionOptions& options,
                    RegularKernel&& kernel) {
  pass_attention(batch_of_one(q), batch_of_one(k), batch_of_one(v), batch_of_one(out), grids,
                 near_fields, options, kernel);
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_PASS_KERNEL_HPP
