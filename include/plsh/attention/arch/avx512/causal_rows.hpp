#ifndef PLSH_ATTENTION_ARCH_AVX512_CAUSAL_ROWS_HPP
#define PLSH_ATTENTION_ARCH_AVX512_CAUSAL_ROWS_HPP

/// \file causal_rows.hpp
/// The fused kernel on the causal rows of a steep head, row by row, in AVX-512 (builds with
/// PLSH_FUSED_AVX512 and PLSH_DECODE_AVX512, detail/simd.hpp; elsewhere kCausalRows is false and
/// fused_span tiles every row). A causal row i at position p sees the keys from its draws'
/// smallest block start to p, with
/// \f[ c_{ij} = \#\{t : b_t \le j\}, \qquad
///     o_i = \frac{\sum_j c_{ij} e^{S_{ij}} v_j}{\sum_j c_{ij} e^{S_{ij}}}, \f]
/// \f$b_t\f$ the start of the block of draw t that holds p: the starts are carried from row to
/// row, so each row computes the scores of its own keys only (5 to 50 of them at
/// \f$1/m <\f$ kCausalRowsReach, s = 20) instead of its tile's union. Cost
/// \f$O(s)\f$ vector operations per row to carry the starts, plus \f$(d + d_v + s/16)\f$ per
/// visible key; scratch O(s + kCausalTileRows d) per thread.
///
/// Tested against plsh::reference::mask_attention and the portable fused kernel in
/// test_plsh_attention_avx512 (tests/test_plsh_attention*.cpp and tests/simd/fused_avx512.cpp
/// compiled for AVX-512).

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../../../detail/decode_simd.hpp"
#include "../../../detail/simd.hpp"
#include "../../../detail/storage.hpp"
#include "../../../options.hpp"
#include "../../../partition.hpp"
#include "../../../sampler.hpp"
#include "../../../tensor.hpp"
#include "../../fused_rows.hpp"
#include "../../near_field.hpp"
#include "../../online_softmax.hpp"

