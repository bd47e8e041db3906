// Tests of kv_cache.hpp: KvCache::attend equals the rows of plsh_attention over the whole
// sequence whatever the chunking of the appends (grouped heads, offsets, both kernels; float,
// double, bfloat16 and half storage); the single-query path gives identical results at any
// thread count and allocates nothing once warm; KvCache::decode gives the bits of append then
// attend and rejects bad arguments before changing the cache; the number of resident tokens stays
// within the bound computed from the partitions over a 10^5 token run; degenerate slopes; every
// rejected argument.
//
// Accuracy: the cache and the whole-sequence kernel weight the same keys by the same counts, but
// tile the keys differently, so float sums differ by rounding only. Outputs are convex
// combinations of values in [-1, 1]; a weighted mean of a few hundred terms in float errs by
// ~1e-6, below the 2e-5 bound. The 16-bit caches compute in float from the same rounded inputs
// and round each output once: against the float kernel on those inputs they differ by at most
// u |o| + 2e-5, u the unit roundoff of the type (2^-8 for bfloat16, 2^-11 for half).

#include <catch2/catch.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/kv_cache.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

#include "allocation_counter.hpp"
#include "attention_fixture.hpp"
#include "thread_count.hpp"

namespace {

using plsh::HeadsView;
using plsh::Index;

/// Queries, keys and values of a whole sequence, packed, in storage type `Scalar`: the attention
/// fixture's problem (every input uniform in [-1, 1]), or another sequence rounded to `Scalar`.
template <class Scalar>
struct Sequence {
  Index tokens, heads, kv_heads, dim, value_dim;
  std::vector<Scalar> q, k, v;

  Sequence(Index n, Index h, Index h_kv, Index d, Index d_v, std::uint64_t seed)
      : tokens(n), heads(h), kv_heads(h_kv), dim(d), value_dim(d_v) {
    const plsh_test::Problem<Scalar> problem(plsh_test::Shape{n, n, h, h_kv, d, d_v}, seed,
                                             plsh_test::Layout::Packed, 1.0);
    const auto copy = [](const HeadsView<const Scalar>& view) {
      return std::vector<Scalar>(view.data, view.data + view.tokens * view.token_stride);
    };
    q = copy(problem.q.in());
    k = copy(problem.k.in());
    v = copy(problem.v.in());
  }

  template <class Other>
  explicit Sequence(const Sequence<Other>& other)
      : tokens(other.tokens),
        heads(other.heads),
        kv_heads(other.kv_heads),
        dim(other.dim),
        value_dim(other.value_dim),
        q(converted(other.q)),
        k(converted(other.k)),
        v(converted(other.v)) {}

  template <class Other>
  static std::vector<Scalar> converted(const std::vector<Other>& values) {
    std::vector<Scalar> result(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) result[i] = static_cast<Scalar>(values[i]);
    return result;
  }

  HeadsView<const Scalar> queries(Index begin, Index count) const {
    return HeadsView<const Scalar>{q.data(), tokens, heads, dim}.slice(begin, count);
  }
  HeadsView<const Scalar> keys(Index begin, Index count) const {
    return HeadsView<const Scalar>{k.data(), tokens, kv_heads, dim}.slice(begin, count);
  }
  HeadsView<const Scalar> values(Index begin, Index count) const {
    return HeadsView<const Scalar>{v.data(), tokens, kv_heads, value_dim}.slice(begin, count);
  }
};

/// Chunk sizes cycling through `pattern`, cut to the sequence length.
std::vector<Index> chunk_schedule(Index tokens, const std::vector<Index>& pattern) {
  std::vector<Index> chunks;
  for (Index done = 0, i = 0; done < tokens; ++i) {
    const Index size =
        std::min(pattern[static_cast<std::size_t>(i) % pattern.size()], tokens - done);
    chunks.push_back(size);
    done += size;
  }
  return chunks;
}

/// Largest \f$|a - b| - u|b|\f$ over the rows `[row_begin, row_begin + rows)` of a
/// `[n][heads][value_dim]` tensor `b` and the packed rows `a`: with u = 0, the largest
/// difference; with u the unit roundoff of a's storage, the error beyond rounding a once.
template <class A, class B>
double max_row_difference(const std::vector<A>& a, const std::vector<B>& b, Index row_begin,
                          Index rows, Index row_size, double roundoff = 0) {
  double difference = 0;
  for (Index i = 0; i < rows * row_size; ++i) {
    const double expected =
        static_cast<double>(b[static_cast<std::size_t>(row_begin * row_size + i)]);
    difference = std::max(difference,
                          std::abs(static_cast<double>(a[static_cast<std::size_t>(i)]) - expected) -
                              roundoff * std::abs(expected));
  }
  return difference;
}

/// \f$\max_p (p - E(p) + 1)\f$ over positions `[first, last)`, with \f$E(p)\f$ the smallest start,
/// over heads and draws, of the block of p: computed from the BlockPartition of every grid.
Index resident_bound(const std::vector<double>& slopes, const plsh::PlshOptions& options,
                     Index first, Index last) {
  std::vector<Index> reachable(static_cast<std::size_t>(last - first),
                               std::numeric_limits<Index>::max());
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    const plsh::RandomBinning sampler(slopes[h],
                                      plsh::head_seed(options.seed, static_cast<Index>(h)));
    for (const plsh::Grid& grid : sampler.draw(options.samples)) {
      const plsh::BlockPartition partition(grid, first, last);
      for (const plsh::Block block : partition) {
        for (Index p = block.begin; p < block.end; ++p) {
          Index& start = reachable[static_cast<std::size_t>(p - first)];
          start = std::min(start, block.begin);
        }
      }
    }
  }
  Index bound = 0;
  for (Index p = first; p < last; ++p) {
    bound = std::max(bound, p - reachable[static_cast<std::size_t>(p - first)] + 1);
  }
  return bound;
}

