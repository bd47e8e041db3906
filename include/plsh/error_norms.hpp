#ifndef PLSH_ERROR_NORMS_HPP
#define PLSH_ERROR_NORMS_HPP

/// \file error_norms.hpp
/// Matrix-free norms of \f$E = \hat K - K\f$, the error of the mean of s block masks
/// \f$\hat K = \frac1s\sum_t M_t\f$ against the ALiBi factor matrix \f$K_{ij} = e^{-m|i-j|}\f$,
/// on positions `[first, first + n)`, without an n x n matrix.
///
/// - \f$Kx\f$ in O(n) by two first-order recursions with \f$r = e^{-m}\f$:
///   \f$f_i = x_i + r f_{i-1}\f$, \f$g_i = r(x_{i+1} + g_{i+1})\f$, \f$Kx = f + g\f$.
/// - \f$\hat Kx\f$ in O(n + blocks), at most O(n s): per draw and block, the block's sum of x
///   (prefix sums) into a difference array over the rows.
/// - \f$\max_{ij}|E_{ij}|\f$ exactly, row by row in O(n s log s): the blocks of row i in the
///   s draws split the row into segments of constant \f$c_{ij}\f$ (draws in which i and j share a
///   block); on each side of the diagonal \f$K_{ij}\f$ is monotone in j, so the largest
///   \f$|c_{ij}/s - K_{ij}|\f$ of a segment is at one of its ends.
/// - \f$\|E\|_2\f$, the largest \f$|\lambda|\f$ of the symmetric E, by Lanczos on E without
///   reorthogonalisation: one product \f$Ex\f$ and O(n) work per step, three vectors of n
///   entries, both ends of the spectrum from one Krylov space, the extreme Ritz values of the
///   tridiagonal \f$T_j\f$ by bisection in O(j). Unrestarted, it keeps the whole Krylov space,
///   which a clustered top of the spectrum (many nearly equal \f$|\lambda|\f$ of a long mask)
///   needs; a restarted basis loses it at every restart. The norms of non-symmetric operators
///   (largest_singular_value) use Spectra's SymEigsSolver on \f$E^\top E\f$. Spectra is
///   optional: the spectral norms are compiled when its header `<Spectra/SymEigsSolver.h>` is found
///   and `PLSH_NO_SPECTRA` is not defined; `PLSH_HAS_SPECTRA` is then defined to 1. The solver's
///   outcome is a status (SpectralNorm): whether it converged, and whether every product was finite
///   (a NaN or an infinity stops it and gives a NaN norm, never an exception).
///
/// Every public function checks its arguments, sizes included, before it allocates: n lies in
/// [1, kMaxPosition] (so an O(n) vector of doubles, 8(n + 1) bytes, is representable in Index and
/// std::size_t), and a buffer not bounded by that, the solver's dense matrix or Spectra's Lanczos
/// basis, by detail::doubles_fit; std::invalid_argument otherwise.
///
/// Tested in tests/test_error_norms.cpp against the dense mask_error (metrics.hpp), dense masks of
/// partitions of offset positions (partition.hpp) and Eigen's dense eigensolver, for n <= 2000,
/// and for convergence on a clustered spectrum at n = 2 10^4.

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <utility>
#include <vector>

#include "detail/check.hpp"
#include "detail/deferred.hpp"
#include "detail/random.hpp"
#include "limits.hpp"
#include "metrics.hpp"
#include "partition.hpp"
#include "sampler.hpp"

#if !defined(PLSH_NO_SPECTRA) && defined(__has_include)
#if __has_include(<Spectra/SymEigsSolver.h>)
#include <Spectra/SymEigsSolver.h>
#define PLSH_HAS_SPECTRA 1
#endif
#endif

