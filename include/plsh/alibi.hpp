#ifndef PLSH_ALIBI_HPP
#define PLSH_ALIBI_HPP

/// \file alibi.hpp
/// ALiBi slopes and the Laplacian factor matrix they induce.

#include <Eigen/Core>
#include <cmath>
#include <vector>

#include "detail/check.hpp"
#include "limits.hpp"

namespace plsh {

using Index = Eigen::Index;

/// Per-head ALiBi slopes, exactly as `get_slopes` of Press et al. (the list used by BLOOM, MPT
/// and ggml).
///
/// For a power of two \f$H\f$: \f$m_h = 2^{-8(h+1)/H}\f$. Otherwise, with
/// \f$c = 2^{\lfloor\log_2 H\rfloor}\f$, the \f$c\f$ slopes of \f$c\f$ heads followed by the
/// slopes at indices 0, 2, 4, ... of the \f$2c\f$ list until \f$H\f$ slopes are reached.
///
/// \param num_heads number of heads, 1 to kMaxHeads.
/// \throws std::invalid_argument if `num_heads` lies outside [1, kMaxHeads].
inline std::vector<double> alibi_slopes(Index num_heads) {
  detail::require(num_heads >= 1 && num_heads <= kMaxHeads, "alibi_slopes",
                  "num_heads must lie in [1, kMaxHeads = 2^20]");
  // Mirrors the reference: start = 2^(-2^-(log2(n) - 3)), slope i = start * start^i.
  const auto power_of_two_slopes = [](Index n) {
    const double start = std::pow(2.0, -std::pow(2.0, -(std::log2(static_cast<double>(n)) - 3)));
    std::vector<double> slopes(static_cast<std::size_t>(n));
    for (std::size_t i = 0; i < slopes.size(); ++i) {
      slopes[i] = start * std::pow(start, static_cast<double>(i));
    }
    return slopes;
  };
  Index closest = 1;
  while (closest * 2 <= num_heads) closest *= 2;
  std::vector<double> slopes = power_of_two_slopes(closest);
  if (closest == num_heads) return slopes;
  const std::vector<double> doubled = power_of_two_slopes(2 * closest);
  for (std::size_t i = 0; static_cast<Index>(slopes.size()) < num_heads; i += 2) {
    slopes.push_back(doubled[i]);
  }
  return slopes;
}

/// The ALiBi factor matrix \f$K_{ij} = e^{-m|i-j|}\f$ on positions 0..n-1: the Laplacian kernel
/// of bandwidth \f$1/m\f$. Dense, for tests and metrics.
///
/// \tparam Scalar element type.
/// \param n number of positions, 0 to kMaxPosition.
/// \param slope \f$m \ge 0\f$, finite.
/// \throws std::invalid_argument for `n` outside [0, kMaxPosition] or a bad slope.
template <class Scalar = double>
Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> laplacian_kernel(Index n, double slope) {
  detail::require(n >= 0 && n <= kMaxPosition, "laplacian_kernel",
                  "n must lie in [0, kMaxPosition]");
  detail::require_slope(slope, "laplacian_kernel");
  Eigen::Matrix<Scalar, Eigen::Dynamic, Eigen::Dynamic> kernel(n, n);
  for (Index j = 0; j < n; ++j) {
    for (Index i = 0; i < n; ++i) {
      kernel(i, j) = static_cast<Scalar>(std::exp(-slope * static_cast<double>(std::abs(i - j))));
    }
  }
  return kernel;
}

}  // namespace plsh

#endif  // PLSH_ALIBI_HPP
