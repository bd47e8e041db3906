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
  std::vector<Index> smallest;         // [row of the tile]: each row's smallest start
  LogWeights<float> log_weights;       // log weights by index, the call's near distances
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
/// the same floats as fused_span's packed copy). With a near field `near` (near_field.hpp) a row
/// also sees the keys within its reach w, whose index is LogWeights::near_index of their distance.
template <class Storage, class KeyStorage>
void fused_causal_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<KeyStorage>& k,
                       const ConstHeadMap<KeyStorage>& v, const std::vector<Grid>& grids,
                       const AttentionOptions& options, const PositionRange& range, Index row_begin,
                       Index row_end, HeadMap<Storage>& out, bool finite_values,
                       NearField near = {}, Compute<Storage>* lse = nullptr) {
  static thread_local CausalRowsWorkspace scratch;
  const Index samples = static_cast<Index>(grids.size());
  const Index draws = (samples + 7) / 8 * 8;
  const Index dim = q.cols();
  const Index value_dim = v.cols();
  const Index key_begin = options.key_position;
  const Index key_end = options.key_position + k.rows();
  const Index first_position = options.query_position + row_begin;
  // The near keys' weights for the distances between these rows and the keys: at most the reach
  // of a steep head (1/m < kCausalRowsReach), whatever the positions.
  scratch.log_weights.prepare(
      samples, near.slope,
      near_distances(near.reach, first_position, options.query_position + row_end - 1, key_begin,
                     key_end - 1));
  const LogCountLookup log_count(scratch.log_weights.data(), scratch.log_weights.max_index());
  // A row at p sees from its smallest start, or from p - w with a near field of reach w.
  const auto first_key_of = [&](Index smallest_start, Index p) {
    return near.reach >= 0 ? std::min(smallest_start, p - near.reach) : smallest_start;
  };
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
    const Index low = std::max(first_key_of(smallest, first_position), key_begin);
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
      scratch.smallest[static_cast<std::size_t>(r - r0)] = first_key_of(smallest, p);
      widest = std::max(widest,
                        std::min(p + 1, key_end) - std::max(first_key_of(smallest, p), key_begin));
    }
    if (widest > kCausalRowKeys) {
      fused_rows<Storage>(q, k, v, grids, options, range, r0, r1, out, finite_values, near, lse);
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
      if (lse != nullptr) lse[r] = -std::numeric_limits<float>::infinity();
      if (count <= 0) {
        out_row.setZero();
        continue;
      }
      const auto bad = std::lower_bound(scratch.bad.begin(), scratch.bad.end(), first);
      if (bad != scratch.bad.end() && *bad < first + count) {
        fused_rows<Storage>(q, k, v, grids, options, range, r, r + 1, out, false, near, lse);
        continue;
      }
      // Pass 1, 16 keys at a time in registers: the logits S + log c_j, c_j = #{t : b_t <=
      // first + j} (at least 1 from the smallest start on), or the near field's index of the
      // distance d = p - first - j <= w from the key near_from on (the keys before the smallest
      // start, if any, are near); their maximum, whether a NaN is among them. With near keys,
      // p - first < w + count: the indices are small.
      const Index near_from =
          near.reach >= 0 ? std::clamp<Index>(p - near.reach - first, 0, count) : count;
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
        if (near_from < count && j + 16 > near_from) {
          // near_index(p - first - offset) = near_index(p - first) - offset, on the valid keys
          // from near_from on.
          const __mmask16 near_keys = _mm512_mask_cmpge_epi32_mask(
              valid, offset, _mm512_set1_epi32(static_cast<int>(near_from)));
          counts = _mm512_mask_sub_epi32(
              counts, near_keys,
              _mm512_set1_epi32(static_cast<int>(scratch.log_weights.near_index(p - first))),
              offset);
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
        if (lse != nullptr && nan != 0) lse[r] = std::numeric_limits<float>::quiet_NaN();
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
      if (lse != nullptr) lse[r] = max + std::log(total);
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
