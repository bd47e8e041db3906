#ifndef PLSH_ATTENTION_REFERENCE_HPP
#define PLSH_ATTENTION_REFERENCE_HPP

/// \file reference.hpp
/// Slow, obvious references for the attention kernels: dense, in double, one head at a time.
///
/// Every reference computes \f$o_i = \sum_j F_{ij} e^{S_{ij}} v_j / \sum_j F_{ij} e^{S_{ij}}\f$,
/// \f$S_{ij} = \text{scale}\; q_i\cdot k_j\f$, over the keys with \f$F_{ij} > 0\f$ (and
/// \f$p_j \le p_i\f$ when causal), straight from the definition: the whole row of scores, its
/// maximum subtracted, no tiling. \f$F\f$ is the ALiBi factor \f$e^{-m|p_i - p_j|}\f$, its
/// truncation, or a mean of block masks. O(n_q n_k) time per head; for tests.

#include <Eigen/Core>
#include <cmath>
#include <vector>

#include "../detail/validate.hpp"
#include "../partition.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "options.hpp"
#include "plsh_attention.hpp"

namespace plsh {
namespace reference {

/// The general form: `factor(h, p_i, p_j)` is \f$F_{ij}\f$ for query head h.
template <class Scalar, class Factor>
void factor_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                      const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                      const AttentionOptions& options, Factor&& factor) {
  detail::validate_attention("reference::factor_attention", q, k, v, out, options);
  const double scale = detail::resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  for (Index h = 0; h < q.heads; ++h) {
    const Eigen::MatrixXd q_head = q.head(h).template cast<double>();
    const Eigen::MatrixXd k_head = k.head(h / group).template cast<double>();
    const Eigen::MatrixXd v_head = v.head(h / group).template cast<double>();
    for (Index i = 0; i < q.tokens; ++i) {
      const Index query_position = options.query_position + i;
      Eigen::VectorXd logits(k.tokens);
      Eigen::VectorXd weights = Eigen::VectorXd::Zero(k.tokens);
      double max_logit = -std::numeric_limits<double>::infinity();
      for (Index j = 0; j < k.tokens; ++j) {
        const Index key_position = options.key_position + j;
        weights[j] = (options.causal && key_position > query_position)
                         ? 0.0
                         : factor(h, query_position, key_position);
        logits[j] = scale * q_head.row(i).dot(k_head.row(j));
        if (weights[j] > 0) max_logit = std::max(max_logit, logits[j]);
      }
      double total = 0;
      Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(v.dim);
      for (Index j = 0; j < k.tokens; ++j) {
        if (weights[j] == 0) continue;
        const double w = weights[j] * std::exp(logits[j] - max_logit);
        total += w;
        sum += w * v_head.row(j);
      }
      for (Index e = 0; e < v.dim; ++e) {
        out.data[i * out.token_stride + h * out.head_stride + e] =
            static_cast<Scalar>(total > 0 ? sum[e] / total : 0.0);
      }
    }
  }
}

/// Exact ALiBi: \f$F_{ij} = e^{-m_h|p_i - p_j|}\f$.
template <class Scalar>
void alibi_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                     const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                     const std::vector<double>& slopes, const AttentionOptions& options = {}) {
  factor_attention(q, k, v, out, options, [&](Index h, Index i, Index j) {
    return std::exp(-slopes[static_cast<std::size_t>(h)] * static_cast<double>(std::abs(i - j)));
  });
}

/// ALiBi without the keys whose factor is below `tolerance`.
template <class Scalar>
void windowed_alibi_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                              const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                              const std::vector<double>& slopes, double tolerance,
                              const AttentionOptions& options = {}) {
  factor_attention(q, k, v, out, options, [&](Index h, Index i, Index j) {
    const double f =
        std::exp(-slopes[static_cast<std::size_t>(h)] * static_cast<double>(std::abs(i - j)));
    return f >= tolerance ? f : 0.0;
  });
}

/// The factor \f$F = \hat K\f$ as a function `(h, p_i, p_j)`: the mean block mask of `grids[h]`.
/// Positions share a block of a grid when their bins \f$\lfloor (p - \text{shift})/\text{pitch}
/// \rfloor\f$ are equal (detail::same_bin). `grids` must outlive the returned function.
inline auto mean_mask_factor(const std::vector<std::vector<Grid>>& grids) {
  return [&grids](Index h, Index i, Index j) {
    const std::vector<Grid>& head_grids = grids[static_cast<std::size_t>(h)];
    double shared = 0;
    for (const Grid& grid : head_grids) {
      if (detail::same_bin(grid, i, j)) shared += 1;
    }
    return shared / static_cast<double>(head_grids.size());
  };
}

/// \f$F = \hat K\f$, the mean block mask of `grids[h]` (mean_mask_factor).
template <class Scalar>
void mask_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<std::vector<Grid>>& grids,
                    const AttentionOptions& options = {}) {
  factor_attention(q, k, v, out, options, mean_mask_factor(grids));
}

/// Positional LSH with the grids plsh_attention draws for `options.seed`.
template <class Scalar>
void plsh_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<double>& slopes, const PlshOptions& options = {}) {
  mask_attention(q, k, v, out, detail::draw_head_grids(slopes, options.samples, options.seed),
                 options);
}

/// Fixed blocks of `block_size`: \f$F_{ij} = 1\f$ when \f$\lfloor p_i/b\rfloor = \lfloor
/// p_j/b\rfloor\f$.
template <class Scalar>
void fixed_block_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                           const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                           Index block_size, const AttentionOptions& options = {}) {
  factor_attention(q, k, v, out, options, [&](Index, Index i, Index j) {
    return i / block_size == j / block_size ? 1.0 : 0.0;
  });
}

}  // namespace reference
}  // namespace plsh

#endif  // PLSH_ATTENTION_REFERENCE_HPP
