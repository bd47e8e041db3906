// Tests of KvCache's decoding steps (kv_cache.hpp): identical results at 1, 2 and 3 threads (on
// the helper team, with the team busy, inside an OpenMP region), one-token decode steps at 1 and
// 2 threads bit for bit, decode against append then attend bit for bit, caches that interleave
// their steps on one thread unaffected by each other, no allocation in a step once warm, and the
// single-query path with a near field against the dense reference (reference::plsh_attention in
// double), with jobs that the near field covers in part, in whole or not at all.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/detail/thread_team.hpp>
#include <plsh/kv_cache.hpp>
#include <plsh/reference.hpp>

#include "allocation_counter.hpp"
#include "test_kv_cache_common.hpp"
#include "thread_count.hpp"

namespace test_kv_cache_decode {

namespace {

using plsh::HeadsView;
using plsh::Index;
using namespace plsh_test;

/// The outputs of one-token decode steps over `tokens` tokens of `sequence`, 8 heads on 2
/// key/value heads of size 64, standard slopes.
template <class Scalar>
std::vector<Scalar> decode_one_token_at_a_time(const Sequence<Scalar>& sequence, Index tokens) {
  const Index row_size = sequence.heads * sequence.value_dim;
  std::vector<Scalar> outputs(static_cast<std::size_t>(tokens * row_size), Scalar(-7));
  plsh::KvCache<Scalar> cache(8, 2, 64, 64, plsh::alibi_slopes(8));
  for (Index t = 0; t < tokens; ++t) {
    cache.decode(sequence.queries(t, 1), sequence.keys(t, 1), sequence.values(t, 1),
                 HeadsView<Scalar>{outputs.data() + t * row_size, 1, 8, 64});
  }
  return outputs;
}

}  // namespace

TEST_CASE(
    "KvCache decoding gives identical results at 1, 2 and 3 threads, on the helper team or not",
    "[kv_cache][threads]") {
  // The standard slopes at d = 64: unions of several hundred keys, split into several jobs per
  // head, enough work for more than one thread; grouped heads; chunks of up to 16 rows (the
  // single-query path) and 40 (the fused kernel). Then one shallow head among steep ones: it
  // holds most keys, so that the cuts split it and, on 3 threads, the middle part lies inside it.
  const Sequence<float> sequence(700, 8, 2, 64, 64, 41);
  const std::vector<double> shallow_head = {1e-4, 1, 1, 1, 1, 1, 1, 1};
  const std::vector<double> slopes = GENERATE_COPY(plsh::alibi_slopes(8), shallow_head);
  plsh::PlshOptions options;
  options.seed = 5;
  const std::vector<float> expected = whole_sequence(sequence, slopes, options);
  const std::vector<Index> chunks = chunk_schedule(sequence.tokens, {1, 3, 16, 2, 40});
  std::vector<std::vector<float>> outputs;
  for (const int threads : {1, 2, 3}) {
    const plsh_test::ThreadCount thread_count(threads);
    outputs.emplace_back();
    const DecodeResult result =
        decode(sequence, slopes, options, chunks, expected, 0, &outputs.back());
    INFO(threads << " threads: max |cache - whole sequence| = " << result.max_difference);
    CHECK(result.max_difference <= 2e-5);
  }
  {
    // 2 threads while the helper team runs a step of another caller: an OpenMP region instead.
    const plsh_test::ThreadCount thread_count(2);
    outputs.emplace_back();
    DecodeResult result;
    const bool ran = plsh::detail::ThreadTeam::shared().run(2, [&](int part) {
      if (part == 0)
        result = decode(sequence, slopes, options, chunks, expected, 0, &outputs.back());
    });
    REQUIRE(ran);
    INFO("team busy: max |cache - whole sequence| = " << result.max_difference);
    CHECK(result.max_difference <= 2e-5);
  }
  {
    // Called from inside an OpenMP parallel region (one thread decodes): a nested region.
    const plsh_test::ThreadCount thread_count(2);
    outputs.emplace_back();
    DecodeResult result;
#if defined(_OPENMP)
#pragma omp parallel num_threads(2)
#pragma omp single
#endif
    result = decode(sequence, slopes, options, chunks, expected, 0, &outputs.back());
    INFO("inside a parallel region: max |cache - whole sequence| = " << result.max_difference);
    CHECK(result.max_difference <= 2e-5);
  }
  for (std::size_t run = 1; run < outputs.size(); ++run) {
    INFO("run " << run + 1 << " against the single-thread run, bit for bit");
    REQUIRE(outputs[run].size() == outputs[0].size());
    CHECK(std::memcmp(outputs[run].data(), outputs[0].data(), outputs[0].size() * sizeof(float)) ==
          0);
  }
}

TEMPLATE_TEST_CASE("KvCache one-token decode steps give the same bits on 1 and 2 threads",
                   "[kv_cache][threads]", float, Eigen::bfloat16) {
  // 600 one-token steps: enough keys per step for 2 threads to split them, heads alternating
  // their order from step to step.
  const Sequence<TestType> sequence(Sequence<float>(600, 8, 2, 64, 64, 43));
  std::vector<std::vector<TestType>> outputs;
  for (const int threads : {1, 2}) {
    const plsh_test::ThreadCount thread_count(threads);
    outputs.push_back(decode_one_token_at_a_time(sequence, sequence.tokens));
  }
  REQUIRE(outputs[1].size() == outputs[0].size());
  CHECK(std::memcmp(outputs[1].data(), outputs[0].data(), outputs[0].size() * sizeof(TestType)) ==
        0);
  CHECK(std::count(outputs[0].begin(), outputs[0].end(), TestType(-7)) == 0);
}

TEST_CASE("KvCache steps of caches that interleave on one thread do not affect each other",
          "[kv_cache][threads]") {
  // A cache decoding alone against the same cache whose steps alternate with those of another
  // cache of a different shape and type on the same thread: the same bits, at 1 and 2 threads.
  const Sequence<float> sequence(400, 8, 2, 64, 64, 53);
  const Sequence<double> other(300, 4, 4, 16, 8, 59);
  const Index row_size = sequence.heads * sequence.value_dim;
  for (const int threads : {1, 2}) {
    const plsh_test::ThreadCount thread_count(threads);
    const std::vector<float> alone = decode_one_token_at_a_time(sequence, sequence.tokens);
    std::vector<float> interleaved(alone.size(), -7.0f);
    plsh::KvCache<float> cache(8, 2, 64, 64, plsh::alibi_slopes(8));
    plsh::KvCache<double> second(4, 4, 16, 8, {0.5, 0.1, 0.01, 0.001});
    std::vector<double> second_out(4 * 8);
    for (Index t = 0; t < sequence.tokens; ++t) {
      cache.decode(sequence.queries(t, 1), sequence.keys(t, 1), sequence.values(t, 1),
                   HeadsView<float>{interleaved.data() + t * row_size, 1, 8, 64});
      const Index s = t % other.tokens;
      if (s == 0) second = plsh::KvCache<double>(4, 4, 16, 8, {0.5, 0.1, 0.01, 0.001});
      second.decode(other.queries(s, 1), other.keys(s, 1), other.values(s, 1),
                    HeadsView<double>{second_out.data(), 1, 4, 8});
    }
    INFO(threads << " threads");
    CHECK(std::memcmp(interleaved.data(), alone.data(), alone.size() * sizeof(float)) == 0);
  }
}

TEMPLATE_TEST_CASE("KvCache::decode equals append then attend, bit for bit", "[kv_cache][decode]",
                   float, Eigen::bfloat16) {
  // The standard slopes at d = 64 on grouped heads, one token at a time and chunks of up to 16
  // (the single-query path) and 40 (the fused kernel), on 1 and 2 threads: decode(q, k, v, out)
  // must leave the cache in the same state and write the same bits as append(k, v) followed by
  // attend(q, out), also where appends follow decodes.
  const Sequence<TestType> sequence(Sequence<float>(600, 8, 2, 64, 64, 47));
  const std::vector<double> slopes = plsh::alibi_slopes(8);
  const std::vector<Index> chunks = chunk_schedule(sequence.tokens, {1, 1, 1, 3, 16, 1, 40});
  const Index row_size = sequence.heads * sequence.value_dim;
  for (const int threads : {1, 2}) {
    const plsh_test::ThreadCount thread_count(threads);
    plsh::KvCache<TestType> stepped(8, 2, 64, 64, slopes);
    plsh::KvCache<TestType> decoded(8, 2, 64, 64, slopes);
    std::vector<TestType> expected;
    std::vector<TestType> out;
    Index done = 0;
    Index mismatches = 0;
    Index step = 0;
    for (const Index chunk : chunks) {
      expected.assign(static_cast<std::size_t>(chunk * row_size), TestType(0));
      out.assign(expected.size(), TestType(-7));
      const HeadsView<TestType> expected_view{expected.data(), chunk, 8, 64};
      stepped.append(sequence.keys(done, chunk), sequence.values(done, chunk));
      stepped.attend(sequence.queries(done, chunk), expected_view);
      const HeadsView<TestType> out_view{out.data(), chunk, 8, 64};
      if (++step % 5 == 0) {
        // Now and then an append and an attend on the decoding cache as well.
        decoded.append(sequence.keys(done, chunk), sequence.values(done, chunk));
        decoded.attend(sequence.queries(done, chunk), out_view);
      } else {
        decoded.decode(sequence.queries(done, chunk), sequence.keys(done, chunk),
                       sequence.values(done, chunk), out_view);
      }
      done += chunk;
      if (std::memcmp(out.data(), expected.data(), out.size() * sizeof(TestType)) != 0) {
        ++mismatches;
      }
      REQUIRE(decoded.position() == stepped.position());
      REQUIRE(decoded.resident() == stepped.resident());
      REQUIRE(decoded.oldest_position() == stepped.oldest_position());
    }
    INFO(threads << " threads: " << mismatches << " of " << chunks.size()
                 << " steps differ from append + attend");
    CHECK(mismatches == 0);
    // An attend after a decode sees the same cache as after an append.
    decoded.attend(sequence.queries(done - 1, 1), HeadsView<TestType>{out.data(), 1, 8, 64});
    stepped.attend(sequence.queries(done - 1, 1), HeadsView<TestType>{expected.data(), 1, 8, 64});
    CHECK(std::memcmp(out.data(), expected.data(),
                      static_cast<std::size_t>(row_size) * sizeof(TestType)) == 0);
  }
}

TEST_CASE("a decoding step allocates nothing once the cache is warm", "[kv_cache][allocations]") {
  // One token at a time, then chunks of 3 queries, on 1 and 2 threads: after a warm-up, attend
  // allocates nothing unless the cache's buffer grew at the append before (its scratch grows
  // with the number of keys a step reads).
  const Sequence<float> sequence(1600, 8, 2, 32, 32, 43);
  const std::vector<double> slopes = {0.5, 0.25, 0.125, 1.0 / 16, 1.0 / 32, 1.0 / 64, 0.2, 0.01};
  for (const int threads : {1, 2}) {
    for (const Index chunk : {Index{1}, Index{3}}) {
      const plsh_test::ThreadCount thread_count(threads);
      plsh::KvCache<float> cache(8, 2, 32, 32, slopes);
      std::vector<float> out(static_cast<std::size_t>(chunk * 8 * 32));
      const HeadsView<float> out_view{out.data(), chunk, 8, 32};
      long attend_allocations = 0;
      Index counted = 0;
      std::size_t bytes = 0;
      for (Index done = 0; done + chunk <= sequence.tokens; done += chunk) {
        cache.append(sequence.keys(done, chunk), sequence.values(done, chunk));
        const bool grown = cache.bytes() != bytes;
        bytes = cache.bytes();
        const long before = plsh_test::allocations.load();
        cache.attend(sequence.queries(done, chunk), out_view);
        if (done >= 800 && !grown) {
          attend_allocations += plsh_test::allocations.load() - before;
          ++counted;
        }
      }
      INFO(threads << " threads, chunks of " << chunk << ": " << attend_allocations
                   << " allocations in " << counted << " attends");
      CHECK(counted >= 200);
      CHECK(attend_allocations == 0);
      // The same with decode, which appends as well: a step that does not grow the buffer (its
      // bytes unchanged) allocates nothing.
      plsh::KvCache<float> decoded(8, 2, 32, 32, slopes);
      long decode_allocations = 0;
      counted = 0;
      bytes = 0;
      for (Index done = 0; done + chunk <= sequence.tokens; done += chunk) {
        const long before = plsh_test::allocations.load();
        decoded.decode(sequence.queries(done, chunk), sequence.keys(done, chunk),
                       sequence.values(done, chunk), out_view);
        const bool grown = decoded.bytes() != bytes;
        bytes = decoded.bytes();
        if (done >= 800 && !grown) {
          decode_allocations += plsh_test::allocations.load() - before;
          ++counted;
        }
      }
      INFO(decode_allocations << " allocations in " << counted << " decoding steps");
      CHECK(counted >= 200);
      CHECK(decode_allocations == 0);
    }
  }
}

TEMPLATE_TEST_CASE("KvCache decoding with a near field equals the dense reference",
                   "[kv_cache][near_field]", float, Eigen::bfloat16, Eigen::half) {
  // d = 64 on grouped heads, the steps of the single-query path only (one token, and chunks of up
  // to 16 rows, whose older rows have block starts of their own). Jobs hold 128 keys
  // (detail::kDecodeKeyChunk) from the start of a head's union; with near_field 0.05 the reach of
  // slope m is floor(ln(20) / m): slope 1/64 reaches 191 of the 300 to 400 keys of the later
  // steps' unions (a job beyond the near field, one across its edge, one inside it), 1/256
  // reaches 766 (every key near), 0.5 reaches 5 of a single job, slope 0 every key. The 16-bit
  // caches against the reference on their rounded inputs, within u |o| of it (u the unit roundoff
  // of the storage).
  const double roundoff = std::is_same<TestType, Eigen::bfloat16>::value ? std::ldexp(1.0, -8)
                          : std::is_same<TestType, Eigen::half>::value   ? std::ldexp(1.0, -11)
                                                                         : 0.0;
  const Sequence<TestType> stored(Sequence<float>(400, 8, 2, 64, 64, 61));
  const Sequence<double> widened(stored);
  const std::vector<double> slopes = {1.0 / 64, 1.0 / 256, 0.5,   0.0,
                                      1.0 / 16, 1.0 / 128, 0.125, 1.0 / 32};
  plsh::PlshOptions defaults;  // s = 100, Latin hypercube, near_field 0.05
  defaults.seed = 6;
  defaults.key_position = 1000;
  plsh::PlshOptions independent = defaults;  // s = 20 independent draws, a narrower near field
  independent.samples = 20;
  independent.sampling = plsh::Sampling::Independent;
  independent.near_field = 0.3;
  for (const plsh::PlshOptions& options : {defaults, independent}) {
    std::vector<double> expected(
        static_cast<std::size_t>(widened.tokens * widened.heads * widened.value_dim));
    plsh::PlshOptions whole = options;
    whole.query_position = options.key_position;
    plsh::reference::plsh_attention<double>(
        widened.queries(0, widened.tokens), widened.keys(0, widened.tokens),
        widened.values(0, widened.tokens),
        HeadsView<double>{expected.data(), widened.tokens, widened.heads, widened.value_dim},
        slopes, whole);
    for (const auto& pattern : std::vector<std::vector<Index>>{{1}, {1, 7, 16, 3}}) {
      const DecodeResult result = decode(
          stored, slopes, options, chunk_schedule(stored.tokens, pattern), expected, roundoff);
      INFO("s = " << options.samples << ", near_field " << options.near_field << ", chunks of "
                  << pattern.front() << (pattern.size() > 1 ? ", ..." : "")
                  << ": max (|cache - reference| - u |reference|) = " << result.max_difference);
      CHECK(result.max_difference <= plsh_test::reference_tolerance<float>());
    }
  }
}

}  // namespace test_kv_cache_decode
