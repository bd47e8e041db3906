/// \file plsh_bench.cpp
/// Speed of the attention kernels of plsh (Google Benchmark).
///
/// Problem: 8 heads with plsh::alibi_slopes(8), head dimension d = d_v = 64, causal, float, q, k
/// and v uniform in [-1, 1] from plsh::detail::CounterRandom (filled once per sequence length,
/// outside the timed region). Benchmarks are named `family/n[/s]`:
///
/// - `gemm/n`: Eigen reference product, the efficiency yardstick. n/1024 times the pair
///   S = Q K^T, O = S V with Q, K, V of 1024 x 64 (float, row-major): the work of n queries
///   against 1024 keys in one large product, 2 (d + d_v) flops per score entry.
/// - `gemm_tile/n`: the same products cut into the tiles of the attention core (64 query rows
///   against 128 keys): what Eigen reaches on those small shapes, before softmax.
/// - `regular/n`: unbiased causal attention, exact_alibi_attention with every slope 0.
/// - `exact/n`: plsh::exact_alibi_attention.
/// - `windowed/n`, `windowed_1e3/n`: plsh::windowed_alibi_attention, tolerance 1e-6 and 1e-3.
/// - `truncated/n`, `truncated_1e3/n`: plsh::truncated_alibi_attention (the factor-only band, no
///   guarantee) at factor tolerance 1e-6 and 1e-3: with the windowed families, the cost of the
///   certificate.
/// - `passes/n/s`, `fused/n/s`: plsh::plsh_attention with Kernel::Passes / Kernel::Fused.
/// - `fixed_blocks/n`: plsh::fixed_block_attention, block size 64.
/// - `fused_threads/16384/20/t`: the fused kernel with t OpenMP threads (OpenMP builds only).
/// - `long_fused/n/20/type`, `long_windowed/n/float`: n = 2^16, 2^18, 2^20, one call each; type
///   float or bfloat16 (and half at 2^16), the float inputs rounded to it. Extra counters:
///   `peak_rss_bytes`, `tensor_bytes`, `peak_reset` and, for 16-bit types at 2^16,
///   `relative_error` (see long_benchmark).
///
/// Counters: `tokens_per_second` (n per second), `scores_per_query` (score entries computed per
/// query and head, counted from the kernels' own tiling), `gflops` (2 (d + d_v) flops per
/// computed score entry, per second, in units of 1e9). Threads: the kernels use
/// omp_get_max_threads() threads; run with OMP_NUM_THREADS=1 for single-thread figures.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <map>
#include <memory>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include <plsh/plsh.hpp>

#include "../tests/fill.hpp"
#include "touch_pages.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using plsh::Index;
using plsh_bench::touch_pages;

constexpr Index kHeads = 8;
constexpr Index kDim = 64;
constexpr Index kValueDim = 64;
constexpr double kWindowTolerance = 1e-6;
constexpr Index kFixedBlockSize = 64;
/// Keys of the gemm yardstick: each product is (1024 x 64) (64 x 1024), then (1024 x 1024)
/// (1024 x 64).
constexpr Index kGemmKeys = 1024;
/// Flops per computed score entry: q.k (2d) and the weighted sum of values (2 d_v).
constexpr double kFlopsPerScore = 2.0 * (kDim + kValueDim);

const std::vector<Index> kLengths = {1024, 4096, 16384, 65536};
/// The fused kernel also runs at 8192, so that its growth from 8192 to 65536 can be read off.
const std::vector<Index> kFusedLengths = {1024, 4096, 8192, 16384, 65536};
const std::vector<Index> kSamples = {5, 20, 100};

/// Fills `values` with uniform numbers in [-1, 1]: element i is 2 U(i) - 1 from a generator
/// seeded with `seed` (the tests' fill, tests/fill.hpp).
using plsh_test::fill_uniform;

/// q, k, v and out of one sequence length, [n][heads][dim], packed.
struct Problem {
  Index n = 0;
  std::vector<float> q, k, v, out;

  plsh::HeadsView<const float> view(const std::vector<float>& data, Index dim) const {
    return plsh::HeadsView<const float>{data.data(), n, kHeads, dim};
  }
  plsh::HeadsView<const float> queries() const { return view(q, kDim); }
  plsh::HeadsView<const float> keys() const { return view(k, kDim); }
  plsh::HeadsView<const float> values() const { return view(v, kValueDim); }
  plsh::HeadsView<float> output() {
    return plsh::HeadsView<float>{out.data(), n, kHeads, kValueDim};
  }
};

