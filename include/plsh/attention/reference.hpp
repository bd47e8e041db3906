#ifndef PLSH_ATTENTION_REFERENCE_HPP
#define PLSH_ATTENTION_REFERENCE_HPP

/// \file reference.hpp
/// Slow, obvious references for the attention kernels and their gradients: dense, in double, one
/// head at a time.
///
/// Every reference computes \f$o_i = \sum_j F_{ij} e^{S_{ij}} v_j / \sum_j F_{ij} e^{S_{ij}}\f$,
/// \f$S_{ij} = \text{scale}\; q_i\cdot k_j\f$, over the keys with \f$F_{ij} > 0\f$ (and
/// \f$p_j \le p_i\f$ when causal), straight from the definition: the whole row of logits, its
/// maximum subtracted, no tiling. \f$F\f$ is the ALiBi factor \f$e^{-m|p_i - p_j|}\f$, its
/// truncation, or a mean of block masks. The factor enters as \f$\log F_{ij}\f$ (\f$-\infty\f$:
/// masked), added to the logit before the maximum is taken, so that a row whose every factor
/// underflows in linear space (\f$m|p_i - p_j| > 745\f$) still has its true softmax. A masked key
/// contributes nothing, whatever its values; a NaN among the visible logits makes the row NaN; a
/// row without a visible key is zero. O(n_q n_k d) time per head; for tests.
///
/// Tested in tests/test_reference.cpp against closed forms computed by hand in long double.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../partition.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "near_field.hpp"

namespace plsh {
namespace detail {

constexpr double kMasked = -std::numeric_limits<double>::infinity();

/// The softmax weights \f$P_{ij}\f$ of query row i of head h over the keys, and the keys it sees:
/// \f$l_j = \log F_{ij} + S_{ij}\f$, \f$P_{ij} = e^{l_j - \max l}/\sum_j e^{l_j - \max l}\f$.
/// A NaN among the visible logits propagates through the maximum into every weight of the row.
template <class LogFactor>
void row_probabilities(const Eigen::MatrixXd& q_head, const Eigen::MatrixXd& k_head, Index i,
                       Index h, double scale, const AttentionOptions& options,
                       LogFactor& log_factor, std::vector<Index>& visible,
                       std::vector<double>& probabilities) {
  const Index query_position = options.query_position + i;
  visible.clear();
  probabilities.clear();
  double max_logit = kMasked;
  for (Index j = 0; j < k_head.rows(); ++j) {
    const Index key_position = options.key_position + j;
    if (options.causal && key_position > query_position) continue;
    const double log_f = log_factor(h, query_position, key_position);
    if (log_f == kMasked) continue;
    const double logit = log_f + scale * q_head.row(i).dot(k_head.row(j));
    visible.push_back(j);
    probabilities.push_back(logit);
    if (!std::isnan(max_logit) && !(logit <= max_logit)) max_logit = logit;
  }
  double total = 0;
  for (double& p : probabilities) {
    p = std::exp(p - max_logit);
    total += p;
  }
  for (double& p : probabilities) p /= total;
}

}  // namespace detail

namespace reference {

/// The general form: `log_factor(h, p_i, p_j)` is \f$\log F_{ij}\f$ for query head h,
/// \f$-\infty\f$ for a masked key.
template <class Scalar, class LogFactor>
void factor_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                      const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                      const AttentionOptions& options, LogFactor&& log_factor) {
  detail::validate_attention("reference::factor_attention", q, k, v, out, options);
  const double scale = detail::resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  std::vector<Index> visible;
  std::vector<double> probabilities;
  for (Index h = 0; h < q.heads; ++h) {
    const Eigen::MatrixXd q_head = q.head(h).template cast<double>();
    const Eigen::MatrixXd k_head = k.head(h / group).template cast<double>();
    const Eigen::MatrixXd v_head = v.head(h / group).template cast<double>();
    for (Index i = 0; i < q.tokens; ++i) {
      detail::row_probabilities(q_head, k_head, i, h, scale, options, log_factor, visible,
                                probabilities);
      Eigen::RowVectorXd sum = Eigen::RowVectorXd::Zero(v.dim);
      for (std::size_t n = 0; n < visible.size(); ++n) {
        sum += probabilities[n] * v_head.row(visible[n]);
      }
      for (Index e = 0; e < v.dim; ++e) {
        out.data[i * out.token_stride + h * out.head_stride + e] = static_cast<Scalar>(sum[e]);
      }
    }
  }
}

/// The ALiBi log-factor \f$-m|p_i - p_j|\f$ of slope m.
inline double alibi_log_factor(double slope, Index i, Index j) {
  return -slope * static_cast<double>(i > j ? i - j : j - i);
}

/// The ALiBi log-factor of head h as a function `(h, p_i, p_j)`, relative to the row:
/// \f$-m_h(|p_i - p_j| - r_i)\f$, \f$r_i\f$ the distance from \f$p_i\f$ to the nearest key it
/// can see. That is the true log-factor plus the row constant \f$m_h r_i\f$, which the softmax
/// cancels; so a row whose every \f$m_h|p_i - p_j|\f$ overflows double (slope 1e300 at distance
/// 1e9) still has its true softmax, the nearest keys', instead of no visible key.
inline auto alibi_row_log_factor(const std::vector<double>& slopes, const AttentionOptions& options,
                                 Index key_tokens) {
  return [&slopes, options, key_tokens](Index h, Index i, Index j) {
    const Index first = options.key_position;
    const Index last =
        options.causal ? std::min(first + key_tokens - 1, i) : first + key_tokens - 1;
    const Index nearest = i < first ? first - i : (i > last ? i - last : 0);
    return -slopes[static_cast<std::size_t>(h)] *
           static_cast<double>((i > j ? i - j : j - i) - nearest);
  };
}

/// Exact ALiBi: \f$F_{ij} = e^{-m_h|p_i - p_j|}\f$ (alibi_row_log_factor).
template <class Scalar>
void alibi_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                     const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                     const std::vector<double>& slopes, const AttentionOptions& options = {}) {
  detail::validate_slopes("reference::alibi_attention", slopes, q.heads);
  factor_attention(q, k, v, out, options, alibi_row_log_factor(slopes, options, k.tokens));
}

