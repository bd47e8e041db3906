#ifndef PLSH_ALIBI_KV_CACHE_HPP
#define PLSH_ALIBI_KV_CACHE_HPP

/// \file alibi_kv_cache.hpp
/// AlibiKvCache: incremental decoding of exact ALiBi attention with a bounded key/value cache, and
/// for every row a certified upper bound on the exact-ALiBi weight of the keys it dropped.
///
/// Eviction. Key/value head g keeps the newest \f$W_g\f$ positions (a query at p sees
/// \f$[p - W_g + 1, p]\f$) and pins up to `sinks` of the keys that leave that window, those of
/// largest norm (decode/pinned_keys.hpp); the others are dropped. With the declared bounds
/// \f$S\f$ = `max_score` and \f$F\f$ = `min_logit`, the window of slope m is the smallest W with
/// \f[ \frac{e^{S - m W} / (1 - e^{-m})}{e^{F} (1 - e^{-m W}) / (1 - e^{-m})} \le \tau,
/// \quad\text{that is}\quad W = \left\lceil \ln(1 + e^{S - F}/\tau) / m \right\rceil \f]
/// (alibi_cache_window): dropped keys at distances \f$\ge W\f$ weigh at most \f$e^{S - m\delta}\f$
/// each, and the W keys of the window at least \f$e^{F - m\delta}\f$. \f$m_g\f$ is the smallest
/// slope of g's query heads. Memory: at most \f$W_g + c - 1 + \text{sinks}\f$ rows per key/value
/// head for appends of at most c tokens, whatever the context, and \f$O(\log n)\f$ blocks of
/// positions (decode/evicted_keys.hpp).
///
/// Certificate. A row at p with \f$a = |\text{scale}|\,\|q\|\f$, slope m and log-sum-exp
/// \f$\ell\f$ over the keys it keeps reports
/// \f[ B = \sum_b e^{a K_b - m(p - e_b + 1)} \sum_{t < L_b} e^{-mt} \big/ e^{\ell} \f]
/// over the blocks of dropped positions (\f$L_b\f$ positions ending at \f$e_b\f$, key norms at
/// most \f$K_b\f$): the certified window's bound (attention/detail/windowed.hpp,
/// dropped_weight_bound) on the keys the cache no longer holds. By Cauchy-Schwarz B is at least the
/// exact-ALiBi weight that the dropped keys have in the row over the whole prefix, whatever the
/// inputs; so each output entry is within \f$2B\max_j|v_j|\f$ of exact ALiBi. When the declaration
/// holds (below) every B is at most the tolerance; when a query breaks it, B says so
/// (DroppedWeight, or CertificateError in strict mode).
///
/// Cost per decoded token and head: \f$(d + d_v)\f$ multiply-adds per resident key (the tiled core
/// of attention/regular.hpp, attend_keys) plus one exponential per block; per appended token and
/// key/value head, O(d) for the norm of the key that leaves the window.
///
/// Tested in tests/test_alibi_kv_cache.cpp: at tolerance 0 and before any eviction against
/// exact_alibi_attention over the whole prefix (bit for bit), at tolerance \f$\tau\f$ within
/// \f$2\tau\max|v|\f$ of it, the bound against the dense double weights of the dropped keys on
/// hostile inputs (a sink at position 0, growing key norms, a sudden large query), the resident
/// bound over a long run, and errors that leave the cache unchanged.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "attention/detail/windowed.hpp"
#include "attention/regular.hpp"
#include "decode/cache_shape.hpp"
#include "decode/evicted_keys.hpp"
#include "decode/kv_buffer.hpp"
#include "decode/pinned_keys.hpp"
#include "detail/check.hpp"
#include "detail/parallel.hpp"
#include "detail/storage.hpp"
#include "detail/validate.hpp"
#include "limits.hpp"
#include "options.hpp"
#include "tensor.hpp"