struct DecodeResult {
  double max_difference = 0;
  Index max_resident = 0;
  Index final_resident = 0;
};

/// Appends `sequence` chunk by chunk and, after every append, attends the whole chunk and its
/// newest token; compares with the rows of `expected` (plsh_attention over the sequence): the
/// largest difference beyond `roundoff` times the expected value. `outputs`, when given, receives
/// every attended row in order.
template <class Scalar, class Expected>
DecodeResult decode(const Sequence<Scalar>& sequence, const std::vector<double>& slopes,
                    const plsh::PlshOptions& options, const std::vector<Index>& chunks,
                    const std::vector<Expected>& expected, double roundoff = 0,
                    std::vector<Scalar>* outputs = nullptr) {
  plsh::KvCache<Scalar> cache(sequence.heads, sequence.kv_heads, sequence.dim, sequence.value_dim,
                              slopes, options);
  const Index row_size = sequence.heads * sequence.value_dim;
  DecodeResult result;
  Index done = 0;
  std::vector<Scalar> out;
  for (const Index chunk : chunks) {
    cache.append(sequence.keys(done, chunk), sequence.values(done, chunk));
    done += chunk;
    REQUIRE(cache.position() == options.key_position + done);
    REQUIRE(cache.oldest_position() + cache.resident() == cache.position());
    result.max_resident = std::max(result.max_resident, cache.resident());
    for (const Index queries : {chunk, Index{1}}) {
      out.assign(static_cast<std::size_t>(queries * row_size), Scalar(0));
      cache.attend(sequence.queries(done - queries, queries),
                   HeadsView<Scalar>{out.data(), queries, sequence.heads, sequence.value_dim});
      result.max_difference =
          std::max(result.max_difference,
                   max_row_difference(out, expected, done - queries, queries, row_size, roundoff));
      if (outputs != nullptr) outputs->insert(outputs->end(), out.begin(), out.end());
    }
  }
  result.final_resident = cache.resident();
  return result;
}

template <class Scalar>
std::vector<Scalar> whole_sequence(const Sequence<Scalar>& sequence,
                                   const std::vector<double>& slopes,
                                   const plsh::PlshOptions& options) {
  std::vector<Scalar> out(
      static_cast<std::size_t>(sequence.tokens * sequence.heads * sequence.value_dim));
  plsh::PlshOptions whole = options;
  whole.query_position = options.key_position;
  plsh::plsh_attention<Scalar>(
      sequence.queries(0, sequence.tokens), sequence.keys(0, sequence.tokens),
      sequence.values(0, sequence.tokens),
      HeadsView<Scalar>{out.data(), sequence.tokens, sequence.heads, sequence.value_dim}, slopes,
      whole);
  return out;
}

}  // namespace

TEST_CASE("KvCache::attend equals plsh_attention over the whole sequence", "[kv_cache]") {
  // Eight query heads on two key/value heads. Steep slopes make eviction happen within 500
  // tokens; the standard ALiBi list keeps nearly everything at this length.
  const Sequence<float> sequence(500, 8, 2, 16, 8, 17);
  const std::vector<std::vector<double>> slope_lists = {
      {0.5, 0.25, 0.125, 1.0 / 16, 1.0 / 32, 0.3, 0.2, 0.1}, plsh::alibi_slopes(8)};
  const std::vector<std::vector<Index>> patterns = {{1}, {1, 7, 64, 3}, {5, 1, 2}};
  for (std::size_t list = 0; list < slope_lists.size(); ++list) {
    const std::vector<double>& slopes = slope_lists[list];
    for (const Index key_position : {Index{0}, Index{1000}}) {
      plsh::PlshOptions options;
      options.samples = 20;
      options.seed = 3;
      options.key_position = key_position;
      const std::vector<float> expected = whole_sequence(sequence, slopes, options);
      for (const auto& pattern : patterns) {
        const DecodeResult result =
            decode(sequence, slopes, options, chunk_schedule(sequence.tokens, pattern), expected);
        // The resident bound of kv_cache.hpp, max_p (p - E(p) + 1) + chunk - 1, from the
        // partitions of the positions of this run.
        const Index bound =
            resident_bound(slopes, options, key_position, key_position + sequence.tokens);
        const Index largest_chunk = *std::max_element(pattern.begin(), pattern.end());
        INFO("slope list " << list << ", first position " << key_position << ", chunks of "
                           << pattern.front() << (pattern.size() > 1 ? ", ..." : "")
                           << ": max |cache - whole sequence| = " << result.max_difference
                           << ", max resident " << result.max_resident << ", bound " << bound
                           << " + " << largest_chunk - 1);
        CHECK(result.max_difference <= 2e-5);
        CHECK(result.max_resident <= bound + largest_chunk - 1);
        if (list == 0) {
          INFO("steep slopes: the cache must have evicted tokens");
          CHECK(result.final_resident < sequence.tokens);
        }
      }
    }
  }
}

