#ifndef PLSH_ATTENTION_ERROR_HPP
#define PLSH_ATTENTION_ERROR_HPP

/// \file attention_error.hpp
/// How far the attention matrix of Positional LSH is from that of exact ALiBi, for one head:
/// norms of \f$E = A_{\text{plsh}} - A_{\text{alibi}}\f$, with the row-stochastic
/// \f[ (A_{\text{alibi}})_{ij} = \frac{e^{S_{ij} - m|p_i - p_j|}}{\sum_l e^{S_{il} - m|p_i -
/// p_l|}},
///     \qquad (A_{\text{plsh}})_{ij} = \frac{c_{ij} e^{S_{ij}}}{\sum_l c_{il} e^{S_{il}}}, \f]
/// \f$S_{ij} = \text{scale}\; q_i\cdot k_j\f$ over the visible keys (causal: \f$p_j \le p_i\f$),
/// \f$c_{ij}\f$ the number of the s grids in which positions \f$p_i, p_j\f$ share a block (a row
/// without a visible key is zero in both).
///
/// - Dense (O(n_q n_k) memory): alibi_attention_matrix and plsh_attention_matrix build the rows
///   with the softmax of the dense references (reference.hpp); dense_attention_error takes the
///   spectral norm by a singular value decomposition, O(n^3): for tests and small n.
/// - Row by row (O(n_k) memory, O(n_q n_k d) time): attention_entry_error, the exact max and
///   Frobenius norms from the same rows.
/// - Matrix-free spectral norm (Spectra): Lanczos on \f$E^\top E\f$. \f$Ax\f$ is a forward pass
///   with \f$v = x\f$ (one value column), \f$A^\top u\f$ the dv of a backward pass with
///   \f$dO = u\f$: exact_alibi_attention and its backward for \f$A_{\text{alibi}}\f$, the fused
///   Positional LSH kernel and its backward, fed the given grids, for \f$A_{\text{plsh}}\f$.
///   The reference is exact ALiBi at every n: O(n_q n_k d) per product, nothing n x n stored.
///
/// Non-finite inputs give NaN norms, never an exception: a score that a query sees and that is
/// NaN or \f$+\infty\f$ (from a NaN or an infinity in q or k, or an overflowing
/// \f$q_i \cdot k_j\f$) makes the query's row of both matrices NaN, as in the kernels
/// (online_softmax.hpp); a NaN entry of E makes every norm NaN, and attention_error and
/// attention_spectral_error then report `spectral.finite == false`. A non-finite entry of q or k
/// that no visible score uses changes nothing.
///
/// Sizes are checked before anything is allocated (detail::doubles_fit): q and k are copied to
/// double, tokens x dim each; the dense functions hold n_q x n_k doubles; the spectral norms a
/// Lanczos basis of min(n_q, n_k) x basis_size doubles (detail::require_lanczos_size).
///
/// Tested in tests/test_attention_error.cpp: the dense matrices against the reference kernels
/// (reference::alibi_attention, reference::mask_attention) times random values, the kernel
/// products against the dense matrices, the matrix-free norms against the dense ones, NaN inputs,
/// an unconverged solver, sizes that cannot be allocated.

#include <Eigen/Core>
#include <Eigen/Eigenvalues>
#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/reference.hpp"
#include "detail/check.hpp"
#include "detail/deferred.hpp"
#include "detail/validate.hpp"
#include "error_norms.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