namespace plsh {
namespace detail {

/// Positions `[first, first + n)` with `n >= 1`, inside [-kMaxPosition, kMaxPosition]. The bound
/// on n also bounds the O(n) vectors of the products: 8(n + 1) bytes, at most \f$2^{56} + 8\f$.
inline void require_positions(Index n, Index first, const char* function) {
  require(n >= 1 && n <= kMaxPosition, function, "n must lie in [1, kMaxPosition]");
  require(first >= -kMaxPosition && first <= kMaxPosition - n, function,
          "positions [first, first + n) must lie in [-kMaxPosition, kMaxPosition]");
}

/// Calls `visit(block)` for every block of the partition of `[first, last)` by `grid`, in order,
/// without storing the partition.
template <class Visit>
void for_each_block(const Grid& grid, Index first, Index last, Visit&& visit) {
  for (Index p = first; p < last;) {
    const Block block = grid_block(grid, p, first, last);
    visit(block);
    p = block.end;
  }
}

}  // namespace detail

/// \f$y = Kx\f$ with \f$K_{ij} = e^{-m|i-j|}\f$, by two first-order recursions: O(n), no
/// cancellation (every term is non-negative times x). `x` and `y` have the same size and must not
/// alias.
/// \throws std::invalid_argument for a negative or non-finite slope or sizes that differ.
inline void laplacian_product(double slope, const Eigen::Ref<const Eigen::VectorXd>& x,
                              Eigen::Ref<Eigen::VectorXd> y) {
  const char* function = "laplacian_product";
  detail::require_slope(slope, function);
  detail::require(x.size() == y.size(), function, "x and y must have the same size");
  const Index n = x.size();
  if (n == 0) return;
  const double r = std::exp(-slope);
  double forward = 0;  // f_i = sum_{j <= i} r^(i - j) x_j
  for (Index i = 0; i < n; ++i) {
    forward = x[i] + r * forward;
    y[i] = forward;
  }
  double backward = 0;  // g_i = sum_{j > i} r^(j - i) x_j
  for (Index i = n - 2; i >= 0; --i) {
    backward = r * (x[i + 1] + backward);
    y[i] += backward;
  }
}

namespace detail {

/// \f$y = \frac1s \sum_t \sum_{\text{blocks } [b, e) \text{ of draw } t} 1_{[b,e)}
/// \sum_{j=b}^{e-1} x_j\f$: `for_each_block(visit)` calls `visit(b, e)` (offsets from the first
/// position) for every block of every draw. Block sums from prefix sums of x go into a difference
/// array, \f$D_b \mathrel{+}= S\f$, \f$D_e \mathrel{-}= S\f$, and \f$y = \frac1s
/// \mathrm{cumsum}(D)\f$: O(n + blocks). `prefix` and `difference` are workspaces of n + 1
/// entries (kept by a caller that multiplies often: a fresh vector of n doubles costs its page
/// faults, several times the arithmetic for large n).
template <class ForEachBlock>
void block_sum_product(Index draws, const Eigen::Ref<const Eigen::VectorXd>& x,
                       Eigen::Ref<Eigen::VectorXd> y, ForEachBlock&& for_each_block,
                       Eigen::VectorXd& prefix, Eigen::VectorXd& difference) {
  const Index n = x.size();
  prefix.resize(n + 1);
  prefix[0] = 0;
  for (Index i = 0; i < n; ++i) prefix[i + 1] = prefix[i] + x[i];
  difference.setZero(n + 1);
  for_each_block([&](Index b, Index e) {
    const double sum = prefix[e] - prefix[b];
    difference[b] += sum;
    difference[e] -= sum;
  });
  const double inverse_s = 1.0 / static_cast<double>(draws);
  double running = 0;
  for (Index i = 0; i < n; ++i) {
    running += difference[i];
    y[i] = running * inverse_s;
  }
}

}  // namespace detail

/// \f$y = \hat Kx\f$ with \f$\hat K = \frac1s\sum_t M_t\f$, the mean mask of `grids` on positions
/// `[first, first + n)`, n = x.size(): block sums of x per draw (detail::block_sum_product), the
/// blocks found with grid_block. O(n + blocks) time, at most O(n s); O(n) memory.
/// \throws std::invalid_argument for sizes that differ, n = 0, positions beyond kMaxPosition, or
/// empty or invalid grids.
inline void mean_mask_product(const std::vector<Grid>& grids, Index first,
                              const Eigen::Ref<const Eigen::VectorXd>& x,
                              Eigen::Ref<Eigen::VectorXd> y) {
  const char* function = "mean_mask_product";
  detail::require(x.size() == y.size(), function, "x and y must have the same size");
  detail::require_positions(x.size(), first, function);
  detail::require_grids(grids, function);
  const Index last = first + x.size();
  Eigen::VectorXd prefix, difference;
  detail::block_sum_product(
      static_cast<Index>(grids.size()), x, y,
      [&](auto&& visit) {
        for (const Grid& grid : grids) {
          detail::for_each_block(grid, first, last, [&](const Block& block) {
            visit(block.begin - first, block.end - first);
          });
        }
      },
      prefix, difference);
}

namespace detail {

/// The arguments of MaskErrorOperator: require_positions, a valid slope and grids, and n below
/// \f$2^{32}\f$ (block ends are kept in 32 bits).
inline void validate_mask_error_operator(Index n, double slope, const std::vector<Grid>& grids,
                                         Index first, const char* function) {
  require_positions(n, first, function);
  require_slope(slope, function);
  require_grids(grids, function);
  require(n <= static_cast<Index>(std::numeric_limits<std::uint32_t>::max()), function,
          "n must be below 2^32 (block ends are kept in 32 bits)");
}

}  // namespace detail

/// The symmetric operator \f$E = \hat K - K\f$ on positions `[first, first + n)`, with the
/// interface of a Spectra matrix operation (`Scalar`, `rows()`, `cols()`, `perform_op`).
/// The constructor finds every block of every draw once (grid_block) and keeps their ends, 4 bytes
/// per block (about \f$4 n m s\f$ bytes for slope m and s draws when \f$m \le 1\f$), and three
/// workspaces of n + 1 doubles; one product then costs O(n + blocks), at most O(n s), and
/// allocates nothing. Not thread-safe: one operator per thread.
class MaskErrorOperator {
 public:
  using Scalar = double;

