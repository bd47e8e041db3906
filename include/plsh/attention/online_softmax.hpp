#ifndef PLSH_ATTENTION_ONLINE_SOFTMAX_HPP
#define PLSH_ATTENTION_ONLINE_SOFTMAX_HPP

/// \file online_softmax.hpp
/// Streaming softmax over key tiles, and the log-sum-exp merge of partial attention results.
///
/// A partial result over a key set \f$J\f$ is, per query row, the normalised output
/// \f$o = \sum_{j\in J} e^{l_j} v_j / \sum_{j\in J} e^{l_j}\f$ and \f$\mathrm{lse} = \log
/// \sum_{j\in J} e^{l_j}\f$ (FlashAttention's `out, softmax_lse`), \f$l_j\f$ the logit of key j.
///
/// Non-finite inputs (the contract every kernel follows, Fused and Passes alike):
/// - A key a query cannot see (causality, window, block mask, count 0) has the logit
///   \f$-\infty\f$ and contributes nothing to that row, whatever its q, k or v entries.
/// - A visible logit \f$-\infty\f$ weighs exactly 0: that key contributes nothing either.
/// - A visible logit NaN or \f$+\infty\f$ makes the row NaN (and its lse NaN).
/// - A visible key with a logit above \f$-\infty\f$ and a non-finite value makes the row's
///   entries in those columns non-finite (NaN or \f$\pm\infty\f$), even when its weight
///   underflows to 0.
/// - A row whose visible logits are all \f$-\infty\f$, or that sees no key, has \f$o = 0\f$ and
///   \f$\mathrm{lse} = -\infty\f$, never NaN (a pass kernel's merge drops such a partial).
///
/// Cost of keeping this on finite data: one finiteness test of each tile of values (O(keys
/// \f$\cdot d_v\f$) per tile, against O(rows \f$\cdot\f$ keys \f$\cdot d_v\f$) for the product).
/// Only a tile whose values hold a non-finite entry takes the slower path.
///
/// AVX-512 builds (PLSH_FUSED_AVX512, detail/simd.hpp): OnlineSoftmax::update_counted, the fused
/// kernel's step, walks a float row in two vectorised passes (counted_weights) and adds \f$PV\f$
/// by register blocks without packing (add_weighted_rows; value rows with a non-finite entry
/// zeroed, then added where they are seen, as add_product does for Eigen's product); other builds
/// and types take the portable code. Summation orders differ between the two, not the results
/// beyond rounding.
///
/// Tested in tests/test_online_softmax.cpp and, for non-finite inputs through every kernel, in
/// tests/test_nonfinite.cpp; the AVX-512 paths through the fused kernel by the same tests and
/// tests/simd/fused_avx512.cpp compiled for AVX-512 (tests/CMakeLists.txt, PLSH_TEST_AVX512).

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>
#include <type_traits>
#include <vector>

#include "../detail/simd.hpp"
#include "../detail/storage.hpp"
#include "../tensor.hpp"

