/// \file bench_train.cpp
/// Speed of a training step's attention: the forward, and the forward then the backward (Google
/// Benchmark families linked into plsh_bench).
///
/// Problem: plsh_bench's (8 heads with plsh::alibi_slopes(8), d = d_v = 64, causal, float; q, k
/// and v uniform in [-1, 1], seeds 1, 2, 3) and the gradient of the output, dout, uniform in
/// [-1, 1] with seed 4; filled once per length outside the timed region. Benchmarks are named
/// `family/kernel/n/threads`:
///
/// - `train/...`: one iteration is the kernel's forward, then its public `*_backward`
///   (backward.hpp) on that output: dq, dk and dv, the attention of one training step.
/// - `train_forward/...`: the forward alone, its twin in the same run.
/// - `train_lse/...`: as `train/`, with the forward writing the row log-sum-exp (RowLse) and the
///   windowed forward its kept keys (KeptKeys), which the backward then takes instead of
///   computing them again.
///
/// Kernels: `exact` (exact_alibi_attention); `windowed_1e3` (windowed_alibi_attention, certified
/// tolerance 1e-3); `truncated_1e3` and `truncated_5e2` (truncated_alibi_attention, factor
/// tolerance 1e-3 and 0.05: the band where the factor is at least 0.05); `fused_defaults`
/// (plsh_attention with PlshOptions{}: s = 100, Latin hypercube, near field 0.05);
/// `fused_paper` (the paper's estimator: s = 20, independent draws, no near field);
/// `fixed_blocks` (fixed_block_attention, b = 64). n = 1024, 2048, ..., 65536 (exact up to
/// 16384, where one forward and backward take about 17 s on one core); threads 1 and 2 (OpenMP
/// builds; 1 otherwise), set for the benchmark with omp_set_num_threads.
///
/// Times are wall times (`real_time`); `cpu_time` is the processor time of the whole process,
/// every thread included. Counters: `tokens_per_second` (n per wall second), `threads`.
/// Select with `--benchmark_filter='^train(_forward|_lse)?/'` (bench/regenerate.sh train).

#include <benchmark/benchmark.h>

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include <plsh/plsh.hpp>

#include "../tests/fill.hpp"
#include "../tests/thread_count.hpp"
#include "touch_pages.hpp"

namespace {

using plsh::Index;

constexpr Index kTrainHeads = 8;
constexpr Index kTrainDim = 64;
constexpr Index kTrainFixedBlock = 64;
constexpr double kCertifiedTolerance = 1e-3;
const std::vector<Index> kTrainLengths = {1024, 2048, 4096, 8192, 16384, 32768, 65536};
/// The quadratic kernel stops here: at 16384 one forward and backward already take seconds.
constexpr Index kExactLongest = 16384;
/// Exact ALiBi from this length runs one iteration per repetition (each takes seconds).
constexpr Index kExactOneIteration = 8192;

/// Inputs, output and gradients of one length, [n][heads][64], packed.
struct TrainProblem {
  Index n = 0;
  std::vector<float> q, k, v, out, dout, dq, dk, dv;
  std::vector<float> lse;  // [heads][n]
  plsh::KeptKeys kept;

  /// The row lse the forward writes and the backward takes when `saved`, else an empty view.
  plsh::RowLse<float> row_lse(bool saved) {
    return saved ? plsh::RowLse<float>(lse.data(), kTrainHeads, n) : plsh::RowLse<float>();
  }
  /// The windowed forward's kept keys when `saved`, else none.
  plsh::KeptKeys* kept_keys(bool saved) { return saved ? &kept : nullptr; }

