#ifndef PLSH_ATTENTION_DETAIL_WINDOWED_HPP
#define PLSH_ATTENTION_DETAIL_WINDOWED_HPP

/// \file windowed.hpp
/// Internal (namespace detail): the core of windowed_alibi_attention
/// (attention/alibi_attention.hpp, the public entry point), shared by AlibiKvCache and the MPI
/// layer: each query tile visits its keys nearest first and stops once the exact-ALiBi weight of
/// every key it has not visited is certified to be at most the tolerance.
///
/// The certificate. For query row i at position \f$p_i\f$ with \f$a_i = |\text{scale}|\,\|q_i\|\f$,
/// a key j has the logit \f$l_{ij} = \text{scale}\,q_i\cdot k_j - m|p_i - p_j| \le a_i\|k_j\| -
/// m|p_i - p_j|\f$ (Cauchy-Schwarz). The keys not yet visited lie on either side of the visited
/// range; each side is cut into segments of \f$T, 2T, 4T, \ldots\f$ keys outward from the visited
/// range (T = kKeyTile), and a segment of \f$L\f$ keys whose nearest key is at distance \f$d\f$
/// and whose key norms are at most \f$K\f$ weighs at most
/// \f[ e^{a_i K - m d} \sum_{t=0}^{L-1} e^{-m t}, \f]
/// a geometric series, so keys of equal norms cost O(log n) segments per row, not the whole
/// sequence. The row's exact-ALiBi weight of all those keys is at most their sum divided by
/// \f$e^{\mathrm{lse}_i}\f$, the sum over the keys already visited (the running log-sum-exp of
/// the online softmax): the tile stops when that quotient is at most `tolerance` for every row.
/// Then each output row differs from exact ALiBi by at most \f$2\,\text{tolerance}\max_j |v_j|\f$
/// per entry (the kept weights are renormalised), up to floating-point rounding.
///
/// The key norms' maxima come from KeyNormBounds: the maximum over blocks of T rows, then a
/// sparse table of maxima over \f$2^l\f$ consecutive blocks, computed once per call and key/value
/// head (O(n d) to build, two lookups per segment). A non-finite norm is \f$+\infty\f$, which
/// never certifies: a row that could see a NaN or infinite key visits it, as exact ALiBi does.
///
/// Cost: the kept tiles' attention (regular.hpp) plus, after each step of T keys on each side, one
/// bound per row and segment (\f$O(\log(n/T))\f$ exponentials per row). Keys of a tile's rows are
/// one contiguous range of key rows, the same for all its rows (rows that need fewer keys keep
/// more); the range is reported (`kept`) for the backward, which differentiates the forward as
/// computed, with these keys.
///
/// Keys beyond the arrays: the sequence-parallel kernel (mpi.hpp) passes bounds whose key range
/// extends past the keys it holds, with a norm bound `outside` for the keys it does not hold; the
/// certificate includes them. A tile that has visited every held key without certifying them says
/// so (windowed_rows returns false), and mpi.hpp widens its halo.
///
/// Tested in tests/test_windowed.cpp: the certificate against the dense exact-ALiBi weights of
/// the dropped keys, the output against plsh::reference::windowed_alibi_attention on the kept
/// ranges and against exact ALiBi within the guaranteed bound.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../../detail/storage.hpp"
#include "../../options.hpp"
#include "../../partition.hpp"
#include "../../tensor.hpp"
#include "../regular.hpp"