/// The cached inputs of the families on float (the latest length only).
std::unique_ptr<Problem>& problem_cache() {
  static std::unique_ptr<Problem> cached;
  return cached;
}

/// The inputs of length n. Only the latest length is kept: at n = 65536 the four tensors take
/// 0.5 GB.
Problem& problem(Index n) {
  std::unique_ptr<Problem>& cached = problem_cache();
  if (!cached || cached->n != n) {
    cached.reset();
    cached = std::make_unique<Problem>();
    cached->n = n;
    const auto size = static_cast<std::size_t>(n * kHeads * kDim);
    cached->q.resize(size);
    cached->k.resize(size);
    cached->v.resize(static_cast<std::size_t>(n * kHeads * kValueDim));
    cached->out.assign(cached->v.size(), 0.0f);
    fill_uniform(cached->q, 1);
    fill_uniform(cached->k, 2);
    fill_uniform(cached->v, 3);
  }
  return *cached;
}

// ---------------------------------------------------------------------------------------------
// Score entries computed by each kernel, counted from the same tiling the kernel uses.
// ---------------------------------------------------------------------------------------------

/// Entries computed by the tiled core (detail::attend_span) on a causal span of `length` queries
/// against the `length` keys at the same positions, keys farther than `window` dropped: query
/// tile [r0, r1) covers keys [max(0, r0 - window), r1), i.e. (r1 - r0) (r1 - key_begin)
/// entries, the masked upper triangle of the diagonal tile included.
double causal_span_entries(Index length, Index window) {
  double entries = 0;
  for (Index r0 = 0; r0 < length; r0 += plsh::detail::kQueryTile) {
    const Index r1 = std::min(length, r0 + plsh::detail::kQueryTile);
    const Index key_begin = std::max<Index>(0, r0 - window);
    entries += static_cast<double>(r1 - r0) * static_cast<double>(r1 - key_begin);
  }
  return entries;
}

/// Exact ALiBi: one causal span per head.
double alibi_entries(Index n, const std::vector<double>& slopes) {
  return static_cast<double>(slopes.size()) * causal_span_entries(n, plsh::detail::kNoWindow);
}

/// Windowed ALiBi at kWindowTolerance, causal, on these inputs: its windows depend on the data, so
/// the key rows each query tile kept are counted from the kernel's own certificate (one more run
/// of the kernel, without output), the masked part of the diagonal tile included.
double windowed_entries(const plsh::HeadsView<const float>& q,
                        const plsh::HeadsView<const float>& k,
                        const plsh::HeadsView<const float>& v,
                        double tolerance = kWindowTolerance) {
  std::vector<plsh::Block> kept;
  plsh::AttentionOptions options;  // causal
  plsh::detail::batched_windowed_alibi_attention<float>(
      plsh::detail::batch_of_one(q), plsh::detail::batch_of_one(k), plsh::detail::batch_of_one(v),
      nullptr, plsh::alibi_slopes(q.heads), tolerance, options, {}, &kept);
  const Index tiles = (q.tokens + plsh::detail::kQueryTile - 1) / plsh::detail::kQueryTile;
  double entries = 0;
  for (std::size_t i = 0; i < kept.size(); ++i) {
    const Index row_begin = static_cast<Index>(i) % tiles * plsh::detail::kQueryTile;
    const Index rows = std::min(q.tokens - row_begin, plsh::detail::kQueryTile);
    entries += static_cast<double>(rows) * static_cast<double>(kept[i].size());
  }
  return entries;
}

/// The pass kernel: per head, draw and block b, the tiled core on a causal b x b span.
double pass_entries(Index n, const std::vector<std::vector<plsh::Grid>>& head_grids) {
  double entries = 0;
  for (const auto& grids : head_grids) {
    for (const plsh::Grid& grid : grids) {
      for (Index p = 0; p < n;) {
        const plsh::Block block = plsh::grid_block(grid, p, 0, n);
        entries += causal_span_entries(block.size(), plsh::detail::kNoWindow);
        p = block.end;
      }
    }
  }
  return entries;
}