namespace plsh {
namespace detail {

/// fused_span takes fused_causal_rows (kCausalRows) for the causal rows of heads of slope m with
/// 1/m below this: their rows see few keys (5 to 50 with s = 20 draws), too few for the tiles'
/// blocked products to pay for their packing.
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
  std::vector<Index> smallest;         // [row of the tile]: each row's first key
  LogWeights<float> log_weights;       // log weights by index, the call's near distances
  AlignedVector<float> query;          // the tile's query rows in float, scaled
  AlignedVector<float> weights;        // one row's scores, then weights
  AlignedVector<float> sum;            // one row's weighted sum of values
  std::vector<Index> bad;              // positions of value rows with a non-finite entry
};

/// The first key a causal row at `p` sees: its draws' smallest block start `smallest_start`, or
/// p - w with a near field of reach `reach` = w (-1: none).
inline Index causal_first_key(Index smallest_start, Index p, Index reach) {
  return reach >= 0 ? std::min(smallest_start, p - reach) : smallest_start;
}

/// Sizes `scratch` for `draws` (padded) draws, `dim` query and `value_dim` value entries, and
/// starts the draws at the position `first_position`: each one's pitch, shift, bin and block
/// start (by grid_block); the padding draws never start a block. Returns the smallest start.
inline Index start_causal_draws(CausalRowsWorkspace& scratch, const std::vector<Grid>& grids,
                                const PositionRange& range, Index first_position, Index draws,
                                Index dim, Index value_dim) {
  const Index samples = static_cast<Index>(grids.size());
  for (auto* vector : {&scratch.pitch, &scratch.shift, &scratch.bin}) {
    vector->resize(static_cast<std::size_t>(draws));
  }
  scratch.begin.resize(static_cast<std::size_t>(draws));
  scratch.tile.resize(static_cast<std::size_t>(kCausalTileRows * draws));
  scratch.smallest.resize(static_cast<std::size_t>(kCausalTileRows));
  scratch.query.resize(static_cast<std::size_t>(kCausalTileRows * dim));
  scratch.weights.resize(static_cast<std::size_t>(kCausalRowKeys + 16));
  scratch.sum.resize(static_cast<std::size_t>(value_dim));
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
  return *std::min_element(scratch.begin.begin(), scratch.begin.end());
}

/// Position p's block starts from p - 1's, all `draws` at once: a draw whose bin changes (or
/// whose pitch is at most 1: blocks of one position) starts a block at p. Returns the smallest
/// start.
inline Index advance_causal_draws(CausalRowsWorkspace& scratch, Index draws, Index p) {
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
}

/// The positions of the value rows of `v` (key positions from `key_begin`) with a non-finite
/// entry among the keys `[low, high)`, into scratch.bad, in increasing order.
template <class KeyStorage>
void find_bad_values(CausalRowsWorkspace& scratch, const ConstHeadMap<KeyStorage>& v,
                     Index key_begin, Index low, Index high) {
  scratch.bad.clear();
  for (Index j = low; j < high; ++j) {
    if (!all_finite(v.row(j - key_begin).template cast<float>())) scratch.bad.push_back(j);
  }
}

/// Carries the draws' starts over the tile's rows `[r0, r1)` (rows from `row_begin`, which the
/// first call starts at; row r at position `query_position + r`): each row's starts into
/// scratch.tile and its first key (causal_first_key) into scratch.smallest. `smallest` is the
/// current row's smallest start, updated. Returns the most keys a row of the tile sees among
/// `[key_begin, key_end)`.
inline Index carry_tile_starts(CausalRowsWorkspace& scratch, Index draws, Index row_begin, Index r0,
                               Index r1, Index query_position, Index reach, Index key_begin,
                               Index key_end, Index& smallest) {
  Index widest = 0;
  for (Index r = r0; r < r1; ++r) {
    const Index p = query_position + r;
    if (r != row_begin) smallest = advance_causal_draws(scratch, draws, p);
    std::copy(scratch.begin.begin(), scratch.begin.end(),
              scratch.tile.begin() + static_cast<std::ptrdiff_t>((r - r0) * draws));
    scratch.smallest[static_cast<std::size_t>(r - r0)] = causal_first_key(smallest, p, reach);
    widest = std::max(widest, std::min(p + 1, key_end) -
                                  std::max(causal_first_key(smallest, p, reach), key_begin));
  }
  return widest;
}

/// The tile's query rows `[r0, r1)` of `q` in float, times `scale`, into scratch.query, in one
/// loop of independent loads.
template <class Storage>
void load_tile_queries(CausalRowsWorkspace& scratch, const ConstHeadMap<Storage>& q, Index r0,
                       Index r1, float scale) {
  const Index dim = q.cols();
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
}

/// The largest logit of a row and whether a NaN is among its logits (causal_row_logits).
struct CausalRowMax {
  float max;
  __mmask16 nan;
};

/// Pass 1 of a causal row, 16 keys at a time in registers: the logits \f$S + \log w\f$ of its
/// `count` keys into `logits`, the weight index of key j being \f$c_j = \#\{t : b_t \le
/// \text{first} + j\}\f$ over the `samples` starts `begins` relative to its first key `first`
/// (at least 1 from the smallest start on), or from the key `near_from` on the near index of its
/// distance \f$d = p - \text{first} - j \le w\f$ (`near_index_first`, LogWeights::near_index of
/// \f$p - \text{first}\f$, minus j: with near keys p - first < w + count, the indices are
/// small), looked up in `log_weight`; the scores by avx512::score_block of the `keys` rows
/// `stride` apart and the `query`. Returns their maximum and whether a NaN is among them.
template <class KeyStorage>
EIGEN_ALWAYS_INLINE CausalRowMax
causal_row_logits(const KeyStorage* keys, Index count, Index dim, Index stride, const float* query,
                  const std::int64_t* begins, Index first, Index samples, Index near_from,
                  Index near_index_first, const LogWeightLookup& log_weight, float* logits) {
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512i one = _mm512_set1_epi32(1);
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
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
    if (near_from < count && j + 16 > near_from) {
      // near_index(p - first - offset) = near_index(p - first) - offset, on the valid keys from
      // near_from on.
      const __mmask16 near_keys = _mm512_mask_cmpge_epi32_mask(
          valid, offset, _mm512_set1_epi32(static_cast<int>(near_from)));
      counts = _mm512_mask_sub_epi32(counts, near_keys,
                                     _mm512_set1_epi32(static_cast<int>(near_index_first)), offset);
    }
    const __m512 logit =
        _mm512_add_ps(avx512::score_block(keys, j, count, dim, stride, query), log_weight(counts));
    nan |= _mm512_mask_cmp_ps_mask(valid, logit, logit, _CMP_UNORD_Q);
    best = _mm512_mask_max_ps(best, valid, logit, best);
    _mm512_store_ps(logits + j, logit);
  }
  return CausalRowMax{_mm512_reduce_max_ps(best), nan};
}

