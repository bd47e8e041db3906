#ifndef PLSH_ATTENTION_FUSED_KERNEL_HPP
#define PLSH_ATTENTION_FUSED_KERNEL_HPP

/// \file fused_kernel.hpp
/// Kernel::Fused, the default evaluation of Positional LSH: with \f$c_{ij}\f$ the number of
/// draws in which i and j share a block,
/// \f[ o_i = \frac{\sum_j c_{ij} e^{S_{ij}} v_j}{\sum_j c_{ij} e^{S_{ij}}} \f]
/// over the union of the blocks of i, each score computed once whatever s. This file cuts a call
/// into jobs and a job into tiles: fused_attention runs one OpenMP region over (batch element,
/// span of up to kFusedSpanRows query rows, head); fused_span packs the keys and values a span
/// may see when they are strided or 16-bit (converted and tested for finiteness once), then
/// hands the span's tiles (height fused_tile_rows(m)) to fused_rows (fused_rows.hpp) or, for the
/// causal rows of steep heads in AVX-512 builds, to fused_causal_rows
/// (arch/avx512/causal_rows.hpp). Cost about \f$(\ln(s)/m + \text{tile})(d + d_v)\f$ per query and
/// head; O(s) block look-ups per span and tile. Every job writes its own rows: the result is
/// identical for any number of threads.
///
/// Tested against plsh::reference::mask_attention (dense, in double, same grids) and against the
/// pass kernel in tests/test_plsh_attention.cpp; packed and in-place keys against each other
/// there (max_packed_keys); the 16-bit types in tests/test_fused_half.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <type_traits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/parallel.hpp"
#include "../detail/scratch.hpp"
#include "../detail/simd.hpp"
#include "../detail/storage.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../partition.hpp"
#include "../row_lse.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "arch/avx512/causal_rows.hpp"
#include "block_counts.hpp"
#include "fused_rows.hpp"
#include "near_field.hpp"

namespace plsh {
namespace detail {

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
/// causal), and the keys within the reach of the near field of `estimator`, cut to the keys
/// `[key_begin, key_end)`. Every row's blocks lie inside, blocks being intervals in the order of
/// the positions. O(s) calls of grid_block.
inline Block span_keys(const std::vector<Grid>& grids, const PositionRange& range,
                       Index first_position, Index last_position, Index key_begin, Index key_end,
                       bool causal, const Estimator& estimator) {
  Index begin = last_position + 1;
  Index end = causal ? last_position + 1 : first_position;
  for (const Grid& grid : grids) {
    begin = std::min(begin, grid_block(grid, first_position, range.first, range.last).begin);
    if (!causal) end = std::max(end, grid_block(grid, last_position, range.first, range.last).end);
  }
  const Index reach = estimator.reach();
  if (reach >= 0) {
    begin = std::min(begin, first_position - reach);
    if (!causal) end = std::max(end, last_position + reach + 1);
  }
  begin = std::max(begin, key_begin);
  end = std::min(end, key_end);
  return begin < end ? Block{begin, end} : Block{key_begin, key_begin};
}

/// Query rows `[row_begin, row_end)` of one head by the fused kernel, tile by tile (height from
/// the slope of the head's Estimator `estimator`, which also gives its weights). When the keys the
/// rows may see (span_keys) are at most `max_packed_keys` and the head's key or value rows are
/// strided (a token-major tensor's rows of one head lie `heads * dim` elements apart: few rows per
/// page for the prefetchers, few sets of the L1 cache for the rows that tile after tile reads
/// again) or stored in a 16-bit type, those key and value rows are first copied, packed and in the
/// compute type, into per-thread scratch: each is read from the tensor and converted once, in a
/// loop whose loads are independent, instead of missing the cache inside the products and being
/// converted again by every tile that sees it. Same arithmetic either way. (A tile's query rows are
/// copied anyway, scaled, and its output rows written once.) When the keys are in the compute type,
/// the values of those keys are tested for finiteness once here, and the tiles skip their own test
/// when they are (OnlineSoftmax::update_counted, fused_row_by_row). When `lse` (the head's, by row)
/// is not null, the rows' log-sum-exp of \f$S_{ij} + \log c_{ij}\f$ go to
/// `lse[row_begin..row_end)`.
template <class Storage>
void fused_span(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                const ConstHeadMap<Storage>& v, const std::vector<Grid>& grids,
                const AttentionOptions& options, const PositionRange& range, Index row_begin,
                Index row_end, HeadMap<Storage>& out, Index max_packed_keys,
                const Estimator& estimator, Compute<Storage>* lse = nullptr) {
  using Scalar = Compute<Storage>;
  const double slope = estimator.slope();
  const Index height = fused_tile_rows(slope);
  const Block keys = span_keys(grids, range, options.query_position + row_begin,
                               options.query_position + row_end - 1, options.key_position,
                               options.key_position + k.rows(), options.causal, estimator);
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
                                   out, finite_values, estimator, lse);
        return;
      }
    }