namespace plsh {
namespace detail {

/// Whether OnlineSoftmax<Scalar>::update_counted takes the AVX-512 walk and weighted sum.
template <class Scalar>
#if defined(PLSH_FUSED_AVX512)
constexpr bool kVectorWalk = std::is_same<Scalar, float>::value;
#else
constexpr bool kVectorWalk = false;
#endif

/// Below this many keys a product of a tile is evaluated coefficient-wise: packing the operands
/// for Eigen's blocked GEMM costs more than it saves.
constexpr Index kSmallProductDepth = 32;

/// `scores = query * keys^T`, by the blocked GEMM or, for few keys, coefficient-wise.
template <class Query, class Keys, class Scores>
void multiply_transposed(const Query& query, const Keys& keys, Scores& scores) {
  if (keys.rows() <= kSmallProductDepth) {
    scores.noalias() = query.lazyProduct(keys.transpose());
  } else {
    scores.noalias() = query * keys.transpose();
  }
}

/// `row = e^{row - shift}` by Eigen's vectorised exp, with exactly 0 where `row` was
/// \f$-\infty\f$ (the vectorised exp maps \f$-\infty\f$ to a tiny subnormal, not 0).
/// `scratch` keeps a copy of rows that hold \f$-\infty\f$; the zeros are put back by a
/// branch-free select over contiguous coefficients, which compilers vectorise.
template <class Row, class Scalar>
void masked_exp(Row&& row, Scalar shift, Eigen::Array<Scalar, 1, Eigen::Dynamic>& scratch) {
  static_assert(std::decay_t<Row>::InnerStrideAtCompileTime == 1, "contiguous rows only");
  constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
  if (row.template minCoeff<Eigen::PropagateNumbers>() != kMinusInfinity) {
    row = (row - shift).exp();
    return;
  }
  scratch = row;
  row = (row - shift).exp();
  const Scalar* logits = scratch.data();
  Scalar* weights = &row.coeffRef(0);
  for (Index c = 0; c < row.size(); ++c) {
    weights[c] = logits[c] == kMinusInfinity ? Scalar(0) : weights[c];
  }
}

/// Whether every entry of `operand` is finite, by one vectorised sum: \f$x - x\f$ is 0 for a
/// finite x and NaN otherwise, and a sum with a NaN term is NaN. (Eigen's allFinite compares
/// two such differences coefficient by coefficient and does not vectorise.)
template <class Operand>
bool all_finite(const Operand& operand) {
  using Scalar = typename Operand::Scalar;
  return (operand.array() - operand.array()).sum() == Scalar(0);
}

/// Indices of the rows of `operand` that hold a non-finite entry (none, the common case, costs
/// one vectorised sum).
template <class Operand>
void find_nonfinite_rows(const Operand& operand, std::vector<Index>& rows) {
  rows.clear();
  if (all_finite(operand)) return;
  for (Index c = 0; c < operand.rows(); ++c) {
    if (!all_finite(operand.row(c))) rows.push_back(c);
  }
}

/// `accumulator += weights * operand` by Eigen: the blocked GEMM or, `lazy`, coefficient-wise.
struct EigenProduct {
  bool lazy;

  template <class Accumulator, class Weights, class Operand>
  void operator()(Accumulator& accumulator, const Weights& weights, const Operand& operand) const {
    if (lazy) {
      accumulator.noalias() += weights.lazyProduct(operand);
    } else {
      accumulator.noalias() += weights * operand;
    }
  }
};

/// `accumulator += weights * operand` by `product(accumulator, weights, operand)`, where an
/// operand row listed in `bad` (non-finite) adds its term to row r only when `contributes(r, i)`
/// holds for `c = bad[i]`: a zero weight times a NaN row adds nothing. The product runs on
/// `operand` with the bad rows zeroed (in `scratch`), so a row that no bad operand row reaches
/// is bit for bit the result of the plain product.
template <class Scalar, class Accumulator, class Weights, class Operand, class Product,
          class Contributes>
void add_product(Accumulator& accumulator, const Weights& weights, const Operand& operand,
                 const std::vector<Index>& bad, RowMatrix<Scalar>& scratch, Product&& product,
                 Contributes&& contributes) {
  if (bad.empty()) {
    product(accumulator, weights, operand);
    return;
  }
  scratch = operand;
  for (const Index c : bad) scratch.row(c).setZero();
  product(accumulator, weights, scratch);
  for (std::size_t i = 0; i < bad.size(); ++i) {
    const Index c = bad[i];
    for (Index r = 0; r < accumulator.rows(); ++r) {
      if (contributes(r, i)) accumulator.row(r) += weights(r, c) * operand.row(c);
    }
  }
}

#if defined(PLSH_FUSED_AVX512)
// GCC 12's AVX-512 headers initialise _mm512_undefined_ps() from itself (GCC bug 105593).
#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wuninitialized"
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#endif

/// 64 columns of one accumulator row in four vectors (lanes outside `mask[0..3]` zero), named
/// rather than an array, which GCC keeps in memory.
struct RowSums {
  __m512 a, b, c, d;

