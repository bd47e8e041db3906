#ifndef PLSH_ATTENTION_PLSH_ATTENTION_HPP
#define PLSH_ATTENTION_PLSH_ATTENTION_HPP

/// \file plsh_attention.hpp
/// ALiBi attention through Positional LSH, the entry points: the factor matrix
/// \f$K_{ij} = e^{-m|p_i - p_j|}\f$ is replaced by the mean of \f$s\f$ random block masks,
/// \f$\hat K = \frac1s\sum_t M_t\f$:
/// \f[ o_i = \frac{\sum_j \hat K_{ij} e^{S_{ij}} v_j}{\sum_j \hat K_{ij} e^{S_{ij}}},
///     \qquad S_{ij} = \text{scale}\; q_i \cdot k_j. \f]
/// Head h, draw t partitions the absolute positions with
/// `RandomBinning(slopes[h], head_seed(seed, h))(t)` (kernel_grids, sampler.hpp); the draws are
/// made once per call and shared by the batch elements (batch.hpp; an unbatched call is a batch
/// of one). With PlshOptions::near_field f > 0, \f$\hat K_{ij}\f$ is the factor itself within
/// each head's reach (near_field.hpp).
///
/// Two evaluations of the same estimator, which agree to rounding for every option:
/// - Kernel::Fused (fused_kernel.hpp): each score once, weighted by \f$s \hat K_{ij}\f$ (the
///   counts \f$c_{ij}\f$ beyond the near field); about \f$(\ln(s)/m + \text{tile})(d + d_v)\f$
///   per query and head.
/// - Kernel::Passes (pass_kernel.hpp): regular attention per draw and block, merged by
///   log-sum-exp, and the near field's band once per head; \f$\sum_t \sum_{\text{blocks}} b^2
///   (d + d_v)\f$ per head. The inner kernel is pluggable.
/// fixed_block_attention, the paper's fixed-blocks baseline, is one pass of the pass kernel.
///
/// Tested against plsh::reference::mask_attention and plsh::reference::plsh_attention (dense
/// \f$D^{-1}(e^S\circ\hat K)V\f$ in double, same grids) in tests/test_plsh_attention.cpp and,
/// with a near field, tests/test_near_field.cpp; the 16-bit types against the float kernels in
/// tests/test_fused_half.cpp.

#include <type_traits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/check.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../row_lse.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "fused_kernel.hpp"
#include "near_field.hpp"
#include "pass_kernel.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// The near fields of the pass kernel for a call of plsh_attention (none for near_field 0): those
/// the fused kernel takes, over the call's positions.
template <class Scalar>
std::vector<Estimator> pass_near_fields(const BatchedHeadsView<const Scalar>& q,
                                        const BatchedHeadsView<const Scalar>& k,
                                        const std::vector<double>& slopes,
                                        const PlshOptions& options) {
  return head_estimators(slopes, options.samples, options.near_field,
                         position_range(q, k, options));
}

/// plsh_attention on a batch whose shapes validate_batch has checked: the checks of one element,
/// the draws (once, shared by the elements), then the fused or pass kernel, or the pass kernel
/// with `kernel` when one is given; the row lse goes to `lse` unless it is empty.
template <class Scalar, class... RegularKernel>
void plsh_attention_writing_lse(const BatchedHeadsView<const Scalar>& q,
                                const BatchedHeadsView<const Scalar>& k,
                                const BatchedHeadsView<const Scalar>& v,
                                const BatchedHeadsView<Scalar>& out,
                                const std::vector<double>& slopes, const PlshOptions& options,
                                const RowLse<Compute<Scalar>>& lse, RegularKernel&&... kernel) {
  static_assert(sizeof...(RegularKernel) <= 1, "at most one regular kernel");
  validate_plsh("plsh_attention", q[0], k[0], v[0], out[0], slopes, options, memory_of(q));
  require_row_lse("plsh_attention", "lse", lse, q.batch, q.heads, q.tokens);
  const auto grids = kernel_grids(slopes, options, "plsh_attention");
  if constexpr (sizeof...(RegularKernel) == 1) {
    pass_attention(q, k, v, out, grids, pass_near_fields(q, k, slopes, options), options, kernel...,
                   lse);
  } else if (options.kernel == Kernel::Passes) {
    pass_attention(q, k, v, out, grids, pass_near_fields(q, k, slopes, options), options,
                   RegularAttention{}, lse);
  } else {
    fused_attention(q, k, v, out, grids, slopes, options, options.near_field, kFusedSpanKeys, lse);
  }
}

/// plsh_attention_writing_lse without the lse.
template <class Scalar, class... RegularKernel>
void batched_plsh_attention(const BatchedHeadsView<const Scalar>& q,
                            const BatchedHeadsView<const Scalar>& k,
                            const BatchedHeadsView<const Scalar>& v,
                            const BatchedHeadsView<Scalar>& out, const std::vector<double>& slopes,
                            const PlshOptions& options, RegularKernel&&... kernel) {
  plsh_attention_writing_lse<Scalar>(q, k, v, out, slopes, options, {}, kernel...);
}

