// Tests of KvCache (kv_cache.hpp) against plsh_attention over the whole sequence: the rows of
// every chunking of the appends (grouped heads, offsets, both kernels; float, double, bfloat16 and
// half storage), the non-finite contract, slope 0, and the number of resident tokens against the
// bound computed from the partitions, also over a 10^5 token run. Accuracy bounds: see
// test_kv_cache_common.hpp.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <limits>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/kv_cache.hpp>

#include "test_kv_cache_common.hpp"

namespace test_kv_cache {

namespace {

using plsh::HeadsView;
using plsh::Index;
using namespace plsh_test;

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
  options.near_field = 0;  // block masks only
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
    if (kernel == plsh::Kernel::Passes) options.near_field = 0;  // block masks only
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

}  // namespace test_kv_cache