/// The fused kernel (detail::fused_attention, causal self-attention at position 0): per head,
/// query tiles of detail::fused_tile_rows(slope) rows; each tile computes its rows against the
/// union of its blocks over all draws, found by the kernel's own detail::tile_block_runs. Where
/// the kernel takes detail::fused_causal_rows (AVX-512 builds, 1/m < kCausalRowsReach), a row
/// computes its own keys only, from its draws' smallest block start to itself, unless a row of
/// its tile of kCausalTileRows sees more than kCausalRowKeys (then the tile's union, as above).
double fused_entries(Index n, const std::vector<double>& slopes,
                     const std::vector<std::vector<plsh::Grid>>& head_grids) {
  double entries = 0;
  std::vector<plsh::detail::BlockRun> runs;
  std::vector<Index> first_key;  // [position]: the smallest block start over the draws
  const auto tile_union = [&](std::size_t h, Index row_begin, Index rows) {
    runs.clear();
    const plsh::Block keys = plsh::detail::tile_block_runs(
        head_grids[h], plsh::detail::PositionRange{0, n}, row_begin, rows, 0, n, true, runs);
    return static_cast<double>(rows) * static_cast<double>(keys.size());
  };
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    if (plsh::detail::kCausalRows<float> && slopes[h] * plsh::detail::kCausalRowsReach > 1) {
      first_key.assign(static_cast<std::size_t>(n), n);
      for (const plsh::Grid& grid : head_grids[h]) {
        for (Index p = 0; p < n;) {
          const plsh::Block block = plsh::grid_block(grid, p, 0, n);
          for (; p < block.end; ++p) {
            Index& first = first_key[static_cast<std::size_t>(p)];
            first = std::min(first, block.begin);
          }
        }
      }
      for (Index row_begin = 0; row_begin < n; row_begin += plsh::detail::kCausalTileRows) {
        const Index rows = std::min(n - row_begin, plsh::detail::kCausalTileRows);
        double own = 0;
        Index widest = 0;
        for (Index p = row_begin; p < row_begin + rows; ++p) {
          const Index width = p + 1 - first_key[static_cast<std::size_t>(p)];
          own += static_cast<double>(width);
          widest = std::max(widest, width);
        }
        entries += widest > plsh::detail::kCausalRowKeys ? tile_union(h, row_begin, rows) : own;
      }
      continue;
    }
    const Index height = plsh::detail::fused_tile_rows(slopes[h]);
    for (Index row_begin = 0; row_begin < n; row_begin += height) {
      entries += tile_union(h, row_begin, std::min(n, row_begin + height) - row_begin);
    }
  }
  return entries;
}

double count_entries(const std::string& family, Index n, Index samples) {
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  if (family == "regular" || family == "exact") return alibi_entries(n, slopes);
  if (family == "truncated" || family == "truncated_1e3") {
    const double tolerance = family == "truncated" ? kWindowTolerance : 1e-3;
    double entries = 0;
    for (const double slope : slopes) {
      entries += causal_span_entries(n, plsh::detail::factor_window(slope, tolerance));
    }
    return entries;
  }
  if (family == "fixed_blocks") {
    return pass_entries(n, std::vector<std::vector<plsh::Grid>>(
                               slopes.size(), {plsh::fixed_grid(kFixedBlockSize)}));
  }
  const plsh::PlshOptions defaults;
  const auto grids = plsh::draw_head_grids(slopes, samples, defaults.seed);
  if (family == "passes") return pass_entries(n, grids);
  return fused_entries(n, slopes, grids);  // "fused", "fused_threads"
}

/// Counting the fused and pass entries at n = 65536, s = 100 takes a noticeable fraction of a
/// second: each count is made once per (family, n, s).
double cached_entries(const std::string& family, Index n, Index samples) {
  static std::map<std::tuple<std::string, Index, Index>, double> counted;
  const auto key = std::make_tuple(family, n, samples);
  const auto found = counted.find(key);
  if (found != counted.end()) return found->second;
  const double entries = count_entries(family, n, samples);
  counted.emplace(key, entries);
  return entries;
}

/// tokens_per_second, scores_per_query and gflops; the rates are per real second of all
/// iterations (kIsIterationInvariantRate: value per iteration times iterations over time).
void set_counters(benchmark::State& state, Index n, Index heads, double entries) {
  using benchmark::Counter;
  state.counters["tokens_per_second"] =
      Counter(static_cast<double>(n), Counter::kIsIterationInvariantRate);
  state.counters["scores_per_query"] = Counter(entries / static_cast<double>(n * heads));
  state.counters["gflops"] =
      Counter(kFlopsPerScore * entries * 1e-9, Counter::kIsIterationInvariantRate);
}

