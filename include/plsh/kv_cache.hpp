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
/// sequence length.
///
/// Cost per appended token: amortised O(1) copies (the resident rows slide to the front of their
/// buffer when it is full) plus O(1) amortised block look-ups per (head, draw), which also keep
/// the block of the newest position of every (head, draw).
///
/// `attend` of at most detail::kDecodeRows queries (decoding) takes the single-query path: for a
/// query at p, the blocks of its draws all end after p, so with \f$b_t\f$ their starts the count
/// is \f$c_j = \#\{t : b_t \le j\}\f$ on the union \f$[\min_t b_t, p]\f$, and
/// \f[ o_p = \frac{\sum_j c_j e^{S_{pj}} v_j}{\sum_j c_j e^{S_{pj}}}, \f]
/// the fused estimator. The union is split into ranges of detail::kDecodeKeyChunk keys; each
/// (query, head, range) is a job: a matrix-vector product for its scores, \f$\log c_j\f$ added,
/// an online softmax of one row and a matrix-vector product with its values, giving a partial
/// (output, lse). With more than one OpenMP thread (when the work is worth it) the jobs are cut
/// into contiguous parts, one per thread, sized by each thread's measured speed (timed from the
/// hand-over), and run on the helper threads of detail/thread_team.hpp (spinning between steps,
/// so a step makes no system call; in an OpenMP region when that team is busy or the caller is
/// inside a parallel region).
/// A one-token `decode` stays on the calling thread instead while that is measured faster
/// (detail::DecodeModeChoice, which tries the other mode every detail::kDecodeProbeEvery steps).
/// They are merged by log-sum-exp in job order (by the thread that ran all of a head's jobs, or
/// after the parts for a head whose jobs two threads shared), so the result is identical for any
/// number of threads, any cut and any order of the jobs: successive one-token `decode` steps of a
/// cache run each part's heads in opposite orders (a head's jobs always in order, one stream of
/// keys for the prefetchers), so that a step starts on the keys the step before read last, still
/// cached when the keys of a step outgrow the cache (float at context 65536, 8 heads, d = 64:
/// about 0.85 MB of keys and values per step against a 1 MB L2). A job's two products run in the
/// AVX-512 code of detail/decode_simd.hpp when the library is compiled for it (the scores' product
/// also returns their maximum, and one pass then computes the exponentials times the counts instead
/// of adding the counts' logarithms; bfloat16 keys meet the bfloat16 query in `vdpbf16ps` where
/// AVX-512 BF16 is present), else in Eigen's matrix-vector products. Either way a job is plain
/// arithmetic; one whose output or sum comes out non-finite is recomputed by the OnlineSoftmax of
/// the other kernels, which applies the non-finite contract. Cost per query and head: \f$(d +
/// d_v)\f$ times the union width (about \f$(\ln s + \ln\ln s)/m\f$), plus O(s) per job for the
/// counts; the newest position's block starts are kept sorted by the appends, and its jobs read
/// them there, so a one-token attend looks up, sorts and copies none, and allocates nothing once
/// the scratch has grown (each thread scales the queries of its own heads: the calling thread
/// writes no copy of them or of the block starts for a helper to fetch; no cache line is written
/// by two threads in a step, and the job list only where it changes from the step before). More
/// queries go to the fused (or pass) kernel of plsh_attention on the resident keys, whose products
/// are GEMMs over query tiles.
///
/// `decode(q, k, v, out)` is one decoding step: append then attend, every check made once and
/// before the cache changes.
///
/// Storage: float, double, Eigen::bfloat16 or Eigen::half keys, values, queries and outputs,
/// computed in detail::Compute (float for the 16-bit types: each key and value range is
/// converted once per job, each output row rounded once).
///
/// Tested in tests/test_kv_cache.cpp against plsh_attention over the whole sequence (every chunk
/// size, grouped heads, float, double, bfloat16 and half, non-finite inputs), for identical
/// results at 1, 2 and 3 threads (and for the choice of mode), for decode against append then
/// attend (bit for bit), for no allocation in a decoding step, and for the resident bound
/// computed from the partitions; the same tests run through the AVX-512 products in
/// test_kv_cache_avx512, where the build machine has AVX-512.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "attention/online_softmax.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/regular.hpp"
#include "detail/check.hpp"
#include "detail/decode_simd.hpp"
#include "detail/parallel.hpp"
#include "detail/storage.hpp"
#include "detail/thread_team.hpp"
#include "detail/validate.hpp"
#include "limits.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

