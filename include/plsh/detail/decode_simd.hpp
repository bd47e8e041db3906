#ifndef PLSH_DETAIL_DECODE_SIMD_HPP
#define PLSH_DETAIL_DECODE_SIMD_HPP

/// \file decode_simd.hpp
/// AVX-512 products of the single-query decoding path (decode/decode_step.hpp), chosen at compile
/// time: with `-mavx512f -mavx512bw -mavx512vl` (or `-march=` of a processor that has them)
/// KvCache computes a job's scores and its weighted sum of values here; otherwise with Eigen's
/// matrix-vector products (the portable path, which the default build of the tests runs).
///
/// - `avx512::scores`: \f$s_j = q \cdot k_j\f$ for up to 16 keys at once: one accumulator per key,
///   one fused multiply-add per 16 entries (each key row read whole before the next, in two
///   chains of sums for d = 64), then the 16 accumulators reduced together by three rounds of
///   shuffles (45 operations per 16 keys instead of a horizontal sum per key). Keys in float, or
///   in bfloat16 or half converted in registers (no copy of the key rows). The near keys of a
///   near field (DecodeNear) get their log weight \f$\log s - m d\f$ added there
///   (`avx512::near_log_weights`, the vector form of Estimator::log_near_weight). Returns the
///   largest logit as well, so that no other pass looks for it.
/// - With AVX-512 BF16 as well (`-mavx512bf16`), bfloat16 keys and the bfloat16 query go to
///   `vdpbf16ps`: products of two bfloat16 numbers are exact in float, and pairs of them are
///   summed into float accumulators, so the scores differ from the converted path by the order
///   of the float sums (and denormals flushed to zero) only. The scale multiplies the sums.
/// - `avx512::exp_counts`: the weights \f$w_j = c_j e^{s_j - \max}\f$ and their sum in one pass,
///   with Eigen's vectorised exponential and the counts \f$c_j\f$ by vector compares (near keys:
///   \f$e^{s_j - \max}\f$, their weight being in their logit).
/// - `avx512::weighted_sum`: \f$o = \sum_j w_j v_j\f$, 64 output columns at a time in registers,
///   values converted in registers; bfloat16 values 32 at a time by a shift and a mask (even and
///   odd columns summed apart, interleaved once at the end).
///
/// `avx512::score_block` (16 scores in a register) and `avx512::weighted_sum` also serve the fused
/// kernel's causal rows of steep heads (attention/plsh_attention.hpp, detail::fused_causal_rows).
///
/// Rows are `stride` entries apart; every size is allowed (tails by masked loads, which do not
/// touch memory past the last row). Tested in tests/simd/decode_avx512.cpp (test_simd)
/// against sums and exponentials in double, for every size from 1 to past two vectors, and the
/// near log weights against Estimator::log_near_weight, where the build machine has these
/// instructions.

#include <Eigen/Core>

#include <algorithm>
#include <limits>

#include "../attention/near_field.hpp"
#include "../tensor.hpp"

#include "simd.hpp"

namespace plsh {
namespace detail {

/// The near field of one job of the single-query path (decode/decode_step.hpp; near_field.hpp):
/// its keys from position `first` on lie within the reach of the query at `position`, and weigh
/// \f$s e^{-m(p - j)}\f$ (the head's `estimator`) in place of their count; `first` past the
/// job's keys: none.
struct DecodeNear {
  Index first = std::numeric_limits<Index>::max();
  Index position = 0;
  Estimator estimator;

  /// The log weight \f$\log s - m d\f$ of the near key at position `key`, at distance
  /// \f$d = p - j\f$ (Estimator::log_near_weight), which avx512::near_log_weights vectorises.
  double log_weight(Index key) const { return estimator.log_near_weight(position - key); }
};

}  // namespace detail
}  // namespace plsh

#if defined(PLSH_DECODE_AVX512)

// GCC 12's AVX-512 headers initialise _mm_undefined_ps() and its kin from themselves, which is
// reported as (maybe) uninitialised where shuffles and extractions are inlined (GCC bug 105593,
// fixed in GCC 13).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#define PLSH_DECODE_DIAGNOSTIC_PUSHED 1
#endif