/// The ALiBi log-factor (alibi_row_log_factor) over a window of keys: query position \f$p_i\f$
/// of head h sees the keys at the positions of `window(h, p_i)` (a Block of key positions),
/// \f$-\infty\f$ for the others. `window` must outlive the returned function.
template <class Window>
auto windowed_log_factor(const std::vector<double>& slopes, const Window& window,
                         const AttentionOptions& options, Index key_tokens) {
  return [row_log_factor = alibi_row_log_factor(slopes, options, key_tokens), &window](
             Index h, Index i, Index j) {
    const Block kept = window(h, i);
    return j >= kept.begin && j < kept.end ? row_log_factor(h, i, j) : detail::kMasked;
  };
}

/// ALiBi over a window of keys (windowed_log_factor). With the key rows each tile of
/// windowed_alibi_attention kept, the function that kernel computes.
template <class Scalar, class Window>
void windowed_alibi_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                              const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                              const std::vector<double>& slopes, const Window& window,
                              const AttentionOptions& options = {}) {
  detail::validate_slopes("reference::windowed_alibi_attention", slopes, q.heads);
  factor_attention(q, k, v, out, options, windowed_log_factor(slopes, window, options, k.tokens));
}

/// The ALiBi log-factor (alibi_row_log_factor) without the keys whose factor
/// \f$e^{-m|p_i - p_j|}\f$ is below `factor_tolerance`: the keys with \f$|p_i - p_j| \le
/// \lfloor -\ln(\text{factor\_tolerance})/m\rfloor\f$ are kept (\f$-\ln\f$, finite for every
/// tolerance in (0, 1], where \f$\ln(1/\text{tolerance})\f$ overflows below about 5.6e-309),
/// every key when m or the tolerance is 0. Written from the definition, not with the kernel's
/// factor_window, so that the two cannot share a mistake. `slopes` must outlive the returned
/// function.
inline auto truncated_log_factor(const std::vector<double>& slopes, double factor_tolerance,
                                 const AttentionOptions& options, Index key_tokens) {
  return [row_log_factor = alibi_row_log_factor(slopes, options, key_tokens), &slopes,
          factor_tolerance](Index h, Index i, Index j) {
    const double slope = slopes[static_cast<std::size_t>(h)];
    const bool kept = slope == 0 || factor_tolerance == 0 ||
                      static_cast<double>(i > j ? i - j : j - i) <=
                          std::floor(-std::log(factor_tolerance) / slope);
    return kept ? row_log_factor(h, i, j) : detail::kMasked;
  };
}

