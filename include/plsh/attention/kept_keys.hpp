#ifndef PLSH_ATTENTION_KEPT_KEYS_HPP
#define PLSH_ATTENTION_KEPT_KEYS_HPP

/// \file kept_keys.hpp
/// KeptKeys, the key rows windowed_alibi_attention kept: written by the forward, taken by
/// windowed_alibi_attention_backward, which then does not run the forward's certificate again.

#include <string>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../partition.hpp"
#include "../tensor.hpp"

namespace plsh {

namespace detail {
struct KeptKeysAccess;
}

/// The key rows each query tile of a windowed_alibi_attention call visited, with the shapes and
/// tolerance of that call. Opaque: filled by the forward, read by the backward, which checks
/// that the batch size, heads, query and key counts and the tolerance are its own (a tolerance of
/// 0 keeps every key and records none). Holds one key range per (batch element, head, query tile
/// of 64 rows): \f$O(BHn_q/64)\f$ memory.
class KeptKeys {
 public:
  KeptKeys() = default;

  /// Whether no forward has filled it.
  bool empty() const { return !filled_; }

 private:
  friend struct detail::KeptKeysAccess;

  bool filled_ = false;
  Index batch_ = 0;
  Index heads_ = 0;
  Index queries_ = 0;
  Index keys_ = 0;
  double tolerance_ = 0;
  std::vector<Block> ranges_;  // at (b * heads + h) * tiles + tile
};

namespace detail {

/// The forward's and the backward's access to KeptKeys.
struct KeptKeysAccess {
  /// Records the ranges of a call with these shapes and tolerance.
  static void store(KeptKeys& kept, Index batch, Index heads, Index queries, Index keys,
                    double tolerance, std::vector<Block> ranges) {
    kept.filled_ = true;
    kept.batch_ = batch;
    kept.heads_ = heads;
    kept.queries_ = queries;
    kept.keys_ = keys;
    kept.tolerance_ = tolerance;
    kept.ranges_ = std::move(ranges);
  }

  /// The ranges of `kept` (the argument `name` of `function`), after checking that they come
  /// from a forward with these shapes and tolerance.
  static const std::vector<Block>& ranges(const char* function, const char* name,
                                          const KeptKeys& kept, Index batch, Index heads,
                                          Index queries, Index keys, double tolerance) {
    require(kept.filled_, function,
            [&] { return std::string(name) + " holds no ranges: pass those a forward wrote"; });
    require(kept.batch_ == batch && kept.heads_ == heads && kept.queries_ == queries &&
                kept.keys_ == keys,
            function, [&] {
              return std::string(name) + " comes from a call with batch " +
                     std::to_string(kept.batch_) + ", " + std::to_string(kept.heads_) + " heads, " +
                     std::to_string(kept.queries_) + " queries and " + std::to_string(kept.keys_) +
                     " keys, not " + std::to_string(batch) + ", " + std::to_string(heads) + ", " +
                     std::to_string(queries) + " and " + std::to_string(keys);
            });
    require(kept.tolerance_ == tolerance, function, [&] {
      return std::string(name) + " comes from a call with tolerance " +
             std::to_string(kept.tolerance_) + ", not " + std::to_string(tolerance);
    });
    return kept.ranges_;
  }
};

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_KEPT_KEYS_HPP