// ---------------------------------------------------------------------------------------------
// Benchmarks.
// ---------------------------------------------------------------------------------------------

plsh::PlshOptions plsh_options(Index samples, plsh::Kernel kernel) {
  plsh::PlshOptions options = plsh::PlshOptions::paper();  // the paper's estimator, at s samples
  options.samples = samples;
  options.kernel = kernel;
  return options;
}

/// Runs `kernel(problem)` as the timed body on the inputs of length n.
template <class Kernel>
void attention_benchmark(benchmark::State& state, const std::string& family, Index n, Index samples,
                         Kernel kernel) {
  Problem& inputs = problem(n);
  const double entries =
      family == "windowed" ? windowed_entries(inputs.queries(), inputs.keys(), inputs.values())
      : family == "windowed_1e3"
          ? windowed_entries(inputs.queries(), inputs.keys(), inputs.values(), 1e-3)
          : cached_entries(family, n, samples);
  touch_pages(inputs.q, inputs.k, inputs.v, inputs.out);
  for (auto _ : state) {
    kernel(inputs);
    benchmark::DoNotOptimize(inputs.out.data());
    benchmark::ClobberMemory();
  }
  set_counters(state, n, kHeads, entries);
}

using RowMatrixF = plsh::RowMatrix<float>;

RowMatrixF uniform_matrix(Index rows, Index cols, std::uint64_t seed) {
  std::vector<float> values(static_cast<std::size_t>(rows * cols));
  fill_uniform(values, seed);
  return Eigen::Map<const RowMatrixF>(values.data(), rows, cols);
}

