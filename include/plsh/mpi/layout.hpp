#ifndef PLSH_MPI_LAYOUT_HPP
#define PLSH_MPI_LAYOUT_HPP

/// \file layout.hpp
/// Which tokens every rank holds (ChunkLayout: contiguous chunks in rank order) and which key
/// rows the queries of each chunk reach. Positional LSH: for queries at positions \f$[a, b)\f$,
/// \f$[\min_{h,t} \mathrm{begin}_{h,t}(a),\; b)\f$ when causal, and up to
/// \f$\max_{h,t} \mathrm{end}_{h,t}(b - 1)\f$ when bidirectional (the blocks of head h, draw
/// t); windowed ALiBi: W positions beyond each query's nearest key, either way, W from the
/// certificate's bound on the ranks' largest query and key norms (certified_window). O(H s)
/// block look-ups per rank. Tested in tests/mpi/test_mpi.cpp (the halo's
/// bytes against these intervals).

#include <mpi.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "../attention/alibi_attention.hpp"
#include "../detail/check.hpp"
#include "../limits.hpp"
#include "../options.hpp"
#include "../partition.hpp"
#include "../sampler.hpp"

namespace plsh {
namespace mpi {

/// The sizes of `ranks` chunks of `tokens` tokens split evenly: the first `tokens % ranks` chunks
/// hold one token more.
/// \throws std::invalid_argument for `tokens < 0` or `ranks < 1`.
inline std::vector<Index> even_chunk_sizes(Index tokens, int ranks) {
  const char* function = "plsh::mpi::even_chunk_sizes";
  detail::require(tokens >= 0, function, "tokens must be non-negative");
  detail::require(ranks >= 1, function, "ranks must be at least 1");
  std::vector<Index> sizes(static_cast<std::size_t>(ranks), tokens / ranks);
  for (Index r = 0; r < tokens % ranks; ++r) ++sizes[static_cast<std::size_t>(r)];
  return sizes;
}

/// Which tokens every rank holds: rank r holds tokens `[chunk(r).begin, chunk(r).end)` of the
/// whole sequence, in rank order, without gaps.
class ChunkLayout {
 public:
  /// \param sizes tokens of ranks 0, 1, ...; each non-negative.
  /// \throws std::invalid_argument for an empty list or a negative size.
  explicit ChunkLayout(const std::vector<Index>& sizes) {
    const char* function = "plsh::mpi::ChunkLayout";
    detail::require(!sizes.empty(), function, "sizes must not be empty");
    offsets_.push_back(0);
    for (const Index size : sizes) {
      detail::require(size >= 0, function, "every size must be non-negative");
      detail::require(size <= kMaxPosition - offsets_.back(), function,
                      "the sizes must sum to at most kMaxPosition = 2^53");
      offsets_.push_back(offsets_.back() + size);
    }
  }

  int ranks() const { return static_cast<int>(offsets_.size()) - 1; }
  Index tokens() const { return offsets_.back(); }
  Block chunk(int rank) const {
    return Block{offsets_[static_cast<std::size_t>(rank)],
                 offsets_[static_cast<std::size_t>(rank) + 1]};
  }