  plsh::HeadsView<const float> in(const std::vector<float>& data) const {
    return plsh::HeadsView<const float>{data.data(), n, kTrainHeads, kTrainDim};
  }
  plsh::HeadsView<float> at(std::vector<float>& data) const {
    return plsh::HeadsView<float>{data.data(), n, kTrainHeads, kTrainDim};
  }
};

/// The inputs of length n. Only the latest length is kept: at n = 65536 the eight tensors take
/// 1 GiB.
TrainProblem& train_problem(Index n) {
  static std::unique_ptr<TrainProblem> cached;
  if (!cached || cached->n != n) {
    cached.reset();
    cached = std::make_unique<TrainProblem>();
    cached->n = n;
    const auto size = static_cast<std::size_t>(n * kTrainHeads * kTrainDim);
    for (std::vector<float>* tensor : {&cached->q, &cached->k, &cached->v, &cached->dout}) {
      tensor->resize(size);
    }
    plsh_test::fill_uniform(cached->q, 1);
    plsh_test::fill_uniform(cached->k, 2);
    plsh_test::fill_uniform(cached->v, 3);
    plsh_test::fill_uniform(cached->dout, 4);
    for (std::vector<float>* tensor : {&cached->out, &cached->dq, &cached->dk, &cached->dv}) {
      tensor->assign(size, 0.0f);
    }
    cached->lse.assign(static_cast<std::size_t>(n * kTrainHeads), 0.0f);
  }
  return *cached;
}

/// A pass on a problem; `saved`: the forward writes p.lse (and p.kept) and the backward takes
/// them.
using Pass = std::function<void(TrainProblem&, bool saved)>;

/// A kernel's forward (writes p.out) and backward (reads p.out and p.dout, writes p.dq, p.dk,
/// p.dv); an empty backward: the kernel has no backward to measure.
struct TrainKernel {
  std::string name;
  Index longest;
  Pass forward;
  Pass backward;
};

std::vector<TrainKernel> train_kernels() {
  const std::vector<double> slopes = plsh::alibi_slopes(kTrainHeads);
  const plsh::PlshOptions paper = plsh::PlshOptions::paper();
  const auto plsh_kernel = [slopes](const std::string& name, const plsh::PlshOptions& options) {
    return TrainKernel{name, kTrainLengths.back(),
                       [=](TrainProblem& p, bool saved) {
                         plsh::plsh_attention<float>(p.in(p.q), p.in(p.k), p.in(p.v), p.at(p.out),
                                                     slopes, options, p.row_lse(saved));
                       },
                       [=](TrainProblem& p, bool saved) {
                         plsh::plsh_attention_backward<float>(
                             p.in(p.q), p.in(p.k), p.in(p.v), p.in(p.out), p.in(p.dout), p.at(p.dq),
                             p.at(p.dk), p.at(p.dv), slopes, options, p.row_lse(saved));
                       }};
  };
  const auto truncated_kernel = [slopes](const std::string& name, double factor_tolerance) {
    TrainKernel kernel{
        name, kTrainLengths.back(),
        [=](TrainProblem& p, bool saved) {
          plsh::truncated_alibi_attention<float>(p.in(p.q), p.in(p.k), p.in(p.v), p.at(p.out),
                                                 slopes, factor_tolerance, {}, p.row_lse(saved));
        },
        [=](TrainProblem& p, bool saved) {
          plsh::truncated_alibi_attention_backward<float>(
              p.in(p.q), p.in(p.k), p.in(p.v), p.in(p.out), p.in(p.dout), p.at(p.dq), p.at(p.dk),
              p.at(p.dv), slopes, factor_tolerance, {}, p.row_lse(saved));
        }};
    return kernel;
  };
  return {
      {"exact", kExactLongest,
       [=](TrainProblem& p, bool saved) {
         plsh::exact_alibi_attention<float>(p.in(p.q), p.in(p.k), p.in(p.v), p.at(p.out), slopes,
                                            {}, p.row_lse(saved));
       },
       [=](TrainProblem& p, bool saved) {
         plsh::exact_alibi_attention_backward<float>(p.in(p.q), p.in(p.k), p.in(p.v), p.in(p.out),
                                                     p.in(p.dout), p.at(p.dq), p.at(p.dk),
                                                     p.at(p.dv), slopes, {}, p.row_lse(saved));
       }},
      {"windowed_1e3", kTrainLengths.back(),
       [=](TrainProblem& p, bool saved) {
         plsh::windowed_alibi_attention<float>(p.in(p.q), p.in(p.k), p.in(p.v), p.at(p.out), slopes,
                                               kCertifiedTolerance, {}, p.row_lse(saved),
                                               p.kept_keys(saved));
       },
       [=](TrainProblem& p, bool saved) {
         plsh::windowed_alibi_attention_backward<float>(
             p.in(p.q), p.in(p.k), p.in(p.v), p.in(p.out), p.in(p.dout), p.at(p.dq), p.at(p.dk),
             p.at(p.dv), slopes, kCertifiedTolerance, {}, p.row_lse(saved), p.kept_keys(saved));
       }},
      truncated_kernel("truncated_1e3", 1e-3),
      truncated_kernel("truncated_5e2", 0.05),
      plsh_kernel("fused_defaults", plsh::PlshOptions{}),
      plsh_kernel("fused_paper", paper),
      {"fixed_blocks", kTrainLengths.back(),
       [](TrainProblem& p, bool saved) {
         plsh::fixed_block_attention<float>(p.in(p.q), p.in(p.k), p.in(p.v), p.at(p.out),
                                            kTrainFixedBlock, {}, p.row_lse(saved));
       },
       [](TrainProblem& p, bool saved) {
         plsh::fixed_block_attention_backward<float>(
             p.in(p.q), p.in(p.k), p.in(p.v), p.in(p.out), p.in(p.dout), p.at(p.dq), p.at(p.dk),
             p.at(p.dv), kTrainFixedBlock, {}, p.row_lse(saved));
       }},
  };
}

/// What one iteration runs: the forward alone, the forward then the backward, or both passing
/// the saved lse (and kept keys).
enum class Step { Forward, ForwardBackward, SavedLse };

/// One iteration of `step` per iteration on the inputs of length n, with `threads` OpenMP
/// threads.
void train_benchmark(benchmark::State& state, const TrainKernel& kernel, Step step, Index n,
                     int threads) {
  const plsh_test::ThreadCount thread_count(threads);
  TrainProblem& p = train_problem(n);
  plsh_bench::touch_pages(p.q, p.k, p.v, p.out, p.dout, p.dq, p.dk, p.dv);
  const bool saved = step == Step::SavedLse;
  for (auto _ : state) {
    kernel.forward(p, saved);
    if (step != Step::Forward) kernel.backward(p, saved);
    benchmark::DoNotOptimize(p.out.data());
    benchmark::DoNotOptimize(p.dq.data());
    benchmark::ClobberMemory();
  }
  state.counters["threads"] = threads;
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(n), benchmark::Counter::kIsIterationInvariantRate);
}

