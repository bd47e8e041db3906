#ifndef PLSH_DETAIL_ARCH_AVX512_BF16_SCORES_HPP
#define PLSH_DETAIL_ARCH_AVX512_BF16_SCORES_HPP

/// \file bf16_scores.hpp
/// The scores of a tile of the fused kernel on bfloat16 storage by `vdpbf16ps` (AVX-512 BF16),
/// chosen at compile time: with `-mavx512bf16` as well as the flags of decode_simd.hpp (or
/// `-march=` of a processor that has them), fused_rows computes \f$S = \text{scale}\,(Q K^T)\f$
/// of a bfloat16 tile here instead of by Eigen's float product (the portable path, which the
/// default build of the tests runs).
///
/// - The query rows as pairs of bfloat16 numbers, one 32-bit word per pair (pack_query_pairs),
///   and the keys in panels of 16 keys (pack_key_panels): pair e of keys 16p .. 16p + 15 in one
///   vector, so that one `vdpbf16ps` adds pair e of a query row times pair e of 16 keys to the
///   16 keys' sums. A panel is built by a 16 × 16 transposition in registers; keys stored in
///   float (the fused kernel's packed copies of bfloat16 rows) are rounded to bfloat16 first,
///   which is exact for them.
/// - bf16_scores: blocks of 8 query rows (then 4, then 1) and 32 keys, 16 sums in registers, a
///   pair of every row and of 32 keys per step.
///
/// Products of two bfloat16 numbers are exact in float; `vdpbf16ps` adds pairs of them to float
/// sums (denormal inputs and results flushed to zero), so the scores differ from the float
/// product's by the order of the float sums only, and the scale multiplies the sums instead of
/// the query. Tested in tests/simd/fused_avx512.cpp against sums in double with a bound from
/// their magnitudes, and through the whole kernel by tests/test_fused_half.cpp.

#include "../../decode_simd.hpp"
#include "../../simd.hpp"

#if defined(PLSH_DECODE_AVX512_BF16)

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>

#include "../../storage.hpp"