namespace plsh {
namespace detail {

/// Query rows up to which KvCache::attend takes the single-query path, whatever the kernel of the
/// options (it evaluates the fused estimator); more rows go to the fused or pass kernel, whose
/// products are GEMMs over query tiles.
constexpr Index kDecodeRows = 16;

/// Keys per job of the single-query path: a (row, head) whose union is wider is split into
/// ranges of this many keys, so that one wide head does not leave the other threads idle.
constexpr Index kDecodeKeyChunk = 128;

/// The fixed work of a job of the single-query path (its maximum, exponentials, counts and merge)
/// in keys, when the jobs are shared among threads: measured, short jobs of steep heads otherwise
/// left the thread that ran them behind.
constexpr Index kDecodeJobKeys = 16;

/// The parts of a decoding step follow the threads' measured speeds, each counted at least
/// 1/kDecodeSpeedRange of the fastest one's (a thread preempted once is not left idle), smoothed
/// from step to step by kDecodeSpeedSmoothing (the weight of the newest measurement).
constexpr double kDecodeSpeedRange = 4;
constexpr double kDecodeSpeedSmoothing = 0.125;

/// `work` per second for `work` done in `seconds`, or 0 for a step that cannot be measured (no
/// work, or no time on the clock).
inline double measured_speed(double work, double seconds) {
  return seconds > 0 && work > 0 ? work / seconds : 0;
}

/// Folds `work` done in `seconds` into the smoothed speed `speed` (work per second, 0 until the
/// first measurement, weight kDecodeSpeedSmoothing for the newest); a step that cannot be
/// measured changes nothing.
inline void smooth_speed(double& speed, double work, double seconds) {
  const double measured = measured_speed(work, seconds);
  if (!(measured > 0)) return;
  speed = speed > 0 ? speed + kDecodeSpeedSmoothing * (measured - speed) : measured;
}

/// One-token decoding steps run on the calling thread alone when that is measured faster than on
/// all threads (see DecodeModeChoice). The mode that runs is measured every kDecodeMeasureEvery
/// steps; every kDecodeProbeEvery steps the other one runs kDecodeProbeSteps steps (a probe), of
/// which the last kDecodeProbeMeasured decide, unless one of the others is kDecodeProbeAbort
/// times slower than the mode that runs. Measured on a 2-core virtual machine:
/// - timing every step cost 0.2-0.3 us of a 7.5 us step;
/// - waking a helper that sleeps took about 110 us;
/// - after a change of mode, steps came within 5% of their steady time from the fifth on
///   (parallel: 113, 10.1, 8.3, 8.0, then 7.8 us against 7.5; the calling thread alone: 13.4,
///   8.6-9.2, 8.0, 8.0, then 7.7-7.9 us against 7.6), so that a probe measured at its second step
///   favoured the mode that ran;
/// - the second step of a probe of parallel mode after 4096 steps on the calling thread took up
///   to 2.5 times the steady time, hence an abort at 4 times;
/// - with the helper on the caller's core (a caller pinned to one core when it started the
///   helpers) a parallel step took 220 us.
constexpr std::uint64_t kDecodeProbeEvery = 4096;
constexpr std::uint64_t kDecodeMeasureEvery = 16;
constexpr int kDecodeProbeSteps = 8;
constexpr int kDecodeProbeMeasured = 4;
constexpr double kDecodeProbeAbort = 4;

/// Estimated multiply-adds from which the single-query path runs on more than one thread. Handing
/// a step to warm helper threads costs 0.1-0.5 microseconds, the time of some 10^4 multiply-adds
/// (an OpenMP region 1.3-3.5 us on the 2-core virtual machines measured).
constexpr double kDecodeParallelWork = 1 << 15;

/// Whether the single-query path computes its products with decode_simd.hpp (float, bfloat16
/// and half storage; double always takes Eigen's products).
#if defined(PLSH_DECODE_AVX512)
constexpr bool kDecodeSimd = true;
#else
constexpr bool kDecodeSimd = false;
#endif

/// The place of job j's log-sum-exp in DecodeWorkspace::lse is `j * kDecodeLseStride<Scalar>`,
/// one 64-byte line per job (a quarter of the bytes of its partial output at d_v = 64): packed,
/// the two threads of a step wrote neighbouring entries of the same lines at once, and a 2-thread
/// decoding step took 3.1-3.7% longer (two builds alternating in one program, both placements).
template <class Scalar>
constexpr Index kDecodeLseStride = 64 / static_cast<Index>(sizeof(Scalar));

/// Keys `[begin, min(end, p + 1))` (absolute positions) of query row `row`, at position p, and
/// head `head`: `end` is the end of the job's range of kDecodeKeyChunk keys, so that the job
/// list of a one-token step is that of the step before (and is not written again) until a
/// head's union gains or loses a range or moves.
struct DecodeJob {
  Index row;
  Index head;
  Index begin;
  Index end;
};

/// The end of `job`'s keys when its query rows start at position `first_query`.
inline Index job_end(const DecodeJob& job, Index first_query) {
  return std::min(job.end, first_query + job.row + 1);
}

inline bool operator==(const DecodeJob& a, const DecodeJob& b) {
  return a.row == b.row && a.head == b.head && a.begin == b.begin && a.end == b.end;
}

/// `target = value`, unless it holds that value already: a helper thread that read the line in
/// the step before keeps it, and the calling thread does not wait to take it back.
template <class T>
void store_changed(T& target, const T& value) {
  if (!(target == value)) target = value;
}

/// What the calling thread keeps of one thread's part of the single-query path, each on a cache
/// line of its own (written at every step, while the helpers read the job list).
struct alignas(64) DecodePart {
  Index work = 0;    // its keys (with kDecodeJobKeys per job and the extra)
  double speed = 0;  // its thread's smoothed keys per second; 0: unmeasured
  // When it ended in the last step split across threads (a helper's as the team saw it).
  std::chrono::steady_clock::time_point end;
};

/// Which of two modes runs a one-token decoding step (KvCache::decode) when more than one thread
/// is available: all threads (parallel) or the calling thread alone. The faster one by its
/// measured speed (keys of work per second of whole steps, append included):
/// - the mode that runs is measured at the last of every kDecodeMeasureEvery steps, smoothed by
///   kDecodeSpeedSmoothing;
/// - every kDecodeProbeEvery steps the other mode runs kDecodeProbeSteps steps (a probe). Its
///   speed becomes the median of the last kDecodeProbeMeasured of them: the first ones wake the
///   helpers and bring the data into their cores' caches. A step of the probe after its first
///   that is kDecodeProbeAbort times slower than the running mode ends the probe, its speed that
///   step's;
/// - at first parallel runs until it is measured, then a probe measures the calling thread alone.
///
/// On a virtual machine a helper can sit on a core that is slower or busy, or cross cores at a
/// cost that outweighs the split: the steps then stay on one thread. Steps whose work cannot be
/// measured (too little work to split) change nothing. The outputs do not depend on the mode. One
/// choice per calling thread and storage type, shared by its caches (the layers of a model decode
/// steps of the same shape).
struct DecodeModeChoice {
  struct Step {
    bool parallel;
    bool measured;
    int probe_step;  // the step's place in a probe, 0 .. kDecodeProbeSteps - 1; else -1
  };
  double speed[2] = {0, 0};       // [0]: the calling thread alone, [1]: parallel; 0: not measured
  std::uint64_t since_probe = 0;  // steps of the faster mode since the last probe
  int probe_left = 0;             // steps left of the running probe
  double samples[kDecodeProbeMeasured] = {};  // the probe's deciding speeds; 0: not measurable

  bool parallel_faster() const { return !(speed[1] > 0 && speed[0] > speed[1]); }

  Step next() {
    if (probe_left == 0 && speed[1] > 0 &&
        (!(speed[0] > 0) || since_probe + 1 >= kDecodeProbeEvery)) {
      probe_left = kDecodeProbeSteps;
      since_probe = 0;
      std::fill(samples, samples + kDecodeProbeMeasured, 0.0);
    }
    if (probe_left > 0) {
      const int place = kDecodeProbeSteps - probe_left--;
      return Step{!parallel_faster(), place > 0, place};
    }
    ++since_probe;
    return Step{parallel_faster(), since_probe % kDecodeMeasureEvery == 0, -1};
  }

