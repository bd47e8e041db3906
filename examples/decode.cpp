// Decoding with a bounded key/value cache.
//
// Generates 20000 tokens (or as many as the first argument says) one at a time with plsh::KvCache:
// 8 query heads on 2 key/value heads (grouped-query attention), the standard ALiBi slopes, head dim
// 64, s = 20 partitions per head. Each step is one KvCache::decode call, which appends the new
// token's key and value and attends its query. The toy "model" feeds the previous output back into
// the next token's q, k, v (plus fresh uniform random numbers), so every step depends on the last.
//
// Every 1000 tokens it prints how many tokens the cache still stores: the partitions live on
// absolute positions, so keys that no later query can share a block with are evicted, and the
// resident size stays bounded however long the sequence grows: a block of pitch delta holds at
// most ceil(delta) positions, so, one token at a time, the cache never stores more than the
// largest ceil(pitch) over heads and draws (a block of the flattest head). The program prints
// that bound and fails if the cache exceeds it. At the end it checks the last output against
// plsh_attention over the whole sequence, which the cache reproduces row for row.
//
// A second cache, KvCache<Eigen::bfloat16>, decodes the same tokens rounded to bfloat16 (16-bit
// keys and values: half the bytes; computed in float): the program prints both caches' bytes and
// how far the bfloat16 outputs are from the float ones.
//
// Build it against an installed plsh with
//   find_package(plsh CONFIG REQUIRED)
//   target_link_libraries(my_program PRIVATE plsh::plsh)
// and compile with -O3 -march=native (and -fopenmp for threads).

#include <plsh/plsh.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