/// ALiBi truncated where the factor falls below `factor_tolerance` (truncated_log_factor): the
/// function truncated_alibi_attention computes.
template <class Scalar>
void truncated_alibi_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                               const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                               const std::vector<double>& slopes, double factor_tolerance,
                               const AttentionOptions& options = {}) {
  detail::validate_slopes("reference::truncated_alibi_attention", slopes, q.heads);
  factor_attention(q, k, v, out, options,
                   truncated_log_factor(slopes, factor_tolerance, options, k.tokens));
}

/// The number of grids of `grids` in which the positions `i` and `j` share a block: their bins
/// \f$\lfloor (p - \text{shift})/\text{pitch} \rfloor\f$ are equal (detail::same_bin).
inline Index shared_blocks(const std::vector<Grid>& grids, Index i, Index j) {
  Index shared = 0;
  for (const Grid& grid : grids) {
    if (detail::same_bin(grid, i, j)) ++shared;
  }
  return shared;
}

/// The log-factor \f$\log \hat K_{ij}\f$ of the Positional LSH estimator as a function
/// `(h, p_i, p_j)`: head h's detail::Estimator `estimators[h]` asked for the count
/// \f$c_{ij}\f$ (shared_blocks of `grids[h]`) at the distance \f$|p_i - p_j|\f$ -- without a near
/// field \f$\log(c_{ij}/s)\f$, \f$-\infty\f$ when \f$c_{ij} = 0\f$. `grids` must outlive the
/// returned function.
inline auto estimator_log_factor(const std::vector<std::vector<Grid>>& grids,
                                 std::vector<detail::Estimator> estimators) {
  return [&grids, estimators = std::move(estimators)](Index h, Index i, Index j) {
    const std::size_t head = static_cast<std::size_t>(h);
    return estimators[head].log_factor(shared_blocks(grids[head], i, j), std::abs(i - j));
  };
}

/// The log-factor \f$\log \hat K_{ij} = \log(c_{ij}/s)\f$ of the mean block mask of `grids[h]`
/// (estimator_log_factor without a near field). `grids` must outlive the returned function.
inline auto mean_mask_log_factor(const std::vector<std::vector<Grid>>& grids) {
  std::vector<detail::Estimator> estimators;
  for (const std::vector<Grid>& head_grids : grids) {
    estimators.emplace_back(0.0, static_cast<Index>(head_grids.size()), 0.0, 0);
  }
  return estimator_log_factor(grids, std::move(estimators));
}

/// \f$F = \hat K\f$, the mean block mask of `grids[h]` (mean_mask_log_factor).
template <class Scalar>
void mask_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<std::vector<Grid>>& grids,
                    const AttentionOptions& options = {}) {
  detail::require(static_cast<Index>(grids.size()) == q.heads, "reference::mask_attention",
                  "grids.size() must equal q.heads");
  for (const std::vector<Grid>& head_grids : grids) {
    detail::require_grids(head_grids, "reference::mask_attention");
  }
  factor_attention(q, k, v, out, options, mean_mask_log_factor(grids));
}

/// The log-factor of the near-field estimator (near_field.hpp) as a function `(h, p_i, p_j)`:
/// \f$-m_h|p_i - p_j|\f$ within the reach of head h's near field for `near_field` (in a call over
/// the positions `[first, last)`, those of its queries and keys), \f$\log(c_{ij}/s)\f$ beyond
/// (estimator_log_factor). `grids` must outlive the returned function.
inline auto near_field_log_factor(const std::vector<std::vector<Grid>>& grids,
                                  const std::vector<double>& slopes, double near_field, Index first,
                                  Index last) {
  std::vector<detail::Estimator> estimators;
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    estimators.push_back(detail::head_estimator(slopes[h], static_cast<Index>(grids[h].size()),
                                                near_field, detail::PositionRange{first, last}));
  }
  return estimator_log_factor(grids, std::move(estimators));
}

/// The positions `[first, last)` of a call of queries `q` and keys `k` with `options`, the
/// interval near_field_log_factor takes.
template <class Scalar>
std::pair<Index, Index> call_positions(const HeadsView<const Scalar>& q,
                                       const HeadsView<const Scalar>& k,
                                       const AttentionOptions& options) {
  const detail::PositionRange range = detail::position_range(q, k, options);
  return {range.first, range.last};
}