TEST_CASE("KvCache decoding keeps the non-finite contract of plsh_attention",
          "[kv_cache][nonfinite]") {
  // Token 100 of key/value head 0 has an infinite key entry and a NaN value entry: by the sign of
  // each query's entry, its logit is +inf (the row is NaN) or -inf (it weighs exactly 0, and its
  // NaN value adds nothing). Token 200 of head 1 has a NaN value entry: every row that reaches it
  // is NaN. The cache's rows equal the whole-sequence kernel's, NaN for NaN, for one query at a
  // time and chunks of 7 (the single-query path), and chunks of 20 (the fused kernel).
  Sequence<float> sequence(300, 4, 2, 16, 8, 61);
  const auto at = [](Index token, Index heads, Index head, Index dim, Index entry) {
    return static_cast<std::size_t>((token * heads + head) * dim + entry);
  };
  sequence.k[at(100, 2, 0, 16, 0)] = std::numeric_limits<float>::infinity();
  sequence.v[at(100, 2, 0, 8, 3)] = std::numeric_limits<float>::quiet_NaN();
  sequence.v[at(200, 2, 1, 8, 5)] = std::numeric_limits<float>::quiet_NaN();
  const std::vector<double> slopes = {0.5, 0.2, 0.05, 0.01};
  plsh::PlshOptions options;
  options.seed = 8;
  const std::vector<float> expected = whole_sequence(sequence, slopes, options);
  const Index row_size = sequence.heads * sequence.value_dim;
  Index nan_rows = 0;
  for (Index i = 0; i < sequence.tokens * row_size; ++i) {
    nan_rows += std::isnan(expected[static_cast<std::size_t>(i)]) ? 1 : 0;
  }
  INFO("NaN entries of the whole-sequence output: " << nan_rows);
  REQUIRE(nan_rows > 0);
  REQUIRE(nan_rows < sequence.tokens * row_size / 2);
  for (const Index chunk : {Index{1}, Index{7}, Index{20}}) {
    plsh::KvCache<float> cache(sequence.heads, sequence.kv_heads, sequence.dim, sequence.value_dim,
                               slopes, options);
    std::vector<float> out(static_cast<std::size_t>(chunk * row_size));
    Index mismatches = 0;
    double difference = 0;
    for (Index done = 0; done < sequence.tokens; done += chunk) {
      const Index rows = std::min(chunk, sequence.tokens - done);
      cache.append(sequence.keys(done, rows), sequence.values(done, rows));
      cache.attend(sequence.queries(done, rows),
                   HeadsView<float>{out.data(), rows, sequence.heads, sequence.value_dim});
      for (Index i = 0; i < rows * row_size; ++i) {
        const float got = out[static_cast<std::size_t>(i)];
        const float want = expected[static_cast<std::size_t>(done * row_size + i)];
        if (std::isnan(want) != std::isnan(got)) {
          ++mismatches;
        } else if (!std::isnan(want)) {
          difference = std::max(difference, static_cast<double>(std::abs(got - want)));
        }
      }
    }
    INFO("chunks of " << chunk << ": " << mismatches << " entries NaN in one output only, max "
                      << "difference elsewhere " << difference);
    CHECK(mismatches == 0);
    CHECK(difference <= 2e-5);
  }
}

TEST_CASE("KvCache with the pass kernel equals plsh_attention", "[kv_cache]") {
  const Sequence<float> sequence(300, 4, 4, 8, 8, 5);
  const std::vector<double> slopes = {0.5, 0.2, 0.05, 0.01};
  plsh::PlshOptions options;
  options.samples = 8;
  options.kernel = plsh::Kernel::Passes;
  const std::vector<float> expected = whole_sequence(sequence, slopes, options);
  const DecodeResult result =
      decode(sequence, slopes, options, chunk_schedule(sequence.tokens, {3, 1, 9}), expected);
  INFO("max |cache - whole sequence| = " << result.max_difference);
  CHECK(result.max_difference <= 2e-5);
}

TEST_CASE("KvCache in double equals plsh_attention to rounding", "[kv_cache]") {
  const Sequence<double> sequence(300, 8, 2, 16, 16, 23);
  const std::vector<double> slopes = {0.5, 0.25, 0.125, 1.0 / 16, 1.0 / 32, 0.3, 0.2, 0.01};
  plsh::PlshOptions options;
  options.seed = 9;
  const std::vector<double> expected = whole_sequence(sequence, slopes, options);
  for (const auto& pattern : std::vector<std::vector<Index>>{{1}, {1, 7, 64, 3}}) {
    const DecodeResult result =
        decode(sequence, slopes, options, chunk_schedule(sequence.tokens, pattern), expected);
    INFO("chunks of " << pattern.front()
                      << ": max |cache - whole sequence| = " << result.max_difference);
    CHECK(result.max_difference <= 1e-12);
  }
}

