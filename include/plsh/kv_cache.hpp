#ifndef PLSH_KV_CACHE_HPP
#define PLSH_KV_CACHE_HPP

/// \file kv_cache.hpp
/// KvCache: incremental (causal) Positional LSH decoding with a key/value cache that forgets the
/// keys no later query can reach.
///
/// The partitions live on absolute positions, so a query at position p sees, in head h and draw
/// t, only keys of its block, which starts at \f$b_{h,t}(p) \le p\f$. The keys any query at
/// position \f$\ge p\f$ can reach start at \f$E(p) = \min_{h,t} b_{h,t}(p)\f$, which never
/// decreases with p: everything before \f$E\f$ of the first position of the newest chunk is
/// evicted. The cache therefore holds at most \f$\max_p (p - E(p) + 1) + c - 1\f$ tokens for
/// chunks of c tokens: about the largest block pitch of the draws, which for s draws of the
/// flattest head (slope \f$m_{\min}\f$) is near \f$(\ln s + \ln\ln s)/m_{\min}\f$, whatever the
/// sequence length. With a near field (PlshOptions::near_field, near_field.hpp) of largest
/// reach w the cache also keeps the last w positions.
///
/// Parts: decode/kv_buffer.hpp stores the rows (amortised O(1) copies per appended token),
/// decode/block_tracker.hpp keeps the blocks of the newest position (O(s) per head and token),
/// decode/decode_step.hpp computes up to detail::kDecodeRows queries by the single-query path
/// on one or more threads, decode/decode_mode.hpp chooses per cache whether one-token steps use
/// more than one (\f$(d + d_v)\f$ multiply-adds per key of each head's union, about
/// \f$(\ln s + \ln\ln s)/m\f$ keys). More queries go to the fused (or pass) kernel of
/// plsh_attention on the resident keys.
///
/// Storage: float, double, Eigen::bfloat16 or Eigen::half keys, values, queries and outputs,
/// computed in detail::Compute (float for the 16-bit types).
///
/// Tested in tests/test_kv_cache*.cpp: against plsh_attention over the whole sequence (every
/// chunk size, grouped heads, float, double, bfloat16 and half, non-finite inputs), identical
/// results at 1, 2 and 3 threads, decode against append then attend (bit for bit), no allocation
/// in a decoding step, the resident bound computed from the partitions, and errors that leave the
/// cache unchanged; the same tests run through the AVX-512 products in test_kv_cache_avx512, where
/// the build machine has AVX-512.

#include <chrono>
#include <cstddef>
#include <string>
#include <utility>
#include <vector>

#include "attention/near_field.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/regular.hpp"
#include "decode/block_tracker.hpp"
#include "decode/cache_shape.hpp"
#include "decode/decode_mode.hpp"
#include "decode/decode_step.hpp"
#include "decode/kv_buffer.hpp"
#include "detail/check.hpp"
#include "detail/storage.hpp"
#include "detail/validate.hpp"
#include "limits.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

namespace plsh {

/// Key/value cache for incremental causal Positional LSH attention.
///
/// Contract: `append` stores the keys and values of the next positions; `attend` computes the
/// outputs of queries at the newest positions, `position() - q.tokens .. position() - 1`, where
/// `q.tokens` may not exceed the number of tokens of the last `append`. The outputs equal those
/// rows of plsh_attention over the whole sequence with the same slopes and options (to rounding):
/// eviction at an append uses the first position of the appended chunk, and no query at or after
/// that position can reach an evicted key. The outputs do not depend on the number of threads.
///
/// A cache keeps the scratch of its steps, so one cache must not be used from two threads at
/// once (not even `attend`, which is const); distinct caches may.
///
/// \code
/// plsh::PlshOptions options;  // causal, s = 100, Latin hypercube, near_field 0.05, seed 0
/// plsh::KvCache<float> cache(heads, kv_heads, dim, dim, plsh::alibi_slopes(heads), options);
/// for (Index step = 0; step < steps; ++step) {
///   // ... compute q, k, v of one token: [1][heads][dim], [1][kv_heads][dim] ...
///   cache.decode(q_view, k_view, v_view, out_view);  // out: [1][heads][dim]
///   // the same as cache.append(k_view, v_view); cache.attend(q_view, out_view);
/// }
/// \endcode
///
/// \tparam Scalar storage type of keys, values, queries and outputs: float, double,
/// Eigen::bfloat16 or Eigen::half (the 16-bit types halve the cache's bytes and compute in float).
template <class Scalar>
class KvCache {
  static_assert(detail::is_storage_type<Scalar>,
                "KvCache stores float, double, Eigen::bfloat16 or Eigen::half");