namespace plsh {
namespace detail {
namespace avx512 {

/// Transposes the 16 × 16 matrix of 32-bit words whose row i is `rows[i]`, in place.
EIGEN_ALWAYS_INLINE void transpose16(__m512i* rows) {
  __m512i a[16];
  __m512i b[16];
  for (int i = 0; i < 16; i += 2) {
    a[i] = _mm512_unpacklo_epi32(rows[i], rows[i + 1]);
    a[i + 1] = _mm512_unpackhi_epi32(rows[i], rows[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    b[i] = _mm512_unpacklo_epi64(a[i], a[i + 2]);
    b[i + 1] = _mm512_unpackhi_epi64(a[i], a[i + 2]);
    b[i + 2] = _mm512_unpacklo_epi64(a[i + 1], a[i + 3]);
    b[i + 3] = _mm512_unpackhi_epi64(a[i + 1], a[i + 3]);
  }
  for (int i = 0; i < 16; i += 8) {
    for (int j = 0; j < 4; ++j) {
      a[i + j] = _mm512_shuffle_i32x4(b[i + j], b[i + j + 4], 0x88);
      a[i + j + 4] = _mm512_shuffle_i32x4(b[i + j], b[i + j + 4], 0xdd);
    }
  }
  for (int j = 0; j < 8; ++j) {
    rows[j] = _mm512_shuffle_i32x4(a[j], a[j + 8], 0x88);
    rows[j + 8] = _mm512_shuffle_i32x4(a[j], a[j + 8], 0xdd);
  }
}

/// Pairs `first .. first + 15` of a row of `dim` entries (zero past the row), as bfloat16 pairs.
EIGEN_ALWAYS_INLINE __m512i load_pairs(const Eigen::bfloat16* row, Index first, Index dim) {
  const Index begin = 2 * first;
  return _mm512_maskz_loadu_epi16(first_lanes32(dim - begin), row + begin);
}

EIGEN_ALWAYS_INLINE __m512i load_pairs(const float* row, Index first, Index dim) {
  const Index begin = 2 * first;
  const Index high_count = dim - begin - 16;
  const __m512 low = _mm512_maskz_loadu_ps(first_lanes16(dim - begin), row + begin);
  const __m512 high =
      _mm512_maskz_loadu_ps(high_count > 0 ? first_lanes16(high_count) : 0, row + begin + 16);
  return (__m512i)_mm512_cvtne2ps_pbh(high, low);
}

/// Number of bfloat16 pairs of a row of `dim` entries.
inline Index bf16_pairs(Index dim) { return (dim + 1) / 2; }

/// The query rows `[0, rows)` (`stride` entries apart) as pairs: row r's pair e at
/// `pairs[r * bf16_pairs(dim) + e]`, the odd entry of an odd `dim` paired with zero.
inline void pack_query_pairs(const Eigen::bfloat16* query, Index rows, Index dim, Index stride,
                             AlignedVector<std::uint32_t>& pairs) {
  const Index width = bf16_pairs(dim);
  pairs.assign(static_cast<std::size_t>(rows * width), 0);
  for (Index r = 0; r < rows; ++r) {
    std::memcpy(pairs.data() + r * width, query + r * stride,
                static_cast<std::size_t>(dim) * sizeof(Eigen::bfloat16));
  }
}

/// The keys `[0, count)` (`stride` entries apart, bfloat16 or bfloat16 values in float) in
/// panels of 16 keys: pair e of key 16p + l at `panels[(p * bf16_pairs(dim) + e) * 16 + l]`;
/// keys past `count` are zero.
template <class KeyStorage>
void pack_key_panels(const KeyStorage* keys, Index count, Index dim, Index stride,
                     AlignedVector<std::uint32_t>& panels) {
  const Index width = bf16_pairs(dim);
  const Index panel_count = (count + 15) / 16;
  panels.resize(static_cast<std::size_t>(panel_count * width * 16));
  __m512i block[16];
  for (Index p = 0; p < panel_count; ++p) {
    const Index lanes = std::min<Index>(16, count - 16 * p);
    std::uint32_t* panel = panels.data() + p * width * 16;
    for (Index e0 = 0; e0 < width; e0 += 16) {
      for (Index l = 0; l < 16; ++l) {
        block[l] =
            l < lanes ? load_pairs(keys + (16 * p + l) * stride, e0, dim) : _mm512_setzero_si512();
      }
      transpose16(block);
      const Index rows = std::min<Index>(16, width - e0);
      for (Index e = 0; e < rows; ++e) _mm512_storeu_si512(panel + (e0 + e) * 16, block[e]);
    }
  }
}

/// Sums of `Rows` query rows (`width` pairs each, `width` apart) against the `Panels` panels from
/// `panel` (`width * 16` words apart), scaled, into `scores` (rows `ld` apart): lanes past
/// `last_lanes` in the last panel are not stored.
template <int Rows, int Panels>
EIGEN_ALWAYS_INLINE void score_tile(const std::uint32_t* query, Index width,
                                    const std::uint32_t* panel, __m512 scale, __mmask16 last_lanes,
                                    float* scores, Index ld) {
  __m512 sums[Rows][Panels];
  for (int r = 0; r < Rows; ++r)
    for (int p = 0; p < Panels; ++p) sums[r][p] = _mm512_setzero_ps();
  for (Index e = 0; e < width; ++e) {
    __m512bh keys[Panels];
    for (int p = 0; p < Panels; ++p) {
      keys[p] = (__m512bh)_mm512_loadu_si512(panel + (p * width + e) * 16);
    }
    for (int r = 0; r < Rows; ++r) {
      const __m512bh pair = (__m512bh)_mm512_set1_epi32(static_cast<int>(query[r * width + e]));
      for (int p = 0; p < Panels; ++p) sums[r][p] = _mm512_dpbf16_ps(sums[r][p], pair, keys[p]);
    }
  }
  for (int r = 0; r < Rows; ++r) {
    for (int p = 0; p < Panels; ++p) {
      const __mmask16 lanes = p == Panels - 1 ? last_lanes : __mmask16(0xFFFF);
      _mm512_mask_storeu_ps(scores + r * ld + 16 * p, lanes, _mm512_mul_ps(sums[r][p], scale));
    }
  }
}

/// \f$S_{rj} = \text{scale} \sum_e q_{r,e} \cdot k_{j,e}\f$ (pairs e) for the `rows` query rows of
/// pack_query_pairs and the `count` keys of pack_key_panels, into `scores` (rows `ld` apart).
inline void bf16_scores(const std::uint32_t* query, Index rows, const std::uint32_t* panels,
                        Index count, Index width, float scale, float* scores, Index ld) {
  const __m512 factor = _mm512_set1_ps(scale);
  const Index panel_count = (count + 15) / 16;
  const Index panel_words = width * 16;
  const auto row_block = [&](auto rows_constant, Index r) {
    constexpr int kRows = decltype(rows_constant)::value;
    const std::uint32_t* query_rows = query + r * width;
    float* score_rows = scores + r * ld;
    Index p = 0;
    for (; p + 2 <= panel_count; p += 2) {
      const __mmask16 last = first_lanes16(count - 16 * (p + 1));
      score_tile<kRows, 2>(query_rows, width, panels + p * panel_words, factor, last,
                           score_rows + 16 * p, ld);
    }
    if (p < panel_count) {
      score_tile<kRows, 1>(query_rows, width, panels + p * panel_words, factor,
                           first_lanes16(count - 16 * p), score_rows + 16 * p, ld);
    }
  };
  Index r = 0;
  for (; r + 8 <= rows; r += 8) row_block(std::integral_constant<int, 8>{}, r);
  for (; r + 4 <= rows; r += 4) row_block(std::integral_constant<int, 4>{}, r);
  for (; r < rows; ++r) row_block(std::integral_constant<int, 1>{}, r);
}

}  // namespace avx512
}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_AVX512_BF16

#endif  // PLSH_DETAIL_ARCH_AVX512_BF16_SCORES_HPP
