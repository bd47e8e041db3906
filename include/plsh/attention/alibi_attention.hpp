#ifndef PLSH_ATTENTION_ALIBI_ATTENTION_HPP
#define PLSH_ATTENTION_ALIBI_ATTENTION_HPP

/// \file alibi_attention.hpp
/// Exact ALiBi attention, and ALiBi restricted to the keys whose factor is above a tolerance.
///
/// \f$o_i = \sum_j e^{\text{scale}\,q_i\cdot k_j - m_h|p_i - p_j|} v_j / \sum_j e^{\ldots}\f$.
/// Cost: tiled online softmax (regular.hpp), \f$2(d + d_v)\f$ flops per computed score; causal
/// key tiles above the diagonal and, for the windowed kernel, tiles outside the band are skipped.
/// Memory: O(tile) per thread, nothing n x n. Parallel over (head, query tile) with OpenMP.
///
/// Tested against plsh::reference::alibi_attention (dense, double) in
/// tests/test_alibi_attention.cpp; non-finite inputs (the contract of online_softmax.hpp) and
/// float accuracy at far absolute positions in tests/test_nonfinite.cpp.

#include <cmath>
#include <limits>
#include <vector>

#include "../detail/parallel.hpp"
#include "../detail/validate.hpp"
#include "../tensor.hpp"
#include "options.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Runs the tiled core for every (head, query tile), with `bias_of(h)` the LinearBias of head h.
/// Grouped heads: query head h reads key/value head `h / (H / H_kv)`.
template <class Scalar, class BiasOf>
void linear_bias_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                           const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                           const AttentionOptions& options, BiasOf&& bias_of) {
  if (q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  const Index tiles = (q.tokens + kQueryTile - 1) / kQueryTile;
  parallel_for(q.heads * tiles, attention_work(q, k, v), [&](Index job) {
    const Index h = job / tiles;
    // Later tiles see more keys under causal masking: hand them out first.
    const Index tile = tiles - 1 - job % tiles;
    HeadMap<Scalar> out_head = out.head(h);
    attend_rows<Scalar>(q.head(h), k.head(h / group), v.head(h / group), resolved, bias_of(h),
                        tile * kQueryTile, std::min(q.tokens, (tile + 1) * kQueryTile), out_head,
                        nullptr);
  });
}

/// Keys kept by the windowed kernel: \f$e^{-m r} \ge \text{tolerance} \iff r \le
/// \ln(1/\text{tolerance})/m\f$.
inline Index alibi_window(double slope, double tolerance) {
  if (slope == 0 || tolerance == 0) return kNoWindow;
  const double window = std::floor(std::log(1.0 / tolerance) / slope);
  return window >= static_cast<double>(kNoWindow) ? kNoWindow : static_cast<Index>(window);
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
  const char* function = "exact_alibi_attention";
  detail::validate_attention(function, q, k, v, out, options);
  detail::validate_slopes(function, slopes, q.heads);
  detail::linear_bias_attention(q, k, v, out, options, [&](Index h) {
    return detail::LinearBias{slopes[static_cast<std::size_t>(h)], detail::kNoWindow};
  });
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
  const char* function = "windowed_alibi_attention";
  detail::validate_attention(function, q, k, v, out, options);
  detail::validate_slopes(function, slopes, q.heads);
  detail::require(tolerance >= 0 && tolerance <= 1, function, "tolerance must lie in [0, 1]");
  detail::linear_bias_attention(q, k, v, out, options, [&](Index h) {
    const double slope = slopes[static_cast<std::size_t>(h)];
    return detail::LinearBias{slope, detail::alibi_window(slope, tolerance)};
  });
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_ALIBI_ATTENTION_HPP