namespace plsh {
namespace detail {

/// `x`, or \f$+\infty\f$ when it is not finite (a NaN included): a norm that never certifies.
inline double finite_or_infinity(double x) {
  return x <= std::numeric_limits<double>::max() ? x : std::numeric_limits<double>::infinity();
}

/// The norm bound of the certificate for one key row: \f$\|k\|\f$ in double of the row's
/// compute-type values, finite_or_infinity.
template <class Row>
double key_norm_bound(const Eigen::MatrixBase<Row>& row) {
  return finite_or_infinity(std::sqrt(row.template cast<double>().squaredNorm()));
}

/// Upper bounds on the norms \f$\|k_j\|\f$ over ranges of key rows. Rows `[0, rows())` are the
/// keys held; rows in `[first(), last())` outside them are keys of the sequence that are not held,
/// with the norm bound `outside()`.
class KeyNormBounds {
 public:
  /// Bounds of the rows of `k` (norms in double of the compute-type values), with `outside` for
  /// the rows `[first, 0)` and `[k.rows(), last)` (first <= 0 <= k.rows() <= last).
  template <class Storage>
  void build(const ConstHeadMap<Storage>& k, Index first, Index last, double outside,
             AlignedVector<Compute<Storage>>& scratch) {
    rows_ = k.rows();
    first_ = first;
    last_ = last;
    outside_ = finite_or_infinity(outside);
    const Index blocks = (rows_ + kKeyTile - 1) / kKeyTile;
    levels_.assign(1, std::vector<double>(static_cast<std::size_t>(blocks), 0.0));
    for (Index b = 0; b < blocks; ++b) {
      const Index begin = b * kKeyTile;
      const Index count = std::min(kKeyTile, rows_ - begin);
      const ConstHeadMap<Compute<Storage>> tile = compute_rows(k, begin, count, scratch);
      double high = 0;
      for (Index j = 0; j < count; ++j) {
        high = std::max(high, key_norm_bound(tile.row(j)));
      }
      levels_[0][static_cast<std::size_t>(b)] = high;
    }
    for (Index width = 2; width <= blocks; width *= 2) {
      const std::vector<double>& below = levels_.back();
      std::vector<double> level(static_cast<std::size_t>(blocks - width + 1));
      for (std::size_t b = 0; b < level.size(); ++b) {
        level[b] = std::max(below[b], below[b + static_cast<std::size_t>(width / 2)]);
      }
      levels_.push_back(std::move(level));
    }
  }

  Index rows() const { return rows_; }
  Index first() const { return first_; }
  Index last() const { return last_; }

  /// An upper bound on the norms of rows `[begin, end)` (0 when empty): the held rows' blocks
  /// that meet the range, and `outside()` when the range reaches past the held rows.
  double max_over(Index begin, Index end) const {
    if (begin >= end) return 0;
    double high = (begin < 0 || end > rows_) ? outside_ : 0.0;
    const Index lo = std::max<Index>(begin, 0);
    const Index hi = std::min(end, rows_);
    if (lo < hi) {
      const Index b0 = lo / kKeyTile;
      const Index b1 = (hi - 1) / kKeyTile + 1;
      std::size_t level = 0;
      while ((Index{2} << level) <= b1 - b0) ++level;
      const Index width = Index{1} << level;
      const std::vector<double>& maxima = levels_[level];
      high = std::max({high, maxima[static_cast<std::size_t>(b0)],
                       maxima[static_cast<std::size_t>(b1 - width)]});
    }
    return high;
  }