 public:
  /// \param heads query heads H, \param kv_heads key/value heads (H a multiple of it),
  /// \param dim key and query size d, \param value_dim value size d_v,
  /// \param slopes one per query head, \param options causal must be true; `key_position` is the
  /// absolute position of the first appended token, `query_position` is ignored (queries are at
  /// the newest positions); samples, seed and kernel as plsh_attention.
  /// \throws std::invalid_argument for non-positive sizes, H not a multiple of kv_heads, a bad
  /// slope, `samples` outside [1, kMaxSamples], `causal == false`, `near_field` outside [0, 1],
  /// a key_position outside [0, kMaxPosition], or a scale that is not finite and non-zero in the
  /// compute type.
  KvCache(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
          PlshOptions options = {})
      : shape_(detail::CacheShape::checked("KvCache", heads, kv_heads, dim, value_dim, slopes,
                                           options.causal, options.key_position)),
        slopes_(std::move(slopes)),
        options_(options),
        blocks_(checked_grids(dim, slopes_, options), options.samples, options.key_position),
        buffer_(kv_heads, dim, value_dim, options.key_position),
        estimators_(detail::head_estimators(slopes_, options.samples, options.near_field,
                                            detail::PositionRange{0, kMaxPosition})),
        near_reach_(detail::largest_reach(estimators_)) {}

  /// Appends the keys and values of positions `position() .. position() + k.tokens - 1`, after
  /// evicting the keys that no query at `position()` or later can reach.
  /// \param k `[n][kv_heads][dim]`, \param v `[n][kv_heads][value_dim]`; n = 0 does nothing.
  /// \throws std::invalid_argument when the shapes disagree with the cache, or when the positions
  /// would pass kMaxPosition.
  void append(HeadsView<const Scalar> k, HeadsView<const Scalar> v) {
    const char* function = "KvCache::append";
    shape_.check_append(function, k, v, position());
    append_checked(k, v);
  }

  /// Outputs of the queries at positions `position() - q.tokens .. position() - 1`.
  /// \param q `[n][heads][dim]`, \param out `[n][heads][value_dim]`, n at most the number of
  /// tokens of the last append (n = 0 does nothing).
  /// \throws std::invalid_argument when the shapes disagree with the cache, when n is larger than
  /// the last append, or when `out` overlaps q or the cache.
  void attend(HeadsView<const Scalar> q, HeadsView<Scalar> out) const {
    const char* function = "KvCache::attend";
    shape_.check_query(function, q, out);
    detail::require(q.tokens <= last_append_, function, [&] {
      return "q.tokens (" + std::to_string(q.tokens) +
             ") must not exceed the tokens of the last append (" + std::to_string(last_append_) +
             ")";
    });
    if (q.tokens == 0) return;
    // The same checks as plsh_attention (out against q and the cache) on the resident views.
    detail::validate_attention(function, q, keys(), values(), out, attend_options(q.tokens));
    attend_checked(q, out);
  }

  /// One decoding step: `append(k, v)` then `attend(q, out)` with `q.tokens == k.tokens` (the
  /// queries of the appended positions), the same outputs bit for bit. Every check is made
  /// before the cache changes (a call that throws leaves it as it was), and once per step.
  /// \param q `[n][heads][dim]`, \param k `[n][kv_heads][dim]`, \param v
  /// `[n][kv_heads][value_dim]`, \param out `[n][heads][value_dim]`; n = 0 does nothing.
  /// \throws std::invalid_argument as append and attend: shapes that disagree with the cache or
  /// with each other, positions past kMaxPosition, or `out` overlapping q, k, v or the cache.
  void decode(HeadsView<const Scalar> q, HeadsView<const Scalar> k, HeadsView<const Scalar> v,
              HeadsView<Scalar> out) {
    const char* function = "KvCache::decode";
    shape_.check_append(function, k, v, position());
    shape_.check_query(function, q, out);
    detail::require(q.tokens == k.tokens, function, "q.tokens must equal k.tokens");
    // The whole buffers: the appended rows land in them (or in new ones, which out cannot
    // overlap).
    const HeadsView<const Scalar> inputs[] = {q, k, v, buffer_.key_buffer(),
                                              buffer_.value_buffer()};
    const char* const input_names[] = {"q", "k", "v", "the cache's keys", "the cache's values"};
    const HeadsView<Scalar> outputs[] = {out};
    const char* const output_names[] = {"out"};
    detail::require_separate(function, inputs, input_names, outputs, output_names);
    if (k.tokens == 0) return;
    if (q.tokens != 1) {
      append_checked(k, v);
      attend_checked(q, out);
      return;
    }
    // Split across threads or kept on this one (decode_mode.hpp), timed from the append on.
    using Clock = std::chrono::steady_clock;
    const detail::DecodeModeChoice::Step mode =
        detail::decode_threads_available() > 1 ? mode_.next()
                                               : detail::DecodeModeChoice::Step{false, false, -1};
    const Clock::time_point start = mode.measured ? Clock::now() : Clock::time_point{};
    append_checked(k, v);
    // Successive one-token steps run their heads in opposite orders (decode_step.hpp): a step
    // starts on the keys that the step before read last.
    const double work =
        detail::decode_step(buffer_, blocks_, shape_.heads, options_.samples, q, out,
                            detail::resolved_scale(attend_options(1), shape_.dim), mode.parallel,
                            reverse_heads_, workspace_, estimators_);
    reverse_heads_ = !reverse_heads_;
    if (mode.measured) {
      mode_.record(mode, work, std::chrono::duration<double>(Clock::now() - start).count());
    }
  }

