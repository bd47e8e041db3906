#ifndef PLSH_DECODE_DECODE_STEP_HPP
#define PLSH_DECODE_DECODE_STEP_HPP

/// \file decode_step.hpp
/// The single-query path of KvCache::attend: the fused estimator for at most kDecodeRows query
/// rows at the newest positions of a cache.
///
/// For a query at p the blocks of its draws all end after p (causal), so with \f$b_t\f$ their
/// starts the count is \f$c_j = \#\{t : b_t \le j\}\f$ on the union \f$[\min_t b_t, p]\f$ and
/// \f[ o_p = \frac{\sum_j c_j e^{S_{pj}} v_j}{\sum_j c_j e^{S_{pj}}}. \f]
/// The union of each (row, head) is cut into ranges of kDecodeKeyChunk keys; each (row, head,
/// range) is a job: a matrix-vector product for its scores, the counts, an online softmax of one
/// row and a matrix-vector product with its values give a partial (output, lse). The jobs of a
/// (row, head) are merged by log-sum-exp in job order, so the result is the same bit for bit
/// whichever thread runs a job.
///
/// Threads: with more than one thread available, at least kDecodeParallelWork multiply-adds, and
/// unless the caller keeps the step on its thread (KvCache::decode, by decode_mode.hpp), the job
/// list is cut into contiguous parts of about equal work (keys plus kDecodeJobKeys per
/// job), one per thread, run on the helpers of detail/thread_team.hpp (which hand a step over
/// without a system call), or in an OpenMP region when the team is busy or the caller is inside
/// a parallel region. A thread merges the (row, head)s whose jobs all lie in its part; the
/// calling thread merges those that a cut splits, after the parts.
///
/// Order: `reverse` runs each part's (row, head)s from last to first (each one's jobs in
/// order): a decoder that alternates it starts a step on the keys that the step before read
/// last, still in cache when a step's keys outgrow it.
///
/// With a near field (near_field.hpp) a key within the reach w of the query, at distance
/// \f$d = p - j \le w\f$, has the weight \f$s e^{-m d}\f$ in place of \f$c_j\f$, and the union
/// reaches back to \f$p - w\f$ at least.
///
/// A job's products run in the AVX-512 code of detail/decode_simd.hpp when the library is
/// compiled for it (scores plus the near keys' log weights, with their maximum, then the
/// exponentials times the counts in one pass; bfloat16 keys meet the bfloat16 query in
/// `vdpbf16ps` where AVX-512 BF16 is present), else in Eigen's matrix-vector products (a job
/// with near keys by OnlineSoftmax). A job whose output or sum comes out non-finite is
/// recomputed by OnlineSoftmax, which applies the non-finite contract.
///
/// Cost per query and head: \f$(d + d_v)\f$ multiply-adds times the union width (about
/// \f$(\ln s + \ln\ln s)/m\f$), plus O(s) per job for the counts; no allocation once the
/// workspace has grown. Tested through KvCache in tests/test_kv_cache*.cpp (against
/// plsh_attention over the whole sequence, identical results at 1, 2 and 3 threads, non-finite
/// inputs), and through the AVX-512 products in test_kv_cache_avx512.

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../attention/near_field.hpp"
#include "../attention/online_softmax.hpp"
#include "../detail/decode_simd.hpp"
#include "../detail/parallel.hpp"
#include "../detail/storage.hpp"
#include "../detail/thread_team.hpp"
#include "../tensor.hpp"
#include "block_tracker.hpp"
#include "kv_buffer.hpp"

