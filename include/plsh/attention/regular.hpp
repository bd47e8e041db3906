#ifndef PLSH_ATTENTION_REGULAR_HPP
#define PLSH_ATTENTION_REGULAR_HPP

/// \file regular.hpp
/// Regular (unbiased) attention on a span of queries and keys, and the tiled core it shares with
/// the ALiBi kernels.
///
/// Computes, for every query row i at absolute position \f$p_i\f$,
/// \f$o_i = \sum_j w_{ij} v_j / \sum_j w_{ij}\f$ and \f$\mathrm{lse}_i = \log \sum_j w_{ij}\f$ with
/// \f$w_{ij} = e^{\text{scale}\, q_i\cdot k_j - m|p_i - p_j|}\f$ over the visible keys (causal:
/// \f$p_j \le p_i\f$; windowed: \f$|p_i - p_j| \le W\f$). Regular attention is \f$m = 0\f$.
///
/// Cost: query tiles of 64 rows against key tiles of 128; per tile one product \f$QK^\top\f$,
/// one vectorised exp, one product \f$PV\f$: \f$2(d + d_v)\f$ flops per visible score. Key tiles
/// outside the causal or window range are skipped. Memory: one tile of scores per thread (its
/// TileWorkspace, detail/scratch.hpp).
///
/// Storage types (detail/storage.hpp): the tiled core reads q, k, v stored as float, double,
/// Eigen::bfloat16 or Eigen::half and computes in `Compute<S>`; a 16-bit tile of queries, keys or
/// values is converted to float once per use (compute_rows) and the output rows are rounded back
/// (OutputRows), O(tile) scratch per thread. For float and double nothing is copied.
/// regular_attention itself, the inner-kernel contract of the pass kernel, takes float or double.
///
/// The bias is formed relative to each row's nearest key (apply_linear_bias), so that its float
/// accuracy does not depend on the absolute positions. Non-finite inputs follow the contract of
/// online_softmax.hpp.
///
/// Tested against plsh::reference::factor_attention (dense, double, factor 1) in
/// tests/test_regular.cpp; non-finite inputs and far positions in tests/test_nonfinite.cpp;
/// bfloat16 and half storage (through the ALiBi kernels) in tests/test_half.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/scratch.hpp"
#include "../detail/storage.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../tensor.hpp"
#include "online_softmax.hpp"

namespace plsh {

/// Output and log-sum-exp of one span: `lse[i]` belongs to row i of `out`.
template <class Scalar>
using LseMap = Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>;

namespace detail {

constexpr Index kQueryTile = 64;
constexpr Index kKeyTile = 128;
/// A window wider than any sequence: no key is dropped.
constexpr Index kNoWindow = std::numeric_limits<Index>::max() / 4;

/// The ALiBi term of a logit: \f$-m|p_i - p_j|\f$, keys with \f$|p_i - p_j| > W\f$ dropped.
struct LinearBias {
  double slope = 0;
  Index window = kNoWindow;
};

template <class Scalar>
struct TileWorkspace {
  RowMatrix<Scalar> query;
  AlignedVector<Scalar> scores;
  OnlineSoftmax<Scalar> softmax;
  Eigen::Array<Scalar, 1, Eigen::Dynamic> offsets;  // 0, 1, ..., kKeyTile - 1
};

/// Rows of a storage type converted to its compute type, one scratch per operand, and output
/// rows rounded back: what a tile of a bfloat16 or half kernel reads and writes (unused, and never
/// allocated, for float and double).
template <class Storage>
struct ConvertedRows {
  AlignedVector<Compute<Storage>> query, key, value, out, dout;
  OutputRows<Storage> result, key_result, value_result;
};

/// The calling thread's ConvertedRows of a storage type, for the lease's lifetime.
template <class Storage>
using ConvertedRowsLease = ScratchLease<ConvertedRows<Storage>>;

/// The calling thread's TileWorkspace of a scalar type for the lease's lifetime (scratch.hpp), so
/// that kernels allocate nothing per tile; `offsets` is set.
template <class Scalar>
class TileWorkspaceLease {
 public:
  TileWorkspaceLease() {
    if (lease_->offsets.size() != kKeyTile) {
      lease_->offsets =
          Eigen::Array<Scalar, 1, Eigen::Dynamic>::LinSpaced(kKeyTile, 0, kKeyTile - 1);
    }
  }
  TileWorkspace<Scalar>& operator*() const { return *lease_; }