#endif
    for (Index r0 = row_begin; r0 < row_end; r0 += height) {
      fused_rows<Storage>(q, key_rows, value_rows, grids, at, range, r0,
                          std::min(row_end, r0 + height), out, finite_values, estimator, lse);
    }
  };
  const bool strided = k.outerStride() != k.cols() || v.outerStride() != v.cols();
  const bool converted = !std::is_same<Storage, Scalar>::value;
  if ((!strided && !converted) || key_count == 0 || key_count > max_packed_keys) {
    tiles(k, v, options);
    return;
  }
  const ScratchLease<SpanKeys<Scalar>> span_lease;
  SpanKeys<Scalar>& span = *span_lease;
  const Index first_key = keys.begin - options.key_position;
  AttentionOptions packed = options;
  packed.key_position = keys.begin;
  tiles(pack_rows<Scalar>(k, first_key, key_count, span.k),
        pack_rows<Scalar>(v, first_key, key_count, span.v), packed);
}

/// The fused kernel: parallel over (batch element, span of fused_span_rows query rows, head) in
/// one parallel region (fused_span, packing at most `max_packed_keys` keys per job); the grids are
/// shared by the batch elements. `near_field` is PlshOptions::near_field (0: none). The row lse
/// goes to `lse` unless it is empty. Consecutive
/// jobs take the heads of one span in turn: in a token-major tensor their rows share pages, which
/// the first job brings in.
template <class Storage>
void fused_attention(const BatchedHeadsView<const Storage>& q,
                     const BatchedHeadsView<const Storage>& k,
                     const BatchedHeadsView<const Storage>& v, const BatchedHeadsView<Storage>& out,
                     const std::vector<std::vector<Grid>>& grids, const std::vector<double>& slopes,
                     const AttentionOptions& options, double near_field = 0,
                     Index max_packed_keys = kFusedSpanKeys,
                     const RowLse<Compute<Storage>>& lse = {}) {
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
    const std::vector<Grid>& head_grids = grids[static_cast<std::size_t>(h)];
    fused_span<Storage>(q[b].head(h), k[b].head(h / group), v[b].head(h / group), head_grids,
                        resolved, range, row_begin, std::min(q.tokens, row_begin + span_rows),
                        out_head, max_packed_keys,
                        head_estimator(slopes[static_cast<std::size_t>(h)],
                                       static_cast<Index>(head_grids.size()), near_field, range),
                        lse.empty() ? nullptr : lse.row(b, h));
  });
}

/// fused_attention on one element (a batch of one), as the KV cache's decoding step and the
/// tests call it.
template <class Scalar>
void fused_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                     const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                     const std::vector<std::vector<Grid>>& grids, const std::vector<double>& slopes,
                     const AttentionOptions& options, double near_field = 0,
                     Index max_packed_keys = kFusedSpanKeys) {
  fused_attention(batch_of_one(q), batch_of_one(k), batch_of_one(v), batch_of_one(out), grids,
                  slopes, options, near_field, max_packed_keys);
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_FUSED_KERNEL_HPP