  void load(const float* row, const __mmask16* mask) {
    a = _mm512_maskz_loadu_ps(mask[0], row);
    b = _mm512_maskz_loadu_ps(mask[1], row + 16);
    c = _mm512_maskz_loadu_ps(mask[2], row + 32);
    d = _mm512_maskz_loadu_ps(mask[3], row + 48);
  }
  /// += weight * (v0, v1, v2, v3), one fused multiply-add per vector.
  void add(float weight, __m512 v0, __m512 v1, __m512 v2, __m512 v3) {
    const __m512 w = _mm512_set1_ps(weight);
    a = _mm512_fmadd_ps(w, v0, a);
    b = _mm512_fmadd_ps(w, v1, b);
    c = _mm512_fmadd_ps(w, v2, c);
    d = _mm512_fmadd_ps(w, v3, d);
  }
  void store(float* row, const __mmask16* mask) const {
    _mm512_mask_storeu_ps(row, mask[0], a);
    _mm512_mask_storeu_ps(row + 16, mask[1], b);
    _mm512_mask_storeu_ps(row + 32, mask[2], c);
    _mm512_mask_storeu_ps(row + 48, mask[3], d);
  }
};

/// Rows `[0, rows)` (1 to 6) of `accumulator += weights * values` over the columns
/// `[column, column + 64)` (lanes outside `mask[0..3]` neither read nor written) and the keys
/// `[0, keys)`: 24 accumulators in registers (six named RowSums, so that the compiler keeps them
/// there), each key's value row loaded once, one broadcast weight per row and key, one fused
/// multiply-add per 16 entries. Missing rows repeat row 0 and are not stored.
inline void add_weighted_rows_block(float* accumulator, Index accumulator_stride,
                                    const float* weights, Index weight_stride, const float* values,
                                    Index value_stride, Index keys, Index rows, Index column,
                                    const __mmask16* mask) {
  float* out[6];
  const float* weight[6];
  for (Index i = 0; i < 6; ++i) {
    const Index row = i < rows ? i : 0;
    out[i] = accumulator + row * accumulator_stride + column;
    weight[i] = weights + row * weight_stride;
  }
  RowSums s0, s1, s2, s3, s4, s5;
  s0.load(out[0], mask);
  s1.load(out[1], mask);
  s2.load(out[2], mask);
  s3.load(out[3], mask);
  s4.load(out[4], mask);
  s5.load(out[5], mask);
  for (Index j = 0; j < keys; ++j) {
    const float* value = values + j * value_stride + column;
    const __m512 v0 = _mm512_maskz_loadu_ps(mask[0], value);
    const __m512 v1 = _mm512_maskz_loadu_ps(mask[1], value + 16);
    const __m512 v2 = _mm512_maskz_loadu_ps(mask[2], value + 32);
    const __m512 v3 = _mm512_maskz_loadu_ps(mask[3], value + 48);
    s0.add(weight[0][j], v0, v1, v2, v3);
    s1.add(weight[1][j], v0, v1, v2, v3);
    s2.add(weight[2][j], v0, v1, v2, v3);
    s3.add(weight[3][j], v0, v1, v2, v3);
    s4.add(weight[4][j], v0, v1, v2, v3);
    s5.add(weight[5][j], v0, v1, v2, v3);
  }
  s0.store(out[0], mask);
  if (rows > 1) s1.store(out[1], mask);
  if (rows > 2) s2.store(out[2], mask);
  if (rows > 3) s3.store(out[3], mask);
  if (rows > 4) s4.store(out[4], mask);
  if (rows > 5) s5.store(out[5], mask);
}

/// The first `count` of 16 lanes (all of them for count >= 16).
inline __mmask16 lanes_below(Index count) {
  return count >= 16 ? static_cast<__mmask16>(0xFFFF)
                     : static_cast<__mmask16>((1u << static_cast<unsigned>(count)) - 1u);
}

/// The log weights of 16 weight indices at once (a count c, or a near key's index: LogWeights),
/// from the table `log_weight[0 .. max_index]`: one permute across two registers when the table
/// has at most 32 entries, a gather otherwise.
class LogWeightLookup {
 public:
  LogWeightLookup(const float* log_weight, Index max_index)
      : table_(log_weight), in_registers_(max_index < 32) {
    if (in_registers_) {
      low_ = _mm512_maskz_loadu_ps(lanes_below(max_index + 1), log_weight);
      high_ = _mm512_maskz_loadu_ps(lanes_below(std::max<Index>(max_index + 1 - 16, 0)),
                                    log_weight + 16);
    }
  }
  __m512 operator()(__m512i index) const {
    return in_registers_ ? _mm512_permutex2var_ps(low_, index, high_)
                         : _mm512_i32gather_ps(index, table_, 4);
  }