  void record(const Step& step, double work, double seconds) {
    double& mode_speed = speed[step.parallel ? 1 : 0];
    if (step.probe_step < 0) {
      smooth_speed(mode_speed, work, seconds);
      return;
    }
    const double measured = measured_speed(work, seconds);
    constexpr int first_sample = kDecodeProbeSteps - kDecodeProbeMeasured;
    if (step.probe_step >= first_sample) {
      samples[step.probe_step - first_sample] = measured;
    } else if (measured > 0 && measured * kDecodeProbeAbort < speed[step.parallel ? 0 : 1]) {
      mode_speed = measured;
      probe_left = 0;
      return;
    }
    if (step.probe_step + 1 < kDecodeProbeSteps) return;
    // The median of the measurable samples (a preempted step does not decide).
    double sorted[kDecodeProbeMeasured];
    const std::ptrdiff_t count = std::copy_if(samples, samples + kDecodeProbeMeasured, sorted,
                                              [](double sample) { return sample > 0; }) -
                                 sorted;
    if (count == 0) return;
    // Insertion sort: GCC 12 warns of bounds in std::sort's code for arrays this short.
    for (std::ptrdiff_t i = 1; i < count; ++i) {
      for (std::ptrdiff_t j = i; j > 0 && sorted[j - 1] > sorted[j]; --j) {
        std::swap(sorted[j - 1], sorted[j]);
      }
    }
    mode_speed = 0.5 * (sorted[(count - 1) / 2] + sorted[count / 2]);
  }
};

/// Scratch of one thread of the single-query path.
template <class Storage>
struct DecodeThreadState {
  using Scalar = Compute<Storage>;
  OnlineSoftmax<Scalar> softmax;
  AlignedVector<Scalar> keys;    // a chunk of keys in the compute type (16-bit storage)
  AlignedVector<Scalar> values;  // a chunk of values in the compute type (16-bit storage)
  alignas(64) Scalar scores[kDecodeKeyChunk];
  OutputRows<Storage> output;     // the output rows of the (row, head)s this thread merges
  AlignedVector<Scalar> queries;  // [row][head][dim]: its part's queries times the scale
};

/// Scratch of the single-query path of one calling thread, reused across calls: after the first
/// calls of a given size, a call allocates nothing.
template <class Storage>
struct DecodeWorkspace {
  using Scalar = Compute<Storage>;
  // [row][head][draw]: the block starts, sorted per row and head, of the rows before the newest
  std::vector<Index> begins;
  std::vector<Index> first_job;  // [row * heads + head]: its first job; one more at the end
  std::vector<DecodeJob> jobs;
  std::vector<Index> part_first;  // [part]: the first job of each thread's part; one more
  std::vector<DecodePart> parts;  // [part]
  AlignedVector<Scalar> partial;  // [job][value_dim]: normalised output of the job's keys
  // [job * kDecodeLseStride]: log-sum-exp of the job's logits, each on a cache line of its own:
  // the jobs on either side of a cut between two parts are written by two threads at once
  AlignedVector<Scalar> lse;
  std::vector<Scalar> log_count;  // log(c) for c = 0..s, log(0) = -inf
  std::vector<DecodeThreadState<Storage>> threads;
};

/// Folds the times of a parallel step's parts into the threads' speeds, each part counted from
/// `published`, when the calling thread handed them out: a helper's part then counts the time the
/// step took to reach it (on the team's helpers, twice: once more for its end to reach the calling
/// thread), and the parts, which follow these speeds, end together rather than last equally long.
template <class Storage>
void record_decode_parts(DecodeWorkspace<Storage>& workspace, Index threads,
                         std::chrono::steady_clock::time_point published) {
  for (Index t = 0; t < threads; ++t) {
    const std::size_t part = static_cast<std::size_t>(t);
    DecodePart& stats = workspace.parts[part];
    smooth_speed(stats.speed, static_cast<double>(stats.work),
                 std::chrono::duration<double>(stats.end - published).count());
  }
}

/// Adds \f$\log c_j\f$ to the logits of keys `first_position .. first_position + count - 1`:
/// \f$c_j = \#\{t : b_t \le j\}\f$, `begins` the s block starts of the row's draws, sorted
/// (causal: every block of the row ends after it, so the counts only step up), in segments of
/// constant count.
template <class Scalar>
void add_log_counts(Scalar* scores, Index count, Index first_position, const Index* begins,
                    Index samples, const std::vector<Scalar>& log_count) {
  Index draws = std::upper_bound(begins, begins + samples, first_position) - begins;
  for (Index position = first_position; position < first_position + count;) {
    const Index next =
        draws < samples ? std::min(begins[draws], first_position + count) : first_position + count;
    const Scalar log_c = log_count[static_cast<std::size_t>(draws)];
    for (Index j = position - first_position; j < next - first_position; ++j) scores[j] += log_c;
    position = next;
    while (draws < samples && begins[draws] <= position) ++draws;
  }
}

/// The logits of one job, \f$\text{scale}\, q \cdot k_j + \log c_j\f$ over its keys, into an
/// online softmax of one row: \f$c_j = \#\{t : b_t \le j\}\f$, `begins` the s block starts of
/// the row's draws, sorted (causal: every block of the row ends after it, so the counts only
/// step up). Writes the job's normalised output and log-sum-exp. The general path: any input,
/// with the non-finite contract of OnlineSoftmax.
template <class Storage>
void decode_job_general(const ConstHeadMap<Storage>& keys, const ConstHeadMap<Storage>& values,
                        const Compute<Storage>* query, Index first_position, const Index* begins,
                        Index samples, const std::vector<Compute<Storage>>& log_count,
                        DecodeThreadState<Storage>& state, Compute<Storage>* out,
                        Compute<Storage>* lse) {
  using Scalar = Compute<Storage>;
  const Index count = keys.rows();
  const ConstHeadMap<Scalar> k = compute_rows(keys, state.keys);
  const ConstHeadMap<Scalar> v = compute_rows(values, state.values);
  Eigen::Map<RowMatrix<Scalar>> scores(state.scores, 1, count);
  const Eigen::Map<const RowMatrix<Scalar>> q(query, 1, keys.cols());
  scores.noalias() = q * k.transpose();
  add_log_counts(scores.data(), count, first_position, begins, samples, log_count);
  state.softmax.reset(1, values.cols());
  state.softmax.update(scores, v);
  state.softmax.finish(Eigen::Map<RowMatrix<Scalar>>(out, 1, values.cols()), lse);
}

/// One job of the single-query path: decode_job_general's result, computed without its
/// non-finite bookkeeping. Every key of a job has a count of at least 1 (the union starts at the
/// smallest block start), so no logit is masked; with finite inputs the plain arithmetic below
/// is the online softmax of one row. Any non-finite input that reaches the output leaves a
/// non-finite output or sum (a NaN or infinite logit, or a value row with a NaN or infinity
/// times its weight, even an underflowed one), and the job is then recomputed by
/// decode_job_general, which applies the contract.
template <class Storage>
void decode_job(const ConstHeadMap<Storage>& keys, const ConstHeadMap<Storage>& values,
                const Compute<Storage>* query, const Storage* raw_query, Compute<Storage> scale,
                Index first_position, const Index* begins, Index samples,
                const std::vector<Compute<Storage>>& log_count, DecodeThreadState<Storage>& state,
                Compute<Storage>* out, Compute<Storage>* lse) {
  using Scalar = Compute<Storage>;
  const Index count = keys.rows();
  const Index value_dim = values.cols();
  Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>, Eigen::Aligned64> scores(state.scores,
                                                                                count);
  constexpr bool simd = kDecodeSimd && std::is_same<Scalar, float>::value;
  static_cast<void>(raw_query);
  static_cast<void>(scale);
  // Logits: with the AVX-512 products, the scores alone and their maximum (the counts later
  // multiply the exponentials instead of adding their logarithms here); else Eigen's product plus
  // log c_j.
  Scalar max = -std::numeric_limits<Scalar>::infinity();
  if constexpr (simd) {
#if defined(PLSH_DECODE_AVX512)
#if defined(PLSH_DECODE_AVX512_BF16)
    if constexpr (std::is_same<Storage, Eigen::bfloat16>::value) {
      max = avx512::scores_bf16(keys.data(), count, keys.cols(), keys.outerStride(), raw_query,
                                scale, state.scores);
    } else
#endif
    {
      max =
          avx512::scores(keys.data(), count, keys.cols(), keys.outerStride(), query, state.scores);
    }
#endif
  } else {
    const ConstHeadMap<Scalar> k = compute_rows(keys, state.keys);
    scores.noalias() =
        k * Eigen::Map<const Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(query, keys.cols());
    add_log_counts(state.scores, count, first_position, begins, samples, log_count);
    max = scores.maxCoeff();
  }
  if (max > -std::numeric_limits<Scalar>::infinity()) {
    Scalar sum = 0;
    if constexpr (simd) {
#if defined(PLSH_DECODE_AVX512)
      sum = avx512::exp_counts(state.scores, count, first_position, begins, samples, max);
      avx512::weighted_sum(values.data(), count, value_dim, values.outerStride(), state.scores,
                           out);
#endif
    } else {
      scores.array() = (scores.array() - max).exp();
      sum = scores.sum();
      Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>>(out, value_dim).noalias() =
          compute_rows(values, state.values).transpose() * scores;
    }
    Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>> result(out, value_dim);
    result /= sum;
    *lse = max + std::log(sum);
    if (all_finite(result) && std::isfinite(*lse)) return;
  }
  decode_job_general(keys, values, query, first_position, begins, samples, log_count, state, out,
                     lse);
}

}  // namespace detail

/// Key/value cache for incremental causal Positional LSH attention.
///
/// Contract: `append` stores the keys and values of the next positions; `attend` computes the
/// outputs of queries at the newest positions, `position() - q.tokens .. position() - 1`, where
/// `q.tokens` may not exceed the number of tokens of the last `append`. The outputs equal those
/// rows of plsh_attention over the whole sequence with the same slopes and options (to rounding):
/// eviction at an append uses the first position of the appended chunk, and no query at or after
/// that position can reach an evicted key.
///
/// \code
/// plsh::PlshOptions options;  // causal, s = 20, seed 0
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
  /// slope, `samples` outside [1, kMaxSamples], `causal == false`, a key_position outside
  /// [0, kMaxPosition], or a scale that is not finite and non-zero in the compute type.
  KvCache(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
          PlshOptions options = {})
      : heads_(heads),
        kv_heads_(kv_heads),
        dim_(dim),
        value_dim_(value_dim),
        slopes_(std::move(slopes)),
        options_(options) {
    const char* function = "KvCache";
    detail::require(heads >= 1, function, "heads must be at least 1");
    detail::require(kv_heads >= 1, function, "kv_heads must be at least 1");
    detail::require(heads % kv_heads == 0, function, "heads must be a multiple of kv_heads");
    detail::require(dim >= 1, function, "dim must be at least 1");
    detail::require(value_dim >= 1, function, "value_dim must be at least 1");
    detail::validate_slopes(function, slopes_, heads, "heads");
    detail::require_samples(options.samples, function, "options.samples");
    detail::require(options.causal, function,
                    "options.causal must be true (a cache serves causal decoding)");
    detail::require(options.key_position >= 0 && options.key_position <= kMaxPosition, function,
                    "options.key_position must lie in [0, kMaxPosition = 2^53]");
    detail::validate_scale<detail::Compute<Scalar>>(function, options, dim);
    grids_ = detail::kernel_grids(slopes_, options, function);
    position_ = options.key_position;
    oldest_ = options.key_position;
    // No block is known yet: the first append looks up every (head, draw).
    blocks_.assign(static_cast<std::size_t>(heads * options.samples), Block{0, 0});
    block_begins_.assign(blocks_.size(), 0);
  }