/// Registers the families length by length, so that the kernels at one length run one after the
/// other (their ratios then share the machine's load at that time) and the inputs are filled
/// once per length.
bool register_train_benchmarks() {
  static const std::vector<TrainKernel> kernels = train_kernels();
#if defined(_OPENMP)
  const std::vector<int> thread_counts = {1, 2};
#else
  const std::vector<int> thread_counts = {1};
#endif
  for (const Index n : kTrainLengths) {
    for (const int threads : thread_counts) {
      for (const TrainKernel& kernel : kernels) {
        if (n > kernel.longest) continue;
        for (const Step step : {Step::Forward, Step::ForwardBackward, Step::SavedLse}) {
          if (step != Step::Forward && !kernel.backward) continue;
          const char* family = step == Step::Forward           ? "train_forward/"
                               : step == Step::ForwardBackward ? "train/"
                                                               : "train_lse/";
          const std::string name = std::string(family) + kernel.name + "/" + std::to_string(n) +
                                   "/" + std::to_string(threads);
          benchmark::internal::Benchmark* benchmark = benchmark::RegisterBenchmark(
              name.c_str(), [&kernel, step, n, threads](benchmark::State& state) {
                train_benchmark(state, kernel, step, n, threads);
              });
          benchmark->Unit(benchmark::kMillisecond)->UseRealTime()->MeasureProcessCPUTime();
          if (kernel.name == "exact" && n >= kExactOneIteration) benchmark->Iterations(1);
        }
      }
    }
  }
  return true;
}

[[maybe_unused]] const bool registered = register_train_benchmarks();

}  // namespace