/// gemm/n: n / 1024 times S = Q K^T (1024 x 1024), O = S V, all operands resident in cache.
void gemm_benchmark(benchmark::State& state, Index n) {
  const RowMatrixF q = uniform_matrix(kGemmKeys, kDim, 1);
  const RowMatrixF k = uniform_matrix(kGemmKeys, kDim, 2);
  const RowMatrixF v = uniform_matrix(kGemmKeys, kValueDim, 3);
  RowMatrixF scores(kGemmKeys, kGemmKeys);
  RowMatrixF out(kGemmKeys, kValueDim);
  for (auto _ : state) {
    for (Index block = 0; block < n; block += kGemmKeys) {
      scores.noalias() = q * k.transpose();
      out.noalias() = scores * v;
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
  }
  set_counters(state, n, 1, static_cast<double>(n * kGemmKeys));
}

/// gemm_tile/n: the same n x 1024 score entries in the attention core's tile shapes: per
/// 64-row query tile and 128-key tile, S = Q_t K_t^T (64 x 128), O_t += S V_t.
void gemm_tile_benchmark(benchmark::State& state, Index n) {
  constexpr Index kRows = plsh::detail::kQueryTile;
  constexpr Index kCols = plsh::detail::kKeyTile;
  const RowMatrixF q = uniform_matrix(n, kDim, 1);
  const RowMatrixF k = uniform_matrix(kGemmKeys, kDim, 2);
  const RowMatrixF v = uniform_matrix(kGemmKeys, kValueDim, 3);
  RowMatrixF scores(kRows, kCols);
  RowMatrixF out(kRows, kValueDim);
  for (auto _ : state) {
    for (Index r0 = 0; r0 < n; r0 += kRows) {
      out.setZero();
      for (Index c0 = 0; c0 < kGemmKeys; c0 += kCols) {
        scores.noalias() = q.middleRows(r0, kRows) * k.middleRows(c0, kCols).transpose();
        out.noalias() += scores * v.middleRows(c0, kCols);
      }
      benchmark::DoNotOptimize(out.data());
      benchmark::ClobberMemory();
    }
  }
  set_counters(state, n, 1, static_cast<double>(n * kGemmKeys));
}

benchmark::internal::Benchmark* configure(benchmark::internal::Benchmark* benchmark) {
  return benchmark->Unit(benchmark::kMillisecond)->UseRealTime();
}

std::string name_of(const std::string& family, Index n) { return family + "/" + std::to_string(n); }
std::string name_of(const std::string& family, Index n, Index samples) {
  return name_of(family, n) + "/" + std::to_string(samples);
}

// ---------------------------------------------------------------------------------------------
// Long sequences: the fused (s = 20) and windowed kernels at n = 2^16, 2^18, 2^20 in float and
// in 16-bit storage, with their peak memory.
// ---------------------------------------------------------------------------------------------

const std::vector<Index> kLongLengths = {65536, 262144, 1048576};
constexpr Index kLongSamples = 20;
/// Length at which the 16-bit outputs are compared with the float output.
constexpr Index kErrorLength = 65536;

template <class Storage>
const char* storage_name() {
  if (std::is_same<Storage, Eigen::bfloat16>::value) return "bfloat16";
  if (std::is_same<Storage, Eigen::half>::value) return "half";
  return "float";
}

/// q, k, v and out of one length in storage type `Storage`: the float inputs of `problem`
/// (same seeds) rounded to nearest.
template <class Storage>
struct StoredProblem {
  Index n = 0;
  std::vector<Storage> q, k, v, out;

  plsh::HeadsView<const Storage> view(const std::vector<Storage>& data, Index dim) const {
    return plsh::HeadsView<const Storage>{data.data(), n, kHeads, dim};
  }
  plsh::HeadsView<const Storage> queries() const { return view(q, kDim); }
  plsh::HeadsView<const Storage> keys() const { return view(k, kDim); }
  plsh::HeadsView<const Storage> values() const { return view(v, kValueDim); }
  plsh::HeadsView<Storage> output() {
    return plsh::HeadsView<Storage>{out.data(), n, kHeads, kValueDim};
  }
  double tensor_bytes() const {
    return static_cast<double>((q.size() + k.size() + v.size() + out.size()) * sizeof(Storage));
  }
};

template <class Storage>
std::vector<Storage> stored_uniform(std::size_t size, std::uint64_t seed) {
  std::vector<float> values(size);
  fill_uniform(values, seed);
  std::vector<Storage> stored(size);
  for (std::size_t i = 0; i < size; ++i) stored[i] = static_cast<Storage>(values[i]);
  return stored;
}

/// The one long problem kept, whatever its type, and a tag of its type.
struct LongProblemSlot {
  std::shared_ptr<void> problem;
  const void* type = nullptr;
};

LongProblemSlot& long_problem_slot() {
  static LongProblemSlot slot;
  return slot;
}

template <class Storage>
const void* type_tag() {
  static const char tag = 0;
  return &tag;
}

/// The inputs of the long families: one problem of one type and length is kept (at n = 2^20 the
/// float tensors take 8 GiB), and the float families' cache is released first.
template <class Storage>
StoredProblem<Storage>& long_problem(Index n) {
  LongProblemSlot& slot = long_problem_slot();
  if (slot.type != type_tag<Storage>() ||
      static_cast<StoredProblem<Storage>*>(slot.problem.get())->n != n) {
    slot.problem.reset();
    slot.type = nullptr;
    problem_cache().reset();
    auto made = std::make_shared<StoredProblem<Storage>>();
    made->n = n;
    const auto size = static_cast<std::size_t>(n * kHeads * kDim);
    made->q = stored_uniform<Storage>(size, 1);
    made->k = stored_uniform<Storage>(size, 2);
    made->v = stored_uniform<Storage>(static_cast<std::size_t>(n * kHeads * kValueDim), 3);
    made->out.assign(made->v.size(), Storage(0));
    slot.problem = made;
    slot.type = type_tag<Storage>();
  }
  return *static_cast<StoredProblem<Storage>*>(slot.problem.get());
}

/// A field of /proc/self/status in bytes ("VmHWM:", "VmRSS:"), -1 where there is none.
double status_bytes(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size(), field) == 0) {
      return 1024.0 * std::stod(line.substr(field.size()));
    }
  }
  return -1;
}

/// Resets the peak resident set size to the current one (Linux 4.0 and later); false where the
/// kernel does not allow it.
bool reset_peak_memory() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

/// \f$\|a - b\|_F / \|b\|_F\f$.
template <class A>
double relative_error(const std::vector<A>& approximate, const std::vector<float>& exact) {
  double error = 0;
  double norm = 0;
  for (std::size_t i = 0; i < exact.size(); ++i) {
    const double difference = static_cast<double>(approximate[i]) - exact[i];
    error += difference * difference;
    norm += static_cast<double>(exact[i]) * exact[i];
  }
  return std::sqrt(error / norm);
}

