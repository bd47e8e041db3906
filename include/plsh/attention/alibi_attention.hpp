#ifndef PLSH_ATTENTION_ALIBI_ATTENTION_HPP
#define PLSH_ATTENTION_ALIBI_ATTENTION_HPP

/// \file alibi_attention.hpp
/// Exact ALiBi attention; windowed ALiBi: the keys whose weight a bound certifies to be below a
/// tolerance are dropped (detail/windowed.hpp); truncated ALiBi: the keys whose factor is below a
/// tolerance are dropped, without a bound. Their gradients are in backward.hpp.
///
/// \f$o_i = \sum_j e^{\text{scale}\,q_i\cdot k_j - m_h|p_i - p_j|} v_j / \sum_j e^{\ldots}\f$.
/// Cost: tiled online softmax (regular.hpp), \f$2(d + d_v)\f$ flops per computed score; causal
/// key tiles above the diagonal are skipped, and the truncated kernel's outside its band; the
/// windowed kernel visits key tiles nearest first
/// and stops at its certificate (detail/windowed.hpp).
/// Memory: O(tile) per thread, nothing n x n. Parallel over (batch element, head, query tile)
/// with OpenMP, in one parallel region (batch.hpp: the batched overloads). Views of float,
/// double, Eigen::bfloat16 or Eigen::half; the 16-bit types computed in float a tile at a time
/// (regular.hpp).
///
/// Tested against plsh::reference::alibi_attention (dense, double) in
/// tests/test_alibi_attention.cpp, windowed and truncated ALiBi against their references in
/// tests/test_windowed.cpp; non-finite inputs (the contract of online_softmax.hpp) and
/// float accuracy at far absolute positions in tests/test_nonfinite.cpp; bfloat16 and half
/// against the float kernel in tests/test_half.cpp.

#include <atomic>
#include <cmath>
#include <limits>
#include <optional>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/parallel.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../row_lse.hpp"
#include "../tensor.hpp"
#include "detail/windowed.hpp"
#include "kept_keys.hpp"
#include "near_field.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Calls `body(b, h, tile, row_begin, row_end)` for every (batch element, head, query tile of
/// kQueryTile rows) in one parallel region; later tiles first (under causal masking they see more
/// keys).
template <class Scalar, class Body>
void for_each_query_tile(const BatchedHeadsView<const Scalar>& q,
                         const BatchedHeadsView<const Scalar>& k,
                         const BatchedHeadsView<const Scalar>& v, Body&& body) {
  const Index tiles = (q.tokens + kQueryTile - 1) / kQueryTile;
  const Index element_jobs = q.heads * tiles;
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  parallel_for(q.batch * element_jobs, work, [&](Index job) {
    const Index tile = tiles - 1 - job % tiles;
    body(job / element_jobs, (job % element_jobs) / tiles, tile, tile * kQueryTile,
         std::min(q.tokens, (tile + 1) * kQueryTile));
  });
}

