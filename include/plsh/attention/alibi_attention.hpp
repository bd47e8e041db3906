#ifndef PLSH_ATTENTION_ALIBI_ATTENTION_HPP
#define PLSH_ATTENTION_ALIBI_ATTENTION_HPP

/// \file alibi_attention.hpp
/// Exact ALiBi attention, and ALiBi restricted to the keys whose factor is above a tolerance.
///
/// \f$o_i = \sum_j e^{\text{scale}\,q_i\cdot k_j - m_h|p_i - p_j|} v_j / \sum_j e^{\ldots}\f$.
/// Cost: tiled online softmax (regular.hpp), \f$2(d + d_v)\f$ flops per computed score; causal
/// key tiles above the diagonal and, for the windowed kernel, tiles outside the band are skipped.
/// Memory: O(tile) per thread, nothing n x n. Parallel over (batch element, head, query tile)
/// with OpenMP, in one parallel region (batch.hpp: the batched overloads). Views of float,
/// double, Eigen::bfloat16 or Eigen::half; the 16-bit types computed in float a tile at a time
/// (regular.hpp).
///
/// Tested against plsh::reference::alibi_attention (dense, double) in
/// tests/test_alibi_attention.cpp; non-finite inputs (the contract of online_softmax.hpp) and
/// float accuracy at far absolute positions in tests/test_nonfinite.cpp; bfloat16 and half
/// against the float kernel in tests/test_half.cpp.

#include <cmath>
#include <limits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validate.hpp"
#include "../tensor.hpp"
#include "options.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Runs the tiled core for every (batch element, head, query tile), with `bias_of(h)` the
/// LinearBias of head h; one parallel region for the whole batch. Grouped heads: query head h
/// reads key/value head `h / (H / H_kv)`.
template <class Scalar, class BiasOf>
void linear_bias_attention(const BatchedHeadsView<const Scalar>& q,
                           const BatchedHeadsView<const Scalar>& k,
                           const BatchedHeadsView<const Scalar>& v,
                           const BatchedHeadsView<Scalar>& out, const AttentionOptions& options,
                           BiasOf&& bias_of) {
  if (q.batch == 0 || q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  const Index tiles = (q.tokens + kQueryTile - 1) / kQueryTile;
  const Index element_jobs = q.heads * tiles;
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  parallel_for(q.batch * element_jobs, work, [&](Index job) {
    const Index b = job / element_jobs;
    const Index h = (job % element_jobs) / tiles;
    // Later tiles see more keys under causal masking: hand them out first.
    const Index tile = tiles - 1 - job % tiles;
    HeadMap<Scalar> out_head = out[b].head(h);
    attend_rows<Scalar>(q[b].head(h), k[b].head(h / group), v[b].head(h / group), resolved,
                        bias_of(h), tile * kQueryTile, std::min(q.tokens, (tile + 1) * kQueryTile),
                        out_head, nullptr);
  });
}

/// Keys kept by the windowed kernel: \f$e^{-m r} \ge \text{tolerance} \iff r \le
/// \ln(1/\text{tolerance})/m\f$.
inline Index alibi_window(double slope, double tolerance) {
  if (slope == 0 || tolerance == 0) return kNoWindow;
  const double window = std::floor(std::log(1.0 / tolerance) / slope);
  return window >= static_cast<double>(kNoWindow) ? kNoWindow : static_cast<Index>(window);
}

/// exact_alibi_attention on a batch whose shapes validate_batch has checked: the checks of one
/// element, then the kernel.
template <class Scalar>
void batched_exact_alibi_attention(const BatchedHeadsView<const Scalar>& q,
                                   const BatchedHeadsView<const Scalar>& k,
                                   const BatchedHeadsView<const Scalar>& v,
                                   const BatchedHeadsView<Scalar>& out,
                                   const std::vector<double>& slopes,
                                   const AttentionOptions& options) {
  const char* function = "exact_alibi_attention";
  validate_attention(function, q[0], k[0], v[0], out[0], options, memory_of(q));
  validate_slopes(function, slopes, q.heads);
  linear_bias_attention(q, k, v, out, options, [&](Index h) {
    return LinearBias{slopes[static_cast<std::size_t>(h)], kNoWindow};
  });
}

/// windowed_alibi_attention on a checked batch, as batched_exact_alibi_attention.
template <class Scalar>
void batched_windowed_alibi_attention(const BatchedHeadsView<const Scalar>& q,
                                      const BatchedHeadsView<const Scalar>& k,
                                      const BatchedHeadsView<const Scalar>& v,
                                      const BatchedHeadsView<Scalar>& out,
                                      const std::vector<double>& slopes, double tolerance,
                                      const AttentionOptions& options) {
  const char* function = "windowed_alibi_attention";
  validate_attention(function, q[0], k[0], v[0], out[0], options, memory_of(q));
  validate_slopes(function, slopes, q.heads);
  require(tolerance >= 0 && tolerance <= 1, function, "tolerance must lie in [0, 1]");
  linear_bias_attention(q, k, v, out, options, [&](Index h) {
    const double slope = slopes[static_cast<std::size_t>(h)];
    return LinearBias{slope, alibi_window(slope, tolerance)};
  });
}

}  // namespace detail

/// Exact ALiBi attention.
///
/// \param q `[n_q][H][d]`, \param k `[n_k][H_kv][d]`, \param v `[n_k][H_kv][d_v]`,
/// \param out `[n_q][H][d_v]`; H a multiple of H_kv (grouped-query attention).
/// \param slopes one slope per query head (alibi_slopes(H) for the standard list).
/// \throws std::invalid_argument on shapes that disagree, a bad slope, or `out` overlapping an
/// input; the message names the argument.
template <class Scalar>
void exact_alibi_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                           HeadsView<const detail::NonDeduced<Scalar>> k,
                           HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                           const std::vector<double>& slopes,
                           const AttentionOptions& options = {}) {
  detail::batched_exact_alibi_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                                detail::batch_of_one(v), detail::batch_of_one(out),
                                                slopes, options);
}

/// ALiBi attention that drops the keys whose factor \f$e^{-m_h|p_i - p_j|}\f$ is below
/// `tolerance`: head h keeps \f$|p_i - p_j| \le \lfloor \ln(1/\text{tolerance}) / m_h \rfloor\f$,
/// and skips whole key tiles outside that band. `tolerance = 0` is exact ALiBi.
///
/// Arguments as exact_alibi_attention; \param tolerance in [0, 1].
template <class Scalar>
void windowed_alibi_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                              HeadsView<const detail::NonDeduced<Scalar>> k,
                              HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                              const std::vector<double>& slopes, double tolerance = 1e-6,
                              const AttentionOptions& options = {}) {
  detail::batched_windowed_alibi_attention<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), slopes, tolerance, options);
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_ALIBI_ATTENTION_HPP
