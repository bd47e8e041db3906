#ifndef PLSH_METRICS_HPP
#define PLSH_METRICS_HPP

/// \file metrics.hpp
/// How far a mean of block masks is from the ALiBi factor matrix.

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <vector>

#include "alibi.hpp"
#include "detail/deferred.hpp"
#include "partition.hpp"

namespace plsh {

/// Norms of \f$E = \hat K - K\f$, with \f$\hat K\f$ the mean mask and \f$K\f$ the Laplacian kernel.
struct MaskError {
  double spectral;  ///< \f$\|E\|_2\f$, the largest \f$|\lambda|\f$ of the symmetric \f$E\f$.
  double max;       ///< \f$\max_{ij} |E_{ij}|\f$.
};

/// Spectral and max-abs norms of `mean_mask(n, grids) - laplacian_kernel(n, slope)`.
/// Dense: O(n^2) memory and O(n^3) time (a symmetric eigenvalue solve), for tests and studies.
/// \throws std::invalid_argument if `n` lies outside [1, kMaxPosition], the slope is invalid, or
/// `grids` is empty or holds an invalid grid (the message names mask_error).
/// \tparam Tag unused: the solver is compiled only where mask_error is called (detail::Deferred).
template <class Tag = void>
MaskError mask_error(Index n, double slope, const std::vector<Grid>& grids) {
  const char* function = "mask_error";
  detail::require(n >= 1 && n <= kMaxPosition, function, "n must lie in [1, kMaxPosition]");
  detail::require_slope(slope, function);
  detail::require_grids(grids, function);
  using Matrix = detail::Deferred<Eigen::MatrixXd, Tag>;
  const Matrix error = mean_mask<double>(n, grids) - laplacian_kernel<double>(n, slope);
  const Eigen::SelfAdjointEigenSolver<Matrix> solver(error, Eigen::EigenvaluesOnly);
  return MaskError{solver.eigenvalues().cwiseAbs().maxCoeff(), error.cwiseAbs().maxCoeff()};
}

}  // namespace plsh

#endif  // PLSH_METRICS_HPP