 private:
  std::vector<Index> offsets_;
};

/// The chunk of this rank of `comm` when `tokens` tokens are split evenly (even_chunk_sizes).
inline Block even_chunk(Index tokens, MPI_Comm comm) {
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  return ChunkLayout(even_chunk_sizes(tokens, ranks)).chunk(rank);
}

}  // namespace mpi

namespace detail {

using mpi::ChunkLayout;

inline Block intersect(const Block& a, const Block& b) {
  const Index begin = std::max(a.begin, b.begin);
  return Block{begin, std::max(begin, std::min(a.end, b.end))};
}

/// Key rows `[begin - key_position, end - key_position)` of the positions `[begin, end)`, cut to
/// the `tokens` rows that exist (empty when they do not meet).
inline Block key_rows(Index begin, Index end, Index key_position, Index tokens) {
  return intersect(Block{begin - key_position, end - key_position}, Block{0, tokens});
}

/// `interval(first, last)` (key positions `[begin, end)` that queries at positions
/// `[first, last]` reach) for every rank's chunk, as key rows; an empty chunk reaches none.
template <class Interval>
std::vector<Block> reachable_per_rank(const ChunkLayout& layout, const AttentionOptions& options,
                                      Interval&& interval) {
  std::vector<Block> reachable;
  for (int r = 0; r < layout.ranks(); ++r) {
    const Block chunk = layout.chunk(r);
    if (chunk.begin == chunk.end) {
      reachable.push_back(Block{0, 0});
      continue;
    }
    const Block positions =
        interval(options.query_position + chunk.begin, options.query_position + chunk.end - 1);
    reachable.push_back(
        key_rows(positions.begin, positions.end, options.key_position, layout.tokens()));
  }
  return reachable;
}

/// The key rows that the queries of every rank's chunk reach in Positional LSH with the draws
/// `grids` (see the file comment) and a near field of reach `near_reach` (the largest over the
/// heads; -1: none); `options` positions are those of token 0.
inline std::vector<Block> plsh_reachable_keys(const ChunkLayout& layout,
                                              const std::vector<std::vector<Grid>>& grids,
                                              const AttentionOptions& options,
                                              Index near_reach = -1) {
  const Index n = layout.tokens();
  const Index first = std::min(options.query_position, options.key_position);
  const Index last = std::max(options.query_position, options.key_position) + n;
  return reachable_per_rank(layout, options, [&](Index query_first, Index query_last) {
    Block keys{query_first, query_last + 1};
    for (const std::vector<Grid>& head : grids) {
      for (const Grid& grid : head) {
        keys.begin = std::min(keys.begin, grid_block(grid, query_first, first, last).begin);
        if (!options.causal) {
          keys.end = std::max(keys.end, grid_block(grid, query_last, first, last).end);
        }
      }
    }
    if (near_reach >= 0) {
      keys.begin = std::min(keys.begin, query_first - near_reach);
      if (!options.causal) keys.end = std::max(keys.end, query_last + near_reach + 1);
    }
    return keys;
  });
}

/// The key rows that the queries of every rank's chunk reach in windowed ALiBi: `window`
/// positions beyond each query's nearest key, before (and, bidirectional, after) the chunk.
inline std::vector<Block> windowed_reachable_keys(const ChunkLayout& layout, Index window,
                                                  const AttentionOptions& options) {
  const Index first_key = options.key_position;
  const Index last_key = options.key_position + layout.tokens() - 1;
  // p - (distance to the nearest key) grows with p, and so does p + that distance; rows beyond
  // the keys reach the last key (the first, for rows before them).
  return reachable_per_rank(layout, options, [&](Index first, Index last) {
    const Index begin = (first > last_key ? last_key : first) - window;
    const Index end =
        options.causal ? last + 1 : (last < first_key ? first_key : last) + window + 1;
    return Block{begin, end};
  });
}

/// The reach of windowed_alibi_attention's certificate (attention/detail/windowed.hpp) from bounds
/// all ranks share: with \f$a_h = |\text{scale}|\max_i\|q_i\|\f$ over head h's queries and \f$K_h =
/// \max_j\|k_j\|\f$ over its key head, a row has seen its nearest key (logit \f$\ge -a_h K_h - m_h
/// r_i\f$), and the keys farther than \f$r_i + W\f$ on both sides weigh at most \f$2e^{a_h K_h -
/// m_h(r_i + W + 1)}/(1 - e^{-m_h})\f$; their share is at most `tolerance` once \f$m_h(W + 1) \ge
/// 2a_h K_h + \ln 2 - \ln(1 - e^{-m_h}) - \ln\text{tolerance}\f$. The kernel's own certificate,
/// tighter, then holds within W plus the steps of its tiles: the result adds two key tiles and a
/// query tile. kNoWindow for slope 0, tolerance 0 or an infinite norm. `query_norms[h]` is
/// \f$a_h\f$, `key_norms[h / group]` is \f$K_h\f$.
inline Index certified_window(const std::vector<double>& slopes,
                              const std::vector<double>& query_norms,
                              const std::vector<double>& key_norms, double tolerance) {
  const std::size_t group = slopes.size() / key_norms.size();
  Index widest = 0;
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    const double m = slopes[h];
    const double exponent = 2 * query_norms[h] * key_norms[h / group] + std::log(2.0) -
                            std::log(-std::expm1(-m)) - std::log(tolerance);
    const double window = std::ceil(exponent / m);
    if (!(window < static_cast<double>(kNoWindow))) return kNoWindow;
    widest = std::max(widest, static_cast<Index>(std::max(window, 0.0)));
  }
  return std::min(kNoWindow, widest + 2 * kKeyTile + kQueryTile);
}

/// Bytes this rank receives when every rank gathers its `reachable` key rows from their owners,
/// `row_bytes` per row: the rows of the interval that other ranks hold.
inline std::uint64_t halo_bytes(const ChunkLayout& layout, const std::vector<Block>& reachable,
                                int rank, std::uint64_t row_bytes) {
  const Block own = layout.chunk(rank);
  const Block wanted = reachable[static_cast<std::size_t>(rank)];
  const Index mine = intersect(own, wanted).size();
  return static_cast<std::uint64_t>(wanted.size() - mine) * row_bytes;
}

/// Bytes a rank receives in the ring of exact_alibi_attention, `row_bytes` per row: every other
/// rank's chunk.
inline std::uint64_t ring_bytes(const ChunkLayout& layout, int rank, std::uint64_t row_bytes) {
  return static_cast<std::uint64_t>(layout.tokens() - layout.chunk(rank).size()) * row_bytes;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_MPI_LAYOUT_HPP