 private:
  const float* table_;
  bool in_registers_;
  __m512 low_ = _mm512_setzero_ps();
  __m512 high_ = _mm512_setzero_ps();
};

/// One row of OnlineSoftmax::update_counted, float, in two vectorised passes over its first
/// `limit` logits instead of five: (1) the logits \f$S + \log c\f$, \f$-\infty\f$ for keys with
/// count 0, the row's maximum, whether a NaN is present; (2) the weights \f$e^{l - \mu}\f$
/// (Eigen's vectorised exp; exactly 0 for a logit \f$-\infty\f$) and their sum. Entries from
/// `limit` on are set to 0. `max` and `sum` are the row's running maximum and sum, updated;
/// returns the factor by which its accumulator is rescaled (1 when the row sees no key here).
/// Same non-finite behaviour as the portable walk (OnlineSoftmax::exponentiate_row).
inline float counted_weights(float* row, const int* count, Index limit, Index cols,
                             const LogWeightLookup& log_weight, float& max, float& sum) {
  constexpr float kMinusInfinity = -std::numeric_limits<float>::infinity();
  const __m512 minus_infinity = _mm512_set1_ps(kMinusInfinity);
  __m512 high = minus_infinity;
  __mmask16 nan = 0;
  for (Index c = 0; c < limit; c += 16) {
    const __mmask16 lanes = lanes_below(limit - c);
    const __m512i n = _mm512_maskz_loadu_epi32(lanes, count + c);
    const __mmask16 visible = _mm512_mask_cmpneq_epi32_mask(lanes, n, _mm512_setzero_si512());
    const __m512 logit =
        _mm512_add_ps(_mm512_mask_loadu_ps(minus_infinity, visible, row + c), log_weight(n));
    _mm512_mask_storeu_ps(row + c, lanes, logit);
    nan = static_cast<__mmask16>(nan | _mm512_cmp_ps_mask(logit, logit, _CMP_UNORD_Q));
    high = _mm512_max_ps(high, logit);
  }
  const float new_max = std::max(max, _mm512_reduce_max_ps(high));
  if (new_max == kMinusInfinity) {
    if (nan != 0) {
      max = std::numeric_limits<float>::quiet_NaN();
      sum = std::numeric_limits<float>::quiet_NaN();
    }
    std::fill(row, row + cols, 0.0f);
    return 1.0f;
  }
  const __m512 shift = _mm512_set1_ps(new_max);
  __m512 total = _mm512_setzero_ps();
  for (Index c = 0; c < limit; c += 16) {
    const __mmask16 lanes = lanes_below(limit - c);
    const __m512 logit = _mm512_maskz_loadu_ps(lanes, row + c);
    // A NaN logit keeps its NaN weight; -inf (masked, or a visible -inf score) weighs 0.
    const __mmask16 weighed = _mm512_mask_cmp_ps_mask(lanes, logit, minus_infinity, _CMP_NEQ_UQ);
    const __m512 weight =
        _mm512_maskz_mov_ps(weighed, Eigen::internal::pexp(_mm512_sub_ps(logit, shift)));
    _mm512_mask_storeu_ps(row + c, lanes, weight);
    total = _mm512_add_ps(total, weight);
  }
  std::fill(row + limit, row + cols, 0.0f);
  const float rescale = std::exp(max - new_max);
  sum = sum * rescale + _mm512_reduce_add_ps(total);
  max = new_max;
  return rescale;
}

#if defined(__GNUC__) && !defined(__clang__) && __GNUC__ < 13
#pragma GCC diagnostic pop
#endif

/// `accumulator += weights * values` (float, row-major, rows contiguous) where row r's weights
/// are 0 at and past `keys[r]`: rows in blocks of 6 (add_weighted_rows_block), each block over
/// the keys up to its largest `keys[r]`, 64 columns at a time; neither operand is packed. The
/// zeros skipped add nothing to finite values: the caller passes finite values only (add_product
/// zeroes the others). Summation order: per entry, the keys in increasing order, one fused
/// multiply-add each.
template <class Accumulator, class Weights, class Values>
void add_weighted_rows(Accumulator& accumulator, const Weights& weights, const Values& values,
                       const std::vector<Index>& keys) {
  constexpr Index kBlock = 6;
  const Index rows = accumulator.rows();
  const Index dim = accumulator.cols();
  for (Index r0 = 0; r0 < rows; r0 += kBlock) {
    const Index height = std::min(kBlock, rows - r0);
    const Index width = *std::max_element(keys.begin() + r0, keys.begin() + r0 + height);
    if (width == 0) continue;
    for (Index column = 0; column < dim; column += 64) {
      __mmask16 mask[4];
      for (Index v = 0; v < 4; ++v) {
        const Index lanes = std::clamp<Index>(dim - column - 16 * v, 0, 16);
        mask[v] = static_cast<__mmask16>((1u << static_cast<unsigned>(lanes)) - 1u);
      }
      add_weighted_rows_block(&accumulator.coeffRef(r0, 0), accumulator.outerStride(),
                              &weights.coeffRef(r0, 0), weights.outerStride(), values.data(),
                              values.outerStride(), width, height, column, mask);
    }
  }
}
#endif

}  // namespace detail

/// Running softmax state of a tile of query rows: per row the running maximum \f$\mu\f$, the sum
/// \f$\ell = \sum_j e^{l_j - \mu}\f$ and the accumulator \f$a = \sum_j e^{l_j - \mu} v_j\f$.
/// A new maximum rescales \f$\ell\f$ and \f$a\f$ by \f$e^{\mu_{old} - \mu_{new}}\f$. Follows the
/// non-finite contract of the file comment.
///
/// \tparam Scalar element type of scores, values and state.
template <class Scalar>
class OnlineSoftmax {
 public:
  using Matrix = RowMatrix<Scalar>;
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