TEMPLATE_TEST_CASE("KvCache in 16 bits: the float kernel's rows rounded once", "[kv_cache][half]",
                   Eigen::bfloat16, Eigen::half) {
  // The inputs rounded to the 16-bit type; the reference is the float kernel on those same
  // (widened, exact) inputs. Chunks of 64 take the fused kernel, the others the single-query
  // path.
  const double roundoff =
      std::is_same<TestType, Eigen::bfloat16>::value ? std::ldexp(1.0, -8) : std::ldexp(1.0, -11);
  const Sequence<TestType> stored(Sequence<float>(400, 8, 2, 32, 32, 31));
  const Sequence<float> widened(stored);
  const std::vector<double> slopes = {0.5, 0.25, 0.125, 1.0 / 16, 1.0 / 32, 0.3, 0.2, 0.01};
  for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
    plsh::PlshOptions options;
    options.seed = 4;
    options.kernel = kernel;
    const std::vector<float> expected = whole_sequence(widened, slopes, options);
    for (const auto& pattern : std::vector<std::vector<Index>>{{1}, {1, 7, 64, 3}}) {
      const DecodeResult result = decode(
          stored, slopes, options, chunk_schedule(stored.tokens, pattern), expected, roundoff);
      INFO((kernel == plsh::Kernel::Fused ? "fused" : "passes")
           << ", chunks of " << pattern.front()
           << ": max (|cache - float kernel| - u |float kernel|) = " << result.max_difference);
      CHECK(result.max_difference <= 2e-5);
    }
  }
  // Half the bytes of a float cache holding the same tokens.
  plsh::KvCache<TestType> half_cache(8, 2, 32, 32, slopes);
  plsh::KvCache<float> float_cache(8, 2, 32, 32, slopes);
  half_cache.append(stored.keys(0, 100), stored.values(0, 100));
  float_cache.append(widened.keys(0, 100), widened.values(0, 100));
  CHECK(half_cache.bytes() > 0);
  CHECK(2 * half_cache.bytes() == float_cache.bytes());
}

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

TEST_CASE(
    "DecodeModeChoice runs the faster mode and probes the other every kDecodeProbeEvery steps",
    "[kv_cache][threads]") {
  using plsh::detail::DecodeModeChoice;
  using plsh::detail::kDecodeMeasureEvery;
  using plsh::detail::kDecodeProbeEvery;
  using plsh::detail::kDecodeProbeMeasured;
  using plsh::detail::kDecodeProbeSteps;
  using Step = DecodeModeChoice::Step;
  DecodeModeChoice choice;
  // Steps of the faster mode (`parallel`), `first` .. `last` of its period: measured at the last
  // of every kDecodeMeasureEvery.
  const auto run_faster = [&](bool parallel, std::uint64_t last, std::uint64_t first = 1) {
    Index wrong = 0;
    for (std::uint64_t step = first; step <= last; ++step) {
      const Step next = choice.next();
      wrong += next.parallel == parallel && next.measured == (step % kDecodeMeasureEvery == 0) &&
                       next.probe_step == -1
                   ? 0
                   : 1;
    }
    return wrong;
  };
  // A probe of the other mode, `parallel`: kDecodeProbeSteps steps, each measured but the first,
  // recorded at the given speeds (keys per second; 0: a step that cannot be measured), the last
  // kDecodeProbeMeasured of them deciding. Returns the number of probe steps that ran (the step
  // after a probe that ended early is the first of the faster mode's period), or -1 when one was
  // not as expected.
  const auto probe = [&](bool parallel, const std::vector<double>& speeds) {
    REQUIRE(speeds.size() == static_cast<std::size_t>(kDecodeProbeSteps));
    for (int place = 0; place < kDecodeProbeSteps; ++place) {
      const Step next = choice.next();
      if (next.probe_step == -1 && next.parallel != parallel) return place;  // ended early
      if (next.parallel != parallel || next.measured != (place > 0) || next.probe_step != place) {
        return -1;
      }
      const double speed = speeds[static_cast<std::size_t>(place)];
      if (next.measured) choice.record(next, speed > 0 ? 1000 : 0, speed > 0 ? 1000 / speed : 1e-6);
    }
    return kDecodeProbeSteps;
  };
  // Parallel until it is measured, then at once a probe of the calling thread alone.
  CHECK(run_faster(true, 3 * kDecodeMeasureEvery) == 0);
  choice.record(Step{true, true, -1}, 1000, 1e-5);  // 1e8 keys per second
  CHECK(choice.speed[1] == Approx(1e8));
  // Only the last kDecodeProbeMeasured steps decide, by their median whatever their order: the
  // slow first steps (waking helpers, warming caches) and a preempted step do not.
  REQUIRE(kDecodeProbeSteps == 8);
  REQUIRE(kDecodeProbeMeasured == 4);
  CHECK(probe(false, {1e3, 6e7, 7e7, 8e7, 1.3e8, 1e6, 1.5e8, 1.2e8}) == kDecodeProbeSteps);
  CHECK(choice.speed[0] == Approx(1.25e8));
  // Now alone is faster: it runs, parallel is probed every kDecodeProbeEvery steps.
  CHECK(run_faster(false, kDecodeProbeEvery - 1) == 0);
  // Measurements of the running mode are smoothed: 1.25e8 + (5e7 - 1.25e8) / 8.
  choice.record(Step{false, true, -1}, 1000, 2e-5);
  CHECK(choice.speed[0] == Approx(1.15625e8));
  // Times that cannot be measured change nothing.
  choice.record(Step{false, true, -1}, 1000, 0);
  choice.record(Step{false, true, -1}, 0, 1e-6);
  CHECK(choice.speed[0] == Approx(1.15625e8));
  // A probe with one measurable deciding step takes it; one with none keeps the old speed.
  CHECK(probe(true, {0, 1e8, 1e8, 1e8, 0, 0, 1.1e8, 0}) == kDecodeProbeSteps);
  CHECK(choice.speed[1] == Approx(1.1e8));
  CHECK(run_faster(false, kDecodeProbeEvery - 1) == 0);
  CHECK(probe(true, {0, 1e8, 1e8, 1e8, 0, 0, 0, 0}) == kDecodeProbeSteps);
  CHECK(choice.speed[1] == Approx(1.1e8));
  // A step after the first more than kDecodeProbeAbort times slower than the running mode
  // (1.15625e8 / 4) ends the probe with its speed; the first step never does.
  REQUIRE(plsh::detail::kDecodeProbeAbort == 4);
  CHECK(run_faster(false, kDecodeProbeEvery - 1) == 0);
  CHECK(probe(true, {1e3, 3e7, 2.5e7, 1e8, 1e8, 1e8, 1e8, 1e8}) == 3);
  CHECK(choice.speed[1] == Approx(2.5e7));
  CHECK(run_faster(false, kDecodeProbeEvery - 1, 2) == 0);
  // A probe that finds parallel faster (median (1.2e8 + 1.4e8) / 2) switches back to it.
  CHECK(probe(true, {1e3, 3e7, 3e7, 3e7, 1.4e8, 1.2e8, 1.1e8, 1.6e8}) == kDecodeProbeSteps);
  CHECK(choice.speed[1] == Approx(1.3e8));
  CHECK(run_faster(true, kDecodeProbeEvery - 1) == 0);
  CHECK(probe(false, {1e8, 1e8, 1e8, 1e8, 1e8, 1e8, 1e8, 1e8}) == kDecodeProbeSteps);
  CHECK(choice.speed[0] == Approx(1e8));
  CHECK(run_faster(true, 2 * kDecodeMeasureEvery) == 0);
}