/// Positional LSH with the grids plsh_attention draws for `options.seed`, and the near field of
/// `options.near_field` (near_field_log_factor).
template <class Scalar>
void plsh_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<double>& slopes, const PlshOptions& options = {}) {
  detail::validate_slopes("reference::plsh_attention", slopes, q.heads);
  const auto grids = detail::kernel_grids(slopes, options, "reference::plsh_attention");
  if (options.near_field == 0) {
    mask_attention(q, k, v, out, grids, options);
    return;
  }
  const auto [first, last] = call_positions(q, k, options);
  factor_attention(q, k, v, out, options,
                   near_field_log_factor(grids, slopes, options.near_field, first, last));
}

/// The log-factor of fixed blocks of `block_size` as a function `(h, p_i, p_j)`: 0 when
/// \f$\lfloor p_i/b\rfloor = \lfloor p_j/b\rfloor\f$ (integer division of the non-negative
/// positions), \f$-\infty\f$ otherwise. \throws std::invalid_argument for `block_size < 1`.
inline auto fixed_block_log_factor(Index block_size, const char* function) {
  detail::require(block_size >= 1, function, "block_size must be at least 1");
  return [block_size](Index, Index i, Index j) {
    return i / block_size == j / block_size ? 0.0 : detail::kMasked;
  };
}

/// Fixed blocks of `block_size`: \f$F_{ij} = 1\f$ when \f$\lfloor p_i/b\rfloor = \lfloor
/// p_j/b\rfloor\f$.
template <class Scalar>
void fixed_block_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                           const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                           Index block_size, const AttentionOptions& options = {}) {
  factor_attention(q, k, v, out, options,
                   fixed_block_log_factor(block_size, "reference::fixed_block_attention"));
}

/// Dense backward of factor_attention in double, straight from the formulas of backward.hpp:
/// per query row the weights \f$P_{ij}\f$ of factor_attention, \f$o_i = \sum_j P_{ij} v_j\f$,
/// \f$D_i = dO_i\cdot o_i\f$, and over the visible keys only \f$dS_{ij} = P_{ij}(dO_i\cdot v_j -
/// D_i)\f$, \f$dV_j \mathrel{+}= P_{ij}\,dO_i\f$, \f$dQ_i \mathrel{+}= \text{scale}\; dS_{ij}
/// k_j\f$, \f$dK_j \mathrel{+}= \text{scale}\; dS_{ij} q_i\f$: a key no query sees gets exactly
/// zero. `log_factor` as factor_attention.
template <class Scalar, class LogFactor>
void factor_attention_backward(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                               const HeadsView<const Scalar>& v,
                               const HeadsView<const Scalar>& dout, const HeadsView<Scalar>& dq,
                               const HeadsView<Scalar>& dk, const HeadsView<Scalar>& dv,
                               const AttentionOptions& options, LogFactor&& log_factor) {
  const char* function = "reference::factor_attention_backward";
  // dout stands in for the forward's output in the checks: both are [n_q][H][d_v].
  detail::validate_backward(function, q, k, v, dout, dout, dq, dk, dv, options);
  const double scale = detail::resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  std::vector<Index> visible;
  std::vector<double> probabilities;
  for (Index g = 0; g < k.heads; ++g) {
    const Eigen::MatrixXd k_head = k.head(g).template cast<double>();
    const Eigen::MatrixXd v_head = v.head(g).template cast<double>();
    Eigen::MatrixXd dk_head = Eigen::MatrixXd::Zero(k.tokens, k.dim);
    Eigen::MatrixXd dv_head = Eigen::MatrixXd::Zero(v.tokens, v.dim);
    for (Index h = g * group; h < (g + 1) * group; ++h) {
      const Eigen::MatrixXd q_head = q.head(h).template cast<double>();
      const Eigen::MatrixXd dout_head = dout.head(h).template cast<double>();
      Eigen::MatrixXd dq_head = Eigen::MatrixXd::Zero(q.tokens, q.dim);
      for (Index i = 0; i < q.tokens; ++i) {
        detail::row_probabilities(q_head, k_head, i, h, scale, options, log_factor, visible,
                                  probabilities);
        Eigen::RowVectorXd out_row = Eigen::RowVectorXd::Zero(v.dim);
        for (std::size_t n = 0; n < visible.size(); ++n) {
          out_row += probabilities[n] * v_head.row(visible[n]);
        }
        const double delta = dout_head.row(i).dot(out_row);
        for (std::size_t n = 0; n < visible.size(); ++n) {
          const Index j = visible[n];
          const double score_gradient =
              probabilities[n] * (dout_head.row(i).dot(v_head.row(j)) - delta);
          dv_head.row(j) += probabilities[n] * dout_head.row(i);
          dq_head.row(i) += scale * score_gradient * k_head.row(j);
          dk_head.row(j) += scale * score_gradient * q_head.row(i);
        }
      }
      dq.head(h) = dq_head.template cast<Scalar>();
    }
    dk.head(g) = dk_head.template cast<Scalar>();
    dv.head(g) = dv_head.template cast<Scalar>();
  }
}