 private:
  Index rows_ = 0;
  Index first_ = 0;
  Index last_ = 0;
  double outside_ = 0;
  std::vector<std::vector<double>> levels_;
};

/// \f$\log \sum_{t=0}^{L-1} e^{-m t}\f$ for L >= 1 (\f$\log L\f$ for m = 0).
inline double log_geometric_sum(double slope, Index length) {
  if (slope == 0) return std::log(static_cast<double>(length));
  return std::log(-std::expm1(-slope * static_cast<double>(length))) -
         std::log(-std::expm1(-slope));
}

/// The certificate's bound on the exact-ALiBi weight of keys a row does not see:
/// \f[ e^{a K - m d} \sum_{t=0}^{L-1} e^{-m t} \big/ e^{b} \f]
/// for a row of `row_norm` \f$a = |\text{scale}|\,\|q\|\f$, L keys of norms at most
/// `key_norm` K whose nearest lies at `distance` d from the row (no decay for d <= 0), `log_sum`
/// = log_geometric_sum(m, L), and `log_base` b a lower bound of the log of the row's total weight
/// (its log-sum-exp over the keys it sees, less any constant its logits carry). window_certified
/// sums it over the segments a tile has not visited; AlibiKvCache over the blocks of keys it has
/// evicted.
inline double dropped_weight_bound(double row_norm, double key_norm, double slope, Index distance,
                                   double log_sum, double log_base) {
  const double decay = distance > 0 ? slope * static_cast<double>(distance) : 0.0;
  return std::exp(row_norm * key_norm - decay + log_sum - log_base);
}

/// Whether the unvisited keys of every row of a tile weigh at most `tolerance`: rows at positions
/// `first_query + r`, visited key rows `[lo, hi)`, the keys a row may see in `[first, last)` (key
/// rows; causal rows see none past their own position, which the visited range always covers).
/// `row_norm[r]` is \f$a_r\f$, `lse[r]` the row's log-sum-exp so far, `shift[r]` the constant the
/// kernel's logits carry (\f$m r_i\f$, apply_linear_bias).
///
/// A segment's geometric sum bounds its weight for a row on one side of it only: the rows must lie
/// at or after the last unvisited key before the visited range and at or before the first one
/// after it. A tile with a row among unvisited keys is not certified (false), whatever the bound.
template <class Scalar>
bool window_certified(const KeyNormBounds& bounds, double slope, double tolerance,
                      Index first_query, Index key_position, Index lo, Index hi, Index first,
                      Index last, const std::vector<double>& row_norm, const Scalar* lse,
                      const std::vector<double>& shift) {
  struct Segment {
    double norm;
    double log_sum;
    Index nearest;  // position of the segment's key nearest the tile
  };
  const Index last_query = first_query + static_cast<Index>(row_norm.size()) - 1;
  if ((lo > first && first_query < key_position + lo - 1) ||
      (hi < last && last_query > key_position + hi)) {
    return false;
  }
  Segment segments[2 * 64];
  int count = 0;
  for (Index length = kKeyTile, edge = lo; edge > first; length *= 2) {
    const Index begin = std::max(first, edge - length);
    segments[count++] = Segment{bounds.max_over(begin, edge),
                                log_geometric_sum(slope, edge - begin), key_position + edge - 1};
    edge = begin;
  }
  const int left = count;
  for (Index length = kKeyTile, edge = hi; edge < last; length *= 2) {
    const Index end = std::min(last, edge + length);
    segments[count++] = Segment{bounds.max_over(edge, end), log_geometric_sum(slope, end - edge),
                                key_position + edge};
    edge = end;
  }
  if (count == 0) return true;
  for (std::size_t r = 0; r < row_norm.size(); ++r) {
    const Index position = first_query + static_cast<Index>(r);
    const double base = static_cast<double>(lse[r]) - shift[r];
    double total = 0;
    for (int s = 0; s < count; ++s) {
      const Index distance =
          s < left ? position - segments[s].nearest : segments[s].nearest - position;
      total += dropped_weight_bound(row_norm[r], segments[s].norm, slope, distance,
                                    segments[s].log_sum, base);
    }
    if (!(total <= tolerance)) return false;
  }
  return true;
}

/// Per-row values of a tile's certificate, per thread (detail/scratch.hpp): \f$a_r\f$, the
/// logits' row constant and the running log-sum-exp.
template <class Scalar>
struct CertificateRows {
  std::vector<double> row_norm;
  std::vector<double> shift;
  std::vector<Scalar> lse;
};

/// Query rows `[row_begin, row_end)` of one head of windowed_alibi_attention: visits key tiles
/// nearest first from the rows' own positions until window_certified holds (or no held key is
/// left), writes the rows of `out` and, when `lse` is not null, `lse[row_begin..row_end)` over the
/// kept keys, and sets `kept` to the key rows visited. `options.scale` resolved, `tolerance` > 0;
/// `bounds` are those of this head's keys. Returns whether the certificate holds for the keys left
/// unvisited: always when every key of the sequence is held (they are all visited, if need be);
/// false when keys that are not held may weigh more than the tolerance (a halo too narrow for the
/// tile).
template <class Storage>
bool windowed_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<Storage>& k,
                   const ConstHeadMap<Storage>& v, const AttentionOptions& options, double slope,
                   double tolerance, const KeyNormBounds& bounds, Index row_begin, Index row_end,
                   HeadMap<Storage>* out, Block& kept, Compute<Storage>* lse = nullptr) {
  using Scalar = Compute<Storage>;
  const TileWorkspaceLease<Scalar> workspace_lease;
  const ConvertedRowsLease<Storage> converted_lease;
  const ScratchLease<CertificateRows<Scalar>> certificate_lease;
  TileWorkspace<Scalar>& workspace = *workspace_lease;
  ConvertedRows<Storage>& converted = *converted_lease;
  const Index rows = row_end - row_begin;
  const Index first_query = options.query_position + row_begin;
  const Index last_query = options.query_position + row_end - 1;
  const LinearBias bias{slope, kNoWindow};
  const KeySpan span{first_query - options.key_position,
                     first_query - (options.key_position + k.rows() - 1)};
  // Key rows the tile may see: held ones, and those of the whole sequence for the certificate.
  const auto visible_end = [&](Index end) {
    return options.causal ? std::min(end, last_query + 1 - options.key_position) : end;
  };
  const Index key_end = visible_end(k.rows());
  const Index sequence_end = visible_end(bounds.last());
  Index lo = std::clamp<Index>(first_query - options.key_position, 0, std::max<Index>(key_end, 0));
  Index hi = std::clamp<Index>(last_query + 1 - options.key_position, lo, std::max(key_end, lo));
  workspace.softmax.reset(rows, v.cols());
  kept = Block{lo, lo};
  // With no held key visible, the certificate holds when the sequence has no other key either.
  bool certified = bounds.first() >= 0 && sequence_end <= 0;
  if (key_end > 0) {
    workspace.query.noalias() =
        compute_rows(q, row_begin, rows, converted.query) * static_cast<Scalar>(options.scale);
    // At most kQueryTile rows: the vectors grow once per thread.
    std::vector<double>& row_norm = certificate_lease->row_norm;
    std::vector<double>& shift = certificate_lease->shift;
    std::vector<Scalar>& lse = certificate_lease->lse;
    row_norm.resize(static_cast<std::size_t>(rows));
    shift.resize(static_cast<std::size_t>(rows));
    lse.resize(static_cast<std::size_t>(rows));
    for (Index r = 0; r < rows; ++r) {
      row_norm[static_cast<std::size_t>(r)] =
          std::sqrt(workspace.query.row(r).template cast<double>().squaredNorm());
      shift[static_cast<std::size_t>(r)] =
          slope == 0 ? 0.0 : slope * static_cast<double>(nearest_key_distance(span, r));
    }
    const auto visit = [&](Index begin, Index end) {
      attend_keys(k, v, options, bias, span, first_query, begin, end, workspace, converted);
    };
    visit(lo, hi);
    for (;;) {
      for (Index r = 0; r < rows; ++r)
        lse[static_cast<std::size_t>(r)] = workspace.softmax.log_sum(r);
      certified = window_certified(bounds, slope, tolerance, first_query, options.key_position, lo,
                                   hi, bounds.first(), sequence_end, row_norm, lse.data(), shift);
      if (certified || (lo == 0 && hi == key_end)) break;
      const Index left = std::max<Index>(0, lo - kKeyTile);
      const Index right = std::min(key_end, hi + kKeyTile);
      visit(left, lo);
      visit(hi, right);
      lo = left;
      hi = right;
    }
    kept = Block{lo, hi};
  }
  if (out != nullptr) {
    Scalar* row_lse = lse == nullptr ? nullptr : lse + row_begin;
    workspace.softmax.finish(converted.result.bind(*out, row_begin, rows), row_lse);
    converted.result.store();
    if (row_lse != nullptr) unshift_lse(row_lse, rows, slope, span);
  }
  return certified;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_DETAIL_WINDOWED_HPP