namespace plsh {
namespace detail {

/// Query rows up to which KvCache::attend takes the single-query path, whatever the kernel of the
/// options (it evaluates the fused estimator); more rows go to the fused or pass kernel, whose
/// products are GEMMs over query tiles.
constexpr Index kDecodeRows = 16;

/// Keys per job: a (row, head) whose union is wider is split into ranges of this many keys, so
/// that one wide head does not leave the other threads idle.
constexpr Index kDecodeKeyChunk = 128;

/// The fixed work of a job (its maximum, exponentials, counts and merge) in keys, when the jobs
/// are cut into parts: the short jobs of steep heads are not free.
constexpr Index kDecodeJobKeys = 16;

/// Multiply-adds from which a step runs on more than one thread: handing a step over costs
/// roughly what some 10^4 multiply-adds do.
constexpr double kDecodeParallelWork = 1 << 15;

/// Whether the jobs compute their products with decode_simd.hpp (float, bfloat16 and half
/// storage; double always takes Eigen's products).
#if defined(PLSH_DECODE_AVX512)
constexpr bool kDecodeSimd = true;
#else
constexpr bool kDecodeSimd = false;
#endif

/// Keys `[begin, end)` (absolute positions) of query row `row` and head `head`.
struct DecodeJob {
  Index row;
  Index head;
  Index begin;
  Index end;
};

/// Scratch of one thread of a step.
template <class Storage>
struct DecodeThreadState {
  using Scalar = Compute<Storage>;
  OnlineSoftmax<Scalar> softmax;
  AlignedVector<Scalar> keys;    // a range of keys in the compute type (16-bit storage)
  AlignedVector<Scalar> values;  // a range of values in the compute type (16-bit storage)
  alignas(64) Scalar scores[kDecodeKeyChunk];
  OutputRows<Storage> output;  // the output rows of the (row, head)s this thread merges
};

/// Scratch of the single-query path, owned by one cache and reused by its steps: once it has
/// grown to a step's size, a step allocates nothing.
template <class Storage>
struct DecodeWorkspace {
  using Scalar = Compute<Storage>;
  std::vector<Index> begins;       // [row][head][draw]: sorted block starts of the older rows
  std::vector<Index> first_job;    // [row * heads + head]: its first job; one more at the end
  std::vector<DecodeJob> jobs;     // in (row, head, range) order
  std::vector<Index> part_first;   // [part]: the first job of each thread's part; one more
  AlignedVector<Scalar> queries;   // [row][head][dim]: the queries times the scale
  AlignedVector<Scalar> partial;   // [job][value_dim]: normalised output of the job's keys
  AlignedVector<Scalar> lse;       // [job]: log-sum-exp of the job's logits
  LogWeights<Scalar> log_weights;  // log c for c = 0..s (Estimator), log(0) = -inf
  std::vector<DecodeThreadState<Storage>> threads;
};

/// Adds \f$\log c_j\f$ to the logits of keys `first_position .. first_position + count - 1`:
/// \f$c_j = \#\{t : b_t \le j\}\f$, `begins` the s block starts of the row's draws, sorted, in
/// segments of constant count; `log_count[c]` is \f$\log c\f$ (LogWeights' counts).
template <class Scalar>
void add_log_counts(Scalar* scores, Index count, Index first_position, const Index* begins,
                    Index samples, const Scalar* log_count) {
  Index draws = std::upper_bound(begins, begins + samples, first_position) - begins;
  for (Index position = first_position; position < first_position + count;) {
    const Index next =
        draws < samples ? std::min(begins[draws], first_position + count) : first_position + count;
    const Scalar log_c = log_count[draws];
    for (Index j = position - first_position; j < next - first_position; ++j) scores[j] += log_c;
    position = next;
    while (draws < samples && begins[draws] <= position) ++draws;
  }
}

/// The logits of one job, \f$q \cdot k_j + \log c_j\f$ over its keys (q already scaled), or
/// \f$q \cdot k_j + \log s - m(p - j)\f$ (Estimator::log_near_weight) for its near keys, into an
/// online softmax of one row; writes the job's normalised output and log-sum-exp. The general
/// path: any input, with the non-finite contract of OnlineSoftmax.
template <class Storage>
void decode_job_general(const ConstHeadMap<Storage>& keys, const ConstHeadMap<Storage>& values,
                        const Compute<Storage>* query, Index first_position, const Index* begins,
                        Index samples, const Compute<Storage>* log_count,
                        DecodeThreadState<Storage>& state, Compute<Storage>* out,
                        Compute<Storage>* lse, const DecodeNear& near) {
  using Scalar = Compute<Storage>;
  const Index count = keys.rows();
  const ConstHeadMap<Scalar> k = compute_rows(keys, state.keys);
  const ConstHeadMap<Scalar> v = compute_rows(values, state.values);
  Eigen::Map<RowMatrix<Scalar>> scores(state.scores, 1, count);
  const Eigen::Map<const RowMatrix<Scalar>> q(query, 1, keys.cols());
  scores.noalias() = q * k.transpose();
  const Index blocked = std::clamp<Index>(near.first - first_position, 0, count);
  add_log_counts(scores.data(), blocked, first_position, begins, samples, log_count);
  for (Index j = blocked; j < count; ++j) {
    scores.data()[j] += static_cast<Scalar>(near.log_weight(first_position + j));
  }
  state.softmax.reset(1, values.cols());
  state.softmax.update(scores, v);
  state.softmax.finish(Eigen::Map<RowMatrix<Scalar>>(out, 1, values.cols()), lse);
}

/// One job: decode_job_general's result without its non-finite bookkeeping. Every key of a job
/// has a weight of at least 1 before the near field (a count: the union starts at the smallest
/// block start) and a positive one within it, so no logit is masked, and with finite inputs the
/// plain arithmetic below is the online softmax of one row. Any non-finite input that reaches the
/// output leaves a non-finite output or sum, and the job is then recomputed by
/// decode_job_general. `raw_query` is the query as stored and `scale` its scale (the bfloat16
/// product scales its sums). With the AVX-512 products the near keys' logits take their log
/// weight (DecodeNear::log_weight) as decode_job_general's do; with Eigen's, a job with near keys
/// takes decode_job_general.
template <class Storage>
void decode_job(const ConstHeadMap<Storage>& keys, const ConstHeadMap<Storage>& values,
                const Compute<Storage>* query, const Storage* raw_query, Compute<Storage> scale,
                Index first_position, const Index* begins, Index samples,
                const Compute<Storage>* log_count, DecodeThreadState<Storage>& state,
                Compute<Storage>* out, Compute<Storage>* lse, const DecodeNear& near) {
  using Scalar = Compute<Storage>;
  const Index count = keys.rows();
  const Index value_dim = values.cols();
  constexpr bool simd = kDecodeSimd && std::is_same<Scalar, float>::value;
  // The index of the job's first near key (count: none).
  const Index near_from = std::clamp<Index>(near.first - first_position, 0, count);
  if (!simd && near_from < count) {
    decode_job_general(keys, values, query, first_position, begins, samples, log_count, state, out,
                       lse, near);
    return;
  }
  Eigen::Map<Eigen::Matrix<Scalar, Eigen::Dynamic, 1>, Eigen::Aligned64> scores(state.scores,
                                                                                count);
  static_cast<void>(raw_query);
  static_cast<void>(scale);
  // Logits: with the AVX-512 products, the scores plus the near keys' log weights, and their
  // maximum (the counts later multiply the exponentials instead of adding their logarithms here);
  // else Eigen's product plus log c_j.
  Scalar max = -std::numeric_limits<Scalar>::infinity();
  if constexpr (simd) {
#if defined(PLSH_DECODE_AVX512)
#if defined(PLSH_DECODE_AVX512_BF16)
    if constexpr (std::is_same<Storage, Eigen::bfloat16>::value) {
      max = avx512::scores_bf16(keys.data(), count, keys.cols(), keys.outerStride(), raw_query,
                                scale, state.scores, first_position, near);
    } else
#endif
    {
      max = avx512::scores(keys.data(), count, keys.cols(), keys.outerStride(), query, state.scores,
                           first_position, near);
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
      sum =
          avx512::exp_counts(state.scores, count, first_position, begins, samples, max, near_from);
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
                     lse, near);
}

/// The threads a step may use: omp_get_max_threads() in OpenMP builds, else 1.
inline int decode_threads_available() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

/// One step of the single-query path (file comment), in named steps: plan_jobs (the jobs and the
/// scaled queries), cut_parts (one contiguous part of the jobs per thread), run_part (a part's
/// jobs, run_job, and the merges of the (row, head)s it holds whole, merge), and
/// merge_split_heads (the (row, head)s that a cut splits). Holds references to the step's
/// arguments (decode_step's) for the length of the step.
template <class Storage>
class DecodeStep {
 public:
  using Scalar = Compute<Storage>;

  DecodeStep(const KvBuffer<Storage>& buffer, const BlockTracker& blocks, Index heads,
             Index samples, const HeadsView<const Storage>& q, const HeadsView<Storage>& out,
             double scale, DecodeWorkspace<Storage>& workspace,
             const std::vector<Estimator>& estimators)
      : buffer_(buffer),
        blocks_(blocks),
        heads_(heads),
        samples_(samples),
        q_(q),
        out_(out),
        scale_(scale),
        workspace_(workspace),
        estimators_(estimators),
        rows_(q.tokens),
        dim_(q.dim),
        value_dim_(out.dim),
        group_(heads / buffer.keys().heads),
        first_query_(buffer.end() - q.tokens) {}

  /// The jobs, in (row, head, range) order, and the queries times the scale; the counts' log
  /// weights. Room for the most jobs the buffer can need, so that the steps between two growths
  /// of the buffer allocate nothing. Returns the keys of the union of every (row, head).
  Index plan_jobs() {
    const Index oldest = buffer_.oldest();
    workspace_.log_weights.prepare(estimators_[0], DistanceRange{});
    workspace_.begins.resize(static_cast<std::size_t>((rows_ - 1) * heads_ * samples_));
    workspace_.first_job.resize(static_cast<std::size_t>(rows_ * heads_ + 1));
    workspace_.queries.resize(static_cast<std::size_t>(rows_ * heads_ * dim_));
    const Index most_jobs = rows_ * heads_ * (buffer_.capacity() / kDecodeKeyChunk + 1);
    workspace_.jobs.reserve(static_cast<std::size_t>(most_jobs));
    workspace_.jobs.clear();
    Index union_keys = 0;
    for (Index r = 0; r < rows_; ++r) {
      const Index position = first_query_ + r;
      for (Index h = 0; h < heads_; ++h) {
        Index first_begin = 0;
        if (r == rows_ - 1) {
          first_begin = std::max(oldest, blocks_.sorted_begins(h)[0]);
        } else {
          // Rows before the newest: chunks that crossed a block boundary.
          Index* begins = &workspace_.begins[static_cast<std::size_t>((r * heads_ + h) * samples_)];
          for (Index t = 0; t < samples_; ++t) {
            begins[t] = std::max(oldest, blocks_.block_begin(h, t, position));
          }
          std::sort(begins, begins + samples_);
          first_begin = begins[0];
        }
        const Index reach = estimators_[static_cast<std::size_t>(h)].reach();
        if (reach >= 0) first_begin = std::max(oldest, std::min(first_begin, position - reach));
        workspace_.first_job[static_cast<std::size_t>(r * heads_ + h)] =
            static_cast<Index>(workspace_.jobs.size());
        for (Index begin = first_begin; begin <= position; begin += kDecodeKeyChunk) {
          workspace_.jobs.push_back(
              DecodeJob{r, h, begin, std::min(begin + kDecodeKeyChunk, position + 1)});
        }
        union_keys += position + 1 - first_begin;
        Scalar* query = &workspace_.queries[static_cast<std::size_t>((r * heads_ + h) * dim_)];
        convert_to_compute(q_.data + r * q_.token_stride + h * q_.head_stride, dim_, query);
        Eigen::Map<Eigen::Matrix<Scalar, 1, Eigen::Dynamic>>(query, dim_) *=
            static_cast<Scalar>(scale_);
      }
    }
    jobs_ = static_cast<Index>(workspace_.jobs.size());
    workspace_.first_job.back() = jobs_;
    if (static_cast<Index>(workspace_.lse.size()) < most_jobs) {
      workspace_.partial.resize(static_cast<std::size_t>(most_jobs * value_dim_));
      workspace_.lse.resize(static_cast<std::size_t>(most_jobs));
    }
    return union_keys;
  }

  /// The number of jobs plan_jobs made.
  Index jobs() const { return jobs_; }

  /// Cuts the jobs into `threads` contiguous parts of about equal work (keys plus kDecodeJobKeys
  /// per job; `union_keys` from plan_jobs), and gives each thread its scratch.
  void cut_parts(Index threads, Index union_keys) {
    if (static_cast<Index>(workspace_.threads.size()) < threads) {
      workspace_.threads.resize(static_cast<std::size_t>(threads));
    }
    workspace_.part_first.assign(static_cast<std::size_t>(threads + 1), jobs_);
    workspace_.part_first[0] = 0;
    if (threads <= 1) return;
    const double total = static_cast<double>(union_keys + kDecodeJobKeys * jobs_);
    Index part = 1;
    double keys_before = 0;
    for (Index j = 0; j < jobs_ && part < threads; ++j) {
      const DecodeJob& job = workspace_.jobs[static_cast<std::size_t>(j)];
      const double job_keys = static_cast<double>(kDecodeJobKeys + job.end - job.begin);
      // Job j starts the next part when its middle lies past this part's share.
      while (part < threads && (keys_before + 0.5 * job_keys) * static_cast<double>(threads) >=
                                   static_cast<double>(part) * total) {
        workspace_.part_first[static_cast<std::size_t>(part++)] = j;
      }
      keys_before += job_keys;
    }
  }

  /// Job j (decode_job) on the scratch `state`: its partial output and log-sum-exp.
  void run_job(Index j, DecodeThreadState<Storage>& state) const {
    const DecodeJob& job = workspace_.jobs[static_cast<std::size_t>(j)];
    const Index g = job.head / group_;
    const Index count = job.end - job.begin;
    const Index index = job.row * heads_ + job.head;
    const Index* begins = job.row == rows_ - 1
                              ? blocks_.sorted_begins(job.head)
                              : &workspace_.begins[static_cast<std::size_t>(index * samples_)];
    const Index position = first_query_ + job.row;
    const Estimator& estimator = estimators_[static_cast<std::size_t>(job.head)];
    // The keys at distance d <= w (Estimator::near) from position - w on; none without a reach.
    const DecodeNear near{estimator.reach() >= 0 ? position - estimator.reach() : position + 1,
                          position, estimator};
    decode_job<Storage>(ConstHeadMap<Storage>(buffer_.key_row(g, job.begin), count, dim_,
                                              Eigen::OuterStride<>(dim_)),
                        ConstHeadMap<Storage>(buffer_.value_row(g, job.begin), count, value_dim_,
                                              Eigen::OuterStride<>(value_dim_)),
                        &workspace_.queries[static_cast<std::size_t>(index * dim_)],
                        q_.data + job.row * q_.token_stride + job.head * q_.head_stride,
                        static_cast<Scalar>(scale_), job.begin, begins, samples_,
                        workspace_.log_weights.data(), state,
                        &workspace_.partial[static_cast<std::size_t>(j * value_dim_)],
                        &workspace_.lse[static_cast<std::size_t>(j)], near);
  }

  /// The log-sum-exp merge of the jobs of (row r, head h), in job order, into its output row.
  void merge(Index r, Index h, OutputRows<Storage>& output) const {
    HeadMap<Scalar> row =
        output.bind(HeadMap<Storage>(out_.data + r * out_.token_stride + h * out_.head_stride, 1,
                                     value_dim_, Eigen::OuterStride<>(value_dim_)));
    row.setZero();
    Scalar lse = -std::numeric_limits<Scalar>::infinity();
    const Index first = workspace_.first_job[static_cast<std::size_t>(r * heads_ + h)];
    const Index last = workspace_.first_job[static_cast<std::size_t>(r * heads_ + h + 1)];
    for (Index j = first; j < last; ++j) {
      online_softmax_merge(
          row, Eigen::Map<Eigen::Matrix<Scalar, 1, 1>>(&lse),
          Eigen::Map<const RowMatrix<Scalar>>(
              &workspace_.partial[static_cast<std::size_t>(j * value_dim_)], 1, value_dim_),
          Eigen::Map<const Eigen::Matrix<Scalar, 1, 1>>(
              &workspace_.lse[static_cast<std::size_t>(j)]));
    }
    output.store();
  }

  /// Part `part` of the jobs on thread `thread`'s scratch: its jobs in order, or with `reverse`
  /// the jobs it shares with the part before, then its (row, head)s from the last to the first
  /// (each one's jobs in order).
  void run_part(Index part, int thread, bool reverse) const {
    DecodeThreadState<Storage>& state = workspace_.threads[static_cast<std::size_t>(thread)];
    const Index first = workspace_.part_first[static_cast<std::size_t>(part)];
    const Index last = workspace_.part_first[static_cast<std::size_t>(part + 1)];
    if (!reverse) {
      run_jobs(first, last, first, state);
      return;
    }
    const Index rest = shared_end(first, last);
    run_jobs(first, rest, first, state);
    for (Index end = last; end > rest;) {
      const DecodeJob& job = workspace_.jobs[static_cast<std::size_t>(end - 1)];
      const Index begin = std::max(
          rest, workspace_.first_job[static_cast<std::size_t>(job.row * heads_ + job.head)]);
      run_jobs(begin, end, first, state);
      end = begin;
    }
  }

  /// The (row, head)s that a cut between the `threads` parts splits, each merged once on the
  /// calling thread (consecutive cuts may split the same one).
  void merge_split_heads(Index threads) const {
    Index merged = -1;
    for (Index part = 1; part < threads; ++part) {
      const Index cut = workspace_.part_first[static_cast<std::size_t>(part)];
      if (cut == 0 || cut == jobs_) continue;
      const DecodeJob& before = workspace_.jobs[static_cast<std::size_t>(cut - 1)];
      const DecodeJob& after = workspace_.jobs[static_cast<std::size_t>(cut)];
      const Index index = after.row * heads_ + after.head;
      if (before.row != after.row || before.head != after.head || index == merged) continue;
      merge(after.row, after.head, workspace_.threads[0].output);
      merged = index;
    }
  }

 private:
  /// Jobs `[begin, end)` of the part that starts at job `part_first`, in order, each (row, head)
  /// merged after its last job when all of its jobs are in this part.
  void run_jobs(Index begin, Index end, Index part_first, DecodeThreadState<Storage>& state) const {
    for (Index j = begin; j < end; ++j) {
      run_job(j, state);
      const DecodeJob& job = workspace_.jobs[static_cast<std::size_t>(j)];
      const std::size_t index = static_cast<std::size_t>(job.row * heads_ + job.head);
      if (workspace_.first_job[index] >= part_first && workspace_.first_job[index + 1] == j + 1) {
        merge(job.row, job.head, state.output);
      }
    }
  }

  /// The end of the jobs from `first` (before `last`) of a (row, head) that begins before
  /// `first`: those that a part starting at `first` shares with the part before; `first` when
  /// there are none.
  Index shared_end(Index first, Index last) const {
    if (first == 0 || first >= last) return first;
    const DecodeJob& job = workspace_.jobs[static_cast<std::size_t>(first)];
    const std::size_t index = static_cast<std::size_t>(job.row * heads_ + job.head);
    return workspace_.first_job[index] < first ? std::min(last, workspace_.first_job[index + 1])
                                               : first;
  }

  const KvBuffer<Storage>& buffer_;
  const BlockTracker& blocks_;
  Index heads_;
  Index samples_;
  const HeadsView<const Storage>& q_;
  const HeadsView<Storage>& out_;
  double scale_;
  DecodeWorkspace<Storage>& workspace_;
  const std::vector<Estimator>& estimators_;
  Index rows_;
  Index dim_;
  Index value_dim_;
  Index group_;        // query heads per key head
  Index first_query_;  // the position of query row 0
  Index jobs_ = 0;
};

/// One step of the single-query path (file comment): the outputs `out` of the queries `q` at the
/// newest `q.tokens` positions of `buffer` (1 <= q.tokens <= kDecodeRows), whose newest position
/// is that of `blocks`. `heads` query heads share each key head in groups of heads / kv_heads;
/// `scale` multiplies the scores. `split == false` keeps the step on the calling thread.
/// `estimators`: the estimator of every head (its `samples` draws and near field,
/// near_field.hpp). Returns the step's work (keys, with kDecodeJobKeys per job) when it is worth
/// more than one thread, else 0.
template <class Storage>
double decode_step(const KvBuffer<Storage>& buffer, const BlockTracker& blocks, Index heads,
                   Index samples, const HeadsView<const Storage>& q, const HeadsView<Storage>& out,
                   double scale, bool split, bool reverse, DecodeWorkspace<Storage>& workspace,
                   const std::vector<Estimator>& estimators) {
  DecodeStep<Storage> step(buffer, blocks, heads, samples, q, out, scale, workspace, estimators);
  const Index union_keys = step.plan_jobs();
  const Index jobs = step.jobs();

  // Contiguous parts of about equal work, one per thread.
  const double work = static_cast<double>(union_keys) * static_cast<double>(q.dim + out.dim);
  const int available = decode_threads_available();
  const bool worth_splitting = available > 1 && jobs > 1 && work >= kDecodeParallelWork;
  const Index threads = worth_splitting && split ? available : 1;
  const double step_work =
      worth_splitting ? static_cast<double>(union_keys + kDecodeJobKeys * jobs) : 0.0;
  step.cut_parts(threads, union_keys);

  // Parts on the team's helpers, else in an OpenMP region (also from inside one, where the
  // helpers would compete with its threads).
  bool in_parallel = false;
#if defined(_OPENMP)
  in_parallel = omp_in_parallel() != 0;
#endif
  if (threads == 1) {
    step.run_part(0, 0, reverse);
    return step_work;
  }
  if (in_parallel || !ThreadTeam::shared().run(static_cast<int>(threads), [&](int part) {
        step.run_part(part, part, reverse);
      })) {
    parallel_for_threads(
        threads, true, [&](Index part, int thread) { step.run_part(part, thread, reverse); },
        Schedule::Static);
  }
  step.merge_split_heads(threads);
  return step_work;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DECODE_DECODE_STEP_HPP