namespace plsh {

/// Options of AlibiKvCache: the attention options (causal must be true; `key_position` is the
/// position of the first appended token; `query_position` is ignored), the tolerance, and the
/// declaration from which the windows are sized.
struct AlibiCacheOptions : AttentionOptions {
  /// \f$\tau\f$ in [0, 1]: the exact-ALiBi weight a row may drop. 0 keeps every key.
  double tolerance = 1e-4;
  /// Declared: \f$|\text{scale}|\,\|q\|\,\|k\| \le\f$ max_score for every query and every key it
  /// drops (a bound on the logits' Cauchy-Schwarz bound, which the certificate evaluates).
  double max_score = 16;
  /// Declared: \f$\text{scale}\,q\cdot k \ge\f$ min_logit for every query and every key of its
  /// window. Cauchy-Schwarz gives -max_score; a tighter value of the model's logits gives shorter
  /// windows.
  double min_logit = -16;
  /// Keys per key/value head kept after they leave the window: those of largest norm.
  Index sinks = 4;
  /// Throw CertificateError from a step whose bound exceeds the tolerance (after its outputs are
  /// written and the cache has advanced), instead of reporting it in the DroppedWeight.
  bool strict = false;
};

/// What a step of AlibiKvCache certifies.
struct DroppedWeight {
  /// The largest, over the step's rows and heads, upper bound on the exact-ALiBi weight that a row
  /// dropped (0 while nothing is dropped; NaN or infinite for non-finite inputs).
  double bound = 0;
  /// `bound <= tolerance`.
  bool certified = true;
};

/// Thrown by a strict AlibiKvCache step whose bound exceeds the tolerance. The step has been taken:
/// its outputs are written and the cache holds its keys.
class CertificateError : public std::runtime_error {
 public:
  CertificateError(const std::string& message, const DroppedWeight& dropped)
      : std::runtime_error(message), dropped_(dropped) {}
  const DroppedWeight& dropped() const noexcept { return dropped_; }