  /// The absolute position of the next token: `options.key_position` plus the tokens appended so
  /// far (with the default key_position 0, the number of tokens appended).
  Index position() const { return buffer_.end(); }

  /// Tokens still stored.
  Index resident() const { return buffer_.resident(); }

  /// Absolute position of the oldest stored token (`position() - resident()`).
  Index oldest_position() const { return buffer_.oldest(); }

  /// The stored keys, `[resident()][kv_heads][dim]`, positions `oldest_position()` on (each
  /// head's rows contiguous: token stride `dim`). Valid until the next append.
  HeadsView<const Scalar> keys() const { return buffer_.keys(); }

  /// The stored values, `[resident()][kv_heads][value_dim]`. Valid until the next append.
  HeadsView<const Scalar> values() const { return buffer_.values(); }

  /// Bytes of the key and value buffers (resident rows and the room for later appends):
  /// `capacity * kv_heads * (dim + value_dim) * sizeof(Scalar)`, half as much for the 16-bit
  /// types as for float.
  std::size_t bytes() const { return buffer_.bytes(); }

  Index heads() const { return shape_.heads; }
  Index kv_heads() const { return shape_.kv_heads; }
  Index dim() const { return shape_.dim; }
  Index value_dim() const { return shape_.value_dim; }
  const std::vector<double>& slopes() const { return slopes_; }
  const PlshOptions& options() const { return options_; }

 private:
  /// The constructor's checks beyond those of CacheShape::checked, then the draws of every head.
  static std::vector<std::vector<Grid>> checked_grids(Index dim, const std::vector<double>& slopes,
                                                      const PlshOptions& options) {
    const char* function = "KvCache";
    detail::require_samples(options.samples, function, "options.samples");
    detail::validate_scale<detail::Compute<Scalar>>(function, options, dim);
    return detail::kernel_grids(slopes, options, function);
  }

  /// The options of plsh_attention over the resident keys for the newest `tokens` queries.
  PlshOptions attend_options(Index tokens) const {
    PlshOptions options = options_;
    options.query_position = position() - tokens;
    options.key_position = buffer_.oldest();
    return options;
  }

  /// append after its checks: evicts before \f$E\f$ of the chunk's first position (and, with a
  /// near field of largest reach w, before that position minus w), stores the rows, and leaves
  /// the tracker at the newest position.
  void append_checked(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
    if (k.tokens == 0) return;
    const Index reachable = blocks_.advance(position());
    buffer_.evict_before(near_reach_ >= 0 ? std::min(reachable, position() - near_reach_)
                                          : reachable);
    buffer_.append(k, v);
    last_append_ = k.tokens;
    if (k.tokens > 1) blocks_.advance(position() - 1);
  }

  /// attend after its checks, for 1 <= q.tokens <= last_append_.
  void attend_checked(const HeadsView<const Scalar>& q, const HeadsView<Scalar>& out) const {
    const PlshOptions options = attend_options(q.tokens);
    if (q.tokens <= detail::kDecodeRows) {
      detail::decode_step(buffer_, blocks_, shape_.heads, options_.samples, q, out,
                          detail::resolved_scale(options, shape_.dim), true, false, workspace_,
                          estimators_);
    } else if (options.kernel == Kernel::Passes) {
      detail::pass_attention(q, keys(), values(), out, blocks_.grids(),
                             detail::head_estimators(slopes_, options.samples, options.near_field,
                                                     detail::position_range(q, keys(), options)),
                             options, RegularAttention{});
    } else {
      detail::fused_attention(q, keys(), values(), out, blocks_.grids(), slopes_, options,
                              options.near_field);
    }
  }

  detail::CacheShape shape_;
  std::vector<double> slopes_;
  PlshOptions options_;
  detail::BlockTracker blocks_;
  detail::KvBuffer<Scalar> buffer_;
  std::vector<detail::Estimator> estimators_;  // per head: its weights and near field
  Index near_reach_;                           // the largest reach of estimators_ (-1: none)
  Index last_append_ = 0;
  bool reverse_heads_ = false;     // the next one-token decode runs its heads last to first
  detail::DecodeModeChoice mode_;  // one-token decode steps on all threads or on the caller's
  // The scratch of the single-query path: written by attend, which is const.
  mutable detail::DecodeWorkspace<Scalar> workspace_;
};

}  // namespace plsh

#endif  // PLSH_KV_CACHE_HPP