/// Runs the tiled core for every (batch element, head, query tile), with `bias_of(h)` the
/// LinearBias of head h; one parallel region for the whole batch. Grouped heads: query head h
/// reads key/value head `h / (H / H_kv)`. Writes the row lse to `lse` unless it is empty.
template <class Scalar, class BiasOf>
void linear_bias_attention(const BatchedHeadsView<const Scalar>& q,
                           const BatchedHeadsView<const Scalar>& k,
                           const BatchedHeadsView<const Scalar>& v,
                           const BatchedHeadsView<Scalar>& out, const AttentionOptions& options,
                           BiasOf&& bias_of, const RowLse<Compute<Scalar>>& lse = {}) {
  if (q.batch == 0 || q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  for_each_query_tile(q, k, v, [&](Index b, Index h, Index, Index row_begin, Index row_end) {
    HeadMap<Scalar> out_head = out[b].head(h);
    attend_rows<Scalar>(q[b].head(h), k[b].head(h / group), v[b].head(h / group), resolved,
                        bias_of(h), row_begin, row_end, out_head,
                        lse.empty() ? nullptr : lse.row(b, h));
  });
}

/// The keys truncated_alibi_attention keeps: \f$e^{-m r} \ge \text{tolerance} \iff r \le
/// \lfloor -\ln(\text{tolerance})/m \rfloor\f$, factor_reach of that threshold with no cap
/// but kNoWindow (which slope 0 and tolerance 0 give: every key).
inline Index factor_window(double slope, double tolerance) {
  return factor_reach(slope, tolerance, kNoWindow);
}

/// truncated_alibi_attention on a batch whose shapes validate_batch has checked: the checks of one
/// element, then the kernel with head h's band factor_window(m_h, factor_tolerance), writing the
/// row lse to `lse` unless it is empty. Tolerance 0 is exact ALiBi: exact_alibi_attention is this
/// core under its own `function` name.
template <class Scalar>
void batched_truncated_alibi_attention(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<Scalar>& out,
    const std::vector<double>& slopes, double factor_tolerance, const AttentionOptions& options,
    const char* function = "truncated_alibi_attention", const RowLse<Compute<Scalar>>& lse = {}) {
  validate_attention(function, q[0], k[0], v[0], out[0], options, memory_of(q));
  validate_slopes(function, slopes, q.heads);
  require_tolerance(factor_tolerance, function, "factor_tolerance");
  require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  linear_bias_attention(
      q, k, v, out, options,
      [&](Index h) {
        const double slope = slopes[static_cast<std::size_t>(h)];
        return LinearBias{slope, factor_window(slope, factor_tolerance)};
      },
      lse);
}

/// exact_alibi_attention on a checked batch: batched_truncated_alibi_attention with tolerance 0.
template <class Scalar>
void batched_exact_alibi_attention(const BatchedHeadsView<const Scalar>& q,
                                   const BatchedHeadsView<const Scalar>& k,
                                   const BatchedHeadsView<const Scalar>& v,
                                   const BatchedHeadsView<Scalar>& out,
                                   const std::vector<double>& slopes,
                                   const AttentionOptions& options,
                                   const RowLse<Compute<Scalar>>& lse = {}) {
  batched_truncated_alibi_attention<Scalar>(q, k, v, out, slopes, 0.0, options,
                                            "exact_alibi_attention", lse);
}

/// Keys of the sequence that the caller does not hold (the sequence-parallel kernel's halo):
/// `before` key rows before the first held one and `after` after the last, of norms at most
/// `norm[g]` for key/value head g. windowed_rows counts them in its certificate but cannot visit
/// them. The single-process kernel holds every key.
struct UnheldKeys {
  Index before = 0;
  Index after = 0;
  std::vector<double> norm;
};

/// windowed_alibi_attention on a checked batch, as batched_exact_alibi_attention; tolerance 0 is
/// exact ALiBi. When `out` is null nothing is written; when `kept` is not null (tolerance > 0) it
/// receives the key rows each query tile visited, at `(b * H + h) * tiles + tile` for the tiles
/// of kQueryTile rows; with `out`, the row lse over the kept keys goes to `lse` unless it is
/// empty. Returns the number of (batch element, head, query tile) whose certificate does not hold
/// after visiting every held key: 0 unless `unheld` keys may weigh more than the tolerance
/// (windowed_rows).
template <class Scalar>
Index batched_windowed_alibi_attention(
    const BatchedHeadsView<const Scalar>& q, const BatchedHeadsView<const Scalar>& k,
    const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<Scalar>* out,
    const std::vector<double>& slopes, double tolerance, const AttentionOptions& options,
    const UnheldKeys& unheld = {}, std::vector<Block>* kept = nullptr,
    const RowLse<Compute<Scalar>>& lse = {}) {
  const char* function = "windowed_alibi_attention";
  if (out != nullptr) {
    validate_attention(function, q[0], k[0], v[0], (*out)[0], options, memory_of(q));
    require_row_lse(function, "lse", lse, q.batch, q.heads, q.tokens);
  }
  validate_slopes(function, slopes, q.heads);
  require_tolerance(tolerance, function);
  if (tolerance == 0) {
    if (out != nullptr) {
      linear_bias_attention(
          q, k, v, *out, options,
          [&](Index h) {
            return LinearBias{slopes[static_cast<std::size_t>(h)], kNoWindow};
          },
          lse);
    }
    return 0;
  }
  const Index tiles = (q.tokens + kQueryTile - 1) / kQueryTile;
  if (kept != nullptr) kept->assign(static_cast<std::size_t>(q.batch * q.heads * tiles), Block{});
  if (q.batch == 0 || q.tokens == 0) return 0;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  std::vector<KeyNormBounds> bounds(static_cast<std::size_t>(q.batch * k.heads));
  const double norm_work = static_cast<double>(q.batch * k.heads * k.tokens * k.dim);
  parallel_for(q.batch * k.heads, norm_work, [&](Index job) {
    const Index g = job % k.heads;
    const double outside = unheld.norm.empty() ? 0.0 : unheld.norm[static_cast<std::size_t>(g)];
    bounds[static_cast<std::size_t>(job)].build(k[job / k.heads].head(g), -unheld.before,
                                                k.tokens + unheld.after, outside,
                                                ConvertedRowsLease<Scalar>()->key);
  });
  const Index group = q.heads / k.heads;
  std::atomic<Index> uncertified{0};
  for_each_query_tile(q, k, v, [&](Index b, Index h, Index tile, Index row_begin, Index row_end) {
    std::optional<HeadMap<Scalar>> out_head;
    if (out != nullptr) out_head.emplace((*out)[b].head(h));
    Block visited;
    if (!windowed_rows<Scalar>(q[b].head(h), k[b].head(h / group), v[b].head(h / group), resolved,
                               slopes[static_cast<std::size_t>(h)], tolerance,
                               bounds[static_cast<std::size_t>(b * k.heads + h / group)], row_begin,
                               row_end, out_head ? &*out_head : nullptr, visited,
                               lse.empty() ? nullptr : lse.row(b, h))) {
      uncertified.fetch_add(1, std::memory_order_relaxed);
    }
    if (kept != nullptr) {
      (*kept)[static_cast<std::size_t>((b * q.heads + h) * tiles + tile)] = visited;
    }
  });
  return uncertified.load();
}

/// windowed_alibi_attention with its optional outputs: the row lse (unless `lse` is empty) and,
/// when `kept` is not null, the kept key rows with the call's shapes and tolerance.
template <class Scalar>
void windowed_alibi_attention_keeping(const BatchedHeadsView<const Scalar>& q,
                                      const BatchedHeadsView<const Scalar>& k,
                                      const BatchedHeadsView<const Scalar>& v,
                                      const BatchedHeadsView<Scalar>& out,
                                      const std::vector<double>& slopes, double tolerance,
                                      const AttentionOptions& options,
                                      const RowLse<Compute<Scalar>>& lse, KeptKeys* kept) {
  std::vector<Block> ranges;
  batched_windowed_alibi_attention<Scalar>(q, k, v, &out, slopes, tolerance, options, {},
                                           kept == nullptr ? nullptr : &ranges, lse);
  if (kept != nullptr) {
    KeptKeysAccess::store(*kept, q.batch, q.heads, q.tokens, k.tokens, tolerance,
                          std::move(ranges));
  }
}

}  // namespace detail

