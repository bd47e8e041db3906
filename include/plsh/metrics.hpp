#ifndef PLSH_METRICS_HPP
#define PLSH_METRICS_HPP

/// \file metrics.hpp
/// How far a mean of block masks is from the ALiBi factor matrix.

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <limits>
#include <vector>

#include "alibi.hpp"
#include "detail/check.hpp"
#include "detail/deferred.hpp"
#include "limits.hpp"
#include "partition.hpp"

namespace plsh {
namespace detail {

/// Whether a buffer of `rows` x `cols` doubles can be sized: its number of entries and its size in
/// bytes are representable in Index (and so in std::size_t). The error norms check every dense
/// matrix and every buffer whose size is not bounded by their inputs against it before they
/// allocate; within it, memory that runs out throws std::bad_alloc as usual.
inline bool doubles_fit(Index rows, Index cols) {
  Index entries = 0;
  return checked_multiply(rows, cols, entries) &&
         entries <= std::numeric_limits<Index>::max() / static_cast<Index>(sizeof(double));
}

}  // namespace detail

/// Norms of \f$E = \hat K - K\f$, with \f$\hat K\f$ the mean mask and \f$K\f$ the Laplacian kernel.
struct MaskError {
  double spectral;  ///< \f$\|E\|_2\f$, the largest \f$|\lambda|\f$ of the symmetric \f$E\f$.
  double max;       ///< \f$\max_{ij} |E_{ij}|\f$.
};

/// Spectral and max-abs norms of `mean_mask(n, grids) - laplacian_kernel(n, slope)`.
/// Dense: O(n^2) memory and O(n^3) time (a symmetric eigenvalue solve), for tests and studies.
/// \throws std::invalid_argument if `n` lies outside [1, kMaxPosition], an n x n matrix of
/// doubles cannot be sized (detail::doubles_fit: n above about \f$2^{30}\f$), the slope is
/// invalid, or `grids` is empty or holds an invalid grid (the message names mask_error); all
/// before anything is allocated.
/// \tparam Tag unused: the solver is compiled only where mask_error is called (detail::Deferred).
template <class Tag = void>
MaskError mask_error(Index n, double slope, const std::vector<Grid>& grids) {
  const char* function = "mask_error";
  detail::require(n >= 1 && n <= kMaxPosition, function, "n must lie in [1, kMaxPosition]");
  detail::require(detail::doubles_fit(n, n), function,
                  "n is too large for a dense n x n matrix of doubles");
  detail::require_slope(slope, function);
  detail::require_grids(grids, function);
  using Matrix = detail::Deferred<Eigen::MatrixXd, Tag>;
  const Matrix error = mean_mask<double>(n, grids) - laplacian_kernel<double>(n, slope);
  const Eigen::SelfAdjointEigenSolver<Matrix> solver(error, Eigen::EigenvaluesOnly);
  return MaskError{solver.eigenvalues().cwiseAbs().maxCoeff(), error.cwiseAbs().maxCoeff()};
}

}  // namespace plsh

#endif  // PLSH_METRICS_HPP
