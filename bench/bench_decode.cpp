/// \file bench_decode.cpp
/// Speed of incremental decoding (Google Benchmark families linked into plsh_bench).
///
/// Problem: 8 heads with plsh::alibi_slopes(8), d = d_v = 64, q, k and v uniform in [-1, 1] from
/// plsh::detail::CounterRandom. One iteration decodes one token:
///
/// - `decode_plsh/context/type/threads`: plsh::KvCache<type> (s = 20, fused kernel; type float
///   or bf16 = Eigen::bfloat16) run with `threads` OpenMP threads, prefilled with `context`
///   tokens in chunks of 1024 outside the timed loop; per iteration one
///   `KvCache::decode` of 1 token (the step a decoder calls: its append, then the attend of its
///   query by the single-query path of decode/decode_step.hpp, checks made once; with 2 threads
///   on both threads or on the calling thread alone, whichever decode/decode_mode.hpp measures
///   faster). The cache evicts what no later query can reach, so the time per token should not
///   grow with the context (goal: 65536 within 1.2x of 4096). Counters `resident`: tokens stored at
///   the end of the run; `cache_bytes`: KvCache::bytes() then (key and value buffers).
/// - `decode_exact/context`: exact ALiBi decoding with a full cache: plsh::exact_alibi_attention
///   of one query at position `context` against all `context` keys, float, with
///   omp_get_max_threads() threads. Counter `resident` = context.
/// - `decode_estimator/16384/estimator/type/1`: decode_plsh's steps at context 16384 on 1 thread
///   with the defaults (`defaults`, PlshOptions{}: s = 100 Latin hypercube draws, near field 0.05)
///   beside the paper's estimator (`paper`, decode_plsh's options).
///
/// Counter `tokens_per_second`: decoded tokens per second. Goals (issue 10): at most 15 us per
/// token at context 65536 on 1 thread, 2 threads at least 1.6x faster than 1.
///
/// What any split step can gain on the machine at the time of the run, with no data to move
/// between the cores:
///
/// - `team_step/work/threads`: a step of `work` microseconds of arithmetic (independent
///   multiply-add chains in registers, calibrated once per process on the calling thread), on
///   the calling thread alone (threads = 1) or cut in two halves run by the calling thread and a
///   helper of plsh/detail/thread_team.hpp (threads = 2), the helper team that KvCache::decode
///   hands its parts to. `work` 8 is about a bf16 decoding step at context 65536, 12 a float one.
///   The ratio of /1 to /2 bounds what 2 threads can give a decoding step of that length then: a
///   decoding step also moves its query, new keys and values and the partial results of a shared
///   head between the cores.
/// - `team_step/empty/2`: a step of two empty parts, the hand-over and the completion alone.
/// - `omp_step/work/2`, `omp_step/empty/2`: the same two halves in an OpenMP parallel region of 2
///   threads, the way a decoding step runs when the helper team is busy: the ratio of omp_step
///   to team_step is what the team gains over OpenMP for a step of that length.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <plsh/detail/thread_team.hpp>
#include <plsh/plsh.hpp>

#include "../tests/fill.hpp"
#include "../tests/thread_count.hpp"

namespace {

using plsh::Index;

constexpr Index kDecodeHeads = 8;
constexpr Index kDecodeDim = 64;
/// Tokens of distinct q, k, v rows cycled through while decoding; the values do not change the
/// work, only the pool keeps memory small.
constexpr Index kPoolTokens = 1024;
constexpr Index kPrefillChunk = 1024;
const std::vector<Index> kContexts = {1024, 4096, 65536};

template <class Scalar>
std::vector<Scalar> uniform_tokens(Index tokens, std::uint64_t seed) {
  return plsh_test::uniform_values<Scalar>(
      static_cast<std::size_t>(tokens * kDecodeHeads * kDecodeDim), seed);
}

/// A pool of `kPoolTokens` tokens of q, k and v.
template <class Scalar>
struct TokenPool {
  std::vector<Scalar> q = uniform_tokens<Scalar>(kPoolTokens, 11);
  std::vector<Scalar> k = uniform_tokens<Scalar>(kPoolTokens, 12);
  std::vector<Scalar> v = uniform_tokens<Scalar>(kPoolTokens, 13);

