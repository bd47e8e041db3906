/// \file bench_decode.cpp
/// Speed of incremental decoding (Google Benchmark families linked into plsh_bench).
///
/// Problem: 8 heads with plsh::alibi_slopes(8), d = d_v = 64, float, q, k and v uniform in
/// [-1, 1] from plsh::detail::CounterRandom. One iteration decodes one token:
///
/// - `decode_plsh/context`: plsh::KvCache (s = 20, fused kernel), prefilled with `context`
///   tokens in chunks of 1024 outside the timed loop; per iteration one `append` of 1 token and
///   one `attend` of 1 query. The cache evicts what no later query can reach, so the time per
///   token should not grow with the context (goal: 65536 within 1.2x of 4096). Counter
///   `resident`: tokens stored at the end of the run.
/// - `decode_exact/context`: exact ALiBi decoding with a full cache: plsh::exact_alibi_attention
///   of one query at position `context` against all `context` keys. Counter `resident` =
///   context.
///
/// Counter `tokens_per_second`: decoded tokens per second. Run with OMP_NUM_THREADS=1 for
/// single-thread figures.

#include <benchmark/benchmark.h>

#include <algorithm>
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include <plsh/plsh.hpp>

#include "../tests/fill.hpp"

namespace {

using plsh::Index;

constexpr Index kDecodeHeads = 8;
constexpr Index kDecodeDim = 64;
constexpr Index kDecodeSamples = 20;
/// Tokens of distinct q, k, v rows cycled through while decoding; the values do not change the
/// work, only the pool keeps memory small.
constexpr Index kPoolTokens = 1024;
constexpr Index kPrefillChunk = 1024;
const std::vector<Index> kContexts = {1024, 4096, 65536};

std::vector<float> uniform_tokens(Index tokens, std::uint64_t seed) {
  return plsh_test::uniform_values<float>(
      static_cast<std::size_t>(tokens * kDecodeHeads * kDecodeDim), seed);
}

/// A pool of `kPoolTokens` tokens of q, k and v.
struct TokenPool {
  std::vector<float> q = uniform_tokens(kPoolTokens, 11);
  std::vector<float> k = uniform_tokens(kPoolTokens, 12);
  std::vector<float> v = uniform_tokens(kPoolTokens, 13);

  plsh::HeadsView<const float> view(const std::vector<float>& data, Index first,
                                    Index count) const {
    return plsh::HeadsView<const float>{data.data(), kPoolTokens, kDecodeHeads, kDecodeDim}.slice(
        first % kPoolTokens, count);
  }
};

const TokenPool& token_pool() {
  static const TokenPool pool;
  return pool;
}

void decode_plsh(benchmark::State& state, Index context) {
  const TokenPool& pool = token_pool();
  plsh::PlshOptions options;
  options.samples = kDecodeSamples;
  plsh::KvCache<float> cache(kDecodeHeads, kDecodeHeads, kDecodeDim, kDecodeDim,
                             plsh::alibi_slopes(kDecodeHeads), options);
  for (Index done = 0; done < context; done += kPrefillChunk) {
    const Index chunk = std::min(kPrefillChunk, context - done);
    cache.append(pool.view(pool.k, 0, chunk), pool.view(pool.v, 0, chunk));
  }
  std::vector<float> out(static_cast<std::size_t>(kDecodeHeads * kDecodeDim));
  const plsh::HeadsView<float> out_view{out.data(), 1, kDecodeHeads, kDecodeDim};
  Index token = 0;
  for (auto _ : state) {
    cache.append(pool.view(pool.k, token, 1), pool.view(pool.v, token, 1));
    cache.attend(pool.view(pool.q, token, 1), out_view);
    benchmark::DoNotOptimize(out.data());
    benchmark::ClobberMemory();
    ++token;
  }
  state.counters["resident"] = static_cast<double>(cache.resident());
  state.counters["tokens_per_second"] =
      benchmark::Counter(static_cast<double>(state.iterations()), benchmark::Counter::kIsRate);
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
    cached->k = uniform_tokens(context, 12);
    cached->v = uniform_tokens(context, 13);
  }
  return *cached;
}

void decode_exact(benchmark::State& state, Index context) {
  const TokenPool& pool = token_pool();
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

bool register_decode_benchmarks() {
  for (const Index context : kContexts) {
    benchmark::RegisterBenchmark(("decode_plsh/" + std::to_string(context)).c_str(), decode_plsh,
                                 context)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  for (const Index context : kContexts) {
    benchmark::RegisterBenchmark(("decode_exact/" + std::to_string(context)).c_str(), decode_exact,
                                 context)
        ->Unit(benchmark::kMicrosecond)
        ->UseRealTime();
  }
  return true;
}

[[maybe_unused]] const bool decode_registered = register_decode_benchmarks();

}  // namespace