 private:
  ScratchLease<TileWorkspace<Scalar>> lease_;
};

/// The keys a span of queries may attend to, as distances from the first query of a tile:
/// \f$p_i - p_{first}\f$ and \f$p_i - p_{last}\f$ for the tile's first row i.
struct KeySpan {
  Index to_first_key;
  Index to_last_key;
};

/// \f$r_i\f$ of apply_linear_bias for row `r` of the tile: 0 inside the span, else the distance
/// to its nearer end.
inline Index nearest_key_distance(const KeySpan& span, Index r) {
  const Index to_last = span.to_last_key + r;
  const Index to_first = span.to_first_key + r;
  return to_last > 0 ? to_last : (to_first < 0 ? -to_first : 0);
}

/// Adds the bias and masks invisible keys in a tile of logits. `distance` is \f$p_i - p_j\f$ for
/// the tile's first row and first column; it grows by one per row and shrinks by one per column.
///
/// The bias is formed relative to each row's nearest key of `span`, at distance \f$r_i\f$:
/// \f$-m(|p_i - p_j| - r_i)\f$, the true logit plus the row constant \f$m r_i\f$, which the
/// softmax cancels. The integer \f$|p_i - p_j| - r_i\f$ stays within the span's length, so the
/// bias keeps the same accuracy in float at any absolute position (\f$|p_i - p_j|\f$ itself can
/// exceed float's 24 bits). Every tile of a row must use the same span.
template <class Scalar>
void apply_linear_bias(Eigen::Map<RowMatrix<Scalar>>& scores, Index distance, bool causal,
                       const LinearBias& bias, const KeySpan& span,
                       const Eigen::Array<Scalar, 1, Eigen::Dynamic>& offsets) {
  const Index cols = scores.cols();
  // A slope beyond the largest Scalar makes every bias but the nearest keys' -inf, as the
  // logits below -max<Scalar> are in the other kernels (the slope as Scalar would be +inf, and
  // +inf * 0 a NaN for the nearest keys).
  const bool infinite_slope = bias.slope > static_cast<double>(std::numeric_limits<Scalar>::max());
  const Scalar slope = infinite_slope ? Scalar(0) : static_cast<Scalar>(bias.slope);
  for (Index r = 0; r < scores.rows(); ++r) {
    const Index d0 = distance + r;
    const Index lo = std::max<Index>(0, d0 - bias.window);
    const Index hi = std::min<Index>(cols, (causal ? d0 : d0 + bias.window) + 1);
    auto row = scores.row(r).array();
    if (lo >= hi) {
      row.setConstant(-std::numeric_limits<Scalar>::infinity());
      continue;
    }
    if (slope != 0 || infinite_slope) {
      const Index nearest = nearest_key_distance(span, r);
      const Index shifted = d0 > 0 ? d0 - nearest : d0 + nearest;
      const auto distances = (static_cast<Scalar>(shifted) - offsets.head(cols)).abs();
      if (infinite_slope) {
        // -inf added: a NaN or +inf score still makes a NaN logit.
        row = (distances == Scalar(0)).select(row, row - std::numeric_limits<Scalar>::infinity());
      } else {
        row -= slope * distances;
      }
    }
    if (lo > 0) row.head(lo).setConstant(-std::numeric_limits<Scalar>::infinity());
    if (hi < cols) row.tail(cols - hi).setConstant(-std::numeric_limits<Scalar>::infinity());
  }
}

/// The log-sum-exp of the true logits of a tile's `rows` rows from that of the logits
/// apply_linear_bias formed with `span`, which carry the row constant \f$m r_i\f$.
template <class Scalar>
void unshift_lse(Scalar* lse, Index rows, double slope, const KeySpan& span) {
  if (slope == 0) return;
  for (Index r = 0; r < rows; ++r) {
    lse[r] -= static_cast<Scalar>(slope * static_cast<double>(nearest_key_distance(span, r)));
  }
}

/// The inverse of unshift_lse: the log-sum-exp of the logits apply_linear_bias forms with `span`
/// (the true logits plus \f$m r_i\f$) from that of the true logits.
template <class Scalar>
void shift_lse(Scalar* lse, Index rows, double slope, const KeySpan& span) {
  if (slope == 0) return;
  for (Index r = 0; r < rows; ++r) {
    lse[r] += static_cast<Scalar>(slope * static_cast<double>(nearest_key_distance(span, r)));
  }
}

/// Key rows `[begin, end)` of `k`, `v` into the running softmax of a tile whose scaled query rows
/// (first at position `first_query`) are in `workspace.query`, kKeyTile keys at a time: the
/// scores, apply_linear_bias, the softmax update.
template <class Storage>
void attend_keys(const ConstHeadMap<Storage>& k, const ConstHeadMap<Storage>& v,
                 const AttentionOptions& options, const LinearBias& bias, const KeySpan& span,
                 Index first_query, Index begin, Index end,
                 TileWorkspace<Compute<Storage>>& workspace, ConvertedRows<Storage>& converted) {
  using Scalar = Compute<Storage>;
  const Index rows = workspace.query.rows();
  const std::size_t needed = static_cast<std::size_t>(rows * kKeyTile);
  if (workspace.scores.size() < needed) workspace.scores.resize(needed);
  for (Index c0 = begin; c0 < end; c0 += kKeyTile) {
    const Index cols = std::min(kKeyTile, end - c0);
    Eigen::Map<RowMatrix<Scalar>> scores(workspace.scores.data(), rows, cols);
    multiply_transposed(workspace.query, compute_rows(k, c0, cols, converted.key), scores);
    apply_linear_bias(scores, first_query - (options.key_position + c0), options.causal, bias, span,
                      workspace.offsets);
    workspace.softmax.update(scores, compute_rows(v, c0, cols, converted.value));
  }
}

/// Query rows `[row_begin, row_end)` of `q` against the visible keys of `k`, `v`: writes those
/// rows of `out` and, when `lse` is not null, `lse[row_begin..row_end)`. `options.scale` must be
/// resolved (non-zero). Inputs and output in the storage type, arithmetic and lse in the compute
/// type; the query rows and each key and value tile are converted once.
template <class Storage>
void attend_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                 const ConstHeadMap<Storage>& v, const AttentionOptions& options,
                 const LinearBias& bias, Index row_begin, Index row_end, HeadMap<Storage>& out,
                 Compute<Storage>* lse) {
  using Scalar = Compute<Storage>;
  const TileWorkspaceLease<Scalar> workspace_lease;
  const ConvertedRowsLease<Storage> converted_lease;
  TileWorkspace<Scalar>& workspace = *workspace_lease;
  ConvertedRows<Storage>& converted = *converted_lease;
  const Index rows = row_end - row_begin;
  const Index first_query = options.query_position + row_begin;
  const Index last_query = options.query_position + row_end - 1;
  const Index key_begin = std::max<Index>(0, first_query - bias.window - options.key_position);
  const Index key_end =
      std::min<Index>(k.rows(), (options.causal ? last_query : last_query + bias.window) + 1 -
                                    options.key_position);
  const KeySpan span{first_query - options.key_position,
                     first_query - (options.key_position + k.rows() - 1)};
  workspace.softmax.reset(rows, v.cols());
  if (key_begin < key_end) {
    workspace.query.noalias() =
        compute_rows(q, row_begin, rows, converted.query) * static_cast<Scalar>(options.scale);
    attend_keys(k, v, options, bias, span, first_query, key_begin, key_end, workspace, converted);
  }
  Scalar* row_lse = lse == nullptr ? nullptr : lse + row_begin;
  workspace.softmax.finish(converted.result.bind(out, row_begin, rows), row_lse);
  converted.result.store();
  if (row_lse != nullptr) unshift_lse(row_lse, rows, bias.slope, span);
}

/// All rows of a span, tile by tile.
template <class Storage>
void attend_span(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                 const ConstHeadMap<Storage>& v, const AttentionOptions& options,
                 const LinearBias& bias, HeadMap<Storage>& out, Compute<Storage>* lse) {
  for (Index r0 = 0; r0 < q.rows(); r0 += kQueryTile) {
    attend_rows(q, k, v, options, bias, r0, std::min(q.rows(), r0 + kQueryTile), out, lse);
  }
}

}  // namespace detail