namespace plsh {

/// Norms of \f$E = A_{\text{plsh}} - A_{\text{alibi}}\f$ for one head, exact (dense or row by
/// row). NaN when E has a NaN entry.
struct AttentionError {
  double spectral = 0;   ///< \f$\|E\|_2\f$, the largest singular value.
  double max = 0;        ///< \f$\max_{ij}|E_{ij}|\f$.
  double frobenius = 0;  ///< \f$\|E\|_F\f$.
};

namespace detail {

/// One head of queries and keys: `q.heads == k.heads == 1`, matching dims, valid options, and
/// copies of q and k to double (tokens x dim each) that can be sized.
template <class Scalar>
void validate_head_pair(const char* function, const HeadsView<const Scalar>& q,
                        const HeadsView<const Scalar>& k, const AttentionOptions& options) {
  require_view(q, function, "q");
  require_view(k, function, "k");
  require(q.heads == 1 && k.heads == 1, function, "q and k must hold one head each");
  require(k.dim == q.dim, function, "k.dim must equal q.dim");
  validate_options<Scalar>(function, options, q.tokens, k.tokens, q.dim);
  require(doubles_fit(q.tokens, q.dim) && doubles_fit(k.tokens, k.dim), function,
          "q and k are copied to double, and a copy of tokens x dim doubles cannot be sized");
}

/// The dense n_q x n_k matrices of one head can be sized.
template <class Scalar>
void require_dense_head_pair(const char* function, const HeadsView<const Scalar>& q,
                             const HeadsView<const Scalar>& k) {
  require(doubles_fit(q.tokens, k.tokens), function,
          "a dense q.tokens x k.tokens matrix of doubles cannot be sized");
}

/// \f$\max(a, b)\f$ that is NaN when either is (std::max drops a NaN second argument).
inline double max_or_nan(double a, double b) {
  return std::isnan(a) || std::isnan(b) ? std::numeric_limits<double>::quiet_NaN() : std::max(a, b);
}

/// \f$\log(c_{ij}/s)\f$ as a function `(h, p_i, p_j)` of the reference softmax, for keys at
/// positions `[key_first, key_first + keys)`: the counts of row \f$p_i\f$ are made once, from the
/// block of \f$p_i\f$ in each grid (a difference array over the keys, O(s + keys)), and reused for
/// the row's keys. reference::mean_mask_log_factor gives the same values in O(s) per entry.
class RowCountLogFactor {
 public:
  RowCountLogFactor(const std::vector<Grid>& grids, Index key_first, Index keys)
      : grids_(grids), key_first_(key_first), log_factor_(static_cast<std::size_t>(keys) + 1) {}

  double operator()(Index, Index query_position, Index key_position) {
    if (query_position != row_) fill_row(query_position);
    return log_factor_[static_cast<std::size_t>(key_position - key_first_)];
  }

 private:
  void fill_row(Index query_position) {
    row_ = query_position;
    const Index keys = static_cast<Index>(log_factor_.size()) - 1;
    std::vector<Index> difference(log_factor_.size(), 0);
    const Index first = std::min(query_position, key_first_);
    const Index last = std::max(query_position + 1, key_first_ + keys);
    for (const Grid& grid : grids_) {
      const Block block = grid_block(grid, query_position, first, last);
      const Index begin = std::max(block.begin, key_first_) - key_first_;
      const Index end = std::min(block.end, key_first_ + keys) - key_first_;
      if (begin >= end) continue;
      difference[static_cast<std::size_t>(begin)] += 1;
      difference[static_cast<std::size_t>(end)] -= 1;
    }
    const double s = static_cast<double>(grids_.size());
    Index count = 0;
    for (Index j = 0; j < keys; ++j) {
      count += difference[static_cast<std::size_t>(j)];
      log_factor_[static_cast<std::size_t>(j)] =
          count > 0 ? std::log(static_cast<double>(count) / s) : detail::kMasked;
    }
  }