TEST_CASE("DecodeModeChoice probes the calling thread until it is measured",
          "[kv_cache][threads]") {
  // Steps too small to split cannot be measured: a probe of the calling thread alone that
  // measured nothing is followed by another at once.
  using plsh::detail::DecodeModeChoice;
  DecodeModeChoice choice;
  choice.record(DecodeModeChoice::Step{true, true, -1}, 1000, 1e-5);
  Index wrong = 0;
  for (int step = 0; step < 3 * plsh::detail::kDecodeProbeSteps; ++step) {
    const DecodeModeChoice::Step next = choice.next();
    wrong += !next.parallel && next.probe_step == step % plsh::detail::kDecodeProbeSteps ? 0 : 1;
    if (next.measured) choice.record(next, 0, 1e-6);
  }
  CHECK(wrong == 0);
  CHECK(choice.speed[0] == 0);
}

TEST_CASE("record_decode_parts times every part from the hand-over", "[kv_cache][threads]") {
  // Parts of 600 and 400 keys seen ending 6 and 5 us after the hand-over: 100 and 80 keys per
  // microsecond (a helper that starts late counts as slower), then smoothed by
  // kDecodeSpeedSmoothing; an empty part changes nothing.
  using Clock = std::chrono::steady_clock;
  using plsh::detail::kDecodeSpeedSmoothing;
  plsh::detail::DecodeWorkspace<float> workspace;
  workspace.parts.resize(3);
  const Clock::time_point published = Clock::now();
  const auto at = [&](double microseconds) {
    return published + std::chrono::duration_cast<Clock::duration>(
                           std::chrono::duration<double, std::micro>(microseconds));
  };
  const Index work[] = {600, 400, 0};
  const double ends[] = {6, 5, 1};
  for (std::size_t part = 0; part < 3; ++part) {
    workspace.parts[part].work = work[part];
    workspace.parts[part].end = at(ends[part]);
  }
  plsh::detail::record_decode_parts(workspace, 3, published);
  CHECK(workspace.parts[0].speed == Approx(100e6).epsilon(1e-6));
  CHECK(workspace.parts[1].speed == Approx(80e6).epsilon(1e-6));
  CHECK(workspace.parts[2].speed == 0);
  workspace.parts[1].end = at(10);  // 40 keys per microsecond this step
  plsh::detail::record_decode_parts(workspace, 2, published);
  CHECK(workspace.parts[0].speed == Approx(100e6).epsilon(1e-6));
  CHECK(workspace.parts[1].speed ==
        Approx(80e6 + kDecodeSpeedSmoothing * (40e6 - 80e6)).epsilon(1e-6));
}