  /// \throws std::invalid_argument as mask_max_error, and for n of \f$2^{32}\f$ or more; before
  /// anything is allocated.
  MaskErrorOperator(Index n, double slope, const std::vector<Grid>& grids, Index first = 0)
      : n_(n), slope_(slope), draws_(static_cast<Index>(grids.size())) {
    detail::validate_mask_error_operator(n, slope, grids, first, "MaskErrorOperator");
    kernel_product_.resize(n);
    prefix_.resize(n + 1);
    difference_.resize(n + 1);
    for (const Grid& grid : grids) {
      detail::for_each_block(grid, first, first + n, [&](const Block& block) {
        ends_.push_back(static_cast<std::uint32_t>(block.end - first));
      });
    }
  }

  Index rows() const { return n_; }
  Index cols() const { return n_; }

  /// \f$y = Ex\f$ for `x` and `y` of n entries each.
  void perform_op(const double* x_in, double* y_out) const {
    const Eigen::Map<const Eigen::VectorXd> x(x_in, n_);
    Eigen::Map<Eigen::VectorXd> y(y_out, n_);
    detail::block_sum_product(
        draws_, x, y,
        [&](auto&& visit) {
          Index begin = 0;  // every draw's last block ends at n
          for (const std::uint32_t end : ends_) {
            visit(begin, static_cast<Index>(end));
            begin = static_cast<Index>(end) == n_ ? 0 : static_cast<Index>(end);
          }
        },
        prefix_, difference_);
    laplacian_product(slope_, x, kernel_product_);
    y -= kernel_product_;
  }

