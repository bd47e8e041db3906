/// \file bench_alibi_decode.cpp
/// Speed and memory of decoding exact ALiBi with plsh::AlibiKvCache (a Google Benchmark family
/// linked into plsh_bench).
///
/// Problem: that of bench_decode.cpp: 8 heads with plsh::alibi_slopes(8), d = d_v = 64, q, k and v
/// uniform in [-1, 1] from plsh::detail::CounterRandom (a pool of 1024 tokens, cycled).
///
/// - `decode_alibi/context/1e-t`: AlibiKvCache<float> at tolerance 10^-t (t = 2, 4, 6) with the
///   declaration that these inputs satisfy by construction (\f$|\text{scale}|\,\|q\|\,\|k\| \le
///   64/8\f$: max_score 8, min_logit -8) and 4 sinks. The cache decodes `context` tokens one at a
///   time (decode: the append, then the attend of its query), once per process and outside the
///   timed loop, then one decode of one token per iteration. Counters, at `context` tokens:
///   `resident`, the most rows a key/value head holds; `resident_fraction`, that over the
///   context; `resident_rows`, the rows of all key/value heads; `window`, the flattest head's
///   \f$W_g\f$; `cache_bytes`. Over the steps, from the first token to the last timed one:
///   `largest_bound`, the largest bound reported by any step from the first token on;
///   `uncertified`, the steps whose bound exceeded the tolerance; `steps`, the steps counted;
///   `tokens_per_second`.
///
/// Compare with `decode_exact/context` (bench_decode.cpp): exact ALiBi of one query against the
/// full cache. Goal (issue 50): at 65536 tokens and tolerance 1e-4, resident_fraction at most 1/8,
/// at least 5x faster per token than decode_exact/65536, uncertified 0.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <plsh/plsh.hpp>

#include "../tests/fill.hpp"

namespace {

using plsh::Index;

constexpr Index kAlibiHeads = 8;
constexpr Index kAlibiDim = 64;
constexpr Index kAlibiPool = 1024;

/// A pool of kAlibiPool tokens of q, k and v, the seeds of bench_decode.cpp's.
struct AlibiPool {
  std::vector<float> q = values(11), k = values(12), v = values(13);

  static std::vector<float> values(std::uint64_t seed) {
    return plsh_test::uniform_values<float>(
        static_cast<std::size_t>(kAlibiPool * kAlibiHeads * kAlibiDim), seed);
  }
  plsh::HeadsView<const float> view(const std::vector<float>& data, Index token) const {
    return plsh::HeadsView<const float>{data.data(), kAlibiPool, kAlibiHeads, kAlibiDim}.slice(
        token % kAlibiPool, 1);
  }
};

/// What decoding from the first token gave: the cache, and the bounds of every step.
struct Decoded {
  std::unique_ptr<plsh::AlibiKvCache<float>> cache;
  double largest_bound = 0;
  Index uncertified = 0;
  Index steps = 0;

  void record(const plsh::DroppedWeight& dropped) {
    if (!(dropped.bound <= largest_bound)) largest_bound = dropped.bound;
    uncertified += dropped.certified ? 0 : 1;
    ++steps;
  }
};

plsh::AlibiCacheOptions alibi_options(int tolerance_exponent) {
  plsh::AlibiCacheOptions options;
  options.tolerance = std::pow(10.0, -tolerance_exponent);
  options.max_score = static_cast<double>(kAlibiDim) / std::sqrt(static_cast<double>(kAlibiDim));
  options.min_logit = -options.max_score;
  options.sinks = 4;
  return options;
}

/// The cache after decoding `context` tokens one at a time, computed once per (context,
/// tolerance) and process.
const Decoded& decoded(const AlibiPool& pool, Index context, int tolerance_exponent) {
  static std::map<std::pair<Index, int>, Decoded> decoded_caches;
  Decoded& result = decoded_caches[{context, tolerance_exponent}];
  if (result.cache) return result;
  result.cache = std::make_unique<plsh::AlibiKvCache<float>>(
      kAlibiHeads, kAlibiHeads, kAlibiDim, kAlibiDim, plsh::alibi_slopes(kAlibiHeads),
      alibi_options(tolerance_exponent));
  std::vector<float> out(static_cast<std::size_t>(kAlibiHeads * kAlibiDim));
  for (Index token = 0; token < context; ++token) {
    result.record(result.cache->decode(pool.view(pool.q, token), pool.view(pool.k, token),
                                       pool.view(pool.v, token),
                                       {out.data(), 1, kAlibiHeads, kAlibiDim}));
  }
  return result;
}

void decode_alibi(benchmark::State& state, Index context, int tolerance_exponent) {
  static const AlibiPool pool;
  const Decoded& before = decoded(pool, context, tolerance_exponent);
  plsh::AlibiKvCache<float> cache = *before.cache;
  Decoded steps = {nullptr, before.largest_bound, before.uncertified, before.steps};
  std::vector<float> out(static_cast<std::size_t>(kAlibiHeads * kAlibiDim));
  const plsh::HeadsView<float> out_view{out.data(), 1, kAlibiHeads, kAlibiDim};
  Index token = context;
  for (auto _ : state) {
    steps.record(cache.decode(pool.view(pool.q, token), pool.view(pool.k, token),
                              pool.view(pool.v, token), out_view));
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    ++token;
  }
  // Memory at `context` tokens, before the timed steps.
  const plsh::AlibiKvCache<float>& at_context = *before.cache;
  Index rows = 0;
  for (Index g = 0; g < at_context.kv_heads(); ++g) rows += at_context.resident(g);
  state.counters["resident"] = static_cast<double>(at_context.resident());
  state.counters["resident_fraction"] =
      static_cast<double>(at_context.resident()) / static_cast<double>(context);
  state.counters["resident_rows"] = static_cast<double>(rows);
  state.counters["window"] = static_cast<double>(at_context.window(kAlibiHeads - 1));
  state.counters["cache_bytes"] = static_cast<double>(at_context.bytes());
  state.counters["largest_bound"] = steps.largest_bound;
  state.counters["uncertified"] = static_cast<double>(steps.uncertified);
  state.counters["steps"] = static_cast<double>(steps.steps);
  state.counters["tolerance"] = std::pow(10.0, -tolerance_exponent);
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
}

bool register_alibi_decode_benchmarks() {
  for (const Index context : {Index{1024}, Index{4096}, Index{65536}}) {
    for (const int tolerance : {2, 4, 6}) {
      benchmark::RegisterBenchmark(
          ("decode_alibi/" + std::to_string(context) + "/1e-" + std::to_string(tolerance)).c_str(),
          decode_alibi, context, tolerance)
          ->Unit(benchmark::kMicrosecond)
          ->UseRealTime();
    }
  }
  return true;
}

[[maybe_unused]] const bool alibi_decode_registered = register_alibi_decode_benchmarks();

}  // namespace