 private:
  DroppedWeight dropped_;
};

/// Returned by alibi_cache_window for a head that keeps every key.
constexpr Index kKeepEveryKey = std::numeric_limits<Index>::max();

namespace detail {

/// The checks of the tolerance and the declaration.
inline void validate_alibi_cache_options(const char* function, const AlibiCacheOptions& options) {
  require(options.tolerance >= 0 && options.tolerance <= 1, function,
          "options.tolerance must lie in [0, 1]");
  require(std::isfinite(options.max_score) && options.max_score >= 0, function,
          "options.max_score must be finite and non-negative");
  require(std::isfinite(options.min_logit) && options.min_logit <= options.max_score, function,
          "options.min_logit must be finite and at most options.max_score");
  require(options.sinks >= 0, function, "options.sinks must be non-negative");
}

}  // namespace detail

/// The window of a head of slope `slope` (file comment): \f$\lceil \ln(1 + e^{S - F}/\tau)/m
/// \rceil\f$ positions, at least 1; kKeepEveryKey for slope 0, tolerance 0, or a window beyond
/// kMaxPosition.
/// \throws std::invalid_argument for a bad slope, tolerance or declaration.
inline Index alibi_cache_window(double slope, const AlibiCacheOptions& options) {
  const char* function = "alibi_cache_window";
  detail::require_slope(slope, function);
  detail::validate_alibi_cache_options(function, options);
  if (slope == 0 || options.tolerance == 0) return kKeepEveryKey;
  // ln(1 + e^y) for y = S - F - ln(tau), without overflow.
  const double y = options.max_score - options.min_logit - std::log(options.tolerance);
  const double softplus = y > 30 ? y + std::log1p(std::exp(-y)) : std::log1p(std::exp(y));
  const double window = std::ceil(softplus / slope);
  if (!(window <= static_cast<double>(kMaxPosition))) return kKeepEveryKey;
  return std::max<Index>(1, static_cast<Index>(window));
}

/// Key/value cache for incremental causal exact-ALiBi attention with bounded memory and a
/// certificate per row.
///
/// Contract (the one of KvCache): `append` stores the keys and values of the next positions;
/// `attend` computes the outputs of queries at the newest positions, `position() - q.tokens ..
/// position() - 1`, with `q.tokens` at most the tokens of the last `append`; `decode` does both.
/// A row attends, with exact ALiBi, the keys its key/value head holds: its window, from the first
/// position of the last append minus \f$W_g - 1\f$ on, and the pinned keys. Each step returns a
/// DroppedWeight and keeps the bound of every row (`bounds()`).
///
/// Guarantees, for every row and up to floating-point rounding:
/// - always: its bound is at least the exact-ALiBi weight, over the whole prefix, of the keys it
///   does not attend; each output entry is within \f$2\,\text{bound}\max_j|v_j|\f$ of
///   exact_alibi_attention over the whole prefix;
/// - at tolerance 0, or before any key leaves a window: the row is exact_alibi_attention's;
/// - when the declaration holds, the bound is at most the tolerance: every query q has
///   \f$|\text{scale}|\,\|q\|\,\|k\| \le\f$ max_score against every key it drops (a key that left
///   the window and is not one of the `sinks` of largest norm that left it), and
///   \f$\text{scale}\,q\cdot k \ge\f$ min_logit against every key of its window;
/// - memory: at most alibi_cache_window + (largest append) - 1 + sinks rows per key/value head.
///
/// Not guaranteed: that the declaration holds (a query far larger than those before, or a key
/// larger than the pinned ones, can break it; its bound then exceeds the tolerance and is
/// reported); and slope 0 or tolerance 0 keep every key (memory grows with the context).
///
/// A cache keeps the scratch and the bounds of its steps, so one cache must not be used from two
/// threads at once (not even `attend`, which is const); distinct caches may.
///
/// \code
/// plsh::AlibiCacheOptions options;  // tolerance 1e-4, max_score 16, min_logit -16, 4 sinks
/// plsh::AlibiKvCache<float> cache(heads, kv_heads, dim, dim, plsh::alibi_slopes(heads), options);
/// for (Index step = 0; step < steps; ++step) {
///   // ... compute q, k, v of one token: [1][heads][dim], [1][kv_heads][dim] ...
///   const plsh::DroppedWeight dropped = cache.decode(q_view, k_view, v_view, out_view);
///   if (!dropped.certified) { /* a row may have dropped more than the tolerance */ }
/// }
/// \endcode
///
/// \tparam Scalar storage type of keys, values, queries and outputs: float, double,
/// Eigen::bfloat16 or Eigen::half (the 16-bit types compute in float).
template <class Scalar>
class AlibiKvCache {
  static_assert(detail::is_storage_type<Scalar>,
                "AlibiKvCache stores float, double, Eigen::bfloat16 or Eigen::half");
  using Compute = detail::Compute<Scalar>;

 public:
  /// \param heads query heads H, \param kv_heads key/value heads (H a multiple of it),
  /// \param dim key and query size d, \param value_dim value size d_v, \param slopes one per
  /// query head, \param options see AlibiCacheOptions.
  /// \throws std::invalid_argument for non-positive sizes, H not a multiple of kv_heads, a bad
  /// slope, `causal == false`, a key_position outside [0, kMaxPosition], a scale that is not
  /// finite and non-zero in the compute type, or a bad tolerance or declaration.
  AlibiKvCache(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
               AlibiCacheOptions options = {})
      : shape_(detail::CacheShape::checked("AlibiKvCache", heads, kv_heads, dim, value_dim, slopes,
                                           options.causal, options.key_position)),
        slopes_(std::move(slopes)),
        options_(options),
        position_(options.key_position) {
    const char* function = "AlibiKvCache";
    detail::validate_scale<Scalar>(function, options, dim);
    detail::validate_alibi_cache_options(function, options);
    scale_ = detail::resolved_scale(options, dim);
    const Index group = heads / kv_heads;
    windows_.assign(static_cast<std::size_t>(kv_heads), 1);
    for (Index h = 0; h < heads; ++h) {
      const double slope = slopes_[static_cast<std::size_t>(h)];
      Index& window = windows_[static_cast<std::size_t>(h / group)];
      window = std::max(window, alibi_cache_window(slope, options));
      log_sums_.push_back(detail::block_log_sums(slope));
    }
    for (Index g = 0; g < kv_heads; ++g) {
      buffers_.emplace_back(1, dim, value_dim, options.key_position);
      pins_.emplace_back(options.sinks, dim, value_dim);
      evicted_.emplace_back(options.key_position);
    }
  }