  const std::vector<Grid>& grids_;
  Index key_first_;
  Index row_ = -1;
  std::vector<double> log_factor_;
};

/// Row i of the attention matrix of `log_factor` (a function `(h, p_i, p_j)` as in
/// reference::factor_attention) as a dense vector of n_k entries, zero where a key is not visible:
/// the softmax of detail::row_probabilities.
template <class LogFactor>
void attention_row(const Eigen::MatrixXd& q_head, const Eigen::MatrixXd& k_head, Index i,
                   double scale, const AttentionOptions& options, LogFactor& log_factor,
                   std::vector<Index>& visible, std::vector<double>& probabilities,
                   Eigen::VectorXd& row) {
  detail::row_probabilities(q_head, k_head, i, 0, scale, options, log_factor, visible,
                            probabilities);
  row.setZero(k_head.rows());
  for (std::size_t n = 0; n < visible.size(); ++n) row[visible[n]] = probabilities[n];
}

/// Calls `visit(i, alibi_row, plsh_row)` for every query row i, with the rows of both attention
/// matrices (attention_row). `alibi` or `plsh` false leaves that row empty.
template <class Scalar, class Visit>
void for_each_attention_row(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                            double slope, const std::vector<Grid>& grids,
                            const AttentionOptions& options, bool alibi, bool plsh, Visit&& visit) {
  const Eigen::MatrixXd q_head = q.head(0).template cast<double>();
  const Eigen::MatrixXd k_head = k.head(0).template cast<double>();
  const double scale = resolved_scale(options, q.dim);
  const std::vector<double> slopes{slope};
  auto alibi_log_factor = reference::alibi_row_log_factor(slopes, options, k.tokens);
  RowCountLogFactor plsh_log_factor(grids, options.key_position, k.tokens);
  std::vector<Index> visible;
  std::vector<double> probabilities;
  Eigen::VectorXd alibi_row, plsh_row;
  for (Index i = 0; i < q.tokens; ++i) {
    if (alibi) {
      attention_row(q_head, k_head, i, scale, options, alibi_log_factor, visible, probabilities,
                    alibi_row);
    }
    if (plsh) {
      attention_row(q_head, k_head, i, scale, options, plsh_log_factor, visible, probabilities,
                    plsh_row);
    }
    visit(i, alibi_row, plsh_row);
  }
}

/// validate_head_pair, and a valid slope and grids.
template <class Scalar>
void validate_attention_error(const char* function, const HeadsView<const Scalar>& q,
                              const HeadsView<const Scalar>& k, double slope,
                              const std::vector<Grid>& grids, const AttentionOptions& options) {
  validate_head_pair(function, q, k, options);
  require_slope(slope, function);
  require_grids(grids, function);
}

}  // namespace detail

/// The row-stochastic exact ALiBi attention matrix of one head, \f$n_q \times n_k\f$, from the
/// softmax of reference::alibi_attention. O(n_q n_k d) time.
/// \param q `[n_q][1][d]`, \param k `[n_k][1][d]`, \param slope \f$m \ge 0\f$.
/// \throws std::invalid_argument for views of more than one head, dims that differ, a bad slope
/// or options, or an n_q x n_k matrix that cannot be sized; before anything is allocated.
template <class Scalar>
Eigen::MatrixXd alibi_attention_matrix(HeadsView<const detail::NonDeduced<Scalar>> q,
                                       HeadsView<const detail::NonDeduced<Scalar>> k, double slope,
                                       const AttentionOptions& options = {}) {
  const char* function = "alibi_attention_matrix";
  detail::validate_head_pair(function, q, k, options);
  detail::require_slope(slope, function);
  detail::require_dense_head_pair(function, q, k);
  Eigen::MatrixXd matrix(q.tokens, k.tokens);
  detail::for_each_attention_row(
      q, k, slope, {}, options, true, false,
      [&](Index i, const Eigen::VectorXd& alibi, const Eigen::VectorXd&) {
        matrix.row(i) = alibi.transpose();
      });
  return matrix;
}

/// The row-stochastic Positional LSH attention matrix of one head with the given grids,
/// \f$(c_{ij} e^{S_{ij}}) / \sum_l c_{il} e^{S_{il}}\f$, as reference::mask_attention computes it.
/// O(n_q (n_k d + s)) time. For the draws of head h of plsh_attention, pass
/// `draw_head_grids(slopes, samples, seed)[h]`.
/// \throws std::invalid_argument as alibi_attention_matrix, and for empty or invalid grids.
template <class Scalar>
Eigen::MatrixXd plsh_attention_matrix(HeadsView<const detail::NonDeduced<Scalar>> q,
                                      HeadsView<const detail::NonDeduced<Scalar>> k,
                                      const std::vector<Grid>& grids,
                                      const AttentionOptions& options = {}) {
  const char* function = "plsh_attention_matrix";
  detail::validate_head_pair(function, q, k, options);
  detail::require_grids(grids, function);
  detail::require_dense_head_pair(function, q, k);
  Eigen::MatrixXd matrix(q.tokens, k.tokens);
  detail::for_each_attention_row(q, k, 0.0, grids, options, false, true,
                                 [&](Index i, const Eigen::VectorXd&, const Eigen::VectorXd& plsh) {
                                   matrix.row(i) = plsh.transpose();
                                 });
  return matrix;
}

/// All three norms of \f$A_{\text{plsh}} - A_{\text{alibi}}\f$ from the dense matrices, the
/// spectral norm as \f$\sqrt{\lambda_{\max}(G)}\f$ of the smaller Gram matrix G (\f$E^T E\f$ or
/// \f$E E^T\f$, by Eigen::SelfAdjointEigenSolver): O(n_q n_k) memory and \f$O(n^3)\f$ time, the
/// reference of the matrix-free norms. All three are NaN when E has a NaN entry (no decomposition
/// is attempted).
/// \throws std::invalid_argument as plsh_attention_matrix, and for a bad slope.
template <class Scalar>
AttentionError dense_attention_error(HeadsView<const detail::NonDeduced<Scalar>> q,
                                     HeadsView<const detail::NonDeduced<Scalar>> k, double slope,
                                     const std::vector<Grid>& grids,
                                     const AttentionOptions& options = {}) {
  const char* function = "dense_attention_error";
  detail::validate_attention_error(function, q, k, slope, grids, options);
  detail::require_dense_head_pair(function, q, k);
  Eigen::MatrixXd error(q.tokens, k.tokens);
  detail::for_each_attention_row(
      q, k, slope, grids, options, true, true,
      [&](Index i, const Eigen::VectorXd& alibi, const Eigen::VectorXd& plsh) {
        error.row(i) = (plsh - alibi).transpose();
      });
  AttentionError result;
  if (error.size() == 0) return result;
  if (error.hasNaN()) {
    const double nan = std::numeric_limits<double>::quiet_NaN();
    return AttentionError{nan, nan, nan};
  }
  const Eigen::MatrixXd gram = error.rows() < error.cols()
                                   ? Eigen::MatrixXd(error * error.transpose())
                                   : Eigen::MatrixXd(error.transpose() * error);
  const Eigen::SelfAdjointEigenSolver<Eigen::MatrixXd> solver(gram, Eigen::EigenvaluesOnly);
  result.spectral = std::sqrt(std::max(solver.eigenvalues().maxCoeff(), 0.0));
  result.max = error.cwiseAbs().maxCoeff();
  result.frobenius = error.norm();
  return result;
}

/// The max and Frobenius norms of \f$A_{\text{plsh}} - A_{\text{alibi}}\f$ exactly, row by row:
/// O(n_k) memory, O(n_q (n_k d + s)) time; both NaN when E has a NaN entry. `spectral` is left 0
/// (see attention_error).
/// \throws std::invalid_argument as dense_attention_error, without its n_q x n_k bound (the
/// message names attention_entry_error); before anything is allocated.
template <class Scalar>
AttentionError attention_entry_error(HeadsView<const detail::NonDeduced<Scalar>> q,
                                     HeadsView<const detail::NonDeduced<Scalar>> k, double slope,
                                     const std::vector<Grid>& grids,
                                     const AttentionOptions& options = {}) {
  const char* function = "attention_entry_error";
  detail::validate_attention_error(function, q, k, slope, grids, options);
  AttentionError result;
  double squares = 0;
  detail::for_each_attention_row(
      q, k, slope, grids, options, true, true,
      [&](Index, const Eigen::VectorXd& alibi, const Eigen::VectorXd& plsh) {
        if (plsh.size() == 0) return;  // no keys
        result.max = detail::max_or_nan(
            result.max, (plsh - alibi).cwiseAbs().template maxCoeff<Eigen::PropagateNaN>());
        squares += (plsh - alibi).squaredNorm();
      });
  result.frobenius = std::sqrt(squares);
  return result;
}

/// \f$E = A_{\text{plsh}} - A_{\text{alibi}}\f$ of one head as products through the attention
/// kernels, without forming E: `product` is \f$y = Ex\f$ (x of n_k entries, y of n_q), two forward
/// passes with one value column; `transpose_product` is \f$y = E^\top u\f$, the dv of two backward
/// passes with \f$dO = u\f$ (and v = 0, whose forward output is 0). q and k are copied to double.
/// Each product costs a forward (or backward) of exact ALiBi, O(n_q n_k d), and of the fused
/// Positional LSH kernel with `grids`.
class AttentionErrorOperator {
 public:
  /// \throws std::invalid_argument as attention_entry_error (the message names
  /// AttentionErrorOperator); before anything is allocated.
  /// \param q `[n_q][1][d]`, \param k `[n_k][1][d]` (float or double, const or not).
  template <class View>
  AttentionErrorOperator(HeadsView<View> q, HeadsView<View> k, double slope,
                         std::vector<Grid> grids, const AttentionOptions& options = {})
      : q_(checked_query<std::remove_const_t<View>>(q, k, slope, grids, options)),
        k_(HeadsView<const std::remove_const_t<View>>(k).head(0).template cast<double>()),
        slopes_{slope},
        grids_{std::move(grids)},
        options_(options),
        zeros_(Eigen::VectorXd::Zero(std::max(q.tokens, k.tokens))),
        kernel_result_(std::max(q.tokens, k.tokens)),
        dq_(q.tokens, q.dim),
        dk_(k.tokens, k.dim) {}