TEST_CASE("KvCache one-token steps give the same bits whichever mode runs them",
          "[kv_cache][threads]") {
  // 600 one-token decoding steps, each split across 2 threads or kept on the calling thread by
  // DecodeModeChoice (parallel until measured, then a probe of the calling thread alone, so both
  // run here), against 1 thread, bit for bit. Each run decodes on a thread of its own, whose
  // choice (one per calling thread) starts afresh whatever ran before.
  const Sequence<float> sequence(600, 8, 2, 64, 64, 43);
  const std::vector<double> slopes = plsh::alibi_slopes(8);
  const Index row_size = sequence.heads * sequence.value_dim;
  std::vector<std::vector<float>> outputs;
  for (const int threads : {1, 2}) {
    outputs.emplace_back(static_cast<std::size_t>(sequence.tokens * row_size), -7.0f);
    std::thread([&, threads] {
      const plsh_test::ThreadCount thread_count(threads);
      plsh::KvCache<float> cache(8, 2, 64, 64, slopes);
      for (Index t = 0; t < sequence.tokens; ++t) {
        cache.decode(sequence.queries(t, 1), sequence.keys(t, 1), sequence.values(t, 1),
                     HeadsView<float>{outputs.back().data() + t * row_size, 1, 8, 64});
      }
    }).join();
  }
  REQUIRE(outputs[1].size() == outputs[0].size());
  CHECK(std::memcmp(outputs[1].data(), outputs[0].data(), outputs[0].size() * sizeof(float)) == 0);
  CHECK(std::count(outputs[0].begin(), outputs[0].end(), -7.0f) == 0);
}