  /// Appends the keys and values of positions `position() .. position() + k.tokens - 1`, after
  /// each key/value head g has let go of the positions before `position() - W_g + 1` (pinning or
  /// dropping them).
  /// \param k `[n][kv_heads][dim]`, \param v `[n][kv_heads][value_dim]`; n = 0 does nothing.
  /// \throws std::invalid_argument when the shapes disagree with the cache, or when the positions
  /// would pass kMaxPosition.
  void append(HeadsView<const Scalar> k, HeadsView<const Scalar> v) {
    shape_.check_append("AlibiKvCache::append", k, v, position());
    append_checked(k, v);
  }

  /// Outputs of the queries at positions `position() - q.tokens .. position() - 1`, and what their
  /// rows dropped (the bound of each row and head in `bounds()`).
  /// \param q `[n][heads][dim]`, \param out `[n][heads][value_dim]`, n at most the tokens of the
  /// last append (n = 0 does nothing).
  /// \throws std::invalid_argument when the shapes disagree with the cache, when n is larger than
  /// the last append, or when `out` overlaps q or the cache; CertificateError in strict mode.
  DroppedWeight attend(HeadsView<const Scalar> q, HeadsView<Scalar> out) const {
    const char* function = "AlibiKvCache::attend";
    shape_.check_query(function, q, out);
    detail::require(q.tokens <= last_append_, function, [&] {
      return "q.tokens (" + std::to_string(q.tokens) +
             ") must not exceed the tokens of the last append (" + std::to_string(last_append_) +
             ")";
    });
    check_separate(function, q, q, q, out, false);
    return attend_checked(function, q, out);
  }

  /// One decoding step: `append(k, v)` then `attend(q, out)` with `q.tokens == k.tokens`, the same
  /// outputs and bounds bit for bit. Every argument is checked before the cache changes (a call
  /// that throws std::invalid_argument leaves it as it was).
  /// \throws std::invalid_argument as append and attend; CertificateError in strict mode.
  DroppedWeight decode(HeadsView<const Scalar> q, HeadsView<const Scalar> k,
                       HeadsView<const Scalar> v, HeadsView<Scalar> out) {
    const char* function = "AlibiKvCache::decode";
    shape_.check_append(function, k, v, position());
    shape_.check_query(function, q, out);
    detail::require(q.tokens == k.tokens, function, "q.tokens must equal k.tokens");
    check_separate(function, q, k, v, out, true);
    append_checked(k, v);
    return attend_checked(function, q, out);
  }

  /// The bound of each row and head of the last attend or decode, at `[row * heads() + head]`.
  const std::vector<double>& bounds() const { return bounds_; }

  /// The absolute position of the next token.
  Index position() const { return position_; }

  /// \f$W_g\f$ of key/value head `kv_head` (alibi_cache_window of its smallest slope), or
  /// kKeepEveryKey.
  Index window(Index kv_head) const { return windows_[checked(kv_head)]; }

  /// Rows that key/value head `kv_head` holds: its window and its pinned keys.
  Index resident(Index kv_head) const {
    const std::size_t g = checked(kv_head);
    return buffers_[g].resident() + pins_[g].size();
  }