  plsh::HeadsView<const Scalar> view(const std::vector<Scalar>& data, Index first,
                                     Index count) const {
    return plsh::HeadsView<const Scalar>{data.data(), kPoolTokens, kDecodeHeads, kDecodeDim}.slice(
        first % kPoolTokens, count);
  }
};

template <class Scalar>
const TokenPool<Scalar>& token_pool() {
  static const TokenPool<Scalar> pool;
  return pool;
}

/// The paper's estimator: s = 20 independent draws, no near field.
plsh::PlshOptions paper_options() { return plsh::PlshOptions::paper(); }

/// One-token decode steps of a KvCache<Scalar> with `options`, prefilled with `context` tokens,
/// on `threads` threads.
template <class Scalar>
void decode_cache(benchmark::State& state, Index context, int threads,
                  const plsh::PlshOptions& options) {
  const plsh_test::ThreadCount thread_count(threads);
  const TokenPool<Scalar>& pool = token_pool<Scalar>();
  plsh::KvCache<Scalar> cache(kDecodeHeads, kDecodeHeads, kDecodeDim, kDecodeDim,
                              plsh::alibi_slopes(kDecodeHeads), options);
  for (Index done = 0; done < context; done += kPrefillChunk) {
    const Index chunk = std::min(kPrefillChunk, context - done);
    cache.append(pool.view(pool.k, 0, chunk), pool.view(pool.v, 0, chunk));
  }
  std::vector<Scalar> out(static_cast<std::size_t>(kDecodeHeads * kDecodeDim));
  const plsh::HeadsView<Scalar> out_view{out.data(), 1, kDecodeHeads, kDecodeDim};
  Index token = 0;
  for (auto _ : state) {
    cache.decode(pool.view(pool.q, token, 1), pool.view(pool.k, token, 1),
                 pool.view(pool.v, token, 1), out_view);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    ++token;
  }
  state.counters["resident"] = static_cast<double>(cache.resident());
  state.counters["cache_bytes"] = static_cast<double>(cache.bytes());
  state.counters["threads"] = threads;
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

template <class Scalar>
void decode_plsh(benchmark::State& state, Index context, int threads) {
  decode_cache<Scalar>(state, context, threads, paper_options());
}

/// Keys and values of a full cache of `context` tokens. Only the latest context is kept: at 65536
/// the two tensors take 256 MB.
struct FullCache {
  Index context = 0;
  std::vector<float> k, v;
};

const FullCache& full_cache(Index context) {
  static std::unique_ptr<FullCache> cached;
  if (!cached || cached->context != context) {
    cached.reset();
    cached = std::make_unique<FullCache>();
    cached->context = context;
    cached->k = uniform_tokens<float>(context, 12);
    cached->v = uniform_tokens<float>(context, 13);
  }
  return *cached;
}

void decode_exact(benchmark::State& state, Index context) {
  const TokenPool<float>& pool = token_pool<float>();
  const FullCache& cache = full_cache(context);
  const std::vector<double> slopes = plsh::alibi_slopes(kDecodeHeads);
  plsh::AttentionOptions options;
  options.query_position = context;
  const plsh::HeadsView<const float> keys{cache.k.data(), context, kDecodeHeads, kDecodeDim};
  const plsh::HeadsView<const float> values{cache.v.data(), context, kDecodeHeads, kDecodeDim};
  std::vector<float> out(static_cast<std::size_t>(kDecodeHeads * kDecodeDim));
  const plsh::HeadsView<float> out_view{out.data(), 1, kDecodeHeads, kDecodeDim};
  Index token = 0;
  for (auto _ : state) {
    plsh::exact_alibi_attention<float>(pool.view(pool.q, token, 1), keys, values, out_view, slopes,
                                       options);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    ++token;
  }
  state.counters["resident"] = static_cast<double>(context);
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

/// `iterations` rounds of 8 independent multiply-add chains in registers.
float team_arithmetic(std::int64_t iterations) {
  float chains[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  benchmark::DoNotOptimize(chains);
  for (std::int64_t i = 0; i < iterations; ++i) {
    for (float& chain : chains) chain = chain * 0.999999f + 1e-7f;
  }
  float sum = 0;
  for (const float chain : chains) sum += chain;
  return sum;
}

/// Rounds of team_arithmetic per microsecond on the calling thread, measured once per process (the
/// fastest of 5 timings of 2^16 rounds).
double team_rounds_per_microsecond() {
  static const double rate = [] {
    constexpr std::int64_t kRounds = std::int64_t{1} << 16;
    double best = 0;
    for (int trial = 0; trial < 5; ++trial) {
      const auto start = std::chrono::steady_clock::now();
      benchmark::DoNotOptimize(team_arithmetic(kRounds));
      const double microseconds =
          std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - start)
              .count();
      best = std::max(best, static_cast<double>(kRounds) / microseconds);
    }
    return best;
  }();
  return rate;
}

/// The two halves of a step of `work_us` microseconds of arithmetic: `part(index)` computes half
/// `index` (nothing for `work_us` 0), each result on its own cache line so that the parts share
/// no line.
class StepHalves {
 public:
  explicit StepHalves(double work_us)
      : rounds_(static_cast<std::int64_t>(work_us * team_rounds_per_microsecond() + 0.5)) {}

  void part(int index) {
    const std::int64_t half = rounds_ / 2;
    if (rounds_ > 0) results_[index].value = team_arithmetic(index == 0 ? half : rounds_ - half);
  }

 private:
  struct alignas(64) Result {
    float value = 0;
  };
  std::int64_t rounds_;
  Result results_[2];
};

/// One iteration: a step of `work_us` microseconds of arithmetic on 1 thread, or its two halves
/// on the calling thread and a helper of the team (`work_us` 0: two empty parts).
void team_step(benchmark::State& state, double work_us, int threads) {
  StepHalves halves(work_us);
  const auto part = [&](int index) { halves.part(index); };
  for (auto _ : state) {
    if (threads == 1) {
      part(0);
      part(1);
    } else if (!plsh::detail::ThreadTeam::shared().run(threads, part)) {
      state.SkipWithError("the helper team is in use or cannot start its threads");
      break;
    }
    benchmark::DoNotOptimize(halves);
  }
  state.counters["threads"] = threads;
  state.counters["work_us"] = work_us;
}

#if defined(_OPENMP)
/// team_step's two halves in an OpenMP parallel region of 2 threads (`work_us` 0: two empty
/// parts).
void omp_step(benchmark::State& state, double work_us) {
  StepHalves halves(work_us);
  for (auto _ : state) {
#pragma omp parallel num_threads(2)
    halves.part(omp_get_thread_num());
    benchmark::DoNotOptimize(halves);
  }
  state.counters["threads"] = 2;
  state.counters["work_us"] = work_us;
}
#endif

bool register_decode_benchmarks() {
#if defined(_OPENMP)
  const std::vector<int> thread_counts = {1, 2};
#else
  const std::vector<int> thread_counts = {1};
#endif
  for (const Index context : kContexts) {
    for (const int threads : thread_counts) {
      const std::string suffix = "/" + std::to_string(threads);
      const std::string name = "decode_plsh/" + std::to_string(context);
      benchmark::RegisterBenchmark((name + "/float" + suffix).c_str(), decode_plsh<float>, context,
                                   threads)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
      benchmark::RegisterBenchmark((name + "/bf16" + suffix).c_str(), decode_plsh<Eigen::bfloat16>,
                                   context, threads)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  for (const Index context : kContexts) {
    benchmark::RegisterBenchmark(("decode_exact/" + std::to_string(context)).c_str(), decode_exact,
                                 context)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  benchmark::RegisterBenchmark("team_step/empty/2", team_step, 0.0, 2)
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
  for (const int work : {8, 12}) {
    for (const int threads : {1, 2}) {
      benchmark::RegisterBenchmark(
          ("team_step/" + std::to_string(work) + "/" + std::to_string(threads)).c_str(), team_step,
          static_cast<double>(work), threads)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
#if defined(_OPENMP)
  benchmark::RegisterBenchmark("omp_step/empty/2", omp_step, 0.0)
      ->Unit(benchmark::kMicrosecond)
      ->UseRealTime();
  for (const int work : {8, 12}) {
    benchmark::RegisterBenchmark(("omp_step/" + std::to_string(work) + "/2").c_str(), omp_step,
                                 static_cast<double>(work))
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
#endif
  return true;
}

[[maybe_unused]] const bool decode_registered = register_decode_benchmarks();

// ---------------------------------------------------------------------------------------------
// decode_estimator: the defaults beside the paper's estimator.

/// `decode_estimator/context/estimator/type/threads`: decode_plsh's steps with the estimator
/// `defaults` (PlshOptions{}: s = 100 Latin hypercube draws, near field 0.05) or `paper` (s = 20
/// independent draws, no near field), at the context a long prompt leaves.
bool register_estimator_benchmarks() {
  const Index context = 16384;
  const std::pair<const char*, plsh::PlshOptions> estimators[] = {{"paper", paper_options()},
                                                                  {"defaults", {}}};
  for (const auto& [estimator, options] : estimators) {
    const std::string name = "decode_estimator/" + std::to_string(context) + "/" + estimator + "/";
    benchmark::RegisterBenchmark((name + "float/1").c_str(), decode_cache<float>, context, 1,
                                 options)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
    benchmark::RegisterBenchmark((name + "bf16/1").c_str(), decode_cache<Eigen::bfloat16>, context,
                                 1, options)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  return true;
}

[[maybe_unused]] const bool estimator_registered = register_estimator_benchmarks();

// End of decode_estimator.
// ---------------------------------------------------------------------------------------------

}  // namespace