/// Runs `kernel(problem)` on the long problem of length n in `Storage`. Counters as
/// attention_benchmark, plus `peak_rss_bytes` (the process's peak resident set during the timed
/// calls, reset before them: inputs, output, the kernel's scratch and the program itself),
/// `tensor_bytes` (q, k, v, out), `peak_reset` (1 where the peak could be reset; otherwise the
/// peak is the process's since it started) and, for 16-bit storage at n = kErrorLength,
/// `relative_error` against the fused kernel on the float inputs.
template <class Storage, class Kernel>
void long_benchmark(benchmark::State& state, const std::string& family, Index n, Kernel kernel) {
  StoredProblem<Storage>& inputs = long_problem<Storage>(n);
  double entries = 0;
  if constexpr (std::is_same<Storage, float>::value) {
    entries = family == "windowed"
                  ? windowed_entries(inputs.queries(), inputs.keys(), inputs.values())
                  : cached_entries(family, n, kLongSamples);
  } else {
    entries = cached_entries(family, n, kLongSamples);
  }
  touch_pages(inputs.q, inputs.k, inputs.v, inputs.out);
  const bool reset = reset_peak_memory();
  for (auto _ : state) {
    kernel(inputs);
    benchmark::DoNotOptimize(inputs.out.data());
    benchmark::ClobberMemory();
  }
  state.counters["peak_rss_bytes"] = status_bytes("VmHWM:");
  state.counters["tensor_bytes"] = inputs.tensor_bytes();
  state.counters["peak_reset"] = reset ? 1 : 0;
  set_counters(state, n, kHeads, entries);
  if (!std::is_same<Storage, float>::value && n == kErrorLength && family == "fused") {
    const std::vector<Storage> stored = inputs.out;
    Problem& reference = problem(n);
    plsh::PlshOptions options = plsh_options(kLongSamples, plsh::Kernel::Fused);
    plsh::plsh_attention<float>(reference.queries(), reference.keys(), reference.values(),
                                reference.output(), plsh::alibi_slopes(kHeads), options);
    state.counters["relative_error"] = relative_error(stored, reference.out);
    problem_cache().reset();
  }
}

template <class Storage>
void register_long_fused(Index n) {
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  const plsh::PlshOptions options = plsh_options(kLongSamples, plsh::Kernel::Fused);
  const std::string name = "long_fused/" + std::to_string(n) + "/" + std::to_string(kLongSamples) +
                           "/" + storage_name<Storage>();
  configure(benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& state) {
    long_benchmark<Storage>(state, "fused", n, [&](StoredProblem<Storage>& p) {
      plsh::plsh_attention<Storage>(p.queries(), p.keys(), p.values(), p.output(), slopes, options);
    });
  }))->Iterations(1);
}

void register_long_windowed(Index n) {
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  const std::string name = "long_windowed/" + std::to_string(n) + "/float";
  configure(benchmark::RegisterBenchmark(name.c_str(), [=](benchmark::State& state) {
    long_benchmark<float>(state, "windowed", n, [&](StoredProblem<float>& p) {
      plsh::windowed_alibi_attention<float>(p.queries(), p.keys(), p.values(), p.output(), slopes,
                                            kWindowTolerance);
    });
  }))->Iterations(1);
}