  /// The largest resident(kv_head) over the key/value heads.
  Index resident() const {
    Index most = 0;
    for (Index g = 0; g < shape_.kv_heads; ++g) most = std::max(most, resident(g));
    return most;
  }

  /// The first position of the window of key/value head `kv_head`.
  Index oldest_position(Index kv_head) const { return buffers_[checked(kv_head)].oldest(); }

  /// The positions of the pinned keys of key/value head `kv_head`, oldest first.
  const std::vector<Index>& pinned_positions(Index kv_head) const {
    return pins_[checked(kv_head)].positions();
  }

  /// Blocks of the dropped positions of key/value head `kv_head` (decode/evicted_keys.hpp).
  Index evicted_blocks(Index kv_head) const {
    return static_cast<Index>(evicted_[checked(kv_head)].blocks().size());
  }

  /// Bytes of the key and value rows held (windows with their room for later appends, and pins)
  /// and of the blocks of dropped positions.
  std::size_t bytes() const {
    std::size_t total = 0;
    for (std::size_t g = 0; g < buffers_.size(); ++g) {
      total += buffers_[g].bytes() + pins_[g].bytes() +
               evicted_[g].blocks().capacity() * sizeof(detail::EvictedKeys::Block);
    }
    return total;
  }

  Index heads() const { return shape_.heads; }
  Index kv_heads() const { return shape_.kv_heads; }
  Index dim() const { return shape_.dim; }
  Index value_dim() const { return shape_.value_dim; }
  const std::vector<double>& slopes() const { return slopes_; }
  const AlibiCacheOptions& options() const { return options_; }

 private:
  std::size_t checked(Index kv_head) const {
    detail::require(kv_head >= 0 && kv_head < shape_.kv_heads, "AlibiKvCache",
                    "kv_head must lie in [0, kv_heads)");
    return static_cast<std::size_t>(kv_head);
  }

  /// `out` writes each element once and overlaps neither q (nor k and v: `with_appended`) nor the
  /// storage of any key/value head (the appended rows land in it, or in new storage).
  void check_separate(const char* function, const HeadsView<const Scalar>& q,
                      const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                      const HeadsView<Scalar>& out, bool with_appended) const {
    const HeadsView<Scalar> outputs[] = {out};
    const char* const output_names[] = {"out"};
    if (with_appended) {
      const HeadsView<const Scalar> inputs[] = {q, k, v};
      const char* const input_names[] = {"q", "k", "v"};
      detail::require_separate(function, inputs, input_names, outputs, output_names);
    } else {
      const HeadsView<const Scalar> inputs[] = {q};
      const char* const input_names[] = {"q"};
      detail::require_separate(function, inputs, input_names, outputs, output_names);
    }
    for (std::size_t g = 0; g < buffers_.size(); ++g) {
      const HeadsView<const Scalar> storage[] = {buffers_[g].key_buffer(),
                                                 buffers_[g].value_buffer(), pins_[g].key_storage(),
                                                 pins_[g].value_storage()};
      const char* const storage_names[] = {"the cache's keys", "the cache's values",
                                           "the cache's pinned keys", "the cache's pinned values"};
      detail::require_separate(function, storage, storage_names, outputs, output_names);
    }
  }

  /// append after its checks: each head lets go of the positions before the chunk's first minus
  /// \f$W_g - 1\f$, then stores the rows.
  void append_checked(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
    if (k.tokens == 0) return;
    for (Index g = 0; g < shape_.kv_heads; ++g) {
      const Index window = windows_[static_cast<std::size_t>(g)];
      if (window != kKeepEveryKey) evict_before(g, position_ - window + 1);
      detail::KvBuffer<Scalar>& buffer = buffers_[static_cast<std::size_t>(g)];
      buffer.append(HeadsView<const Scalar>{k.data + g * k.head_stride, k.tokens, 1, shape_.dim,
                                            k.token_stride, k.head_stride},
                    HeadsView<const Scalar>{v.data + g * v.head_stride, v.tokens, 1,
                                            shape_.value_dim, v.token_stride, v.head_stride});
    }
    position_ += k.tokens;
    last_append_ = k.tokens;
  }