 private:
  Index n_;
  double slope_;
  Index draws_;
  std::vector<std::uint32_t> ends_;  // block ends of every draw, offsets from first, in order
  mutable Eigen::VectorXd kernel_product_, prefix_, difference_;  // workspaces of the products
};

/// \f$\max_{ij}|E_{ij}|\f$, \f$E = \hat K - K\f$ on positions `[first, first + n)`, exactly,
/// without an n x n matrix: O(n s log s) time, O(s) memory.
///
/// Row i: the draws' blocks \f$[b_t, e_t)\f$ of i. Left of the diagonal, \f$c_{ij} =
/// \#\{t: b_t \le j\}\f$ is constant between consecutive sorted \f$b_t\f$; right of it,
/// \f$c_{ij} = \#\{t: e_t > j\}\f$ between consecutive sorted \f$e_t\f$; beyond the union of the
/// blocks \f$c_{ij} = 0\f$ and \f$|E_{ij}| = K_{ij}\f$ is largest next to the union. On each
/// segment \f$K_{ij}\f$ is monotone, so only the two ends of every segment are evaluated.
/// Equals mask_error(n, slope, grids).max for first = 0 (to rounding: \f$c/s\f$ here, a sum of s
/// weights \f$1/s\f$ there).
/// \throws std::invalid_argument if `n` is not positive, the positions exceed kMaxPosition, the
/// slope is invalid, or `grids` is empty or holds an invalid grid (the message names
/// mask_max_error).
inline double mask_max_error(Index n, double slope, const std::vector<Grid>& grids,
                             Index first = 0) {
  const char* function = "mask_max_error";
  detail::require_positions(n, first, function);
  detail::require_slope(slope, function);
  detail::require_grids(grids, function);
  const Index last = first + n;
  const Index s = static_cast<Index>(grids.size());
  const double inverse_s = 1.0 / static_cast<double>(s);
  std::vector<Block> blocks(static_cast<std::size_t>(s), Block{first, first});
  std::vector<Index> begins(static_cast<std::size_t>(s));
  std::vector<Index> ends(static_cast<std::size_t>(s));
  double largest = 0;
  for (Index i = first; i < last; ++i) {
    for (Index t = 0; t < s; ++t) {
      Block& block = blocks[static_cast<std::size_t>(t)];
      if (i >= block.end) block = grid_block(grids[static_cast<std::size_t>(t)], i, first, last);
      begins[static_cast<std::size_t>(t)] = block.begin;
      ends[static_cast<std::size_t>(t)] = block.end;
    }
    std::sort(begins.begin(), begins.end());
    std::sort(ends.begin(), ends.end());
    const auto error = [&](Index j, Index count) {
      const double distance = static_cast<double>(i > j ? i - j : j - i);
      return std::abs(static_cast<double>(count) * inverse_s - std::exp(-slope * distance));
    };
    // Left: j in [begins[k-1], begins[k] - 1] has count k (begins[s] taken as i + 1).
    for (Index k = 1; k <= s; ++k) {
      const Index low = begins[static_cast<std::size_t>(k - 1)];
      const Index high = (k < s ? begins[static_cast<std::size_t>(k)] : i + 1) - 1;
      if (low > high) continue;
      largest = std::max({largest, error(low, k), error(high, k)});
    }
    // Right: j in [ends[k-1], ends[k] - 1] has count s - k (ends[-1] taken as i).
    for (Index k = 0; k < s; ++k) {
      const Index low = k > 0 ? ends[static_cast<std::size_t>(k - 1)] : i;
      const Index high = ends[static_cast<std::size_t>(k)] - 1;
      if (low > high) continue;
      largest = std::max({largest, error(low, s - k), error(high, s - k)});
    }
    // Outside the union [begins[0], ends[s-1]): count 0, largest next to the union.
    if (begins.front() > first) largest = std::max(largest, error(begins.front() - 1, 0));
    if (ends.back() < last) largest = std::max(largest, error(ends.back(), 0));
  }
  return largest;
}

#ifdef PLSH_HAS_SPECTRA

/// Settings of the Lanczos solvers behind the spectral norms.
///
/// `tolerance` is the relative accuracy of the norm. For a symmetric E (symmetric_spectral_norm,
/// mask_spectral_error) the solver stops when the Ritz pair \f$(\theta, v)\f$ of largest
/// \f$|\theta|\f$ has the residual \f$\|Ev - \theta v\| \le \mathrm{tolerance}\,|\theta|\f$, so
/// an eigenvalue of E lies within tolerance \f$|\theta|\f$ of \f$\theta\f$. For any other E
/// (largest_singular_value) the norm is the square root of the largest eigenvalue \f$\theta\f$ of
/// \f$E^\top E\f$ or \f$EE^\top\f$, and Spectra's SymEigsSolver stops at the residual
/// \f$2\,\mathrm{tolerance}\,\theta\f$ of that square (tol = 2 tolerance), which puts a singular
/// value within \f$\mathrm{tolerance}\sqrt\theta\f$ of \f$\sqrt\theta\f$ (to first order). As for
/// any Krylov method, that it is the largest one is what the Krylov space saw.
struct LanczosOptions {
  /// Symmetric E: Lanczos steps between two convergence tests (three vectors of n entries
  /// whatever it is). Otherwise: Spectra's basis (ncv), at most n; memory n x basis.
  Index basis_size = 20;
  /// Symmetric E: at most basis_size x max_restarts Lanczos steps. Otherwise: Spectra's maxit.
  Index max_restarts = 1000;
  double tolerance = 1e-10;  ///< relative accuracy of the norm (see above).
  Index dense_below = 32;    ///< an operator with fewer rows is formed and solved densely.
};

/// A spectral norm and how the solver reached it (a status, not an exception, as in Spectra).
/// `value` is the norm only when `converged` is true.
struct SpectralNorm {
  /// The norm when converged; otherwise the square root of the largest Ritz value of the square
  /// after the last restart, a lower bound of the norm (a Rayleigh quotient); NaN when `finite`
  /// is false.
  double value = 0;
  bool converged = false;  ///< whether the Lanczos solver met its tolerance.
  Index products = 0;      ///< operator products used (\f$Ex\f$ and \f$E^\top u\f$ alike).
  /// False when an operator product had a NaN or an infinite entry (a non-finite input, or
  /// overflow): the solver stopped there, `value` is NaN and `converged` false.
  bool finite = true;
};

namespace detail {

/// Spectra's SymEigsSolver, with the largest Ritz value readable when the solver stops before
/// convergence (Spectra reports converged eigenvalues only). After compute() with
/// SortRule::LargestAlge the Ritz values are sorted largest first.
template <class SymmetricOperator>
class RitzSolver : public Spectra::SymEigsSolver<SymmetricOperator> {
 public:
  using Spectra::SymEigsSolver<SymmetricOperator>::SymEigsSolver;
  double largest_ritz_value() const { return this->m_ritz_val[0]; }
};

inline void require_lanczos(const LanczosOptions& options, const char* function) {
  require(options.basis_size >= 2, function, "options.basis_size must be at least 2");
  require(options.max_restarts >= 1, function, "options.max_restarts must be at least 1");
  require(options.tolerance > 0, function, "options.tolerance must be positive");
}

/// The largest buffer of a spectral norm of an operator of n >= 0 rows (the smaller side of a
/// non-symmetric one) must fit (doubles_fit): the dense n x n matrix below `options.dense_below`
/// rows (and below 3); otherwise, unless `symmetric` (three vectors of n doubles), Spectra's
/// Lanczos basis of n x min(basis_size, n) doubles.
inline void require_lanczos_size(Index n, const LanczosOptions& options, const char* function,
                                 bool symmetric = false) {
  if (n < std::max<Index>(options.dense_below, 3)) {
    require(doubles_fit(n, n), function,
            "an operator of fewer than options.dense_below rows is formed densely, and this n x n "
            "matrix of doubles cannot be sized: lower options.dense_below");
  } else if (!symmetric) {
    require(doubles_fit(n, std::min(options.basis_size, n)), function,
            "the Lanczos basis, n x options.basis_size doubles, cannot be sized: lower "
            "options.basis_size");
  }
}

/// Thrown by CheckedProducts on a product with a non-finite entry, to stop the solver at once;
/// caught by spectral_norm_or_nan, never seen by a caller.
struct NonFiniteProduct {};

/// A symmetric operator (Spectra's interface) whose products are counted and checked: a product
/// with a NaN or an infinite entry throws NonFiniteProduct. Spectra would go on with it and throw
/// a std::runtime_error from its tridiagonal eigensolver.
template <class SymmetricOperator>
class CheckedProducts {
 public:
  using Scalar = double;
  explicit CheckedProducts(SymmetricOperator op) : op_(std::move(op)) {}
  Index rows() const { return op_.rows(); }
  Index cols() const { return op_.cols(); }
  Index products() const { return products_; }
  void perform_op(const double* x_in, double* y_out) const {
    op_.perform_op(x_in, y_out);
    ++products_;
    if (!Eigen::Map<const Eigen::VectorXd>(y_out, rows()).allFinite()) throw NonFiniteProduct{};
  }