  /// Starts `rows` rows that have seen no key, with `value_dim` output columns.
  void reset(Index rows, Index value_dim) {
    max_.setConstant(rows, -kInfinity);
    sum_.setZero(rows);
    accumulator_.setZero(rows, value_dim);
  }

  Index rows() const { return max_.size(); }

  /// Row r's log-sum-exp of the logits taken so far, \f$\mu + \log\ell\f$: \f$-\infty\f$ before
  /// any visible key, NaN after a NaN or \f$+\infty\f$ logit.
  Scalar log_sum(Index r) const { return sum_[r] != 0 ? max_[r] + std::log(sum_[r]) : -kInfinity; }

  /// Takes a tile of logits (`rows() x keys`, \f$-\infty\f$ for masked entries) and the keys'
  /// values (`keys x value_dim`). Overwrites `scores` with the unnormalised probabilities; a
  /// masked entry weighs exactly 0 and adds nothing, whatever its value.
  void update(Eigen::Ref<Matrix> scores, const Eigen::Ref<const Matrix>& values) {
    detail::find_nonfinite_rows(values, bad_);
    // Which rows see the non-finite value rows, decided on the logits (an underflowing weight
    // still carries the NaN or infinity).
    visible_.resize(bad_.size() * static_cast<std::size_t>(scores.rows()));
    for (std::size_t i = 0; i < bad_.size(); ++i) {
      for (Index r = 0; r < scores.rows(); ++r) {
        visible_[i * static_cast<std::size_t>(scores.rows()) + static_cast<std::size_t>(r)] =
            !(scores(r, bad_[i]) == -kInfinity);
      }
    }
    exponentiate(scores);
    detail::add_product(accumulator_, scores, values, bad_, scratch_,
                        detail::EigenProduct{scores.cols() <= detail::kSmallProductDepth},
                        [&](Index r, std::size_t i) {
                          return visible_[i * static_cast<std::size_t>(scores.rows()) +
                                          static_cast<std::size_t>(r)] != 0;
                        });
  }

  /// The first half of update: rescales the running state to each row's new maximum \f$\mu\f$
  /// and replaces the logits by \f$e^{l - \mu}\f$ (exactly 0 for \f$-\infty\f$). A NaN or
  /// \f$+\infty\f$ logit makes the row's sum NaN.
  void exponentiate(Eigen::Ref<Matrix> scores) {
    for (Index r = 0; r < scores.rows(); ++r) exponentiate_row(r, scores.row(r));
  }