  /// Key/value head g lets go of its window's positions before `first`: each is offered to the
  /// pins, and the position, with the norm of the key dropped (if it is this one), joins the
  /// dropped blocks; a pin it replaces is dropped with its norm.
  void evict_before(Index g, Index first) {
    detail::KvBuffer<Scalar>& buffer = buffers_[static_cast<std::size_t>(g)];
    detail::PinnedKeys<Scalar>& pins = pins_[static_cast<std::size_t>(g)];
    detail::EvictedKeys& evicted = evicted_[static_cast<std::size_t>(g)];
    for (Index position = buffer.oldest(); position < first; ++position) {
      const Scalar* key = buffer.key_row(0, position);
      const double norm = key_norm(key);
      const auto offer = pins.offer(position, norm, key, buffer.value_row(0, position));
      const bool this_key = offer.dropped && offer.position == position;
      evicted.push(this_key ? norm : -1.0);
      if (offer.dropped && !this_key) evicted.raise(offer.position, offer.norm);
    }
    buffer.evict_before(first);
  }

  /// key_norm_bound of a stored key row, in the compute type.
  double key_norm(const Scalar* row) {
    const ConstHeadMap<Scalar> map(row, 1, shape_.dim, Eigen::OuterStride<>(shape_.dim));
    return detail::key_norm_bound(detail::compute_rows(map, norm_scratch_).row(0));
  }

  /// attend after its checks: every (head, tile of query rows) in parallel, then the summary.
  DroppedWeight attend_checked(const char* function, const HeadsView<const Scalar>& q,
                               const HeadsView<Scalar>& out) const {
    const Index rows = q.tokens;
    bounds_.resize(static_cast<std::size_t>(rows * shape_.heads));
    if (rows == 0) return DroppedWeight{};
    const Index tiles = (rows + detail::kQueryTile - 1) / detail::kQueryTile;
    const Index group = shape_.heads / shape_.kv_heads;
    double work = 0;
    for (Index h = 0; h < shape_.heads; ++h) {
      work += static_cast<double>(resident(h / group)) * static_cast<double>(rows) *
              static_cast<double>(shape_.dim + shape_.value_dim);
    }
    detail::parallel_for(shape_.heads * tiles, work, [&](Index job) {
      const Index h = job / tiles;
      const Index tile = job % tiles;
      attend_rows(q, out, h, tile * detail::kQueryTile,
                  std::min(rows, (tile + 1) * detail::kQueryTile));
    });
    DroppedWeight dropped;
    Index worst = 0;
    for (std::size_t i = 0; i < bounds_.size(); ++i) {
      if (!(bounds_[i] <= dropped.bound)) {
        dropped.bound = bounds_[i];
        worst = static_cast<Index>(i);
        if (std::isnan(dropped.bound)) break;
      }
    }
    dropped.certified = dropped.bound <= options_.tolerance;
    if (options_.strict && !dropped.certified) {
      throw CertificateError(
          std::string(function) + ": the row at position " +
              std::to_string(position() - rows + worst / shape_.heads) + " of head " +
              std::to_string(worst % shape_.heads) + " may have dropped an exact-ALiBi weight of " +
              std::to_string(dropped.bound) + " > tolerance " + std::to_string(options_.tolerance),
          dropped);
    }
    return dropped;
  }

