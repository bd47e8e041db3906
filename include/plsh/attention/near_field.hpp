#ifndef PLSH_ATTENTION_NEAR_FIELD_HPP
#define PLSH_ATTENTION_NEAR_FIELD_HPP

/// \file near_field.hpp
/// The near-field estimator of Positional LSH (PlshOptions::near_field = f > 0): head h of slope
/// m takes the exact ALiBi factor for the keys within its reach \f$w = \lfloor -\ln f/m
/// \rfloor\f$ of the query, where \f$e^{-m|p_i - p_j|} \ge f\f$, and the mean of its s block masks
/// beyond:
/// \f[ \hat K_{ij} = e^{-m|p_i - p_j|} \text{ for } |p_i - p_j| \le w, \qquad
///     \hat K_{ij} = c_{ij}/s \text{ otherwise,} \f]
/// \f$c_{ij}\f$ the number of draws in which i and j share a block.
///
/// Mean: \f$E[\hat K_{ij}] = e^{-m|p_i - p_j|}\f$ for every pair, as for the block estimator (the
/// near field is the factor itself; each draw's mask is unbiased beyond it).
/// Variance: 0 in the near field, where the steep heads put most of their weight; beyond it, the
/// block estimator's: \f$K_{ij}(1 - K_{ij})/s\f$ with independent draws, at most s/(s - 1)
/// times that with a Latin hypercube (Owen, 1997). Cost: the near field lies inside the blocks'
/// union for the distances that matter (a union spans about \f$\ln(s)/m\f$, the near field
/// \f$-\ln f/m\f$), so the fused kernel sees about the same keys; slope 0 (factor 1 everywhere)
/// makes every key near, that is exact ALiBi.
///
/// Estimator is the one definition of these weights (and factor_reach of the reach), which every
/// path asks: the dense reference, the fused kernel and its backward, the single-query path. The
/// kernels weigh by \f$s \hat K_{ij}\f$; the fused kernel and its backward look the weights up by
/// index in one table per head and chunk of keys (LogWeights, built from the Estimator): an index
/// c in [0, s] is a block count (weight c), an index s + 1 + (d - first) a near key at distance d
/// (weight \f$s e^{-m d}\f$), first the smallest near distance of the chunk's rows and keys.
/// Tested against plsh::reference::plsh_attention (dense, in double) and statistically (the dense
/// mean over many seeds equals the factor within 4 standard deviations) in
/// tests/test_near_field.cpp, where one test also holds every path (BlockCounts, the fused kernel
/// with its AVX-512 causal rows, KvCache's single-query path, the reference) to Estimator on the
/// same draws at the distances around the reach.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../limits.hpp"
#include "../options.hpp"
#include "../partition.hpp"

namespace plsh {
namespace detail {

/// The reach of a factor threshold: the largest distance \f$d \le\f$ `cap` whose ALiBi factor
/// \f$e^{-m d}\f$ is at least `threshold` = t in [0, 1], \f$\lfloor -\ln t/m\rfloor\f$; `cap`
/// when every distance is (slope 0, factor 1 everywhere, or t = 0). The one definition of a reach
/// from a factor threshold: the near field's (Estimator, `cap` the largest distance of a call) and
/// the band of truncated_alibi_attention (factor_window, `cap` kNoWindow).
///
/// \f$-\ln t\f$ is at most 744.5 for every t > 0 (the smallest denormal, 4.9e-324), whereas
/// \f$1/t\f$ overflows for t below about 5.6e-309.
inline Index factor_reach(double slope, double threshold, Index cap) {
  if (slope == 0 || threshold == 0) return cap;
  const double reach = std::floor(-std::log(threshold) / slope);
  return reach >= static_cast<double>(cap) ? cap : static_cast<Index>(reach);
}

/// The weights of the Positional LSH estimator of one head (file comment): slope m, s draws and
/// the near field of PlshOptions::near_field = f. A key at distance d from the query, sharing a
/// block with it in c of the draws, has the factor \f$\hat K = e^{-m d}\f$ when d is within the
/// reach w (near(d)), else \f$c/s\f$; the kernels weigh it by \f$s \hat K\f$ (log_weight). The
/// reach is factor_reach(m, f, largest distance of the call), -1 (no distance is near) for f = 0.
/// Every path asks this type for the weights: the dense reference (log_factor), LogWeights (the
/// fused forward's and backward's table), the single-query path (decode_step.hpp); the vector
/// forms (the AVX-512 causal rows' table lookups, avx512::near_log_weights) compute the same
/// expressions. Small and inline: no allocation, nothing virtual.
class Estimator {
 public:
  /// No draw and no near field.
  Estimator() = default;

  /// The estimator of a head of slope `slope` with `samples` draws and near field `near_field`
  /// (0: none), in a call where no two positions lie more than `largest_distance` apart.
  Estimator(double slope, Index samples, double near_field, Index largest_distance)
      : slope_(slope),
        samples_(samples),
        log_samples_(std::log(static_cast<double>(samples))),
        reach_(near_field > 0
                   ? factor_reach(slope, near_field, std::max<Index>(largest_distance, 0))
                   : -1) {}

  double slope() const { return slope_; }
  Index samples() const { return samples_; }
  /// \f$\log s\f$.
  double log_samples() const { return log_samples_; }
  /// The near field's reach w: the distances up to it take the exact factor; -1: none does.
  Index reach() const { return reach_; }
  /// Whether a key at distance `distance` takes the exact factor.
  bool near(Index distance) const { return distance <= reach_; }

  /// \f$\log(s \hat K)\f$ of a key at distance `distance` that shares a block with the query in
  /// `count` of the draws: log_near_weight within the reach, log_count_weight beyond.
  double log_weight(Index count, Index distance) const {
    return near(distance) ? log_near_weight(distance) : log_count_weight(count);
  }