namespace plsh {
namespace detail {
namespace avx512 {

/// The first `count` of 16 lanes (all of them for count >= 16).
inline __mmask16 first_lanes16(Index count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << static_cast<unsigned>(count)) - 1u);
}

/// The first `count` of 32 lanes (all of them for count >= 32).
inline __mmask32 first_lanes32(Index count) {
  return count >= 32 ? static_cast<__mmask32>(0xFFFFFFFFu)
                     : static_cast<__mmask32>((1u << static_cast<unsigned>(count)) - 1u);
}

/// 16 floats from `data`, lanes outside `mask` zero (and not read).
inline __m512 load(const float* data, __mmask16 mask) { return _mm512_maskz_loadu_ps(mask, data); }

inline __m512 load(const Eigen::half* data, __mmask16 mask) {
  return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(mask, data));
}

/// A bfloat16 is the upper half of a float: widening is a 16-bit shift.
inline __m512 load(const Eigen::bfloat16* data, __mmask16 mask) {
  return _mm512_castsi512_ps(
      _mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(mask, data)), 16));
}

/// 16 floats from `data`, all of them read (the products load whole vectors without a mask and
/// mask only the tail of a row).
inline __m512 load(const float* data) { return _mm512_loadu_ps(data); }

inline __m512 load(const Eigen::half* data) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data)));
}

inline __m512 load(const Eigen::bfloat16* data) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(data))), 16));
}

