#ifndef PLSH_LIMITS_HPP
#define PLSH_LIMITS_HPP

/// \file limits.hpp
/// The largest arguments plsh accepts. Every public entry point checks its arguments against
/// these bounds and throws std::invalid_argument beyond them.

#include <Eigen/Core>

namespace plsh {

using Index = Eigen::Index;

/// Largest absolute position, \f$2^{53}\f$: every position `p` of a query, a key or a partition
/// satisfies \f$|p| \le\f$ kMaxPosition, and so does the end `position + tokens` of a range.
///
/// Bins are computed in double, \f$\lfloor (p - \text{shift})/\text{pitch} \rfloor\f$, and every
/// integer up to \f$2^{53}\f$ is a double. Beyond it neighbouring positions round to the same
/// double and Positional LSH no longer approximates ALiBi (with slope 1, positions 10 and 11 past
/// \f$2^{54}\f$ share a block with probability 0.018 instead of \f$e^{-1}\f$).
constexpr Index kMaxPosition = Index(1) << 53;

/// Largest number of draws `samples` of plsh_attention, its backward, KvCache and
/// draw_head_grids: \f$2^{16}\f$.
///
/// Memory grows linearly with s. The draws take 16·H·s bytes (H heads). Per thread, the fused
/// forward keeps, for a tile of R <= 64 query rows, every draw's block runs (at most R·s, 32
/// bytes each) and their first and past-the-end rows as events (16 bytes per run), plus one
/// vector of counts over a chunk of keys: about 48·R·s bytes, 300 KiB at the default s = 100 and
/// 200 MiB at s = kMaxSamples. The backward keeps R·s begins and ends per thread (64 MiB at
/// s = kMaxSamples). Time also grows with s: O(s) block look-ups per query tile and head.
constexpr Index kMaxSamples = Index(1) << 16;

/// Largest number of heads of alibi_slopes: \f$2^{20}\f$ (8 MiB of slopes).
constexpr Index kMaxHeads = Index(1) << 20;

}  // namespace plsh

#endif  // PLSH_LIMITS_HPP