  /// update for the logits \f$l_{ij} = S_{ij} + \log w(c_{ij})\f$ with integer weight indices
  /// \f$0 \le c_{ij} \le\f$ `max_index`: `scores` holds \f$S\f$, `log_weight[c]` is the log
  /// weight of index c (LogWeights: \f$\log c\f$ for a count, \f$-\infty\f$ for 0) and
  /// `counts(r, limit)` returns row r's indices (called for r = 0, 1, ... in turn), setting
  /// `limit`: indices at columns `>= limit` are 0. A key with \f$c_{ij} = 0\f$ is masked (weighs
  /// exactly 0 and adds nothing, whatever its score and value). Each row in one walk (mask, logits,
  /// maximum, exponentials), which is the fused kernel's inner loop; a row's largest weight is
  /// \f$e^0 = 1\f$, so a row that sees one key gets its value exactly. `finite_values`: the caller
  /// has checked that every entry of `values` is finite (their test is then skipped).
  template <class Counts>
  void update_counted(Eigen::Ref<Matrix> scores, const Eigen::Ref<const Matrix>& values,
                      Counts&& counts, const Scalar* log_weight, Index max_index,
                      bool finite_values = false) {
    if (finite_values) {
      bad_.clear();
    } else {
      detail::find_nonfinite_rows(values, bad_);
    }
    const Index rows = scores.rows();
    const Index cols = scores.cols();
    visible_.resize(bad_.size() * static_cast<std::size_t>(rows));
    limits_.resize(static_cast<std::size_t>(rows));
#if defined(PLSH_FUSED_AVX512)
    std::optional<detail::LogWeightLookup> lookup;
    if constexpr (detail::kVectorWalk<Scalar>) lookup.emplace(log_weight, max_index);
#else
    static_cast<void>(max_index);
#endif
    for (Index r = 0; r < rows; ++r) {
      Index limit = 0;
      const int* count = counts(r, limit);
      Scalar* row = scores.row(r).data();
      limits_[static_cast<std::size_t>(r)] = limit;
      // Which non-finite value rows this row sees: those of its keys with a logit above -inf.
      for (std::size_t i = 0; i < bad_.size(); ++i) {
        const Index c = bad_[i];
        visible_[i * static_cast<std::size_t>(rows) + static_cast<std::size_t>(r)] =
            c < limit && count[c] != 0 && !(row[c] == -kInfinity);
      }
#if defined(PLSH_FUSED_AVX512)
      if constexpr (detail::kVectorWalk<Scalar>) {
        const float rescale =
            detail::counted_weights(row, count, limit, cols, *lookup, max_[r], sum_[r]);
        if (rescale != 1.0f) accumulator_.row(r) *= rescale;
        continue;
      }
#endif
      for (Index c = 0; c < limit; ++c) {
        row[c] = count[c] == 0 ? -kInfinity : row[c] + log_weight[count[c]];
      }
      for (Index c = limit; c < cols; ++c) row[c] = -kInfinity;
      exponentiate_row(r, scores.row(r));
    }
    // The weighted sum, by register blocks up to each row's limit in the AVX-512 walk (the
    // values it reads are finite: add_product zeroes the non-finite rows), else by Eigen.
    const auto product = [&](Matrix& accumulator, const Eigen::Ref<Matrix>& weights,
                             const auto& clean) {
#if defined(PLSH_FUSED_AVX512)
      if constexpr (detail::kVectorWalk<Scalar>) {
        detail::add_weighted_rows(accumulator, weights, clean, limits_);
        return;
      }
#endif
      detail::EigenProduct{cols <= detail::kSmallProductDepth}(accumulator, weights, clean);
    };
    detail::add_product(
        accumulator_, scores, values, bad_, scratch_, product, [&](Index r, std::size_t i) {
          return visible_[i * static_cast<std::size_t>(rows) + static_cast<std::size_t>(r)] != 0;
        });
  }

  /// The second half of update, for a caller that transforms the probabilities first (the
  /// backward's \f$dS\f$): `accumulator += weights * operand`, an operand row with a non-finite
  /// entry reaching only the rows whose weight for it is not 0.
  template <class Operand>
  void accumulate(const Eigen::Ref<Matrix>& weights, const Operand& operand) {
    detail::find_nonfinite_rows(operand, bad_);
    detail::add_product(accumulator_, weights, operand, bad_, scratch_,
                        detail::EigenProduct{weights.cols() <= detail::kSmallProductDepth},
                        [&](Index r, std::size_t i) { return weights(r, bad_[i]) != 0; });
  }

