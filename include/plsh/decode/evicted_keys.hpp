#ifndef PLSH_DECODE_EVICTED_KEYS_HPP
#define PLSH_DECODE_EVICTED_KEYS_HPP

/// \file evicted_keys.hpp
/// EvictedKeys: what an AlibiKvCache remembers of the keys it has dropped, one per key/value head:
/// the positions, cut into blocks, and the largest key norm of each block. It is all that a row's
/// certificate needs: for a row at p of norm \f$a = |\text{scale}|\,\|q\|\f$, slope m and
/// log-sum-exp \f$\ell\f$ over the keys it keeps, the exact-ALiBi weight of the dropped keys is at
/// most
/// \f[ \sum_b e^{a K_b - m (p - e_b + 1)} \sum_{t=0}^{L_b - 1} e^{-m t} \big/ e^{\ell}, \f]
/// block b holding the \f$L_b\f$ positions \f$[s_b, e_b)\f$ with key norms at most \f$K_b\f$:
/// the bound of the certified window (attention/detail/windowed.hpp, dropped_weight_bound) over the
/// blocks.
///
/// Blocks (an exponential histogram): positions arrive oldest first as blocks of one; whenever
/// three blocks have the same length, the two oldest of them merge. Lengths are powers of two,
/// never shorter for older blocks, at most two of each: \f$\le 2\log_2 n + 2\f$ blocks for n
/// positions, amortised O(1) work per position. A block is never longer than the positions after
/// it plus one, so a large norm (an evicted attention sink) weighs in at about its own distance,
/// not at the distance of the newest evicted key.
///
/// A position may be kept elsewhere (a pinned key): it joins a block without a norm; if it is
/// dropped later, `raise` adds its norm to the block that holds it.
///
/// Cost of a bound: one exponential per block and row. Tested in tests/test_alibi_kv_cache.cpp
/// (the blocks' invariants, and the bound against the dense double weights of the dropped keys).

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

#include "../attention/detail/windowed.hpp"
#include "../tensor.hpp"

namespace plsh {
namespace detail {

/// The dropped keys of one key/value head, in blocks of positions with their largest key norm.
class EvictedKeys {
 public:
  /// Positions `[begin, end)`, `log2_length` = \f$\log_2(\text{end} - \text{begin})\f$, and the
  /// largest norm of the dropped keys among them (negative: none, every position is kept
  /// elsewhere).
  struct Block {
    Index begin;
    Index end;
    int log2_length;
    double norm;
  };

  /// The position after the newest dropped one (`first` before any).
  explicit EvictedKeys(Index first) : end_(first) {}

  const std::vector<Block>& blocks() const { return blocks_; }
  Index end() const { return end_; }

  /// Appends position `end()`: a dropped key of norm `norm` (norm_bound), or with a negative norm a
  /// position whose key is kept elsewhere.
  void push(double norm) {
    blocks_.push_back(Block{end_, end_ + 1, 0, norm});
    ++end_;
    // The run of blocks of the newest length ends at `last`; three of one length: the two oldest
    // merge into one of twice the length, which may make three of that length.
    std::size_t last = blocks_.size() - 1;
    while (true) {
      std::size_t first = last;
      while (first > 0 && blocks_[first - 1].log2_length == blocks_[last].log2_length) --first;
      if (last - first < 2) return;
      Block& older = blocks_[first];
      const Block& newer = blocks_[first + 1];
      older.end = newer.end;
      older.norm = std::max(older.norm, newer.norm);
      ++older.log2_length;
      blocks_.erase(blocks_.begin() + static_cast<std::ptrdiff_t>(first) + 1);
      last = first;
    }
  }

  /// A key kept elsewhere at `position` (< end()) is dropped after all: its norm joins its block.
  void raise(Index position, double norm) {
    const auto block = std::upper_bound(
        blocks_.begin(), blocks_.end(), position,
        [](Index value, const Block& candidate) { return value < candidate.begin; });
    if (block == blocks_.begin()) return;
    Block& holder = *(block - 1);
    holder.norm = std::max(holder.norm, norm);
  }

  /// The certificate of a row at `position` (after every dropped position) of norm `row_norm`,
  /// slope `slope`, and \f$\log\f$ of its total weight at least `log_base`: the sum over the blocks
  /// of dropped_weight_bound. `log_sums[l]` is log_geometric_sum(slope, 2^l).
  double bound(double row_norm, double slope, Index position, double log_base,
               const std::vector<double>& log_sums) const {
    double total = 0;
    for (const Block& block : blocks_) {
      if (block.norm < 0) continue;
      total +=
          dropped_weight_bound(row_norm, block.norm, slope, position - (block.end - 1),
                               log_sums[static_cast<std::size_t>(block.log2_length)], log_base);
    }
    return total;
  }

 private:
  std::vector<Block> blocks_;  // oldest first
  Index end_;
};

/// log_geometric_sum(slope, 2^l) for l = 0 .. 62: the `log_sums` of EvictedKeys::bound.
inline std::vector<double> block_log_sums(double slope) {
  std::vector<double> sums(63);
  for (std::size_t l = 0; l < sums.size(); ++l) {
    sums[l] = log_geometric_sum(slope, Index{1} << l);
  }
  return sums;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_EVICTED_KEYS_HPP