 private:
  SymmetricOperator op_;
  mutable Index products_ = 0;
};

/// The extreme eigenvalues of a symmetric tridiagonal matrix T (diagonal `alpha`, off-diagonal
/// `beta`, `beta.size() + 1 == alpha.size()`) and the last entries of their unit eigenvectors:
/// bisection on Sturm counts, then inverse iteration with a pivoted LU (LAPACK's dgttrf). O(j)
/// per eigenvalue for j rows, so that a Lanczos run can test convergence often.
class TridiagonalExtremes {
 public:
  struct Pair {
    double value = 0;  ///< the eigenvalue
    double last = 0;   ///< the last entry of its unit eigenvector
  };

  TridiagonalExtremes(const std::vector<double>& alpha, const std::vector<double>& beta)
      : alpha_(alpha), beta_(beta) {
    // Scaled to a largest row sum of 1, so that beta^2 neither overflows nor underflows.
    double scale = 0;
    const std::size_t j = alpha_.size();
    for (std::size_t i = 0; i < j; ++i) {
      const double row = std::abs(alpha_[i]) + (i > 0 ? std::abs(beta_[i - 1]) : 0) +
                         (i + 1 < j ? std::abs(beta_[i]) : 0);
      scale = std::max(scale, row);
    }
    scale_ = scale > 0 ? scale : 1;
    for (double& a : alpha_) a /= scale_;
    for (double& b : beta_) b /= scale_;
  }

  Pair largest() const { return pair(extreme(true)); }
  Pair smallest() const { return pair(extreme(false)); }

 private:
  static constexpr double kEpsilon = std::numeric_limits<double>::epsilon();

  /// The number of eigenvalues below x (Sylvester's law of inertia on the LDL^T of T - x I).
  std::size_t eigenvalues_below(double x) const {
    std::size_t count = 0;
    double pivot = 1;
    for (std::size_t i = 0; i < alpha_.size(); ++i) {
      pivot = alpha_[i] - x - (i > 0 ? beta_[i - 1] * beta_[i - 1] / pivot : 0);
      if (pivot == 0) pivot = -kEpsilon * kEpsilon;
      if (pivot < 0) ++count;
    }
    return count;
  }

  /// The largest (`top`) or smallest eigenvalue of the scaled T, by bisection inside [-1, 1]
  /// (Gershgorin) to the last bits.
  double extreme(bool top) const {
    const std::size_t j = alpha_.size();
    if (j == 1) return alpha_[0];
    double low = -1 - 2 * kEpsilon, high = 1 + 2 * kEpsilon;
    for (int iteration = 0; iteration < 128; ++iteration) {
      const double middle = 0.5 * (low + high);
      if (middle <= low || middle >= high) break;
      const std::size_t below = eigenvalues_below(middle);
      if (top ? below == j : below >= 1) {
        high = middle;
      } else {
        low = middle;
      }
    }
    return 0.5 * (low + high);
  }

  /// The eigenvalue `value` of the scaled T with the last entry of its unit eigenvector, from
  /// three steps of inverse iteration.
  Pair pair(double value) const {
    const std::size_t j = alpha_.size();
    Pair result{value * scale_, 1};
    if (j == 1) return result;
    // LU of T - value I with partial pivoting: L has `lower` below its unit diagonal, U has the
    // diagonal `diagonal` and two superdiagonals `upper`, `upper2`.
    std::vector<double> diagonal(j), lower(beta_), upper(beta_), upper2(j, 0.0);
    std::vector<char> swapped(j, 0);
    for (std::size_t i = 0; i < j; ++i) diagonal[i] = alpha_[i] - value;
    const double tiny = kEpsilon * kEpsilon;
    for (std::size_t i = 0; i + 1 < j; ++i) {
      if (std::abs(diagonal[i]) >= std::abs(lower[i])) {
        if (diagonal[i] == 0) diagonal[i] = tiny;
        const double factor = lower[i] / diagonal[i];
        lower[i] = factor;
        diagonal[i + 1] -= factor * upper[i];
      } else {
        const double factor = diagonal[i] / lower[i];
        diagonal[i] = lower[i];
        lower[i] = factor;
        const double kept = upper[i];
        upper[i] = diagonal[i + 1];
        diagonal[i + 1] = kept - factor * diagonal[i + 1];
        if (i + 2 < j) {
          upper2[i] = upper[i + 1];
          upper[i + 1] = -factor * upper[i + 1];
        }
        swapped[i] = 1;
      }
    }
    if (diagonal[j - 1] == 0) diagonal[j - 1] = tiny;
    std::vector<double> x(j, 1.0);
    for (int iteration = 0; iteration < 3; ++iteration) {
      for (std::size_t i = 0; i + 1 < j; ++i) {
        if (swapped[i]) {
          const double kept = x[i];
          x[i] = x[i + 1];
          x[i + 1] = kept - lower[i] * x[i];
        } else {
          x[i + 1] -= lower[i] * x[i];
        }
      }
      for (std::size_t i = j; i-- > 0;) {
        double sum = x[i];
        if (i + 1 < j) sum -= upper[i] * x[i + 1];
        if (i + 2 < j) sum -= upper2[i] * x[i + 2];
        x[i] = sum / diagonal[i];
      }
      double largest = 0;
      for (const double entry : x) largest = std::max(largest, std::abs(entry));
      if (!(largest > 0) || !std::isfinite(largest)) break;
      double norm = 0;
      for (double& entry : x) {
        entry /= largest;
        norm += entry * entry;
      }
      norm = std::sqrt(norm);
      for (double& entry : x) entry /= norm;
    }
    result.last = x[j - 1];
    return result;
  }