/// Registers every family, family by family, sizes increasing.
bool register_benchmarks() {
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  const std::vector<double> no_slopes(slopes.size(), 0.0);

  for (const Index n : kLengths) {
    configure(benchmark::RegisterBenchmark(name_of("gemm", n).c_str(), gemm_benchmark, n));
  }
  for (const Index n : kLengths) {
    configure(
        benchmark::RegisterBenchmark(name_of("gemm_tile", n).c_str(), gemm_tile_benchmark, n));
  }
  for (const Index n : kLengths) {
    configure(benchmark::RegisterBenchmark(
        name_of("regular", n).c_str(), [n, no_slopes](benchmark::State& state) {
          attention_benchmark(state, "regular", n, 0, [&](Problem& p) {
            plsh::exact_alibi_attention<float>(p.queries(), p.keys(), p.values(), p.output(),
                                               no_slopes);
          });
        }));
  }
  for (const Index n : kLengths) {
    configure(benchmark::RegisterBenchmark(
        name_of("exact", n).c_str(), [n, slopes](benchmark::State& state) {
          attention_benchmark(state, "exact", n, 0, [&](Problem& p) {
            plsh::exact_alibi_attention<float>(p.queries(), p.keys(), p.values(), p.output(),
                                               slopes);
          });
        }));
  }
  for (const Index n : kLengths) {
    configure(benchmark::RegisterBenchmark(
        name_of("windowed", n).c_str(), [n, slopes](benchmark::State& state) {
          attention_benchmark(state, "windowed", n, 0, [&](Problem& p) {
            plsh::windowed_alibi_attention<float>(p.queries(), p.keys(), p.values(), p.output(),
                                                  slopes, kWindowTolerance);
          });
        }));
  }
  // The certified window and the factor-only band at the same tolerances (the cost of the
  // certificate): windowed_1e3 and truncated_1e3 at 1e-3, truncated at kWindowTolerance.
  const std::tuple<const char*, double, bool> window_families[] = {
      {"windowed_1e3", 1e-3, true},
      {"truncated", kWindowTolerance, false},
      {"truncated_1e3", 1e-3, false}};
  for (const auto& [family, tolerance, certified] : window_families) {
    for (const Index n : kLengths) {
      const std::string name = family;
      const double tol = tolerance;
      const bool guaranteed = certified;
      configure(benchmark::RegisterBenchmark(
          name_of(name, n).c_str(), [n, slopes, name, tol, guaranteed](benchmark::State& state) {
            attention_benchmark(state, name, n, 0, [&](Problem& p) {
              if (guaranteed) {
                plsh::windowed_alibi_attention<float>(p.queries(), p.keys(), p.values(), p.output(),
                                                      slopes, tol);
              } else {
                plsh::truncated_alibi_attention<float>(p.queries(), p.keys(), p.values(),
                                                       p.output(), slopes, tol);
              }
            });
          }));
    }
  }
  const std::pair<const char*, plsh::Kernel> plsh_families[] = {{"passes", plsh::Kernel::Passes},
                                                                {"fused", plsh::Kernel::Fused}};
  for (const auto& [family, kernel] : plsh_families) {
    const bool fused = kernel == plsh::Kernel::Fused;
    for (const Index n : fused ? kFusedLengths : kLengths) {
      for (const Index samples : kSamples) {
        const std::string name = family;
        const plsh::PlshOptions options = plsh_options(samples, kernel);
        configure(benchmark::RegisterBenchmark(
            name_of(name, n, samples).c_str(), [=](benchmark::State& state) {
              attention_benchmark(state, name, n, samples, [&](Problem& p) {
                plsh::plsh_attention<float>(p.queries(), p.keys(), p.values(), p.output(), slopes,
                                            options);
              });
            }));
      }
    }
  }
  for (const Index n : kLengths) {
    configure(benchmark::RegisterBenchmark(
        name_of("fixed_blocks", n).c_str(), [n](benchmark::State& state) {
          attention_benchmark(state, "fixed_blocks", n, 0, [&](Problem& p) {
            plsh::fixed_block_attention<float>(p.queries(), p.keys(), p.values(), p.output(),
                                               kFixedBlockSize);
          });
        }));
  }
  for (const Index n : kLongLengths) {
    register_long_fused<float>(n);
    register_long_fused<Eigen::bfloat16>(n);
    if (n == kErrorLength) register_long_fused<Eigen::half>(n);
    register_long_windowed(n);
  }
#if defined(_OPENMP)
  constexpr Index kThreadsLength = 16384;
  constexpr Index kThreadsSamples = 20;
  for (const int threads : {1, 2}) {
    const plsh::PlshOptions options = plsh_options(kThreadsSamples, plsh::Kernel::Fused);
    configure(benchmark::RegisterBenchmark(
        (name_of("fused_threads", kThreadsLength, kThreadsSamples) + "/" + std::to_string(threads))
            .c_str(),
        [=](benchmark::State& state) {
          const int saved_threads = omp_get_max_threads();
          omp_set_num_threads(threads);
          attention_benchmark(state, "fused_threads", kThreadsLength, kThreadsSamples,
                              [&](Problem& p) {
                                plsh::plsh_attention<float>(p.queries(), p.keys(), p.values(),
                                                            p.output(), slopes, options);
                              });
          state.counters["threads"] = threads;
          omp_set_num_threads(saved_threads);
        }));
  }
#endif
  return true;
}

[[maybe_unused]] const bool registered = register_benchmarks();

}  // namespace

BENCHMARK_MAIN();