/// fixed_block_attention on a checked batch: the checks of one element, then one pass of the
/// pass kernel with `fixed_grid(block_size)` for every head.
template <class Scalar>
void batched_fixed_block_attention(const BatchedHeadsView<const Scalar>& q,
                                   const BatchedHeadsView<const Scalar>& k,
                                   const BatchedHeadsView<const Scalar>& v,
                                   const BatchedHeadsView<Scalar>& out, Index block_size,
                                   const AttentionOptions& options,
                                   const RowLse<Compute<Scalar>>& lse = {}) {
  const char* function = "fixed_block_attention";
  validate_attention(function, q[0], k[0], v[0], out[0], options, memory_of(q));
  require(block_size >= 1, function, "block_size must be at least 1");
  require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  const std::vector<std::vector<Grid>> grids(
      static_cast<std::size_t>(q.heads),
      std::vector<Grid>{fixed_grid(static_cast<double>(block_size))});
  pass_attention(q, k, v, out, grids, {}, options, RegularAttention{}, lse);
}

}  // namespace detail

/// ALiBi attention through Positional LSH, the average of `options.samples` random block
/// partitions per head (see the file comment for the formula).
///
/// \code
/// const Index n = 4096, heads = 8, dim = 64;
/// std::vector<float> q(n * heads * dim), k(q.size()), v(q.size()), out(q.size());
/// // ... fill q, k, v ...
/// plsh::PlshOptions options;  // causal, s = 100, Latin hypercube, near_field 0.05, fused kernel
/// plsh::plsh_attention<float>({q.data(), n, heads, dim}, {k.data(), n, heads, dim},
///                             {v.data(), n, heads, dim}, {out.data(), n, heads, dim},
///                             plsh::alibi_slopes(heads), options);
/// \endcode
///
/// \tparam Scalar the storage type: float, double, Eigen::bfloat16 or Eigen::half. The 16-bit
/// types are computed in float (detail::Compute) and the output rounded once to the storage
/// type (to nearest even: relative error at most \f$2^{-8}\f$ for bfloat16, \f$2^{-11}\f$ for
/// half, against the float kernel on the same inputs).
/// \param q `[n_q][H][d]`, \param k `[n_k][H_kv][d]`, \param v `[n_k][H_kv][d_v]`,
/// \param out `[n_q][H][d_v]`; H a multiple of H_kv. \param slopes one per query head.
/// \param options causal, scale, absolute positions of the first query and key rows, samples s,
/// seed, and which kernel evaluates the estimator (Kernel::Fused and Kernel::Passes agree to
/// rounding). The result is identical for any number of threads.
/// \param lse when not empty, receives each row's log-sum-exp of \f$S_{ij} + \log(s \hat
/// K_{ij})\f$,
/// `[1][H][n_q]` (row_lse.hpp), for plsh_attention_backward.
/// \throws std::invalid_argument on shapes that disagree, a bad slope, `samples < 1`, `out`
/// overlapping an input, a scale that is not finite and non-zero in the compute type, or an
/// `lse` of another shape.
template <class Scalar>
void plsh_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                    HeadsView<const detail::NonDeduced<Scalar>> k,
                    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                    const std::vector<double>& slopes, const PlshOptions& options = {},
                    RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::plsh_attention_writing_lse<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                             detail::batch_of_one(v), detail::batch_of_one(out),
                                             slopes, options, lse);
}

/// Positional LSH with a user-supplied regular attention kernel: always the pass kernel
/// (`options.kernel` is ignored), calling
/// `kernel(q, k, v, block_options, out, lse)` once per draw and block with, for C =
/// `detail::Compute<Scalar>` (float for Eigen::bfloat16 and Eigen::half, whose block rows are
/// converted before the call; Scalar itself otherwise), `ConstHeadMap<C>` q (`rows x d`), k
/// (`keys x d`), v (`keys x d_v`), an AttentionOptions
/// whose `scale` is resolved and whose positions are the absolute positions of the first query
/// and key rows, `HeadMap<C>` out (`rows x d_v`) and `LseMap<C>` lse (`rows`). The
/// kernel must write normalised rows and their log-sum-exp (\f$-\infty\f$ and zeros for a row
/// with no visible key), like RegularAttention. With OpenMP it is called from several threads
/// at once (one job per head and batch element). With a near field (`options.near_field` > 0)
/// the kernel gets only queries and keys every pair of which lies beyond the reach: the keys
/// within the reach, and a strip of keys in part within it, are computed by the library, so the
/// result is plsh_attention's whatever the kernel.
template <class Scalar, class RegularKernel,
          class = std::enable_if_t<
              !std::is_convertible<RegularKernel, RowLse<detail::Compute<Scalar>>>::value>>
void plsh_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                    HeadsView<const detail::NonDeduced<Scalar>> k,
                    HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                    const std::vector<double>& slopes, const PlshOptions& options,
                    RegularKernel&& kernel) {
  detail::batched_plsh_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                         detail::batch_of_one(v), detail::batch_of_one(out), slopes,
                                         options, kernel);
}

/// The fixed-blocks baseline of the paper: every head attends (regularly) within deterministic
/// blocks of `block_size` positions, `[0, b), [b, 2b), ...` on absolute positions. No bias and no
/// expectation property; one pass of the pass kernel with `fixed_grid(block_size)`. Storage
/// types as plsh_attention.
/// \throws std::invalid_argument as exact_alibi_attention, and for `block_size < 1`.
template <class Scalar>
void fixed_block_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                           HeadsView<const detail::NonDeduced<Scalar>> k,
                           HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                           Index block_size, const AttentionOptions& options = {},
                           RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::batched_fixed_block_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                                detail::batch_of_one(v), detail::batch_of_one(out),
                                                block_size, options, lse);
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_PLSH_ATTENTION_HPP