  Index rows() const { return q_.rows(); }
  Index cols() const { return k_.rows(); }

  /// \f$y = Ex\f$: `x` holds cols() entries, `y` rows(). (`Tag` unused: the kernels are compiled
  /// only where the products are called, detail::Deferred.)
  template <class Tag = void>
  void product(const double* x, double* y) const {
    using Real = detail::Deferred<double, Tag>;
    const HeadsView<const double> v{x, cols(), 1, 1};
    detail::fused_attention<Real>(query(), key(), v, HeadsView<double>{y, rows(), 1, 1}, grids_,
                                  slopes_, options_);
    exact_alibi_attention<Real>(query(), key(), v,
                                HeadsView<double>{kernel_result_.data(), rows(), 1, 1}, slopes_,
                                options_);
    Eigen::Map<Eigen::VectorXd>(y, rows()) -= kernel_result_.head(rows());
  }

  /// \f$y = E^\top u\f$: `u` holds rows() entries, `y` cols().
  template <class Tag = void>
  void transpose_product(const double* u, double* y) const {
    using Real = detail::Deferred<double, Tag>;
    const HeadsView<const double> dout{u, rows(), 1, 1};
    const HeadsView<const double> v{zeros_.data(), cols(), 1, 1};
    const HeadsView<const double> out{zeros_.data(), rows(), 1, 1};
    const HeadsView<double> dq{dq_.data(), rows(), 1, q_.cols()};
    const HeadsView<double> dk{dk_.data(), cols(), 1, k_.cols()};
    detail::block_counts_backward<Real>(
        detail::batch_of_one(query()), detail::batch_of_one(key()), detail::batch_of_one(v),
        detail::batch_of_one(out), detail::batch_of_one(dout), detail::batch_of_one(dq),
        detail::batch_of_one(dk), detail::batch_of_one(HeadsView<double>{y, cols(), 1, 1}), slopes_,
        grids_, options_);
    exact_alibi_attention_backward<Real>(query(), key(), v, out, dout, dq, dk,
                                         HeadsView<double>{kernel_result_.data(), cols(), 1, 1},
                                         slopes_, options_);
    Eigen::Map<Eigen::VectorXd>(y, cols()) -= kernel_result_.head(cols());
  }