  /// Appends the keys and values of positions `position() .. position() + k.tokens - 1`, after
  /// evicting the keys that no query at `position()` or later can reach.
  /// \param k `[n][kv_heads][dim]`, \param v `[n][kv_heads][value_dim]`; n = 0 does nothing.
  /// \throws std::invalid_argument when the shapes disagree with the cache, or when the positions
  /// would pass kMaxPosition.
  void append(HeadsView<const Scalar> k, HeadsView<const Scalar> v) {
    const char* function = "KvCache::append";
    check_append(function, k, v);
    append_checked(k, v);
  }

  /// Outputs of the queries at positions `position() - q.tokens .. position() - 1`.
  /// \param q `[n][heads][dim]`, \param out `[n][heads][value_dim]`, n at most the number of
  /// tokens of the last append (n = 0 does nothing).
  /// \throws std::invalid_argument when the shapes disagree with the cache, when n is larger than
  /// the last append, or when `out` overlaps q or the cache.
  void attend(HeadsView<const Scalar> q, HeadsView<Scalar> out) const {
    const char* function = "KvCache::attend";
    check_query(function, q, out);
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
    check_append(function, k, v);
    check_query(function, q, out);
    detail::require(q.tokens == k.tokens, function, "q.tokens must equal k.tokens");
    detail::require_injective(out, function, "out");
    detail::require(!detail::views_overlap(out, q), function, "out overlaps q");
    detail::require(!detail::views_overlap(out, k), function, "out overlaps k");
    detail::require(!detail::views_overlap(out, v), function, "out overlaps v");
    // The whole buffers: the appended rows land in them (or in new ones, which out cannot
    // overlap).
    detail::require(!detail::views_overlap(out, buffer_view(keys_, dim_)), function,
                    "out overlaps the cache's keys");
    detail::require(!detail::views_overlap(out, buffer_view(values_, value_dim_)), function,
                    "out overlaps the cache's values");
    if (k.tokens == 0) return;
    if (q.tokens != 1) {
      append_checked(k, v);
      attend_checked(q, out);
      return;
    }
    // Split across threads or kept on this one (DecodeModeChoice), timed from the append on:
    // a step kept here looks up the next position's blocks in the next append, a split one in
    // the calling thread's part.
    using Clock = std::chrono::steady_clock;
    static thread_local detail::DecodeModeChoice choice;
    const detail::DecodeModeChoice::Step mode =
        available_threads() > 1 ? choice.next() : detail::DecodeModeChoice::Step{false, false, -1};
    const Clock::time_point start = mode.measured ? Clock::now() : Clock::time_point{};
    append_checked(k, v);
    // The blocks of the next position depend on nothing but the position: with more than one
    // thread they are looked up by the calling thread's part of this step, off the serial path of
    // the next append (on this thread, whose appends write and read the same tables).
    const Index next = position_;
    const auto look_ahead = [this, next] {
      next_.blocks = blocks_;
      next_.begins = block_begins_;
      next_.reachable = advance_blocks(next, next_.blocks, next_.begins);
      next_.position = next;
    };
    // Each step runs its heads in the opposite order to the step before (file comment).
    const double work =
        attend_rows(q, out, detail::resolved_scale(attend_options(1), dim_), look_ahead,
                    heads_ * options_.samples, mode.parallel, reverse_heads_);
    reverse_heads_ = !reverse_heads_;
    if (mode.measured) {
      choice.record(mode, work, std::chrono::duration<double>(Clock::now() - start).count());
    }
  }

  /// The absolute position of the next token: `options.key_position` plus the tokens appended so
  /// far (with the default key_position 0, the number of tokens appended).
  Index position() const { return position_; }

  /// Tokens still stored.
  Index resident() const { return resident_; }

  /// Absolute position of the oldest stored token (`position() - resident()`).
  Index oldest_position() const { return oldest_; }

  /// The stored keys, `[resident()][kv_heads][dim]`, positions `oldest_position()` on (each
  /// head's rows contiguous: token stride `dim`). Valid until the next append.
  HeadsView<const Scalar> keys() const {
    return HeadsView<const Scalar>{
        keys_.data() + start_ * dim_, resident_, kv_heads_, dim_, dim_, capacity_ * dim_};
  }

  /// The stored values, `[resident()][kv_heads][value_dim]`. Valid until the next append.
  HeadsView<const Scalar> values() const {
    return HeadsView<const Scalar>{values_.data() + start_ * value_dim_,
                                   resident_,
                                   kv_heads_,
                                   value_dim_,
                                   value_dim_,
                                   capacity_ * value_dim_};
  }

  /// Bytes of the key and value buffers (resident rows and the room for later appends):
  /// `capacity * kv_heads * (dim + value_dim) * sizeof(Scalar)`, half as much for the 16-bit
  /// types as for float.
  std::size_t bytes() const { return (keys_.size() + values_.size()) * sizeof(Scalar); }

  Index heads() const { return heads_; }
  Index kv_heads() const { return kv_heads_; }
  Index dim() const { return dim_; }
  Index value_dim() const { return value_dim_; }
  const std::vector<double>& slopes() const { return slopes_; }
  const PlshOptions& options() const { return options_; }

