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
/// union for the distances that matter (a union reaches about \f$\ln(s)/m\f$, the near field
/// \f$-\ln f/m\f$), so the fused kernel sees about the same keys; slope 0 (factor 1 everywhere)
/// makes every key near, that is exact ALiBi.
///
/// In the fused kernel and its backward the weights are \f$s \hat K_{ij}\f$, looked up by index
/// in one table per head and chunk of keys (LogWeights): an index c in [0, s] is a block count
/// (weight c), an index s + 1 + (d - first) a near key at distance d (weight \f$s e^{-m d}\f$),
/// first the smallest near distance of the chunk's rows and keys. Tested against
/// plsh::reference::plsh_attention (dense, in double) and statistically (the dense mean over many
/// seeds equals the factor within 4 standard deviations) in tests/test_near_field.cpp.

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

#include "../limits.hpp"
#include "../options.hpp"
#include "../partition.hpp"

namespace plsh {
namespace detail {

/// The near field of one head in a call: its slope and its reach w (near_field_reach; -1: none).
struct NearField {
  double slope = 0;
  Index reach = -1;
};

/// The reach w of the near field of a head of slope `slope` for `near_field` = f in [0, 1]: the
/// largest distance whose factor \f$e^{-m d}\f$ is at least f, \f$\lfloor -\ln f/m\rfloor\f$, at
/// most `cap` (every key of a call lies within distance `cap`); -1 (no near field) when f is 0.
/// Slope 0: `cap`, every key near. The one definition of a reach from a factor threshold: the band
/// of truncated_alibi_attention (factor_window) is the same function of its tolerance.
///
/// \f$-\ln f\f$ is at most 744.5 for every f > 0 (the smallest denormal, 4.9e-324), whereas
/// \f$1/f\f$ overflows for f below about 5.6e-309.
inline Index near_field_reach(double slope, double near_field, Index cap) {
  if (near_field <= 0) return -1;
  if (slope == 0) return cap;
  const double reach = std::floor(-std::log(near_field) / slope);
  return reach >= static_cast<double>(cap) ? cap : static_cast<Index>(reach);
}

/// The near field of a head of slope `slope` for PlshOptions::near_field `near_field`, in a call
/// whose positions are `range` (no two of them further apart than its width).
inline NearField head_near_field(double slope, double near_field, const PositionRange& range) {
  return NearField{
      slope, near_field_reach(slope, near_field, std::max<Index>(range.last - range.first, 0))};
}

/// The near fields of every head of `slopes` in a call whose positions are `range`
/// (head_near_field), or none (an empty list) for `near_field` = 0.
inline std::vector<NearField> head_near_fields(const std::vector<double>& slopes, double near_field,
                                               const PositionRange& range) {
  std::vector<NearField> fields;
  if (near_field == 0) return fields;
  fields.reserve(slopes.size());
  for (const double slope : slopes) fields.push_back(head_near_field(slope, near_field, range));
  return fields;
}

/// The largest reach of `fields` (-1: none).
inline Index largest_reach(const std::vector<NearField>& fields) {
  Index reach = -1;
  for (const NearField& field : fields) reach = std::max(reach, field.reach);
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

/// The logarithms of the fused kernel's weights \f$s \hat K\f$ by index for one head: \f$\log c\f$
/// for a count c = 0 .. s (\f$\log 0 = -\infty\f$), then \f$\log s - m d\f$ (in double, then
/// rounded to Scalar) at index near_index(d) = s + 1 + (d - first) for the near distances d of a
/// DistanceRange \f$[\text{first}, \text{last}]\f$, those that occur within a tile
/// (near_distances). Its size is s + 1 plus the number of those distances, bounded by the tile
/// whatever the positions and the reach, and every index fits an int. prepare() computes the
/// counts' part when s changes and the near part when the slope or the distances do.
template <class Scalar>
class LogWeights {
 public:
  /// The table for `samples` draws and the near distances `distances` of a head of slope `slope`.
  void prepare(Index samples, double slope, DistanceRange distances) {
    if (samples != samples_) {
      table_.resize(static_cast<std::size_t>(samples + 1));
      table_[0] = -std::numeric_limits<Scalar>::infinity();
      for (Index c = 1; c <= samples; ++c) {
        table_[static_cast<std::size_t>(c)] = static_cast<Scalar>(std::log(static_cast<double>(c)));
      }
      samples_ = samples;
      near_ = DistanceRange{};
    }
    if (distances.size() == 0) distances = DistanceRange{};
    if (distances.first == near_.first && distances.last == near_.last && slope == slope_) return;
    slope_ = slope;
    near_ = distances;
    table_.resize(static_cast<std::size_t>(samples + 1 + distances.size()));
    const double log_samples = std::log(static_cast<double>(samples));
    for (Index d = distances.first; d <= distances.last; ++d) {
      table_[static_cast<std::size_t>(near_index(d))] =
          static_cast<Scalar>(log_samples - slope * static_cast<double>(d));
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