 private:
  HeadsView<const double> query() const { return {q_.data(), q_.rows(), 1, q_.cols()}; }
  HeadsView<const double> key() const { return {k_.data(), k_.rows(), 1, k_.cols()}; }

  template <class Scalar>
  static RowMatrix<double> checked_query(const HeadsView<const Scalar>& q,
                                         const HeadsView<const Scalar>& k, double slope,
                                         const std::vector<Grid>& grids,
                                         const AttentionOptions& options) {
    detail::validate_attention_error("AttentionErrorOperator", q, k, slope, grids, options);
    return q.head(0).template cast<double>();
  }

  RowMatrix<double> q_, k_;
  std::vector<double> slopes_;
  std::vector<std::vector<Grid>> grids_;
  AttentionOptions options_;
  Eigen::VectorXd zeros_;
  mutable Eigen::VectorXd kernel_result_;
  mutable RowMatrix<double> dq_, dk_;
};

#ifdef PLSH_HAS_SPECTRA

/// Norms of \f$E = A_{\text{plsh}} - A_{\text{alibi}}\f$ from attention_error: the max and
/// Frobenius norms exact, the spectral norm with the status of the Lanczos solver that found it.
struct AttentionErrorNorms {
  /// \f$\|E\|_2\f$: `spectral.value` is the norm only when `spectral.converged`; otherwise a
  /// lower bound (a Rayleigh quotient), or NaN with `spectral.finite == false` when E or a kernel
  /// product has a NaN entry.
  SpectralNorm spectral;
  double max = 0;        ///< \f$\max_{ij}|E_{ij}|\f$, NaN when E has a NaN entry.
  double frobenius = 0;  ///< \f$\|E\|_F\f$, NaN when E has a NaN entry.
};

namespace detail {

/// The checks of the matrix-free spectral norms: validate_attention_error, the Lanczos options,
/// and the solver's buffers for the smaller side of E (require_lanczos_size).
template <class Scalar>
void validate_attention_spectral_error(const char* function, const HeadsView<const Scalar>& q,
                                       const HeadsView<const Scalar>& k, double slope,
                                       const std::vector<Grid>& grids,
                                       const AttentionOptions& options,
                                       const LanczosOptions& lanczos) {
  validate_attention_error(function, q, k, slope, grids, options);
  require_lanczos(lanczos, function);
  require_lanczos_size(std::min(q.tokens, k.tokens), lanczos, function);
}

}  // namespace detail

/// \f$\|A_{\text{plsh}} - A_{\text{alibi}}\|_2\f$ of one head without forming either matrix:
/// largest_singular_value over AttentionErrorOperator (Lanczos on \f$E^\top E\f$ or
/// \f$EE^\top\f$, whichever is smaller). Each Lanczos step costs two forward and two backward
/// passes; exact ALiBi makes them O(n_q n_k d) each. The value is the norm only when `converged`;
/// a kernel product with a NaN or infinite entry stops the solver with `finite == false` and a
/// NaN value.
/// \throws std::invalid_argument as dense_attention_error (without its n_q x n_k bound), for
/// invalid Lanczos options, and for a Lanczos basis or dense matrix that cannot be sized; before
/// anything is allocated.
template <class Scalar>
SpectralNorm attention_spectral_error(HeadsView<const detail::NonDeduced<Scalar>> q,
                                      HeadsView<const detail::NonDeduced<Scalar>> k, double slope,
                                      const std::vector<Grid>& grids,
                                      const AttentionOptions& options = {},
                                      const LanczosOptions& lanczos = {}) {
  detail::validate_attention_spectral_error("attention_spectral_error", q, k, slope, grids, options,
                                            lanczos);
  return largest_singular_value(AttentionErrorOperator(q, k, slope, grids, options), lanczos);
}

/// All three norms without an n x n matrix: attention_entry_error, then attention_spectral_error.
/// Read `spectral.value` as the norm only when `spectral.converged`. When E has a NaN entry (a NaN
/// input that a visible score uses), `max` and `frobenius` are NaN and the solver is not run:
/// `spectral` is `{NaN, converged = false, products = 0, finite = false}`.
/// \throws std::invalid_argument as attention_spectral_error (the message names attention_error).
template <class Scalar>
AttentionErrorNorms attention_error(HeadsView<const detail::NonDeduced<Scalar>> q,
                                    HeadsView<const detail::NonDeduced<Scalar>> k, double slope,
                                    const std::vector<Grid>& grids,
                                    const AttentionOptions& options = {},
                                    const LanczosOptions& lanczos = {}) {
  detail::validate_attention_spectral_error("attention_error", q, k, slope, grids, options,
                                            lanczos);
  const AttentionError entries = attention_entry_error<Scalar>(q, k, slope, grids, options);
  AttentionErrorNorms result;
  result.max = entries.max;
  result.frobenius = entries.frobenius;
  if (std::isnan(entries.max) || std::isnan(entries.frobenius)) {
    result.spectral = SpectralNorm{std::numeric_limits<double>::quiet_NaN(), false, 0, false};
  } else {
    result.spectral = attention_spectral_error<Scalar>(q, k, slope, grids, options, lanczos);
  }
  return result;
}

#endif  // PLSH_HAS_SPECTRA

}  // namespace plsh

#endif  // PLSH_ATTENTION_ERROR_HPP