/// Regular (unbiased) attention of a query span against a key span of one head, with the
/// FlashAttention contract: normalised `out` and per-row `lse`. Positions are
/// `options.query_position + i` and `options.key_position + j`; causal keeps keys at positions
/// \f$\le\f$ the query's. A row with no visible key gets zeros and \f$\mathrm{lse} = -\infty\f$.
///
/// \param q `n_q x d`, \param k `n_k x d`, \param v `n_k x d_v`, \param out `n_q x d_v`,
/// \param lse `n_q`. `options.scale == 0` means \f$1/\sqrt d\f$.
/// \tparam Scalar float or double: the type the kernels compute in (a bfloat16 or half kernel
/// calls it on tiles converted to float).
/// \throws std::invalid_argument when the shapes disagree.
template <class Scalar>
void regular_attention(const ConstHeadMap<Scalar>& q, const ConstHeadMap<Scalar>& k,
                       const ConstHeadMap<Scalar>& v, const AttentionOptions& options,
                       HeadMap<Scalar> out, LseMap<Scalar> lse) {
  static_assert(std::is_same<Scalar, float>::value || std::is_same<Scalar, double>::value,
                "regular_attention takes float or double; bfloat16 and half go through the "
                "kernels, which compute in float");
  const char* function = "regular_attention";
  detail::require(k.cols() == q.cols(), function, "k.cols() must equal q.cols()");
  detail::require(v.rows() == k.rows(), function, "v.rows() must equal k.rows()");
  detail::require(out.rows() == q.rows(), function, "out.rows() must equal q.rows()");
  detail::require(out.cols() == v.cols(), function, "out.cols() must equal v.cols()");
  detail::require(lse.size() == q.rows(), function, "lse.size() must equal q.rows()");
  detail::validate_scale<Scalar>(function, options, q.cols());
  AttentionOptions resolved = options;
  resolved.scale = detail::resolved_scale(options, q.cols());
  detail::attend_span(q, k, v, resolved, detail::LinearBias{}, out, lse.data());
}

/// The built-in regular kernel as a function object: the default inner kernel of the Positional
/// LSH pass kernel, and the contract a user-supplied kernel must follow (see plsh_attention).
struct RegularAttention {
  template <class Scalar>
  void operator()(const ConstHeadMap<Scalar>& q, const ConstHeadMap<Scalar>& k,
                  const ConstHeadMap<Scalar>& v, const AttentionOptions& options,
                  HeadMap<Scalar> out, LseMap<Scalar> lse) const {
    regular_attention<Scalar>(q, k, v, options, out, lse);
  }
};

}  // namespace plsh

#endif  // PLSH_ATTENTION_REGULAR_HPP