  /// Query rows `[row_begin, row_end)` of head h: the pinned keys, then the window, through the
  /// tiled core (regular.hpp) into one online softmax; writes the rows of `out` and their bounds.
  void attend_rows(const HeadsView<const Scalar>& q, const HeadsView<Scalar>& out, Index h,
                   Index row_begin, Index row_end) const {
    const detail::TileWorkspaceLease<Compute> workspace_lease;
    const detail::ConvertedRowsLease<Scalar> converted_lease;
    detail::TileWorkspace<Compute>& workspace = *workspace_lease;
    detail::ConvertedRows<Scalar>& converted = *converted_lease;
    const std::size_t g = static_cast<std::size_t>(h / (shape_.heads / shape_.kv_heads));
    const detail::KvBuffer<Scalar>& buffer = buffers_[g];
    const detail::PinnedKeys<Scalar>& pins = pins_[g];
    const Index rows = row_end - row_begin;
    const Index first_query = position() - q.tokens + row_begin;
    const double slope = slopes_[static_cast<std::size_t>(h)];
    const detail::LinearBias bias{slope, detail::kNoWindow};
    // Every row lies within the window's span: no row constant on the logits (apply_linear_bias).
    const detail::KeySpan span{first_query - buffer.oldest(), first_query - (buffer.end() - 1)};
    AttentionOptions options;
    options.scale = scale_;
    workspace.softmax.reset(rows, shape_.value_dim);
    workspace.query.noalias() = detail::compute_rows(q.head(h), row_begin, rows, converted.query) *
                                static_cast<Compute>(scale_);
    pins.for_each_run([&](Index first, Index count) {
      options.key_position = pins.position(first);
      detail::attend_keys(ConstHeadMap<Scalar>(pins.key_row(first), count, shape_.dim,
                                               Eigen::OuterStride<>(shape_.dim)),
                          ConstHeadMap<Scalar>(pins.value_row(first), count, shape_.value_dim,
                                               Eigen::OuterStride<>(shape_.value_dim)),
                          options, bias, span, first_query, 0, count, workspace, converted);
    });
    // The window's keys up to the tile's last row (as attend_rows: the same tiles of keys).
    options.key_position = buffer.oldest();
    const Index key_end = std::min(buffer.resident(), first_query + rows - buffer.oldest());
    detail::attend_keys(buffer.keys().head(0), buffer.values().head(0), options, bias, span,
                        first_query, 0, key_end, workspace, converted);
    // The certificate of each row, from its norm and log-sum-exp, lowered by a margin for the
    // rounding of the sum over the kept keys and of their logits.
    const double kept = static_cast<double>(buffer.resident() + pins.size());
    constexpr double epsilon = std::numeric_limits<Compute>::epsilon();
    for (Index r = 0; r < rows; ++r) {
      const double lse = static_cast<double>(workspace.softmax.log_sum(r));
      const double margin = epsilon * (std::abs(lse) + kept + static_cast<double>(shape_.dim));
      bounds_[static_cast<std::size_t>((row_begin + r) * shape_.heads + h)] =
          evicted_[g].bound(detail::key_norm_bound(workspace.query.row(r)), slope, first_query + r,
                            lse - margin, log_sums_[static_cast<std::size_t>(h)]);
    }
    HeadMap<Scalar> out_head = out.head(h);
    workspace.softmax.finish(converted.result.bind(out_head, row_begin, rows), nullptr);
    converted.result.store();
  }

  detail::CacheShape shape_;
  std::vector<double> slopes_;
  AlibiCacheOptions options_;
  Index position_;  // of the next appended token
  double scale_ = 0;
  std::vector<Index> windows_;                     // per key/value head: W_g or kKeepEveryKey
  std::vector<std::vector<double>> log_sums_;      // per head: block_log_sums of its slope
  std::vector<detail::KvBuffer<Scalar>> buffers_;  // per key/value head: its window
  std::vector<detail::PinnedKeys<Scalar>> pins_;   // per key/value head
  std::vector<detail::EvictedKeys> evicted_;       // per key/value head: the dropped positions
  Index last_append_ = 0;
  detail::AlignedVector<Compute> norm_scratch_;  // a key row in the compute type (16-bit storage)
  mutable std::vector<double> bounds_;           // [row][head] of the last step
};

}  // namespace plsh

#endif  // PLSH_ALIBI_KV_CACHE_HPP