 private:
  /// append's checks of k and v.
  void check_append(const char* function, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v) const {
    detail::require_view(k, function, "k");
    detail::require_view(v, function, "v");
    detail::require(k.heads == kv_heads_, function, "k.heads must equal the cache's kv_heads");
    detail::require(k.dim == dim_, function, "k.dim must equal the cache's dim");
    detail::require(v.heads == kv_heads_, function, "v.heads must equal the cache's kv_heads");
    detail::require(v.dim == value_dim_, function, "v.dim must equal the cache's value_dim");
    detail::require(v.tokens == k.tokens, function, "v.tokens must equal k.tokens");
    detail::require(k.tokens <= kMaxPosition - position_, function,
                    "position() + k.tokens must not exceed kMaxPosition = 2^53");
  }

  /// The shapes of q and out against the cache.
  void check_query(const char* function, const HeadsView<const Scalar>& q,
                   const HeadsView<Scalar>& out) const {
    detail::require_view(q, function, "q");
    detail::require_view(out, function, "out");
    detail::require(q.heads == heads_, function, "q.heads must equal the cache's heads");
    detail::require(q.dim == dim_, function, "q.dim must equal the cache's dim");
    detail::require(out.tokens == q.tokens, function, "out.tokens must equal q.tokens");
    detail::require(out.heads == heads_, function, "out.heads must equal the cache's heads");
    detail::require(out.dim == value_dim_, function, "out.dim must equal the cache's value_dim");
  }

  /// A key or value buffer as one view (for overlap checks).
  static HeadsView<const Scalar> buffer_view(const detail::AlignedVector<Scalar>& buffer,
                                             Index width) {
    return HeadsView<const Scalar>{buffer.data(), static_cast<Index>(buffer.size()) / width, 1,
                                   width};
  }

  /// The options of plsh_attention over the resident keys for the newest `tokens` queries.
  PlshOptions attend_options(Index tokens) const {
    PlshOptions options = options_;
    options.query_position = position_ - tokens;
    options.key_position = oldest_;
    return options;
  }

  /// append after its checks.
  void append_checked(const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v) {
    if (k.tokens == 0) return;
    evict(reachable_from(position_));
    reserve(k.tokens);
    const Index first_row = start_ + resident_;
    for (Index g = 0; g < kv_heads_; ++g) {
      for (Index t = 0; t < k.tokens; ++t) {
        std::copy_n(k.data + t * k.token_stride + g * k.head_stride, dim_,
                    keys_.data() + (g * capacity_ + first_row + t) * dim_);
        std::copy_n(v.data + t * v.token_stride + g * v.head_stride, value_dim_,
                    values_.data() + (g * capacity_ + first_row + t) * value_dim_);
      }
    }
    resident_ += k.tokens;
    position_ += k.tokens;
    last_append_ = k.tokens;
    // The blocks of the newest position: a one-token attend looks none up. (After one token they
    // are those of the eviction above.)
    if (k.tokens > 1) reachable_from(position_ - 1);
  }

  /// attend after its checks, for 1 <= q.tokens <= last_append_.
  void attend_checked(const HeadsView<const Scalar>& q, const HeadsView<Scalar>& out) const {
    const PlshOptions options = attend_options(q.tokens);
    if (q.tokens <= detail::kDecodeRows) {
      attend_rows(
          q, out, detail::resolved_scale(options, dim_), [] {}, 0);
    } else if (options.kernel == Kernel::Passes) {
      detail::pass_attention(q, keys(), values(), out, grids_, options, RegularAttention{});
    } else {
      detail::fused_attention(q, keys(), values(), out, grids_, slopes_, options);
    }
  }

  /// \f$E(p) = \min_{h,t} b_{h,t}(p)\f$. Blocks are cached per (head, draw): p only grows, so
  /// each block is looked up once, when p enters it. The partitions are cut to
  /// `[key_position, kMaxPosition)`, which holds every position append accepts.
  Index reachable_from(Index position) {
    if (next_.position == position) {
      // Looked up during the previous step's parts (decode).
      blocks_.swap(next_.blocks);
      block_begins_.swap(next_.begins);
      next_.position = -1;
      return next_.reachable;
    }
    next_.position = -1;
    return advance_blocks(position, blocks_, block_begins_);
  }

  /// reachable_from on given arrays of blocks ([head][draw]) and their sorted begins.
  Index advance_blocks(Index position, std::vector<Block>& blocks,
                       std::vector<Index>& block_begins) const {
    Index start = position;
    const Index samples = options_.samples;
    for (Index h = 0; h < heads_; ++h) {
      Index* begins = &block_begins[static_cast<std::size_t>(h * samples)];
      for (Index t = 0; t < samples; ++t) {
        Block& block = blocks[static_cast<std::size_t>(h * samples + t)];
        if (!block.contains(position)) {
          const Index old_begin = block.begin;
          const Grid& grid = grids_[static_cast<std::size_t>(h)][static_cast<std::size_t>(t)];
          if (position == block.end) {
            // A position just past its draw's block starts the next block: only its end is
            // looked up, and its begin, the position, is the largest of the begins (no other
            // draw's block begins after the position), so the old begin leaves the sorted begins
            // and the new one goes last.
            block = detail::block_starting_at(grid, position, kMaxPosition);
            Index* old = std::lower_bound(begins, begins + samples, old_begin);
            std::copy(old + 1, begins + samples, old);
            begins[samples - 1] = position;
          } else {
            block = grid_block(grid, position, options_.key_position, kMaxPosition);
            replace_sorted(begins, samples, old_begin, block.begin);
          }
        }
      }
      start = std::min(start, begins[0]);
    }
    return start;
  }

  /// In the sorted `values[0, count)`, one entry equal to `old_value` becomes `new_value`, the
  /// entries between moving by one place so that the range stays sorted.
  static void replace_sorted(Index* values, Index count, Index old_value, Index new_value) {
    Index i = std::lower_bound(values, values + count, old_value) - values;
    for (; i + 1 < count && values[i + 1] < new_value; ++i) values[i] = values[i + 1];
    for (; i > 0 && values[i - 1] > new_value; --i) values[i] = values[i - 1];
    values[i] = new_value;
  }

  void evict(Index reachable) {
    const Index dropped = std::min(resident_, std::max<Index>(0, reachable - oldest_));
    if (dropped == 0) return;  // start_ and oldest_ unwritten (the helpers of a step read them)
    start_ += dropped;
    resident_ -= dropped;
    oldest_ += dropped;
  }

  /// Room for `count` more rows after the resident ones. When the buffer end is reached, the
  /// resident rows move to the front; the buffer grows to twice what is needed when they would
  /// fill more than half of it. Each row moved is paid for by at least as many appended rows.
  void reserve(Index count) {
    const Index capacity = capacity_;
    const Index needed = resident_ + count;
    if (start_ + needed <= capacity) return;
    const Index new_capacity = 2 * needed > capacity ? 2 * needed : capacity;
    // Per key/value head g, rows [start_, start_ + resident_) of its region move to the front of
    // its region (of new_capacity rows).
    const auto move = [&](detail::AlignedVector<Scalar>& buffer, Index width) {
      const auto rows = [&](detail::AlignedVector<Scalar>& b, Index g, Index size, Index row) {
        return b.begin() + (g * size + row) * width;
      };
      if (new_capacity == capacity) {
        // Here start_ > capacity - needed >= needed > 0: the rows move towards the front, which
        // std::copy allows within one buffer.
        for (Index g = 0; g < kv_heads_; ++g) {
          std::copy(rows(buffer, g, capacity, start_),
                    rows(buffer, g, capacity, start_ + resident_), rows(buffer, g, capacity, 0));
        }
      } else {
        detail::AlignedVector<Scalar> grown(
            static_cast<std::size_t>(new_capacity * kv_heads_ * width));
        for (Index g = 0; g < kv_heads_; ++g) {
          std::copy(rows(buffer, g, capacity, start_),
                    rows(buffer, g, capacity, start_ + resident_), rows(grown, g, new_capacity, 0));
        }
        buffer.swap(grown);
      }
    };
    move(keys_, dim_);
    move(values_, value_dim_);
    capacity_ = new_capacity;
    start_ = 0;
  }