/// Exact ALiBi attention.
///
/// \param q `[n_q][H][d]`, \param k `[n_k][H_kv][d]`, \param v `[n_k][H_kv][d_v]`,
/// \param out `[n_q][H][d_v]`; H a multiple of H_kv (grouped-query attention).
/// \param slopes one slope per query head (alibi_slopes(H) for the standard list).
/// \param lse when not empty, receives each row's log-sum-exp, `[1][H][n_q]` (row_lse.hpp), for
/// the backward.
/// \throws std::invalid_argument on shapes that disagree, a bad slope, `out` overlapping an
/// input, or an `lse` of another shape; the message names the argument.
template <class Scalar>
void exact_alibi_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                           HeadsView<const detail::NonDeduced<Scalar>> k,
                           HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                           const std::vector<double>& slopes, const AttentionOptions& options = {},
                           RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::batched_exact_alibi_attention<Scalar>(detail::batch_of_one(q), detail::batch_of_one(k),
                                                detail::batch_of_one(v), detail::batch_of_one(out),
                                                slopes, options, lse);
}

/// ALiBi attention that drops only keys it certifies to weigh at most `tolerance`: for every
/// query row, the exact-ALiBi attention weight of all the keys it drops is at most `tolerance`,
/// so each output entry is within \f$2\,\text{tolerance}\max_j |v_j|\f$ of exact ALiBi, up
/// to floating-point rounding. Each tile of 64 query rows visits its keys nearest first, 128 per
/// step and side, until the bound of detail/windowed.hpp (from
/// \f$|\text{scale}|\,\|q_i\|\,\|k_j\|\f$, the distance and the row's log-sum-exp so far) certifies
/// the rest. The window therefore depends on the data: keys with large scores far back (attention
/// sinks, copied spans) are visited, and where they are absent the window is a few multiples of
/// \f$1/m_h\f$. `tolerance = 0` is exact ALiBi.
///
/// Arguments as exact_alibi_attention (`lse` over the kept keys); \param tolerance in [0, 1];
/// \param kept when not null, receives the key rows each query tile kept, for
/// windowed_alibi_attention_backward.
template <class Scalar>
void windowed_alibi_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                              HeadsView<const detail::NonDeduced<Scalar>> k,
                              HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                              const std::vector<double>& slopes, double tolerance = 1e-6,
                              const AttentionOptions& options = {},
                              RowLse<detail::Compute<Scalar>> lse = {}, KeptKeys* kept = nullptr) {
  detail::windowed_alibi_attention_keeping<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), slopes, tolerance, options, lse, kept);
}