TEMPLATE_TEST_CASE("KvCache::decode equals append then attend, bit for bit", "[kv_cache][decode]",
                   float, Eigen::bfloat16) {
  // The standard slopes at d = 64 on grouped heads, one token at a time and chunks of up to 16
  // (the single-query path) and 40 (the fused kernel), on 1 and 2 threads: decode(q, k, v, out)
  // must leave the cache in the same state and write the same bits as append(k, v) followed by
  // attend(q, out), also where appends follow decodes (on 2 threads a one-token decode looks up
  // the blocks of the next position ahead).
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
        // Now and then an append and an attend on the decoding cache as well: the append takes
        // over the blocks that the decode before it looked up ahead.
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
  // allocates nothing unless the cache's buffer grew at the append before (its scratch is sized
  // from the buffer's capacity).
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

TEST_CASE("KvCache keeps a bounded number of tokens over a long run", "[kv_cache][long]") {
  // 10^5 tokens in chunks of 1, 7, 64, 3. The cache may hold at most
  // max_p (p - E(p) + 1) + chunk - 1 tokens (see kv_cache.hpp), computed here independently from
  // the BlockPartition of every grid.
  const Index tokens = 100000;
  const Sequence<float> sequence(tokens, 2, 1, 8, 8, 29);
  const std::vector<double> slopes = {1.0 / 8, 1.0 / 64};
  plsh::PlshOptions options;
  options.samples = 20;
  options.seed = 7;
  const Index bound = resident_bound(slopes, options, 0, tokens);
  const std::vector<Index> chunks = chunk_schedule(tokens, {1, 7, 64, 3});
  plsh::KvCache<float> cache(2, 1, 8, 8, slopes, options);
  std::vector<float> out;
  std::vector<float> expected;
  Index done = 0;
  Index max_resident = 0;
  Index violations = 0;
  double max_difference = 0;
  for (std::size_t step = 0; step < chunks.size(); ++step) {
    const Index chunk = chunks[step];
    cache.append(sequence.keys(done, chunk), sequence.values(done, chunk));
    done += chunk;
    max_resident = std::max(max_resident, cache.resident());
    if (cache.resident() > bound + chunk) ++violations;
    if (step % 97 == 0) {
      // Attend here and compare with the rows of the whole-sequence kernel: these queries
      // against every key so far (the fused kernel reads only the union of their blocks).
      // Attending every chunk would test nothing more and cost a thread start-up per chunk.
      out.assign(static_cast<std::size_t>(chunk * 2 * 8), 0.0f);
      cache.attend(sequence.queries(done - chunk, chunk),
                   HeadsView<float>{out.data(), chunk, 2, 8});
      expected.assign(out.size(), 0.0f);
      plsh::PlshOptions rows = options;
      rows.query_position = done - chunk;
      plsh::plsh_attention<float>(sequence.queries(done - chunk, chunk), sequence.keys(0, done),
                                  sequence.values(0, done),
                                  HeadsView<float>{expected.data(), chunk, 2, 8}, slopes, rows);
      max_difference = std::max(max_difference, max_row_difference(out, expected, 0, chunk, 16));
    }
  }
  INFO("bound from the partitions " << bound << ", max resident " << max_resident
                                    << ", final resident " << cache.resident() << " of "
                                    << cache.position() << " tokens");
  CHECK(violations == 0);
  CHECK(max_resident <= bound + 64);
  // The bound is about the largest pitch of the 20 draws of the flatter head, Gamma(2, 64):
  // the maximum of 20 such draws is near 4.4 * 64 ~ 280 (where 20 (1 + x) e^-x = 1): far below
  // the 2000 asked here, and far below 10^5.
  CHECK(max_resident < tokens / 50);
  CHECK(cache.position() == tokens);
  INFO("max |cache - whole sequence| at the checked steps = " << max_difference);
  CHECK(max_difference <= 2e-5);
}

TEST_CASE("KvCache with a zero slope keeps every token", "[kv_cache]") {
  // Slope 0 is one block holding everything: no key can ever be evicted.
  const Sequence<float> sequence(200, 2, 1, 4, 4, 1);
  const std::vector<double> slopes = {0.0, 0.5};
  plsh::PlshOptions options;
  const std::vector<float> expected = whole_sequence(sequence, slopes, options);
  const DecodeResult result =
      decode(sequence, slopes, options, chunk_schedule(sequence.tokens, {4, 1}), expected);
  INFO("max |cache - whole sequence| = " << result.max_difference);
  CHECK(result.final_resident == 200);
  CHECK(result.max_difference <= 2e-5);
}

TEST_CASE("KvCache rejects bad arguments", "[kv_cache][validation]") {
  const std::vector<double> slopes = {0.1, 0.2};
  const auto construct = [&](Index heads, Index kv_heads, Index dim, Index value_dim,
                             std::vector<double> s, plsh::PlshOptions options) {
    plsh::KvCache<float> cache(heads, kv_heads, dim, value_dim, std::move(s), options);
  };
  const plsh::PlshOptions good;
  REQUIRE_NOTHROW(construct(2, 1, 4, 3, slopes, good));
  const auto expect_rejected = [](auto&& call, const std::string& function,
                                  const std::string& argument) {
    INFO(function << " must reject " << argument);
    REQUIRE_THROWS_AS(call(), std::invalid_argument);
    REQUIRE_THROWS_WITH(call(), Catch::Contains(function + ": ") && Catch::Contains(argument));
  };
  const std::string ctor = "KvCache";
  expect_rejected([&] { construct(0, 1, 4, 3, {}, good); }, ctor, "heads");
  expect_rejected([&] { construct(2, 0, 4, 3, slopes, good); }, ctor, "kv_heads");
  expect_rejected(
      [&] {
        construct(3, 2, 4, 3, {0.1, 0.2, 0.3}, good);
      },
      ctor, "heads must be a multiple of kv_heads");
  expect_rejected([&] { construct(2, 1, 0, 3, slopes, good); }, ctor, "dim");
  expect_rejected([&] { construct(2, 1, 4, 0, slopes, good); }, ctor, "value_dim");
  expect_rejected([&] { construct(2, 1, 4, 3, {0.1}, good); }, ctor, "slopes.size()");
  expect_rejected([&] { construct(2, 1, 4, 3, {0.1, -1.0}, good); }, ctor, "slopes[1]");
  plsh::PlshOptions options = good;
  options.samples = 0;
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.samples");
  options = good;
  options.causal = false;
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.causal");
  options = good;
  options.key_position = -1;
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.key_position");
  options = good;
  options.scale = std::numeric_limits<double>::infinity();
  expect_rejected([&] { construct(2, 1, 4, 3, slopes, options); }, ctor, "options.scale");

  plsh::KvCache<float> cache(2, 1, 4, 3, slopes, good);
  std::vector<float> buffer(256, 0.5f);
  using View = HeadsView<const float>;
  using Out = HeadsView<float>;
  const std::string append = "KvCache::append";
  const std::string attend = "KvCache::attend";
  std::vector<float> q(2 * 2 * 4, 0.1f);
  std::vector<float> out(2 * 2 * 3);
  const View q_view{q.data(), 1, 2, 4};
  const Out out_view{out.data(), 1, 2, 3};
  expect_rejected([&] { cache.attend(q_view, out_view); }, attend, "q.tokens (1) must not exceed");
  const View k_view{buffer.data(), 2, 1, 4};
  const View v_view{buffer.data() + 100, 2, 1, 3};
  expect_rejected([&] { cache.append(View{buffer.data(), -1, 1, 4}, v_view); }, append, "k.tokens");
  expect_rejected([&] { cache.append(View{nullptr, 2, 1, 4}, v_view); }, append, "k.data");
  expect_rejected([&] { cache.append(View{buffer.data(), 2, 2, 4}, v_view); }, append, "k.heads");
  expect_rejected([&] { cache.append(View{buffer.data(), 2, 1, 5}, v_view); }, append, "k.dim");
  expect_rejected(
      [&] {
        cache.append(k_view, View{buffer.data(), 2, 1, 3, -1, 3});
      },
      append, "v strides");
  expect_rejected([&] { cache.append(k_view, View{buffer.data(), 2, 2, 3}); }, append, "v.heads");
  expect_rejected([&] { cache.append(k_view, View{buffer.data(), 2, 1, 4}); }, append, "v.dim");
  expect_rejected([&] { cache.append(k_view, View{buffer.data(), 3, 1, 3}); }, append, "v.tokens");

  REQUIRE_NOTHROW(cache.append(k_view.slice(0, 0), v_view.slice(0, 0)));
  CHECK(cache.position() == 0);
  REQUIRE_NOTHROW(cache.append(k_view, v_view));
  CHECK(cache.position() == 2);
  CHECK(cache.resident() == 2);
  REQUIRE_NOTHROW(cache.attend(View{q.data(), 2, 2, 4}, Out{out.data(), 2, 2, 3}));
  REQUIRE_NOTHROW(cache.attend(q_view.slice(0, 0), out_view.slice(0, 0)));
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 2, 2, 4}.slice(0, 0), Out{nullptr, 0, 0, 3});
      },
      attend, "out.heads");
  expect_rejected([&] { cache.attend(View{nullptr, 1, 2, 4}, out_view); }, attend, "q.data");
  expect_rejected([&] { cache.attend(View{q.data(), 1, 1, 4}, out_view); }, attend, "q.heads");
  expect_rejected([&] { cache.attend(View{q.data(), 1, 2, 3}, out_view); }, attend, "q.dim");
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 3, 2, 4}, Out{out.data(), 3, 2, 3});
      },
      attend, "q.tokens (3) must not exceed the tokens of the last append (2)");
  expect_rejected([&] { cache.attend(q_view, Out{out.data(), 2, 2, 3}); }, attend, "out.tokens");
  expect_rejected(
      [&] {
        cache.attend(q_view, Out{out.data(), 1, 1, 3});
      },
      attend, "out.heads must equal");
  expect_rejected([&] { cache.attend(q_view, Out{out.data(), 1, 2, 4}); }, attend, "out.dim");
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 2, 2, 4}, Out{out.data(), 2, 2, 3, 1, 3});
      },
      attend, "out strides make rows overlap");
  expect_rejected(
      [&] {
        cache.attend(View{q.data(), 1, 2, 4}, Out{q.data(), 1, 2, 3});
      },
      attend, "out overlaps q");
  // The cache's own storage cannot be passed as out through the public interface except by
  // casting away const; the check exists for it all the same.
  const View stored = cache.values();
  expect_rejected(
      [&] {
        cache.attend(q_view, Out{const_cast<float*>(stored.data), 1, 2, 3});
      },
      attend, "out overlaps v");

  // decode checks everything before it changes the cache: a rejected step appends nothing.
  const std::string decode = "KvCache::decode";
  plsh::KvCache<float> fresh(2, 1, 4, 3, slopes, good);
  std::vector<float> k_one(4, 0.2f);
  std::vector<float> v_one(3, 0.3f);
  const View q1{q.data(), 1, 2, 4};
  const View k1{k_one.data(), 1, 1, 4};
  const View v1{v_one.data(), 1, 1, 3};
  const Out out1{out.data(), 1, 2, 3};
  const auto expect_decode_rejected = [&](const View& q_arg, const View& k_arg, const View& v_arg,
                                          const Out& out_arg, const std::string& argument) {
    const Index position = fresh.position();
    expect_rejected([&] { fresh.decode(q_arg, k_arg, v_arg, out_arg); }, decode, argument);
    CHECK(fresh.position() == position);
  };
  expect_decode_rejected(q1, View{k_one.data(), 1, 1, 3}, v1, out1, "k.dim");
  expect_decode_rejected(q1, k1, View{v_one.data(), 1, 1, 2}, out1, "v.dim");
  expect_decode_rejected(q1, k1, View{v_one.data(), 0, 1, 3}, out1, "v.tokens");
  expect_decode_rejected(View{q.data(), 1, 1, 4}, k1, v1, out1, "q.heads");
  expect_decode_rejected(View{q.data(), 1, 2, 3}, k1, v1, out1, "q.dim");
  expect_decode_rejected(q1, k1, v1, Out{out.data(), 2, 2, 3}, "out.tokens");
  expect_decode_rejected(q1, k1, v1, Out{out.data(), 1, 2, 2}, "out.dim");
  expect_decode_rejected(View{q.data(), 2, 2, 4}, k1, v1, Out{out.data(), 2, 2, 3},
                         "q.tokens must equal k.tokens");
  expect_decode_rejected(q1, k1, v1, Out{out.data(), 1, 2, 3, 6, 1},
                         "out strides make rows overlap");
  expect_decode_rejected(q1, k1, v1, Out{q.data(), 1, 2, 3}, "out overlaps q");
  expect_decode_rejected(q1, k1, v1, Out{k_one.data(), 1, 1, 3}.slice(0, 1), "out.heads");
  std::vector<float> shared(8, 0.2f);
  expect_decode_rejected(q1, View{shared.data(), 1, 1, 4}, v1, Out{shared.data() + 2, 1, 2, 3},
                         "out overlaps k");
  expect_decode_rejected(q1, k1, View{shared.data(), 1, 1, 3}, Out{shared.data() + 1, 1, 2, 3},
                         "out overlaps v");
  REQUIRE_NOTHROW(fresh.decode(q1, k1, v1, out1));
  CHECK(fresh.position() == 1);
  REQUIRE_NOTHROW(fresh.decode(q1.slice(0, 0), k1.slice(0, 0), v1.slice(0, 0), out1.slice(0, 0)));
  CHECK(fresh.position() == 1);
  expect_decode_rejected(q1, k1, v1, Out{const_cast<float*>(fresh.keys().data), 1, 2, 3},
                         "out overlaps the cache's keys");
  expect_decode_rejected(q1, k1, v1, Out{const_cast<float*>(fresh.values().data), 1, 2, 3},
                         "out overlaps the cache's values");
  plsh::KvCache<float> far(2, 1, 4, 3, slopes, [] {
    plsh::PlshOptions options;
    options.key_position = plsh::kMaxPosition;
    return options;
  }());
  expect_rejected([&] { far.decode(q1, k1, v1, out1); }, decode, "kMaxPosition");
}
