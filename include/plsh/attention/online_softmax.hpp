#ifndef PLSH_ATTENTION_ONLINE_SOFTMAX_HPP
#define PLSH_ATTENTION_ONLINE_SOFTMAX_HPP

/// \file online_softmax.hpp
/// Streaming softmax over key tiles, and the log-sum-exp merge of partial attention results.
///
/// A partial result over a key set \f$J\f$ is, per query row, the normalised output
/// \f$o = \sum_{j\in J} e^{s_j} v_j / \sum_{j\in J} e^{s_j}\f$ and \f$\mathrm{lse} = \log
/// \sum_{j\in J} e^{s_j}\f$ (FlashAttention's `out, softmax_lse`). A row with no key has
/// \f$o = 0\f$ and \f$\mathrm{lse} = -\infty\f$, never NaN.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "../tensor.hpp"

namespace plsh {

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

/// Entries `[begin, end)` of row `row` of a tile of logits are masked (\f$-\infty\f$).
struct MaskedRange {
  Index row;
  Index begin;
  Index end;
};

/// Running softmax state of a tile of query rows: per row the running maximum \f$\mu\f$, the sum
/// \f$\ell = \sum_j e^{s_j - \mu}\f$ and the accumulator \f$a = \sum_j e^{s_j - \mu} v_j\f$.
/// A new maximum rescales \f$\ell\f$ and \f$a\f$ by \f$e^{\mu_{old} - \mu_{new}}\f$.
///
/// \tparam Scalar element type of scores, values and state.
template <class Scalar>
class OnlineSoftmax {
 public:
  using Matrix = RowMatrix<Scalar>;
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

  /// Starts `rows` rows that have seen no key, with `value_dim` output columns.
  void reset(Index rows, Index value_dim) {
    max_.setConstant(rows, -std::numeric_limits<Scalar>::infinity());
    sum_.setZero(rows);
    accumulator_.setZero(rows, value_dim);
  }

  Index rows() const { return max_.size(); }

  /// Takes a tile of logits (`rows() x keys`, \f$-\infty\f$ for masked entries) and the keys'
  /// values (`keys x value_dim`). Overwrites `scores` with the unnormalised probabilities; a
  /// masked entry weighs exactly 0. (Eigen's vectorised exp maps \f$-\infty\f$ to a tiny
  /// subnormal, not 0: rows holding \f$-\infty\f$ are exponentiated entry by entry.)
  void update(Eigen::Ref<Matrix> scores, const Eigen::Ref<const Matrix>& values) {
    exponentiate(scores, [&](Index r) { return scores.row(r).minCoeff() == -kInfinity; });
    accumulate(scores, values);
  }

  /// As update(scores, values), faster: `masked` lists every run of \f$-\infty\f$ entries of
  /// the tile, which are zeroed after the vectorised exp.
  void update(Eigen::Ref<Matrix> scores, const Eigen::Ref<const Matrix>& values,
              const std::vector<MaskedRange>& masked) {
    exponentiate(scores, [](Index) { return false; });
    for (const MaskedRange& range : masked) {
      scores.row(range.row).segment(range.begin, range.end - range.begin).setZero();
    }
    accumulate(scores, values);
  }

  /// Writes the normalised rows \f$a/\ell\f$ to `out` and, when `lse` is not null,
  /// \f$\mu + \log\ell\f$ to `lse[r]`. Rows that saw no key get zeros and \f$-\infty\f$.
  template <class Out>
  void finish(Out&& out, Scalar* lse) const {
    for (Index r = 0; r < rows(); ++r) {
      const bool seen = sum_[r] > 0;
      if (seen) {
        out.row(r) = accumulator_.row(r) / sum_[r];
      } else {
        out.row(r).setZero();
      }
      if (lse != nullptr) {
        lse[r] = seen ? max_[r] + std::log(sum_[r]) : -std::numeric_limits<Scalar>::infinity();
      }
    }
  }

 private:
  static constexpr Scalar kInfinity = std::numeric_limits<Scalar>::infinity();

  /// Rescales the running state to each row's new maximum \f$\mu\f$ and replaces the logits
  /// by \f$e^{s - \mu}\f$, entry by entry (exactly 0 for \f$-\infty\f$) where
  /// `has_masked(r)` holds, vectorised elsewhere.
  template <class HasMasked>
  void exponentiate(Eigen::Ref<Matrix>& scores, HasMasked&& has_masked) {
    for (Index r = 0; r < scores.rows(); ++r) {
      const Scalar new_max = std::max(max_[r], scores.row(r).maxCoeff());
      if (new_max == -kInfinity) {
        scores.row(r).setZero();  // nothing visible yet: exp(-inf - -inf) would be NaN
        continue;
      }
      auto row = scores.row(r).array();
      if (has_masked(r)) {
        for (Index c = 0; c < row.size(); ++c) {
          row[c] = row[c] == -kInfinity ? Scalar(0) : std::exp(row[c] - new_max);
        }
      } else {
        row = (row - new_max).exp();
      }
      const Scalar rescale = std::exp(max_[r] - new_max);
      sum_[r] = sum_[r] * rescale + row.sum();
      accumulator_.row(r) *= rescale;
      max_[r] = new_max;
    }
  }

  void accumulate(const Eigen::Ref<Matrix>& probabilities, const Eigen::Ref<const Matrix>& values) {
    if (probabilities.cols() <= kSmallProductDepth) {
      accumulator_.noalias() += probabilities.lazyProduct(values);
    } else {
      accumulator_.noalias() += probabilities * values;
    }
  }

  Vector max_;
  Vector sum_;
  Matrix accumulator_;
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