  std::vector<double> alpha_, beta_;
  double scale_ = 1;
};

/// The Ritz values at the ends of a Lanczos run and their residual norms.
struct LanczosEnds {
  double largest = 0, smallest = 0;                    ///< extreme Ritz values
  double largest_residual = 0, smallest_residual = 0;  ///< \f$\|Ey - \theta y\|\f$ of each
};

/// Lanczos without reorthogonalisation (three vectors of n entries) on a symmetric operator,
/// from the unit vector `start`, for at most `options.basis_size * options.max_restarts` steps,
/// the ends of \f$T_j\f$ tested every `options.basis_size` steps by `done(ends)`. The residual of
/// a Ritz pair \f$(\theta, Vu)\f$ of \f$T_j\f$ is \f$\beta_j |u_j|\f$ (Paige: it stays a bound, to
/// rounding, when the Lanczos vectors lose orthogonality, which only repeats converged Ritz
/// values). Returns the last ends tested and whether `done` accepted them.
template <class SymmetricOperator, class Done>
std::pair<LanczosEnds, bool> lanczos_ends(const SymmetricOperator& op, Eigen::VectorXd start,
                                          const LanczosOptions& options, Done&& done) {
  const Index n = op.rows();
  Eigen::VectorXd previous = Eigen::VectorXd::Zero(n), current = std::move(start), next(n);
  std::vector<double> alpha, beta;
  const Index most = options.max_restarts > std::numeric_limits<Index>::max() / options.basis_size
                         ? std::numeric_limits<Index>::max()
                         : options.basis_size * options.max_restarts;
  LanczosEnds ends;
  double previous_beta = 0, size = 0;
  for (Index step = 1; step <= most; ++step) {
    op.perform_op(current.data(), next.data());
    double a = next.dot(current);
    next -= a * current + previous_beta * previous;
    const double correction = next.dot(current);  // one local reorthogonalisation
    next -= correction * current;
    a += correction;
    const double b = next.norm();
    alpha.push_back(a);
    // An invariant subspace (b at rounding level of the largest row of T_j so far): T_j holds
    // exact eigenvalues of the operator.
    size = std::max(size, std::abs(a) + previous_beta + b);
    const bool invariant = !(b > 8 * std::numeric_limits<double>::epsilon() * size);
    if (step % options.basis_size == 0 || step == most || invariant) {
      const TridiagonalExtremes extremes(alpha, beta);
      const TridiagonalExtremes::Pair top = extremes.largest(), bottom = extremes.smallest();
      const double residual = invariant ? 0 : b;
      ends = LanczosEnds{top.value, bottom.value, residual * std::abs(top.last),
                         residual * std::abs(bottom.last)};
      if (invariant || done(ends)) return {ends, true};
    }
    beta.push_back(b);
    previous.swap(current);
    current = next / b;
    previous_beta = b;
  }
  return {ends, false};
}

/// The start vector of every Lanczos run: entries uniform in (-1/2, 1/2) from plsh's own
/// generator, normalised.
inline Eigen::VectorXd lanczos_start(Index n) {
  Eigen::VectorXd start(n);
  for (Index i = 0; i < n; ++i) start[i] = open_unit(mix64(static_cast<std::uint64_t>(i))) - 0.5;
  start.normalize();
  return start;
}

/// The largest \f$|\lambda|\f$ of a symmetric operator E of n >= 3 rows by lanczos_ends on E
/// itself, one product per step, both ends of the spectrum in one Krylov space. Converged when
/// the Ritz value \f$\theta\f$ of larger magnitude has a residual at most tolerance
/// \f$|\theta|\f$ (an eigenvalue lies within tolerance \f$|\theta|\f$ of it), and the other
/// end either as well or with \f$|\theta'| + \|r'\| \le |\theta|\f$. `products` is left 0.
template <class SymmetricOperator>
SpectralNorm largest_magnitude_by_lanczos(const SymmetricOperator& op,
                                          const LanczosOptions& options) {
  const double tolerance = options.tolerance;
  const auto [ends, converged] =
      lanczos_ends(op, lanczos_start(op.rows()), options, [&](const LanczosEnds& ends) {
        const bool top = std::abs(ends.largest) >= std::abs(ends.smallest);
        const double value = std::abs(top ? ends.largest : ends.smallest);
        const double residual = top ? ends.largest_residual : ends.smallest_residual;
        const double other = std::abs(top ? ends.smallest : ends.largest);
        const double other_residual = top ? ends.smallest_residual : ends.largest_residual;
        return residual <= tolerance * value &&
               (other_residual <= tolerance * value || other + other_residual <= value);
      });
  SpectralNorm result;
  result.value = std::max(std::abs(ends.largest), std::abs(ends.smallest));
  result.converged = converged;
  return result;
}

/// `op` divided by a positive number, with Spectra's interface.
template <class SymmetricOperator>
class ScaledOperator {
 public:
  using Scalar = double;
  ScaledOperator(const SymmetricOperator& op, double divisor) : op_(&op), divisor_(divisor) {}
  Index rows() const { return op_->rows(); }
  Index cols() const { return op_->cols(); }
  void perform_op(const double* x_in, double* y_out) const {
    op_->perform_op(x_in, y_out);
    Eigen::Map<Eigen::VectorXd>(y_out, rows()) /= divisor_;
  }