int main(int argc, char** argv) {
  using plsh::Index;
  const Index tokens = argc > 1 ? std::atol(argv[1]) : 20000;
  const Index heads = 8, kv_heads = 2, dim = 64;
  if (tokens < 1) {
    std::fprintf(stderr, "usage: decode [tokens >= 1]\n");
    return 2;
  }
  const std::vector<double> slopes = plsh::alibi_slopes(heads);
  plsh::PlshOptions options;  // causal, the default estimator, seed 0, fused kernel
  plsh::KvCache<float> cache(heads, kv_heads, dim, dim, slopes, options);
  plsh::KvCache<Eigen::bfloat16> cache16(heads, kv_heads, dim, dim, slopes, options);
  std::vector<Eigen::bfloat16> q16(static_cast<std::size_t>(heads * dim));
  std::vector<Eigen::bfloat16> k16(static_cast<std::size_t>(kv_heads * dim));
  std::vector<Eigen::bfloat16> v16(k16.size());
  std::vector<Eigen::bfloat16> out16(q16.size());
  const auto to_bfloat16 = [](const float* from, std::vector<Eigen::bfloat16>& to) {
    for (std::size_t i = 0; i < to.size(); ++i) to[i] = static_cast<Eigen::bfloat16>(from[i]);
  };
  double bfloat16_difference = 0;  // largest |bfloat16 output - float output| over every step

  // Every token's q, k, v are kept only for the final check against the whole-sequence kernel;
  // the cache itself needs none of them.
  std::vector<float> all_q(static_cast<std::size_t>(tokens * heads * dim));
  std::vector<float> all_k(static_cast<std::size_t>(tokens * kv_heads * dim));
  std::vector<float> all_v(all_k.size());
  std::vector<float> out(static_cast<std::size_t>(heads * dim), 0.0f);
  std::mt19937_64 engine(2024);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);

  // The resident bound: the largest block of the draws, max over h, t of ceil(pitch_{h,t}), with
  // the draws plsh_attention and the cache use (head h, draw t: RandomBinning(slopes[h],
  // head_seed(seed, h))(t)).
  Index bound = 0;
  for (Index h = 0; h < heads; ++h) {
    const plsh::RandomBinning sampler(slopes[static_cast<std::size_t>(h)],
                                      plsh::head_seed(options.seed, h));
    for (Index t = 0; t < options.samples; ++t) {
      const double pitch = sampler(static_cast<std::uint64_t>(t)).pitch;
      bound = std::max(bound, static_cast<Index>(std::ceil(pitch)));
    }
  }

  std::printf("%8s %10s %14s %12s\n", "position", "resident", "max resident", "us/token");
  Index max_resident = 0;
  auto start = std::chrono::steady_clock::now();
  for (Index t = 0; t < tokens; ++t) {
    float* q = &all_q[static_cast<std::size_t>(t * heads * dim)];
    float* k = &all_k[static_cast<std::size_t>(t * kv_heads * dim)];
    float* v = &all_v[static_cast<std::size_t>(t * kv_heads * dim)];
    // The new token: fresh noise plus half of the previous output (head h feeds head h, and
    // key/value head g takes the output of its first query head).
    for (Index i = 0; i < heads * dim; ++i) q[i] = 2.0f * uniform(engine) + 0.5f * out[i];
    for (Index i = 0; i < kv_heads * dim; ++i) {
      const float previous =
          out[static_cast<std::size_t>((i / dim) * (heads / kv_heads) * dim + i % dim)];
      k[i] = uniform(engine) + 0.5f * previous;
      v[i] = uniform(engine) + 0.5f * previous;
    }
    cache.decode({q, 1, heads, dim}, {k, 1, kv_heads, dim}, {v, 1, kv_heads, dim},
                 {out.data(), 1, heads, dim});
    to_bfloat16(q, q16);
    to_bfloat16(k, k16);
    to_bfloat16(v, v16);
    cache16.decode({q16.data(), 1, heads, dim}, {k16.data(), 1, kv_heads, dim},
                   {v16.data(), 1, kv_heads, dim}, {out16.data(), 1, heads, dim});
    for (std::size_t i = 0; i < out.size(); ++i) {
      bfloat16_difference =
          std::max(bfloat16_difference,
                   std::abs(static_cast<double>(static_cast<float>(out16[i])) - out[i]));
    }
    max_resident = std::max(max_resident, cache.resident());
    if ((t + 1) % 1000 == 0) {
      const auto now = std::chrono::steady_clock::now();
      const double microseconds = std::chrono::duration<double, std::micro>(now - start).count();
      std::printf("%8lld %10lld %14lld %12.1f\n", static_cast<long long>(cache.position()),
                  static_cast<long long>(cache.resident()), static_cast<long long>(max_resident),
                  microseconds / 1000);
      start = now;
    }
  }

  // The last token's output, recomputed by plsh_attention over the whole sequence (the same
  // draws, from the same seed): the same row up to float rounding.
  std::vector<float> expected(static_cast<std::size_t>(heads * dim));
  plsh::PlshOptions last = options;
  last.query_position = tokens - 1;
  plsh::plsh_attention<float>(
      plsh::HeadsView<const float>{all_q.data(), tokens, heads, dim}.slice(tokens - 1, 1),
      {all_k.data(), tokens, kv_heads, dim}, {all_v.data(), tokens, kv_heads, dim},
      {expected.data(), 1, heads, dim}, slopes, last);
  double difference = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    difference = std::max(difference, std::abs(static_cast<double>(out[i]) - expected[i]));
  }
  std::printf("\n%lld tokens decoded; the cache stores %lld of them (at most %lld at any time).\n",
              static_cast<long long>(cache.position()), static_cast<long long>(cache.resident()),
              static_cast<long long>(max_resident));
  std::printf("bound: the largest block of the draws, max ceil(pitch) = %lld tokens\n",
              static_cast<long long>(bound));
  std::printf("last output vs plsh_attention over the whole sequence: max |difference| = %.2e\n",
              difference);
  std::printf(
      "cache bytes: float %zu, bfloat16 %zu; bfloat16 outputs vs float outputs (inputs "
      "rounded to bfloat16): max |difference| = %.2e\n",
      cache.bytes(), cache16.bytes(), bfloat16_difference);
  return max_resident <= bound && difference < 1e-4 ? 0 : 1;
}