/// Backward of exact ALiBi: \f$F_{ij} = e^{-m_h|p_i - p_j|}\f$.
template <class Scalar>
void alibi_attention_backward(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                              const HeadsView<const Scalar>& v, const HeadsView<const Scalar>& dout,
                              const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                              const HeadsView<Scalar>& dv, const std::vector<double>& slopes,
                              const AttentionOptions& options = {}) {
  detail::validate_slopes("reference::alibi_attention_backward", slopes, q.heads);
  factor_attention_backward(q, k, v, dout, dq, dk, dv, options,
                            alibi_row_log_factor(slopes, options, k.tokens));
}

/// Backward of ALiBi over a window of keys (windowed_log_factor).
template <class Scalar, class Window>
void windowed_alibi_attention_backward(
    const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
    const HeadsView<const Scalar>& v, const HeadsView<const Scalar>& dout,
    const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk, const HeadsView<Scalar>& dv,
    const std::vector<double>& slopes, const Window& window, const AttentionOptions& options = {}) {
  detail::validate_slopes("reference::windowed_alibi_attention_backward", slopes, q.heads);
  factor_attention_backward(q, k, v, dout, dq, dk, dv, options,
                            windowed_log_factor(slopes, window, options, k.tokens));
}

/// Backward of truncated ALiBi (truncated_log_factor): the masked softmax attention's gradients,
/// exactly zero from the keys outside the band.
template <class Scalar>
void truncated_alibi_attention_backward(const HeadsView<const Scalar>& q,
                                        const HeadsView<const Scalar>& k,
                                        const HeadsView<const Scalar>& v,
                                        const HeadsView<const Scalar>& dout,
                                        const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                                        const HeadsView<Scalar>& dv,
                                        const std::vector<double>& slopes, double factor_tolerance,
                                        const AttentionOptions& options = {}) {
  detail::validate_slopes("reference::truncated_alibi_attention_backward", slopes, q.heads);
  factor_attention_backward(q, k, v, dout, dq, dk, dv, options,
                            truncated_log_factor(slopes, factor_tolerance, options, k.tokens));
}

/// Backward of Positional LSH with the grids plsh_attention draws for `options.seed`:
/// \f$F_{ij} = c_{ij}/s\f$, the mean block mask, with the near field of `options.near_field`
/// (near_field_log_factor).
template <class Scalar>
void plsh_attention_backward(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                             const HeadsView<const Scalar>& v, const HeadsView<const Scalar>& dout,
                             const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                             const HeadsView<Scalar>& dv, const std::vector<double>& slopes,
                             const PlshOptions& options = {}) {
  detail::validate_slopes("reference::plsh_attention_backward", slopes, q.heads);
  const auto grids = detail::kernel_grids(slopes, options, "reference::plsh_attention_backward");
  const auto [first, last] = call_positions(q, k, options);
  factor_attention_backward(q, k, v, dout, dq, dk, dv, options,
                            near_field_log_factor(grids, slopes, options.near_field, first, last));
}

/// Backward of fixed blocks of `block_size` (fixed_block_log_factor).
template <class Scalar>
void fixed_block_attention_backward(const HeadsView<const Scalar>& q,
                                    const HeadsView<const Scalar>& k,
                                    const HeadsView<const Scalar>& v,
                                    const HeadsView<const Scalar>& dout,
                                    const HeadsView<Scalar>& dq, const HeadsView<Scalar>& dk,
                                    const HeadsView<Scalar>& dv, Index block_size,
                                    const AttentionOptions& options = {}) {
  factor_attention_backward(
      q, k, v, dout, dq, dk, dv, options,
      fixed_block_log_factor(block_size, "reference::fixed_block_attention_backward"));
}

}  // namespace reference
}  // namespace plsh

#endif  // PLSH_ATTENTION_REFERENCE_HPP