  /// Writes the normalised rows \f$a/\ell\f$ (times `factor`, when given) to `out` and, when
  /// `lse` is not null, \f$\mu + \log\ell\f$ to `lse[r]`. Rows that saw no key get zeros and
  /// \f$-\infty\f$; rows that saw a NaN or \f$+\infty\f$ logit get NaN.
  template <class Out>
  void finish(Out&& out, Scalar* lse, const Scalar* factor = nullptr) const {
    for (Index r = 0; r < rows(); ++r) {
      const bool seen = sum_[r] != 0;  // NaN: seen, and poisoned
      if (seen && factor != nullptr) {
        out.row(r) = accumulator_.row(r) * (*factor / sum_[r]);
      } else if (seen) {
        out.row(r) = accumulator_.row(r) / sum_[r];
      } else {
        out.row(r).setZero();
      }
      if (lse != nullptr) lse[r] = seen ? max_[r] + std::log(sum_[r]) : -kInfinity;
    }
  }

 private:
  static constexpr Scalar kInfinity = std::numeric_limits<Scalar>::infinity();

  /// exponentiate on row r: the running state rescaled to the row's new maximum, its logits
  /// replaced by their weights (nothing to do when nothing is visible yet).
  template <class Row>
  void exponentiate_row(Index r, Row&& row) {
    const Scalar new_max = raise_max(r, row);
    if (new_max == -kInfinity) return;
    detail::masked_exp(row.array(), new_max, row_scratch_);
    add_row(r, new_max, row);
  }

  /// Row r's running maximum with its logits `row`, or \f$-\infty\f$ when nothing is visible
  /// yet: then `row` is zeroed (\f$e^{-\infty - -\infty}\f$ would be NaN), and the row's state
  /// made NaN when a NaN hid from the maximum.
  template <class Row>
  Scalar raise_max(Index r, Row&& row) {
    const Scalar new_max = std::max(max_[r], row.maxCoeff());
    if (new_max == -kInfinity) {
      if (row.hasNaN()) {
        max_[r] = std::numeric_limits<Scalar>::quiet_NaN();
        sum_[r] = std::numeric_limits<Scalar>::quiet_NaN();
      }
      row.setZero();
    }
    return new_max;
  }

  /// Rescales row r's state from its maximum to `new_max` and adds the sum of its `weights`
  /// (the weighted values are added by the caller's product).
  template <class Row>
  void add_row(Index r, Scalar new_max, const Row& weights) {
    const Scalar rescale = std::exp(max_[r] - new_max);
    sum_[r] = sum_[r] * rescale + weights.sum();
    accumulator_.row(r) *= rescale;
    max_[r] = new_max;
  }

  Vector max_;
  Vector sum_;
  Matrix accumulator_;
  std::vector<Index> bad_;  // value rows of the current tile that hold a non-finite entry
  std::vector<char> visible_;
  std::vector<Index> limits_;  // update_counted: row r's weights are 0 from limits_[r] on
  Matrix scratch_;
  Eigen::Array<Scalar, 1, Eigen::Dynamic> row_scratch_;
};

/// Merges the partial result `(out_b, lse_b)` into `(out, lse)`, row by row:
/// \f$L = \log(e^{\mathrm{lse}} + e^{\mathrm{lse}_b})\f$,
/// \f$o \leftarrow e^{\mathrm{lse} - L} o + e^{\mathrm{lse}_b - L} o_b\f$, computed from the larger
/// of the two so that nothing overflows. Attention over the union of the two key sets (or, with
/// repeated keys, the sum of both weightings).
template <class Out, class Lse, class OutB, class LseB>
void online_softmax_merge(Out&& out, Lse&& lse, const OutB& out_b, const LseB& lse_b) {
  using Scalar = typename std::decay_t<Out>::Scalar;
  for (Index r = 0; r < out.rows(); ++r) {
    const Scalar a = lse[r];
    const Scalar b = lse_b[r];
    // A partial with lse = -inf saw no key (or only -inf logits): it is dropped. A NaN lse
    // (a NaN or +inf logit) makes the merged row NaN through the arithmetic below.
    if (b == -std::numeric_limits<Scalar>::infinity()) continue;
    if (a == -std::numeric_limits<Scalar>::infinity()) {
      out.row(r) = out_b.row(r);
      lse[r] = b;
      continue;
    }
    const Scalar high = std::max(a, b);
    const Scalar weight_a = std::exp(a - high);
    const Scalar weight_b = std::exp(b - high);
    const Scalar total = weight_a + weight_b;
    // o + (w_b / W)(o_b - o): exact when both partial rows are equal.
    out.row(r) += (weight_b / total) * (out_b.row(r) - out.row(r));
    lse[r] = high + std::log(total);
  }
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_ONLINE_SOFTMAX_HPP