 private:
  const SymmetricOperator* op_;
  double divisor_;
};

/// \f$\sqrt{\theta}\f$ for the largest eigenvalue \f$\theta\f$ of a symmetric positive
/// semidefinite operator G of n >= 3 rows (Spectra's interface): Lanczos for one eigenvalue,
/// SortRule::LargestAlge, Spectra's tolerance 2 options.tolerance (LanczosOptions), from a start
/// vector u of plsh's own generator. Spectra's thresholds are absolute (a Lanczos vector below
/// \f$\epsilon\sqrt n\f$ counts as zero), so G is divided by \f$\|Gu\| \le \theta\f$ first: the
/// square of an operator of rounding-sized entries would otherwise be lost below them. When
/// \f$Gu = 0\f$, \f$(0, u)\f$ is a Ritz pair of residual 0 and the result is 0, converged.
/// `products` is left 0 for the caller.
template <class SemidefiniteOperator>
SpectralNorm square_root_of_largest_eigenvalue(SemidefiniteOperator& op,
                                               const LanczosOptions& options) {
  const Index n = op.rows();
  const Eigen::VectorXd start = lanczos_start(n);
  Eigen::VectorXd image(n);
  op.perform_op(start.data(), image.data());
  const double divisor = image.norm();
  if (divisor == 0) return SpectralNorm{0, true, 0, true};
  ScaledOperator<SemidefiniteOperator> scaled(op, divisor);
  RitzSolver<ScaledOperator<SemidefiniteOperator>> solver(scaled, 1,
                                                          std::min(options.basis_size, n));
  solver.init(start.data());
  solver.compute(Spectra::SortRule::LargestAlge, options.max_restarts, 2 * options.tolerance);
  SpectralNorm result;
  result.converged = solver.info() == Spectra::CompInfo::Successful;
  const double largest = result.converged ? solver.eigenvalues()[0] : solver.largest_ritz_value();
  result.value = std::sqrt(std::max(largest, 0.0) * divisor);  // max: a rounding below 0
  return result;
}

/// The spectral norm of `op` (rows() >= 1, options checked): with `symmetric`, op is E and the
/// norm is its largest \f$|\lambda|\f$; otherwise op is a Gram operator \f$E^\top E\f$ and the
/// norm the square root of its largest eigenvalue. Dense below `options.dense_below` rows (the
/// operator applied to the unit vectors); otherwise Lanczos on E (largest_magnitude_by_lanczos) or
/// Spectra's on the Gram operator (square_root_of_largest_eigenvalue).
/// `products` counts the products of `op`. Throws NonFiniteProduct from `op`.
template <class SymmetricOperator>
SpectralNorm spectral_norm_of_checked(CheckedProducts<SymmetricOperator>& op, bool symmetric,
                                      const LanczosOptions& options) {
  const Index n = op.rows();
  SpectralNorm result;
  if (n < std::max<Index>(options.dense_below, 3)) {
    Eigen::MatrixXd dense(n, n);
    Eigen::VectorXd unit = Eigen::VectorXd::Zero(n);
    for (Index j = 0; j < n; ++j) {
      unit[j] = 1;
      op.perform_op(unit.data(), dense.col(j).data());
      unit[j] = 0;
    }
    const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(dense, Eigen::EigenvaluesOnly);
    result.value = symmetric ? solver.eigenvalues().cwiseAbs().maxCoeff()
                             : std::sqrt(std::max(solver.eigenvalues().maxCoeff(), 0.0));
    result.converged = true;
  } else if (symmetric) {
    result = largest_magnitude_by_lanczos(op, options);
  } else {
    result = square_root_of_largest_eigenvalue(op, options);
  }
  result.products = op.products();
  return result;
}

/// spectral_norm_of_checked over the products of `op`, checked; a non-finite product gives
/// `{NaN, converged = false, products, finite = false}`.
template <class SymmetricOperator>
SpectralNorm spectral_norm_or_nan(SymmetricOperator op, bool symmetric,
                                  const LanczosOptions& options) {
  CheckedProducts<SymmetricOperator> checked(std::move(op));
  try {
    return spectral_norm_of_checked(checked, symmetric, options);
  } catch (const NonFiniteProduct&) {
    return SpectralNorm{std::numeric_limits<double>::quiet_NaN(), false, checked.products(), false};
  }
}

}  // namespace detail

/// The largest \f$|\lambda|\f$ of a symmetric operator E with Spectra's interface (`Scalar` =
/// double, `rows()`, `perform_op(const double*, double*) const`): the larger magnitude of the two
/// extreme eigenvalues, by unrestarted Lanczos on E without reorthogonalisation
/// (detail::largest_magnitude_by_lanczos), one product of E per step, convergence tested every
/// `options.basis_size` steps; `tolerance` is the relative accuracy of the norm (LanczosOptions).
/// Memory: three vectors of n entries and \f$T_j\f$. Below `options.dense_below` rows (and below
/// 3) the operator is applied to the unit vectors and the dense matrix solved exactly. When not
/// converged, the value is the largest \f$|\theta|\f$ of the Ritz values, a lower bound of the
/// norm.
///
/// Every product is checked (O(n) each): the first with a NaN or an infinite entry stops the
/// solver, and the result is `{NaN, converged = false, products, finite = false}`.
/// \throws std::invalid_argument for invalid options, an operator with no rows or not square, or
/// a dense matrix that cannot be sized (detail::require_lanczos_size).
template <class SymmetricOperator>
SpectralNorm symmetric_spectral_norm(SymmetricOperator op, const LanczosOptions& options = {}) {
  const char* function = "symmetric_spectral_norm";
  detail::require_lanczos(options, function);
  const Index n = op.rows();
  detail::require(n >= 1 && op.cols() == n, function, "the operator must be square and non-empty");
  detail::require_lanczos_size(n, options, function, true);
  return detail::spectral_norm_or_nan(std::move(op), true, options);
}

namespace detail {

/// \f$E^\top E\f$ (`normal`) or \f$EE^\top\f$ of an operator with `rows()`, `cols()`,
/// `product` and `transpose_product`, as a Spectra symmetric operator.
template <class Operator>
class GramOperator {
 public:
  using Scalar = double;
  GramOperator(const Operator& op, bool normal)
      : op_(&op), normal_(normal), middle_(normal ? op.rows() : op.cols()) {}
  Index rows() const { return normal_ ? op_->cols() : op_->rows(); }
  Index cols() const { return rows(); }
  void perform_op(const double* x_in, double* y_out) const {
    if (normal_) {
      op_->product(x_in, middle_.data());
      op_->transpose_product(middle_.data(), y_out);
    } else {
      op_->transpose_product(x_in, middle_.data());
      op_->product(middle_.data(), y_out);
    }
  }