  /// \f$\log(s e^{-m d}) = \log s - m d\f$, the log weight of a near key at distance d, in
  /// double (avx512::near_log_weights is its vector form).
  double log_near_weight(Index distance) const {
    return log_samples_ - slope_ * static_cast<double>(distance);
  }

  /// \f$\log c\f$, the log weight of a key beyond the reach in c draws' blocks
  /// (\f$-\infty\f$ for c = 0).
  static double log_count_weight(Index count) {
    return count == 0 ? -std::numeric_limits<double>::infinity()
                      : std::log(static_cast<double>(count));
  }

  /// \f$\log \hat K\f$ itself: \f$-m d\f$ within the reach, \f$\log(c/s)\f$ beyond
  /// (\f$-\infty\f$ for c = 0), as the dense reference takes it.
  double log_factor(Index count, Index distance) const {
    if (near(distance)) return -slope_ * static_cast<double>(distance);
    return count > 0 ? std::log(static_cast<double>(count) / static_cast<double>(samples_))
                     : -std::numeric_limits<double>::infinity();
  }

 private:
  double slope_ = 0;
  Index samples_ = 0;
  double log_samples_ = -std::numeric_limits<double>::infinity();
  Index reach_ = -1;
};

/// The estimator of a head of slope `slope` with `samples` draws and PlshOptions::near_field
/// `near_field`, in a call whose positions are `range` (no two of them further apart than its
/// width).
inline Estimator head_estimator(double slope, Index samples, double near_field,
                                const PositionRange& range) {
  return Estimator(slope, samples, near_field, range.last - range.first);
}

/// head_estimator of every head of `slopes`.
inline std::vector<Estimator> head_estimators(const std::vector<double>& slopes, Index samples,
                                              double near_field, const PositionRange& range) {
  std::vector<Estimator> estimators;
  estimators.reserve(slopes.size());
  for (const double slope : slopes) {
    estimators.push_back(head_estimator(slope, samples, near_field, range));
  }
  return estimators;
}

/// The largest reach of `estimators` (-1: none).
inline Index largest_reach(const std::vector<Estimator>& estimators) {
  Index reach = -1;
  for (const Estimator& estimator : estimators) reach = std::max(reach, estimator.reach());
  return reach;
}

/// The distances \f$[\text{first}, \text{last}]\f$ that occur between a tile's rows and keys
/// within a near field's reach (near_distances); empty when last < first.
struct DistanceRange {
  Index first = 0;
  Index last = -1;

  Index size() const { return last >= first ? last - first + 1 : 0; }
};

/// The distances within `reach` (-1: none) between the positions `[row_first, row_last]` and
/// `[key_first, key_last]` (no key when key_last < key_first): from the distance between the two
/// intervals to the largest distance within them, at most `reach`. At most (row_last - row_first)
/// + (key_last - key_first) + 1 distances, however far apart the positions lie.
inline DistanceRange near_distances(Index reach, Index row_first, Index row_last, Index key_first,
                                    Index key_last) {
  if (reach < 0 || key_last < key_first) return DistanceRange{};
  const Index nearest = std::max<Index>({0, key_first - row_last, row_first - key_last});
  const Index farthest = std::max(row_last - key_first, key_last - row_first);
  return DistanceRange{nearest, std::min(reach, farthest)};
}

/// The fused kernel's log weights \f$\log(s \hat K)\f$ of one head (Estimator) by index, rounded
/// to Scalar: Estimator::log_count_weight(c) for a count c = 0 .. s (\f$\log 0 = -\infty\f$),
/// then Estimator::log_near_weight(d) at index near_index(d) = s + 1 + (d - first) for the near
/// distances d of a DistanceRange \f$[\text{first}, \text{last}]\f$, those that occur within a
/// tile (near_distances). Its size is s + 1 plus the number of those distances, bounded by the
/// tile whatever the positions and the reach, and every index fits an int. prepare() computes the
/// counts' part when s changes and the near part when the slope or the distances do; the table's
/// storage is kept, so that a prepare allocates only when the table outgrows every earlier one.
template <class Scalar>
class LogWeights {
 public:
  /// The table for the estimator `estimator` and the near distances `distances`.
  void prepare(const Estimator& estimator, DistanceRange distances) {
    const Index samples = estimator.samples();
    if (samples != samples_) {
      table_.resize(static_cast<std::size_t>(samples + 1));
      for (Index c = 0; c <= samples; ++c) {
        table_[static_cast<std::size_t>(c)] = static_cast<Scalar>(Estimator::log_count_weight(c));
      }
      samples_ = samples;
      near_ = DistanceRange{};
    }
    if (distances.size() == 0) distances = DistanceRange{};
    const double slope = estimator.slope();
    if (distances.first == near_.first && distances.last == near_.last && slope == slope_) return;
    slope_ = slope;
    near_ = distances;
    table_.resize(static_cast<std::size_t>(samples + 1 + distances.size()));
    for (Index d = distances.first; d <= distances.last; ++d) {
      table_[static_cast<std::size_t>(near_index(d))] =
          static_cast<Scalar>(estimator.log_near_weight(d));
    }
  }

  /// The table, indices 0 .. max_index().
  const Scalar* data() const { return table_.data(); }
  Index max_index() const { return static_cast<Index>(table_.size()) - 1; }

  /// The index of the weight of a near key at distance `distance`, one of the prepared distances.
  Index near_index(Index distance) const { return samples_ + 1 + (distance - near_.first); }

 private:
  std::vector<Scalar> table_;
  Index samples_ = -1;
  double slope_ = 0;
  DistanceRange near_;  // the distances of the table's near part
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_NEAR_FIELD_HPP