/// Pass 2 of a causal row: its `count` logits in `weights` replaced by the weights
/// \f$e^{l - \max}\f$ (the largest exactly 1; exactly 0 for a logit \f$-\infty\f$, where the
/// vectorised exp gives a tiny subnormal); returns their sum.
EIGEN_ALWAYS_INLINE float causal_row_weights(float* weights, Index count, float max) {
  const __m512 minus_infinity = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  const __m512 shift = _mm512_set1_ps(max);
  __m512 totals = _mm512_setzero_ps();
  for (Index j = 0; j < count; j += 16) {
    const __mmask16 valid = lanes_below(count - j);
    const __m512 logit = _mm512_load_ps(weights + j);
    const __mmask16 weighs = _mm512_mask_cmp_ps_mask(valid, logit, minus_infinity, _CMP_NEQ_OQ);
    const __m512 weight = _mm512_maskz_mov_ps(
        weighs, Eigen::internal::pexp<Eigen::internal::Packet16f>(_mm512_sub_ps(logit, shift)));
    _mm512_store_ps(weights + j, weight);
    totals = _mm512_add_ps(totals, weight);
  }
  return _mm512_reduce_add_ps(totals);
}

/// The fused kernel on causal query rows `[row_begin, row_end)` of a steep head, row by row,
/// with the AVX-512 code of the walk and of decoding. Row i at position p sees the keys from its
/// draws' smallest block start to p, with \f$c_{ij} = \#\{t : b_t \le j\}\f$ (a causal block
/// that holds p starts at \f$b_t\f$ and reaches p). The starts are carried from row to row, all
/// draws at once (start_causal_draws, then advance_causal_draws: a draw's block changes where
/// its bin does, the bin test of tile_block_runs, in vectors of 8 draws). Per tile of
/// kCausalTileRows rows: the rows' starts (carry_tile_starts), the query rows
/// (load_tile_queries); per row, the logits \f$S + \log w\f$ and their maximum \f$\mu\f$
/// (causal_row_logits), the weights \f$e^{l - \mu}\f$ and their sum as the walk's
/// counted_weights computes them (causal_row_weights: the largest weight is exactly 1, so a row
/// that sees one key gets its value exactly; a logit \f$-\infty\f$ weighs exactly 0; a NaN makes
/// the row NaN), and the weighted sum of values by avx512::weighted_sum. A tile with a row wider
/// than kCausalRowKeys keys goes to fused_rows, and so does a row that sees a non-finite value
/// (unless `finite_values`, the value rows are scanned for them first: find_bad_values). Key and
/// value rows in float or, read in place, in a 16-bit type (converted in registers: the same
/// floats as fused_span's packed copy). With a near field (the head's Estimator `estimator`,
/// near_field.hpp) a row also sees the keys within its reach w, whose index is
/// LogWeights::near_index of their distance.
template <class Storage, class KeyStorage>
void fused_causal_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<KeyStorage>& k,
                       const ConstHeadMap<KeyStorage>& v, const std::vector<Grid>& grids,
                       const AttentionOptions& options, const PositionRange& range, Index row_begin,
                       Index row_end, HeadMap<Storage>& out, bool finite_values,
                       const Estimator& estimator, Compute<Storage>* lse = nullptr) {
  const ScratchLease<CausalRowsWorkspace> scratch_lease;
  CausalRowsWorkspace& scratch = *scratch_lease;
  const Index samples = static_cast<Index>(grids.size());
  const Index reach = estimator.reach();
  const Index draws = (samples + 7) / 8 * 8;
  const Index dim = q.cols();
  const Index value_dim = v.cols();
  const Index key_begin = options.key_position;
  const Index key_end = options.key_position + k.rows();
  const Index first_position = options.query_position + row_begin;
  // The near keys' weights for the distances between these rows and the keys: at most the reach
  // of a steep head (1/m < kCausalRowsReach), whatever the positions.
  scratch.log_weights.prepare(
      estimator, near_distances(reach, first_position, options.query_position + row_end - 1,
                                key_begin, key_end - 1));
  const LogWeightLookup log_weight(scratch.log_weights.data(), scratch.log_weights.max_index());
  Index smallest = start_causal_draws(scratch, grids, range, first_position, draws, dim, value_dim);
  // The value rows with a non-finite entry among the keys the rows may see (from the first row's
  // first key on): a row that sees one goes to fused_rows, so that the rows that see none are
  // those of clean values, bit for bit.
  if (finite_values) {
    scratch.bad.clear();
  } else {
    find_bad_values(scratch, v, key_begin,
                    std::max(causal_first_key(smallest, first_position, reach), key_begin),
                    std::min(options.query_position + row_end, key_end));
  }
  for (Index r0 = row_begin; r0 < row_end; r0 += kCausalTileRows) {
    const Index r1 = std::min(row_end, r0 + kCausalTileRows);
    if (carry_tile_starts(scratch, draws, row_begin, r0, r1, options.query_position, reach,
                          key_begin, key_end, smallest) > kCausalRowKeys) {
      fused_rows<Storage>(q, k, v, grids, options, range, r0, r1, out, finite_values, estimator,
                          lse);
      continue;
    }
    load_tile_queries(scratch, q, r0, r1, static_cast<float>(options.scale));
    for (Index r = r0; r < r1; ++r) {
      const Index p = options.query_position + r;
      const Index first = std::max(scratch.smallest[static_cast<std::size_t>(r - r0)], key_begin);
      const Index count = std::min(p + 1, key_end) - first;
      auto out_row = out.row(r);
      if (lse != nullptr) lse[r] = -std::numeric_limits<float>::infinity();
      if (count <= 0) {
        out_row.setZero();
        continue;
      }
      const auto bad = std::lower_bound(scratch.bad.begin(), scratch.bad.end(), first);
      if (bad != scratch.bad.end() && *bad < first + count) {
        fused_rows<Storage>(q, k, v, grids, options, range, r, r + 1, out, false, estimator, lse);
        continue;
      }
      const Index near_from = reach >= 0 ? std::clamp<Index>(p - reach - first, 0, count) : count;
      const CausalRowMax row_max = causal_row_logits(
          k.data() + (first - key_begin) * k.outerStride(), count, dim, k.outerStride(),
          scratch.query.data() + (r - r0) * dim,
          &scratch.tile[static_cast<std::size_t>((r - r0) * draws)], first, samples, near_from,
          near_from < count ? scratch.log_weights.near_index(p - first) : 0, log_weight,
          scratch.weights.data());
      if (row_max.nan != 0 || row_max.max == -std::numeric_limits<float>::infinity()) {
        // A NaN poisons the row; a row whose scores are all -inf sees nothing (fused_rows).
        out_row.setConstant(row_max.nan != 0
                                ? static_cast<Storage>(std::numeric_limits<float>::quiet_NaN())
                                : Storage(0));
        if (lse != nullptr && row_max.nan != 0) lse[r] = std::numeric_limits<float>::quiet_NaN();
        continue;
      }
      const float total = causal_row_weights(scratch.weights.data(), count, row_max.max);
      if (lse != nullptr) lse[r] = row_max.max + std::log(total);
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

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_ARCH_AVX512_CAUSAL_ROWS_HPP