 private:
  const Operator* op_;
  bool normal_;
  mutable Eigen::VectorXd middle_;
};

}  // namespace detail

/// The largest singular value \f$\|E\|_2\f$ of an operator with `rows()`, `cols()`,
/// `product(x, y)` (\f$y = Ex\f$) and `transpose_product(u, y)` (\f$y = E^\top u\f$): the square
/// root of the largest eigenvalue of \f$E^\top E\f$ (when cols() <= rows()) or \f$EE^\top\f$, by
/// Lanczos (SortRule::LargestAlge, one eigenvalue); `tolerance` is the relative accuracy of the
/// norm (LanczosOptions). `products` counts operator products, a product and a transpose product
/// per Lanczos step. An operator with no rows or no columns has norm 0. A non-finite product
/// gives `finite = false` and a NaN value, as in symmetric_spectral_norm.
/// \throws std::invalid_argument for invalid options, negative sizes, or a dense matrix or
/// Lanczos basis of min(rows(), cols()) rows that cannot be sized; before anything is allocated.
template <class Operator>
SpectralNorm largest_singular_value(const Operator& op, const LanczosOptions& options = {}) {
  const char* function = "largest_singular_value";
  detail::require_lanczos(options, function);
  detail::require(op.rows() >= 0 && op.cols() >= 0, function,
                  "the operator's sizes must be non-negative");
  detail::require_lanczos_size(std::min(op.rows(), op.cols()), options, function);
  if (op.rows() == 0 || op.cols() == 0) return SpectralNorm{0, true, 0, true};
  SpectralNorm result = detail::spectral_norm_or_nan(
      detail::GramOperator<Operator>(op, op.cols() <= op.rows()), false, options);
  result.products *= 2;  // one Gram product is two operator products
  return result;
}

/// \f$\|\hat K - K\|_2\f$ on positions `[first, first + n)`: symmetric_spectral_norm over
/// MaskErrorOperator (unrestarted Lanczos on E, one product per step), O(n + blocks) per product,
/// O(n + blocks) memory. Equals mask_error(n, slope, grids).spectral for first = 0 to the Lanczos
/// tolerance.
/// \throws std::invalid_argument as MaskErrorOperator, for invalid options, and for a dense
/// matrix that cannot be sized (the message names mask_spectral_error); all before anything is
/// allocated.
/// \tparam Tag unused: the solver is compiled only where mask_spectral_error is called
/// (detail::Deferred).
template <class Tag = void>
SpectralNorm mask_spectral_error(Index n, double slope, const std::vector<Grid>& grids,
                                 Index first = 0, const LanczosOptions& options = {}) {
  const char* function = "mask_spectral_error";
  detail::validate_mask_error_operator(n, slope, grids, first, function);
  detail::require_lanczos(options, function);
  detail::require_lanczos_size(n, options, function, true);
  return symmetric_spectral_norm(detail::Deferred<MaskErrorOperator, Tag>(n, slope, grids, first),
                                 options);
}

#endif  // PLSH_HAS_SPECTRA

}  // namespace plsh

#endif  // PLSH_ERROR_NORMS_HPP