  /// The threads a step may use: omp_get_max_threads() in OpenMP builds, else 1.
  static int available_threads() {
#if defined(_OPENMP)
    return omp_get_max_threads();
#else
    return 1;
#endif
  }

  /// The single-query path (file comment): the jobs (row, head, key range), cut into one part per
  /// thread, then per row and head the log-sum-exp merge of its jobs, in job order, so that the
  /// result does not depend on the number of threads.
  ///
  /// With more than one thread, `extra()` runs on the calling thread after the jobs of its part
  /// (the first), counted as `extra_keys` keys of work at the start of that part when the parts
  /// are cut; on one thread it does not run.
  /// `split == false` keeps the step on the calling thread; `reverse` runs each part's (row,
  /// head)s from its last to its first, each one's jobs in order (the same results). Returns the
  /// step's work in keys (as the parts count it, with `extra_keys`) when it is worth more than one
  /// thread, else 0.
  template <class Extra>
  double attend_rows(const HeadsView<const Scalar>& q, const HeadsView<Scalar>& out, double scale,
                     Extra&& extra, Index extra_keys, bool split = true,
                     bool reverse = false) const {
    using Compute = detail::Compute<Scalar>;
    using Clock = std::chrono::steady_clock;
    const int max_threads = available_threads();
    static thread_local detail::DecodeWorkspace<Scalar> calling_thread_workspace;
    // A reference: on the other threads the name must denote the calling thread's workspace, not
    // each thread's own.
    detail::DecodeWorkspace<Scalar>& workspace = calling_thread_workspace;
    const Index rows = q.tokens;
    const Index samples = options_.samples;
    const Index group = heads_ / kv_heads_;
    const Index first_query = position_ - rows;
    const Index newest_row = start_ + position_ - 1 - oldest_;  // the buffer row of the newest key
    detail::fill_log_counts(workspace.log_count, samples);
    // Room for the most jobs the cache's buffer can need, so that calls between two growths of
    // the buffer allocate nothing.
    const Index most_jobs = rows * heads_ * (capacity_ / detail::kDecodeKeyChunk + 1);
    workspace.begins.resize(static_cast<std::size_t>((rows - 1) * heads_ * samples));
    workspace.first_job.resize(static_cast<std::size_t>(rows * heads_ + 1));
    workspace.jobs.reserve(static_cast<std::size_t>(most_jobs));
    // The job list written over the one of the call before, only where it changed.
    std::size_t job_count = 0;
    const auto put_job = [&](const detail::DecodeJob& job) {
      if (job_count < workspace.jobs.size()) {
        detail::store_changed(workspace.jobs[job_count], job);
      } else {
        workspace.jobs.push_back(job);
      }
      ++job_count;
    };
    Index union_keys = 0;  // keys of every (row, head) union
    for (Index r = 0; r < rows; ++r) {
      const Index position = first_query + r;
      for (Index h = 0; h < heads_; ++h) {
        Index first_begin = 0;
        if (r == rows - 1) {
          // The newest position: the sorted starts of its blocks are kept by the appends, and
          // read there (begins_of).
          first_begin = std::max(oldest_, block_begins_[static_cast<std::size_t>(h * samples)]);
        } else {
          Index* begins = &workspace.begins[static_cast<std::size_t>((r * heads_ + h) * samples)];
          for (Index t = 0; t < samples; ++t) {
            const Block& newest = blocks_[static_cast<std::size_t>(h * samples + t)];
            // Rows before the newest block of a draw: chunks that crossed a block boundary.
            begins[t] = std::max(
                oldest_,
                newest.contains(position)
                    ? newest.begin
                    : grid_block(grids_[static_cast<std::size_t>(h)][static_cast<std::size_t>(t)],
                                 position, options_.key_position, kMaxPosition)
                          .begin);
          }
          std::sort(begins, begins + samples);
          first_begin = begins[0];
        }
        detail::store_changed(workspace.first_job[static_cast<std::size_t>(r * heads_ + h)],
                              static_cast<Index>(job_count));
        for (Index begin = first_begin; begin <= position; begin += detail::kDecodeKeyChunk) {
          put_job(detail::DecodeJob{r, h, begin, begin + detail::kDecodeKeyChunk});
        }
        union_keys += position + 1 - first_begin;
      }
    }
    workspace.jobs.resize(job_count);
    const Index jobs = static_cast<Index>(job_count);
    detail::store_changed(workspace.first_job.back(), jobs);
    workspace.partial.resize(static_cast<std::size_t>(most_jobs * value_dim_));
    constexpr Index lse_stride = detail::kDecodeLseStride<Compute>;
    workspace.lse.resize(static_cast<std::size_t>(most_jobs * lse_stride));
    const double work = static_cast<double>(union_keys) * static_cast<double>(dim_ + value_dim_);
    // Whether the work is worth more than one thread, and whether this step uses them.
    const bool worth_splitting = max_threads > 1 && jobs > 1 && work >= detail::kDecodeParallelWork;
    const Index threads = worth_splitting && split ? max_threads : 1;
    if (static_cast<Index>(workspace.threads.size()) < threads) {
      workspace.threads.resize(static_cast<std::size_t>(threads));
    }
    // The closures that a part runs capture by value (but the workspace and extra): a helper runs
    // a copy of run_part on its own stack (below), so that its jobs read nothing from the calling
    // thread's stack, whose lines that thread writes meanwhile.
    const auto run_job = [this, &workspace, group, q, scale, rows, samples, first_query](
                             Index j, detail::DecodeThreadState<Scalar>& state) {
      const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(j)];
      const Index g = job.head / group;
      const Index first_row = start_ + job.begin - oldest_;
      const Index count = detail::job_end(job, first_query) - job.begin;
      const Index index = job.row * heads_ + job.head;
      detail::decode_job<Scalar>(
          ConstHeadMap<Scalar>(keys_.data() + (g * capacity_ + first_row) * dim_, count, dim_,
                               Eigen::OuterStride<>(dim_)),
          ConstHeadMap<Scalar>(values_.data() + (g * capacity_ + first_row) * value_dim_, count,
                               value_dim_, Eigen::OuterStride<>(value_dim_)),
          &state.queries[static_cast<std::size_t>(index * dim_)],
          q.data + job.row * q.token_stride + job.head * q.head_stride, static_cast<Compute>(scale),
          job.begin, begins_of(workspace, rows, job.row, job.head), samples, workspace.log_count,
          state, &workspace.partial[static_cast<std::size_t>(j * value_dim_)],
          &workspace.lse[static_cast<std::size_t>(j * lse_stride)]);
    };
    // Each thread takes a contiguous part of the jobs with about its share of the keys (each job
    // counted kDecodeJobKeys more, the extra work extra_keys at the start): from one token to the
    // next the parts cover nearly the same keys, which stay in that core's cache. The shares
    // follow each thread's measured speed on its recent parts (equal until measured; each part
    // timed from the hand-over, record_decode_parts): the cores of a shared or virtual machine can
    // differ by tens of percent, and the step ends with its slowest part.
    workspace.part_first.resize(static_cast<std::size_t>(threads + 1));
    if (workspace.parts.size() < static_cast<std::size_t>(threads)) {
      workspace.parts.resize(static_cast<std::size_t>(threads));
    }
    {
      const double total = static_cast<double>(union_keys + detail::kDecodeJobKeys * jobs +
                                               (threads > 1 ? extra_keys : 0));
      bool measured = true;
      double fastest = 0;
      for (Index t = 0; t < threads; ++t) {
        const double speed = workspace.parts[static_cast<std::size_t>(t)].speed;
        measured = measured && speed > 0;
        fastest = std::max(fastest, speed);
      }
      // Each thread's share: its speed, at least 1/kDecodeSpeedRange of the fastest; equal shares
      // until every thread has been measured.
      const auto share = [&](Index t) {
        return measured ? std::max(workspace.parts[static_cast<std::size_t>(t)].speed,
                                   fastest / detail::kDecodeSpeedRange)
                        : 1.0;
      };
      double share_sum = 0;
      for (Index t = 0; t < threads; ++t) share_sum += share(t);
      Index part = 0;
      double share_before = share(0);                    // shares of parts 0..part
      Index keys_before = threads > 1 ? extra_keys : 0;  // keys before job j (extra first)
      Index keys_at_cut = 0;
      detail::store_changed(workspace.part_first[0], Index{0});
      for (Index j = 0; j < jobs && part + 1 < threads; ++j) {
        const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(j)];
        const Index job_keys =
            detail::kDecodeJobKeys + detail::job_end(job, first_query) - job.begin;
        // Job j starts the next part when its middle lies past this part's share.
        while (part + 1 < threads &&
               (static_cast<double>(keys_before) + 0.5 * static_cast<double>(job_keys)) *
                       share_sum >=
                   share_before * total) {
          workspace.parts[static_cast<std::size_t>(part)].work = keys_before - keys_at_cut;
          keys_at_cut = keys_before;
          detail::store_changed(workspace.part_first[static_cast<std::size_t>(++part)], j);
          share_before += share(part);
        }
        keys_before += job_keys;
      }
      workspace.parts[static_cast<std::size_t>(part)].work =
          static_cast<Index>(total) - keys_at_cut;
      while (++part < threads) {
        detail::store_changed(workspace.part_first[static_cast<std::size_t>(part)], jobs);
        workspace.parts[static_cast<std::size_t>(part)].work = 0;
      }
      detail::store_changed(workspace.part_first[static_cast<std::size_t>(threads)], jobs);
    }
    // The log-sum-exp merge of the jobs of (row r, head h), in job order, into its output row.
    const auto merge = [this, &workspace, out](Index r, Index h,
                                               detail::OutputRows<Scalar>& output) {
      HeadMap<Compute> row =
          output.bind(HeadMap<Scalar>(out.data + r * out.token_stride + h * out.head_stride, 1,
                                      value_dim_, Eigen::OuterStride<>(value_dim_)));
      row.setZero();
      Compute lse = -std::numeric_limits<Compute>::infinity();
      const Index first = workspace.first_job[static_cast<std::size_t>(r * heads_ + h)];
      const Index last = workspace.first_job[static_cast<std::size_t>(r * heads_ + h + 1)];
      for (Index j = first; j < last; ++j) {
        online_softmax_merge(
            row, Eigen::Map<Eigen::Matrix<Compute, 1, 1>>(&lse),
            Eigen::Map<const RowMatrix<Compute>>(
                &workspace.partial[static_cast<std::size_t>(j * value_dim_)], 1, value_dim_),
            Eigen::Map<const Eigen::Matrix<Compute, 1, 1>>(
                &workspace.lse[static_cast<std::size_t>(j * lse_stride)]));
      }
      output.store();
    };
    // A (row, head) whose jobs all lie in one part is merged by that part's thread as soon as its
    // last job is done; the others (at most threads - 1) after every part is done.
    // `on_team`: the part runs on the team's helpers, which time their parts themselves.
    const auto run_part = [this, &workspace, &extra, run_job, merge, threads, reverse, q, scale,
                           rows, newest_row](Index part, int thread, bool on_team) {
      detail::DecodeThreadState<Scalar>& state =
          workspace.threads[static_cast<std::size_t>(thread)];
      const Index first = workspace.part_first[static_cast<std::size_t>(part)];
      const Index last = workspace.part_first[static_cast<std::size_t>(part + 1)];
      if (thread > 0) prefetch_part(workspace, q, first, last, newest_row);
      // The queries of its jobs times the scale, converted by this thread: a helper reads the
      // rows as given rather than a copy that the calling thread wrote.
      state.queries.resize(static_cast<std::size_t>(rows * heads_ * dim_));
      for (Index j = first, previous = -1; j < last; ++j) {
        const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(j)];
        const Index index = job.row * heads_ + job.head;
        if (index == previous) continue;
        previous = index;
        Compute* query = &state.queries[static_cast<std::size_t>(index * dim_)];
        detail::convert_to_compute(q.data + job.row * q.token_stride + job.head * q.head_stride,
                                   dim_, query);
        Eigen::Map<Eigen::Matrix<Compute, 1, Eigen::Dynamic>>(query, dim_) *=
            static_cast<Compute>(scale);
      }
      // Jobs begin..end-1 in order, each (row, head) merged after its last job when all of its
      // jobs are in this part.
      const auto run_jobs = [&](Index begin, Index end) {
        for (Index j = begin; j < end; ++j) {
          run_job(j, state);
          const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(j)];
          const std::size_t index = static_cast<std::size_t>(job.row * heads_ + job.head);
          if (workspace.first_job[index] >= first && workspace.first_job[index + 1] == j + 1) {
            merge(job.row, job.head, state.output);
          }
        }
      };
      if (!reverse) {
        run_jobs(first, last);
      } else {
        // A (row, head) that the part shares with the one before comes first all the same, so
        // that its partial outputs are ready when the calling thread asks for them (below).
        const Index rest = split_head_end(workspace, first, last);
        run_jobs(first, rest);
        // The (row, head)s from the last to the first, each one's jobs in order (a forward stream
        // of keys for the hardware's prefetch).
        for (Index end = last; end > rest;) {
          const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(end - 1)];
          const Index begin = std::max(
              rest, workspace.first_job[static_cast<std::size_t>(job.row * heads_ + job.head)]);
          run_jobs(begin, end);
          end = begin;
        }
      }
      if (threads > 1 && part == 0) {
        extra();
        // The partial outputs that the helpers wrote for the heads they share with the part
        // before, asked for before the calling thread waits for the helpers: they then arrive
        // while it waits, not after.
        for (Index next = 1; next < threads; ++next) {
          const Index begin = workspace.part_first[static_cast<std::size_t>(next)];
          const Index end = split_head_end(
              workspace, begin, workspace.part_first[static_cast<std::size_t>(next + 1)]);
          for (Index j = begin; j < end; ++j) {
            detail::prefetch(&workspace.lse[static_cast<std::size_t>(j * lse_stride)]);
            detail::prefetch_bytes(&workspace.partial[static_cast<std::size_t>(j * value_dim_)],
                                   static_cast<std::size_t>(value_dim_) * sizeof(Compute));
          }
        }
      }
      // Timed only where there are parts to cut (a clock read is some 30 ns of a step of 7 us);
      // the team times its helpers' parts itself, on the line that reports them done.
      if (threads > 1 && (thread == 0 || !on_team)) {
        workspace.parts[static_cast<std::size_t>(part)].end = Clock::now();
      }
    };
    // Parts on the team's helpers (no system call on warm helpers), else in an OpenMP region
    // (also when called from inside one, where the helpers would compete with its threads).
    bool in_parallel = false;