/// The sums of 16 vectors, lane j holding the sum of the lanes of `v[j]`.
inline __m512 sum16(const __m512* v) {
  // Within each 128-bit lane, pairs (v[2i], v[2i+1]): [x0+x2, y0+y2, x1+x3, y1+y3].
  __m512 a[8];
  for (int i = 0; i < 8; ++i) {
    a[i] = _mm512_add_ps(_mm512_unpacklo_ps(v[2 * i], v[2 * i + 1]),
                         _mm512_unpackhi_ps(v[2 * i], v[2 * i + 1]));
  }
  // Pairs (a[2i], a[2i+1]): per 128-bit lane, the lane sums of v[4i], ..., v[4i + 3].
  __m512 b[4];
  for (int i = 0; i < 4; ++i) {
    b[i] = _mm512_add_ps(_mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // Across the four 128-bit lanes: b[i]'s four lane sums added, into 128-bit lane i.
  const __m512 c0 = _mm512_add_ps(_mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(b[0], b[1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 c1 = _mm512_add_ps(_mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(1, 0, 1, 0)),
                                  _mm512_shuffle_f32x4(b[2], b[3], _MM_SHUFFLE(3, 2, 3, 2)));
  return _mm512_add_ps(_mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(2, 0, 2, 0)),
                       _mm512_shuffle_f32x4(c0, c1, _MM_SHUFFLE(3, 1, 3, 1)));
}

/// `rows[r]`: key row `first + r` of a block of 16, the last row repeated past `count` (its
/// sums are computed and not stored).
template <class Storage>
void block_rows(const Storage* keys, Index stride, Index first, Index count,
                const Storage* (&rows)[16]) {
  for (Index r = 0; r < 16; ++r) {
    rows[r] = keys + (first + (first + r < count ? r : count - 1 - first)) * stride;
  }
}

/// `best` raised to `sums` in the lanes of `mask`; a NaN in `sums` leaves its lane as it was.
inline __m512 raise_max(__m512 best, __mmask16 mask, __m512 sums) {
  // _mm512_max_ps returns its second operand where either is NaN.
  return _mm512_mask_max_ps(best, mask, sums, best);
}

/// DecodeNear::log_weight (Estimator::log_near_weight) of the 16 keys at positions `key` ..
/// `key + 15`, each rounded to float:
/// the distances \f$d = p - j\f$ are exact in double (integers below \f$2^{53}\f$), and
/// \f$\log s - m d\f$ is one fused multiply-add in double, which is what the scalar form
/// compiles to where the compiler contracts it (GCC's default, Clang's within an expression);
/// elsewhere the two differ by one rounding in double, which the float rounding hides but for
/// values within \f$2^{-29}\f$ of a float rounding boundary.
inline __m512 near_log_weights(const DecodeNear& near, Index key) {
  const __m512d low_lanes = _mm512_setr_pd(0, 1, 2, 3, 4, 5, 6, 7);
  const __m512d high_lanes = _mm512_setr_pd(8, 9, 10, 11, 12, 13, 14, 15);
  const __m512d distance = _mm512_set1_pd(static_cast<double>(near.position - key));
  const __m512d slope = _mm512_set1_pd(near.estimator.slope());
  const __m512d log_samples = _mm512_set1_pd(near.estimator.log_samples());
  const __m256 low =
      _mm512_cvtpd_ps(_mm512_fnmadd_pd(slope, _mm512_sub_pd(distance, low_lanes), log_samples));
  const __m256 high =
      _mm512_cvtpd_ps(_mm512_fnmadd_pd(slope, _mm512_sub_pd(distance, high_lanes), log_samples));
  return _mm512_castpd_ps(
      _mm512_insertf64x4(_mm512_castps_pd(_mm512_castps256_ps512(low)), _mm256_castps_pd(high), 1));
}

/// The lanes of the 16 keys from index `first` of a job whose keys from index `near_from` on are
/// near.
inline __mmask16 near_lanes16(Index first, Index near_from) {
  return first >= near_from ? static_cast<__mmask16>(0xFFFF)
                            : static_cast<__mmask16>(~first_lanes16(near_from - first));
}

/// \f$s_j = q \cdot k_j\f$ for the 16 keys from `first` (`keys` rows `stride` apart, `query` of
/// `dim` floats); lanes past `count` hold the last key's score. Always inlined, so that its 16
/// sums stay in registers instead of going through memory as a call's result.
template <class Storage>
EIGEN_ALWAYS_INLINE __m512 score_block(const Storage* keys, Index first, Index count, Index dim,
                                       Index stride, const float* query) {
  const Storage* rows[16];
  block_rows(keys, stride, first, count, rows);
  __m512 sums[16];
  for (__m512& sum : sums) sum = _mm512_setzero_ps();
  const Index whole = dim / 16 * 16;
  if (whole == 64) {
    const __m512 q0 = _mm512_loadu_ps(query), q1 = _mm512_loadu_ps(query + 16),
                 q2 = _mm512_loadu_ps(query + 32), q3 = _mm512_loadu_ps(query + 48);
    for (int r = 0; r < 16; ++r) {
      __m512 a = _mm512_mul_ps(load(rows[r]), q0);
      __m512 b = _mm512_mul_ps(load(rows[r] + 16), q1);
      a = _mm512_fmadd_ps(load(rows[r] + 32), q2, a);
      b = _mm512_fmadd_ps(load(rows[r] + 48), q3, b);
      sums[r] = _mm512_add_ps(a, b);
    }
  } else {
    for (int r = 0; r < 16; ++r) {
      for (Index d = 0; d < whole; d += 16) {
        sums[r] = _mm512_fmadd_ps(load(rows[r] + d), _mm512_loadu_ps(query + d), sums[r]);
      }
    }
  }
  if (whole < dim) {
    const Index d = whole;
    const __mmask16 mask = first_lanes16(dim - d);
    const __m512 q = _mm512_maskz_loadu_ps(mask, query + d);
    for (int r = 0; r < 16; ++r) sums[r] = _mm512_fmadd_ps(load(rows[r] + d, mask), q, sums[r]);
  }
  return sum16(sums);
}

/// The logits of a job's keys `first` .. `first + 15` (none past `count`) into `out`, from their
/// scores `block`: the near keys (positions from `near.first` on, the job's keys starting at
/// position `position`) with their log weight added, the others as they are; `best` raised to
/// them.
EIGEN_ALWAYS_INLINE void store_logits(__m512 block, Index first, Index count, Index position,
                                      const DecodeNear& near, float* out, __m512& best) {
  const __mmask16 stored = first_lanes16(count - first);
  const Index near_from = near.first - position;
  if (near_from < count && first + 16 > near_from) {
    block = _mm512_mask_add_ps(block, near_lanes16(first, near_from), block,
                               near_log_weights(near, position + first));
  }
  _mm512_mask_storeu_ps(out + first, stored, block);
  best = raise_max(best, stored, block);
}

/// \f$s_j = q \cdot k_j\f$, \f$j < \f$ `count`: `keys` rows `stride` apart, `query` of `dim`
/// floats; with a near field `near`, the keys at positions `position + j` from `near.first` on
/// take \f$s_j + \log s - m(p - j)\f$ (DecodeNear::log_weight, rounded to float, added).
/// Returns the maximum of what it wrote, over the values that are not NaN (\f$-\infty\f$ if
/// none is above it).
template <class Storage>
float scores(const Storage* keys, Index count, Index dim, Index stride, const float* query,
             float* out, Index position = 0, const DecodeNear& near = {}) {
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (Index first = 0; first < count; first += 16) {
    store_logits(score_block(keys, first, count, dim, stride, query), first, count, position, near,
                 out, best);
  }
  return _mm512_reduce_max_ps(best);
}

#if defined(PLSH_DECODE_AVX512_BF16)
/// \f$s_j = \text{scale}\,(q \cdot k_j)\f$ with bfloat16 keys and query, by `vdpbf16ps`, the
/// near keys' log weights added. Returns their maximum as scores does.
inline float scores_bf16(const Eigen::bfloat16* keys, Index count, Index dim, Index stride,
                         const Eigen::bfloat16* query, float scale, float* out, Index position = 0,
                         const DecodeNear& near = {}) {
  const __m512 scale_vector = _mm512_set1_ps(scale);
  __m512 best = _mm512_set1_ps(-std::numeric_limits<float>::infinity());
  for (Index first = 0; first < count; first += 16) {
    const Eigen::bfloat16* rows[16];
    block_rows(keys, stride, first, count, rows);
    __m512 sums[16];
    for (__m512& sum : sums) sum = _mm512_setzero_ps();
    Index d = 0;
    for (; d + 32 <= dim; d += 32) {
      const __m512bh q = (__m512bh)_mm512_loadu_si512(query + d);
      for (int r = 0; r < 16; ++r) {
        sums[r] = _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_loadu_si512(rows[r] + d), q);
      }
    }
    if (d < dim) {
      const __mmask32 mask = first_lanes32(dim - d);
      const __m512bh q = (__m512bh)_mm512_maskz_loadu_epi16(mask, query + d);
      for (int r = 0; r < 16; ++r) {
        sums[r] =
            _mm512_dpbf16_ps(sums[r], (__m512bh)_mm512_maskz_loadu_epi16(mask, rows[r] + d), q);
      }
    }
    store_logits(_mm512_mul_ps(sum16(sums), scale_vector), first, count, position, near, out, best);
  }
  return _mm512_reduce_max_ps(best);
}
#endif

/// \f$w_j \leftarrow c_j e^{s_j - \text{max}}\f$ for the scores \f$s_j\f$ in `weights` of the
/// keys at positions `first + j`, \f$j <\f$ `count`, with \f$c_j = \#\{t : b_t \le \text{first} +
/// j\}\f$ over the `samples` sorted block starts `begins`; returns \f$\sum_j w_j\f$. One pass over
/// the scores: the exponentials by Eigen's vectorised exp (the one its array exp applies to whole
/// packets; a NaN stays NaN), the starts at or before `first` counting for every key and each one
/// inside the range by one vector compare per 16 keys. The near keys, from index `near_from` on,
/// hold logits that include their weight (scores with a DecodeNear): \f$w_j = e^{s_j -
/// \text{max}}\f$, and the starts among them are not compared.
inline float exp_counts(float* weights, Index count, Index first, const Index* begins,
                        Index samples, float max,
                        Index near_from = std::numeric_limits<Index>::max()) {
  const Index* inside = std::upper_bound(begins, begins + samples, first);
  const Index* end = std::lower_bound(inside, begins + samples, first + std::min(count, near_from));
  const __m512i base = _mm512_set1_epi32(static_cast<int>(inside - begins));
  const __m512i one = _mm512_set1_epi32(1);
  const __m512i lanes = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
  const __m512 shift = _mm512_set1_ps(max);
  __m512 total = _mm512_setzero_ps();
  for (Index j = 0; j < count; j += 16) {
    const __m512i offset = _mm512_add_epi32(lanes, _mm512_set1_epi32(static_cast<int>(j)));
    __m512i counts = base;
    if (j < near_from) {
      for (const Index* b = inside; b < end; ++b) {
        const __mmask16 reached =
            _mm512_cmpge_epi32_mask(offset, _mm512_set1_epi32(static_cast<int>(*b - first)));
        counts = _mm512_mask_add_epi32(counts, reached, counts, one);
      }
    }
    if (j + 16 > near_from) counts = _mm512_mask_mov_epi32(counts, near_lanes16(j, near_from), one);
    const __mmask16 mask = first_lanes16(count - j);
    const __m512 e = Eigen::internal::pexp<Eigen::internal::Packet16f>(
        _mm512_sub_ps(_mm512_maskz_loadu_ps(mask, weights + j), shift));
    const __m512 w = _mm512_mul_ps(e, _mm512_cvtepi32_ps(counts));
    _mm512_mask_storeu_ps(weights + j, mask, w);
    total = _mm512_mask_add_ps(total, mask, total, w);
  }
  return _mm512_reduce_add_ps(total);
}

/// `add_row(set, row, w_j)` for the `count` rows `stride` apart from `first`: even rows into
/// `sets[0]`, odd rows into `sets[1]` (one chain of dependent multiply-adds per set, so that the
/// adds of one row wait for the previous row's only every other step).
template <class Storage, class AddRow>
void add_rows(const Storage* first, Index count, Index stride, const float* weights,
              __m512 (&sets)[2][4], AddRow&& add_row) {
  const Storage* row = first;
  Index j = 0;
  for (; j + 1 < count; j += 2, row += 2 * stride) {
    add_row(sets[0], row, weights[j]);
    add_row(sets[1], row + stride, weights[j + 1]);
  }
  if (j < count) add_row(sets[0], row, weights[j]);
}

/// \f$o = \sum_{j < \text{count}} w_j v_j\f$ (`out` overwritten): `values` rows `stride` apart,
/// `value_dim` entries each.
template <class Storage>
void weighted_sum(const Storage* values, Index count, Index value_dim, Index stride,
                  const float* weights, float* out) {
  for (Index c = 0; c < value_dim; c += 64) {
    const __mmask16 m0 = first_lanes16(value_dim - c);
    const __mmask16 m1 = value_dim - c > 16 ? first_lanes16(value_dim - c - 16) : 0;
    const __mmask16 m2 = value_dim - c > 32 ? first_lanes16(value_dim - c - 32) : 0;
    const __mmask16 m3 = value_dim - c > 48 ? first_lanes16(value_dim - c - 48) : 0;
    // Two sets of accumulators (add_rows).
    __m512 o[2][4];
    for (auto& set : o) {
      for (__m512& column : set) column = _mm512_setzero_ps();
    }
    // `load_column(row, i)`: columns c + 16 i .. c + 16 i + 15 of a row.
    const auto accumulate = [&](auto&& load_column) {
      const auto add_row = [&](__m512(&set)[4], const Storage* values_row, float weight) {
        const __m512 w = _mm512_set1_ps(weight);
        for (int i = 0; i < 4; ++i) set[i] = _mm512_fmadd_ps(load_column(values_row, i), w, set[i]);
      };
      add_rows(values + c, count, stride, weights, o, add_row);
    };
    if (value_dim - c >= 64) {
      accumulate([](const Storage* row, int i) { return load(row + 16 * i); });
    } else {
      // A column block past value_dim loads nothing (mask 0) from the row's start.
      const __mmask16 masks[4] = {m0, m1, m2, m3};
      const Index offsets[4] = {0, m1 != 0 ? 16 : 0, m2 != 0 ? 32 : 0, m3 != 0 ? 48 : 0};
      accumulate([&](const Storage* row, int i) { return load(row + offsets[i], masks[i]); });
    }
    const __m512 o0 = _mm512_add_ps(o[0][0], o[1][0]);
    const __m512 o1 = _mm512_add_ps(o[0][1], o[1][1]);
    const __m512 o2 = _mm512_add_ps(o[0][2], o[1][2]);
    const __m512 o3 = _mm512_add_ps(o[0][3], o[1][3]);
    _mm512_mask_storeu_ps(out + c, m0, o0);
    if (m1 != 0) _mm512_mask_storeu_ps(out + c + 16, m1, o1);
    if (m2 != 0) _mm512_mask_storeu_ps(out + c + 32, m2, o2);
    if (m3 != 0) _mm512_mask_storeu_ps(out + c + 48, m3, o3);
  }
}

/// weighted_sum of bfloat16 values, 32 columns per load: a 32-bit lane holds the bfloat16 pair
/// (2i, 2i + 1), and a bfloat16 is the upper half of a float, so the lane shifted left by 16 is
/// column 2i and the lane with its lower half cleared is column 2i + 1 (no cross-lane widening).
/// The even and odd columns are summed apart and interleaved once at the end; each column sees
/// the same multiply-adds in the same order as in the generic weighted_sum.
inline void weighted_sum(const Eigen::bfloat16* values, Index count, Index value_dim, Index stride,
                         const float* weights, float* out) {
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  // Lanes of the interleaved columns: (even 0, odd 0, even 1, odd 1, ...), in two halves.
  const __m512i low_half =
      _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
  const __m512i high_half =
      _mm512_setr_epi32(8, 24, 9, 25, 10, 26, 11, 27, 12, 28, 13, 29, 14, 30, 15, 31);
  for (Index c = 0; c < value_dim; c += 64) {
    const __mmask32 m0 = first_lanes32(value_dim - c);
    const __mmask32 m1 = value_dim - c > 32 ? first_lanes32(value_dim - c - 32) : 0;
    // A column block past value_dim loads nothing (mask 0) from the row's start.
    const Index c1 = m1 != 0 ? 32 : 0;
    // [set][even 0-31, odd 0-31, even 32-63, odd 32-63]: two sets as in weighted_sum.
    __m512 o[2][4];
    for (auto& set : o) {
      for (__m512& column : set) column = _mm512_setzero_ps();
    }
    // `load_half(row, i)`: columns c + 32 i .. c + 32 i + 31 of a row, as 16 pairs.
    const auto accumulate = [&](auto&& load_half) {
      const auto add_row = [&](__m512(&set)[4], const Eigen::bfloat16* row, float weight) {
        const __m512 w = _mm512_set1_ps(weight);
        const __m512i a = load_half(row, 0);
        const __m512i b = load_half(row, 1);
        set[0] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(a, 16)), w, set[0]);
        set[1] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(a, high)), w, set[1]);
        set[2] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_slli_epi32(b, 16)), w, set[2]);
        set[3] = _mm512_fmadd_ps(_mm512_castsi512_ps(_mm512_and_si512(b, high)), w, set[3]);
      };
      add_rows(values + c, count, stride, weights, o, add_row);
    };
    if (value_dim - c >= 64) {
      accumulate(
          [](const Eigen::bfloat16* row, int i) { return _mm512_loadu_si512(row + 32 * i); });
    } else {
      accumulate([&](const Eigen::bfloat16* row, int i) {
        return i == 0 ? _mm512_maskz_loadu_epi16(m0, row) : _mm512_maskz_loadu_epi16(m1, row + c1);
      });
    }
    const __m512 even0 = _mm512_add_ps(o[0][0], o[1][0]);
    const __m512 odd0 = _mm512_add_ps(o[0][1], o[1][1]);
    const __m512 even1 = _mm512_add_ps(o[0][2], o[1][2]);
    const __m512 odd1 = _mm512_add_ps(o[0][3], o[1][3]);
    const Index left = value_dim - c;
    _mm512_mask_storeu_ps(out + c, first_lanes16(left),
                          _mm512_permutex2var_ps(even0, low_half, odd0));
    if (left > 16) {
      _mm512_mask_storeu_ps(out + c + 16, first_lanes16(left - 16),
                            _mm512_permutex2var_ps(even0, high_half, odd0));
    }
    if (left > 32) {
      _mm512_mask_storeu_ps(out + c + 32, first_lanes16(left - 32),
                            _mm512_permutex2var_ps(even1, low_half, odd1));
    }
    if (left > 48) {
      _mm512_mask_storeu_ps(out + c + 48, first_lanes16(left - 48),
                            _mm512_permutex2var_ps(even1, high_half, odd1));
    }
  }
}

}  // namespace avx512
}  // namespace detail
}  // namespace plsh

#if defined(PLSH_DECODE_DIAGNOSTIC_PUSHED)
#pragma GCC diagnostic pop
#undef PLSH_DECODE_DIAGNOSTIC_PUSHED
#endif

#endif  // PLSH_DECODE_AVX512

#endif  // PLSH_DETAIL_DECODE_SIMD_HPP