/// ALiBi truncated where the factor \f$e^{-m_h|p_i - p_j|}\f$ falls below `factor_tolerance`:
/// head h keeps \f$|p_i - p_j| \le \lfloor \ln(1/\text{factor\_tolerance}) / m_h \rfloor\f$ and
/// skips whole key tiles outside that band. **No bound on the error:** a dropped key that scores
/// far above the kept ones (an attention sink, a copied span) keeps a large weight under exact
/// ALiBi, so the output can be far from exact ALiBi at any `factor_tolerance`. It is the cheapest
/// band, for comparison and for logits known to be flat; windowed_alibi_attention is the kernel
/// whose tolerance is a guarantee. `factor_tolerance = 0` is exact ALiBi. Gradients:
/// truncated_alibi_attention_backward (backward.hpp).
///
/// Arguments as exact_alibi_attention; \param factor_tolerance in [0, 1].
template <class Scalar>
void truncated_alibi_attention(HeadsView<const detail::NonDeduced<Scalar>> q,
                               HeadsView<const detail::NonDeduced<Scalar>> k,
                               HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                               const std::vector<double>& slopes, double factor_tolerance,
                               const AttentionOptions& options = {},
                               RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::batched_truncated_alibi_attention<Scalar>(
      detail::batch_of_one(q), detail::batch_of_one(k), detail::batch_of_one(v),
      detail::batch_of_one(out), slopes, factor_tolerance, options, "truncated_alibi_attention",
      lse);
}

}  // namespace plsh

#endif  // PLSH_ATTENTION_ALIBI_ATTENTION_HPP