#if defined(_OPENMP)
    in_parallel = omp_in_parallel() != 0;
#endif
    const auto published = threads > 1 ? Clock::now() : Clock::time_point{};
    if (threads > 1 && !in_parallel &&
        detail::ThreadTeam::shared().run(static_cast<int>(threads), [&](int part) {
          if (part == 0) {
            run_part(part, part, true);
          } else {
            auto copy = run_part;
            copy(part, part, true);
          }
        })) {
      // A helper's part ends for this thread when its done line arrives here, some time after
      // the helper wrote it: counted as long again as the hand-over took (the helper's start
      // after `published`), so that the cut leaves the helper that much less and this thread
      // stops waiting sooner.
      const detail::ThreadTeam& team = detail::ThreadTeam::shared();
      for (Index part = 1; part < threads; ++part) {
        workspace.parts[static_cast<std::size_t>(part)].end =
            team.part_end(static_cast<int>(part)) +
            (team.part_start(static_cast<int>(part)) - published);
      }
    } else {
      detail::parallel_for_threads(
          threads, threads > 1, [&](Index part, int thread) { run_part(part, thread, false); },
          detail::Schedule::Static);
    }
    if (threads > 1) detail::record_decode_parts(workspace, threads, published);
    // The (row, head)s that a cut between two parts splits, each once (found from the cuts, so
    // that nothing the other threads wrote is read but the split heads' partial outputs).
    const detail::DecodeJob* merged = nullptr;
    for (Index part = 1; part < threads; ++part) {
      const Index cut = workspace.part_first[static_cast<std::size_t>(part)];
      if (cut == 0 || cut == jobs) continue;
      const detail::DecodeJob& before = workspace.jobs[static_cast<std::size_t>(cut - 1)];
      const detail::DecodeJob& after = workspace.jobs[static_cast<std::size_t>(cut)];
      if (before.row != after.row || before.head != after.head) continue;
      if (merged != nullptr && merged->row == after.row && merged->head == after.head) continue;
      merge(after.row, after.head, workspace.threads[0].output);
      merged = &after;
    }
    return worth_splitting
               ? static_cast<double>(union_keys + detail::kDecodeJobKeys * jobs + extra_keys)
               : 0.0;
  }

  /// The end of the jobs from `first` (before `last`) of a (row, head) whose jobs begin before
  /// `first`: those that a part beginning at `first` shares with the part before; `first` when
  /// there are none.
  template <class Workspace>
  Index split_head_end(const Workspace& workspace, Index first, Index last) const {
    if (first == 0 || first >= last) return first;
    const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(first)];
    const std::size_t index = static_cast<std::size_t>(job.row * heads_ + job.head);
    return workspace.first_job[index] < first ? std::min(last, workspace.first_job[index + 1])
                                              : first;
  }

  /// The sorted block starts of query row `row` of `rows` (the last at the newest position) and
  /// head `head`: those of the newest position as the appends keep them (some may lie before the
  /// oldest stored key, which changes no count of a stored key), the others as attend_rows looked
  /// them up.
  template <class Workspace>
  const Index* begins_of(const Workspace& workspace, Index rows, Index row, Index head) const {
    return row == rows - 1
               ? &block_begins_[static_cast<std::size_t>(head * options_.samples)]
               : &workspace
                      .begins[static_cast<std::size_t>((row * heads_ + head) * options_.samples)];
  }

  /// Asks for the lines that the calling thread wrote for the jobs first..last-1 of a step (the
  /// jobs, their queries and block starts, the newest key and value of their heads, in buffer row
  /// `newest`), all at once: a helper that read them job by job waited for each from the calling
  /// thread's core in turn.
  template <class Workspace>
  void prefetch_part(const Workspace& workspace, const HeadsView<const Scalar>& q, Index first,
                     Index last, Index newest) const {
    if (first >= last) return;
    detail::prefetch_bytes(&workspace.jobs[static_cast<std::size_t>(first)],
                           static_cast<std::size_t>(last - first) * sizeof(detail::DecodeJob));
    const Index group_size = heads_ / kv_heads_;
    Index previous = -1;
    Index previous_group = -1;
    for (Index j = first; j < last; ++j) {
      const detail::DecodeJob& job = workspace.jobs[static_cast<std::size_t>(j)];
      const Index index = job.row * heads_ + job.head;
      if (index == previous) continue;
      previous = index;
      detail::prefetch_bytes(q.data + job.row * q.token_stride + job.head * q.head_stride,
                             static_cast<std::size_t>(dim_) * sizeof(Scalar));
      detail::prefetch_bytes(begins_of(workspace, q.tokens, job.row, job.head),
                             static_cast<std::size_t>(options_.samples) * sizeof(Index));
      detail::prefetch_bytes(&workspace.first_job[static_cast<std::size_t>(index)],
                             2 * sizeof(Index));
      // The newest key and value row, once per key head of a group of consecutive heads.
      const Index g = job.head / group_size;
      if (g == previous_group) continue;
      previous_group = g;
      detail::prefetch_bytes(keys_.data() + (g * capacity_ + newest) * dim_,
                             static_cast<std::size_t>(dim_) * sizeof(Scalar));
      detail::prefetch_bytes(values_.data() + (g * capacity_ + newest) * value_dim_,
                             static_cast<std::size_t>(value_dim_) * sizeof(Scalar));
    }
  }

  Index heads_;
  Index kv_heads_;
  Index dim_;
  Index value_dim_;
  std::vector<double> slopes_;
  PlshOptions options_;
  std::vector<std::vector<Grid>> grids_;
  std::vector<Block> blocks_;        // [head][draw]: the block of the newest position
  std::vector<Index> block_begins_;  // [head][]: the begins of blocks_, sorted per head
  // The blocks, sorted begins and E of position `position` (-1: none), looked up by decode ahead
  // of the append that reaches it. On cache lines of their own: the calling thread writes them
  // during a step whose helpers read the members around them.
  struct alignas(64) LookAhead {
    std::vector<Block> blocks;
    std::vector<Index> begins;
    Index reachable = 0;
    Index position = -1;
  };
  LookAhead next_;
  // [kv_head][capacity_][dim]: rows [start_, start_ + resident_) of each head's region hold
  // positions oldest_ on.
  detail::AlignedVector<Scalar> keys_;
  detail::AlignedVector<Scalar> values_;  // [kv_head][capacity_][value_dim]
  Index capacity_ = 0;
  Index start_ = 0;
  Index oldest_ = 0;
  // Written by every append and step: on a cache line of their own, away from the members that
  // the helpers of a step read (the ones above change only when rows are evicted or moved).
  alignas(64) Index resident_ = 0;
  Index position_ = 0;
  Index last_append_ = 0;
  bool reverse_heads_ = false;  // the next one-token decode runs its heads last to first
};

}  // namespace plsh

#endif  // PLSH_KV_CACHE_HPP
