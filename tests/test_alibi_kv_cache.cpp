// Tests of AlibiKvCache (alibi_kv_cache.hpp) and of the blocks of dropped positions
// (decode/evicted_keys.hpp): against exact_alibi_attention over the whole prefix (bit for bit at
// tolerance 0 and before any eviction, within 2 tau max|v| at tolerance tau), the reported bound
// against the exact-ALiBi weight of the dropped keys computed densely in double, on hostile inputs
// (a sink at position 0, growing key norms, a sudden large query), the memory bound over a long
// run, the window formula, and errors that leave the cache unchanged.
//
// Accuracy: the cache and the whole-prefix kernel take the same keys through the same tiled core,
// so before any eviction the rows agree bit for bit; after it the cache's row is the exact row of
// its kept keys, computed in float (1e-5 allowed for rounding) or double (1e-12).

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/alibi_kv_cache.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/decode/evicted_keys.hpp>

#include "kernel_instances.hpp"
#include "test_kv_cache_common.hpp"

namespace test_alibi_kv_cache {

namespace {

using plsh::HeadsView;
using plsh::Index;

/// The exact-ALiBi weight, in double over the whole prefix, of the keys that query row `t` of head
/// h does not attend in `cache` (those before its kv head's window that are not pinned).
template <class Scalar>
double dropped_weight(const plsh_test::Sequence<Scalar>& tokens,
                      const plsh::AlibiKvCache<Scalar>& cache, Index t, Index h) {
  const Index g = h / (tokens.heads / tokens.kv_heads);
  const Index first = cache.options().key_position;
  const double scale = plsh::detail::resolved_scale(cache.options(), tokens.dim);
  const double slope = cache.slopes()[static_cast<std::size_t>(h)];
  std::vector<double> logits(static_cast<std::size_t>(t + 1));
  double largest = -std::numeric_limits<double>::infinity();
  for (Index j = 0; j <= t; ++j) {
    double dot = 0;
    for (Index e = 0; e < tokens.dim; ++e) {
      dot += static_cast<double>(
                 tokens.q[static_cast<std::size_t>((t * tokens.heads + h) * tokens.dim + e)]) *
             static_cast<double>(
                 tokens.k[static_cast<std::size_t>((j * tokens.kv_heads + g) * tokens.dim + e)]);
    }
    logits[static_cast<std::size_t>(j)] = scale * dot - slope * static_cast<double>(t - j);
    largest = std::max(largest, logits[static_cast<std::size_t>(j)]);
  }
  const std::vector<Index>& pinned = cache.pinned_positions(g);
  double total = 0;
  double dropped = 0;
  for (Index j = 0; j <= t; ++j) {
    const double weight = std::exp(logits[static_cast<std::size_t>(j)] - largest);
    total += weight;
    const Index key_position = first + j;
    if (key_position < cache.oldest_position(g) &&
        std::find(pinned.begin(), pinned.end(), key_position) == pinned.end()) {
      dropped += weight;
    }
  }
  return dropped / total;
}

/// What decoding a sequence through a cache chunk by chunk gave, against exact_alibi_attention of
/// each chunk's queries over the whole prefix.
struct Run {
  double max_difference = 0;  // largest |cache - exact| over the entries
  double max_excess = -1;     // largest |cache - exact| - 2 bound max|v| - rounding (<= 0: within)
  double largest_bound = 0;
  bool certified = true;             // every step certified
  double worst_bound_ratio = 1e300;  // smallest bound / true dropped weight over rows dropping any
  Index bound_below_truth = 0;       // rows whose bound is below the true dropped weight
  Index resident_excess = -1;        // largest resident(g) - (W_g + chunk - 1 + sinks)
  bool all_resident = true;          // every key appended so far resident at every step
  Index steps = 0;
  bool bit_equal = true;  // every output equal to exact bit for bit
};

template <class Scalar>
Run run_cache(const plsh_test::Sequence<Scalar>& tokens, const std::vector<double>& slopes,
              const plsh::AlibiCacheOptions& options, const std::vector<Index>& chunks,
              bool check_truth, double rounding) {
  plsh::AlibiKvCache<Scalar> cache(tokens.heads, tokens.kv_heads, tokens.dim, tokens.value_dim,
                                   slopes, options);
  Run run;
  double max_value = 0;
  Index done = 0;
  const Index row_size = tokens.heads * tokens.value_dim;
  for (const Index chunk : chunks) {
    for (Index i = done * tokens.kv_heads * tokens.value_dim;
         i < (done + chunk) * tokens.kv_heads * tokens.value_dim; ++i) {
      max_value =
          std::max(max_value, std::abs(static_cast<double>(tokens.v[static_cast<std::size_t>(i)])));
    }
    std::vector<Scalar> out(static_cast<std::size_t>(chunk * row_size));
    const plsh::DroppedWeight step = cache.decode(
        tokens.queries(done, chunk), tokens.keys(done, chunk), tokens.values(done, chunk),
        {out.data(), chunk, tokens.heads, tokens.value_dim});
    std::vector<Scalar> exact(out.size());
    plsh::AttentionOptions exact_options = options;
    exact_options.query_position = options.key_position + done;
    plsh::exact_alibi_attention<Scalar>(
        tokens.queries(done, chunk), tokens.keys(0, done + chunk), tokens.values(0, done + chunk),
        {exact.data(), chunk, tokens.heads, tokens.value_dim}, slopes, exact_options);
    const std::vector<double>& bounds = cache.bounds();
    for (Index r = 0; r < chunk; ++r) {
      for (Index h = 0; h < tokens.heads; ++h) {
        const double bound = bounds[static_cast<std::size_t>(r * tokens.heads + h)];
        for (Index e = 0; e < tokens.value_dim; ++e) {
          const std::size_t i = static_cast<std::size_t>(r * row_size + h * tokens.value_dim + e);
          const double difference =
              std::abs(static_cast<double>(out[i]) - static_cast<double>(exact[i]));
          run.bit_equal = run.bit_equal && out[i] == exact[i];
          run.max_difference = std::max(run.max_difference, difference);
          run.max_excess = std::max(run.max_excess, difference - 2 * bound * max_value - rounding);
        }
        if (check_truth) {
          const double truth = dropped_weight(tokens, cache, done + r, h);
          if (truth > 0) run.worst_bound_ratio = std::min(run.worst_bound_ratio, bound / truth);
          if (!(bound >= truth)) ++run.bound_below_truth;
        }
      }
    }
    run.largest_bound = std::max(run.largest_bound, step.bound);
    run.certified = run.certified && step.certified;
    for (Index g = 0; g < tokens.kv_heads; ++g) {
      run.all_resident = run.all_resident && cache.resident(g) == done + chunk;
      if (cache.window(g) == plsh::kKeepEveryKey) {
        run.resident_excess = std::max(run.resident_excess, cache.resident(g) - (done + chunk));
      } else {
        run.resident_excess = std::max(
            run.resident_excess, cache.resident(g) - (cache.window(g) + chunk - 1 + options.sinks));
      }
    }
    ++run.steps;
    done += chunk;
  }
  return run;
}

/// Steep slopes, so that keys leave the windows within a few hundred tokens.
const std::vector<double> kSteepSlopes = {0.5, 0.25, 0.125, 0.0625};

/// The declaration that inputs in [-1, 1] satisfy by construction: |scale| ||q|| ||k|| <= d /
/// sqrt(d).
plsh::AlibiCacheOptions declared(Index dim, double tolerance, Index sinks) {
  plsh::AlibiCacheOptions options;
  options.tolerance = tolerance;
  options.max_score = std::sqrt(static_cast<double>(dim));
  options.min_logit = -options.max_score;
  options.sinks = sinks;
  return options;
}

}  // namespace

TEST_CASE("alibi_cache_window is the smallest window that the declaration certifies",
          "[alibi_kv_cache]") {
  // ratio(W) = e^{S - F - mW} / (1 - e^{-mW}): the dropped keys' bound over the window's.
  const auto ratio = [](double slope, double spread, Index window) {
    const double w = static_cast<double>(window);
    return std::exp(spread - slope * w) / -std::expm1(-slope * w);
  };
  for (const double slope : {1.0 / 256, 0.0625, 0.5, 3.0}) {
    for (const double tolerance : {1e-2, 1e-4, 1e-6}) {
      for (const double spread : {0.0, 8.0, 24.0}) {
        plsh::AlibiCacheOptions options;
        options.tolerance = tolerance;
        options.max_score = spread / 2;
        options.min_logit = -spread / 2;
        const Index window = plsh::alibi_cache_window(slope, options);
        INFO("slope " << slope << ", tolerance " << tolerance << ", S - F = " << spread
                      << ": W = " << window);
        CHECK(window >= 1);
        CHECK(ratio(slope, spread, window) <= tolerance * (1 + 1e-12));
        if (window > 1) CHECK(ratio(slope, spread, window - 1) > tolerance);
      }
    }
  }
  plsh::AlibiCacheOptions options;
  CHECK(plsh::alibi_cache_window(0.0, options) == plsh::kKeepEveryKey);
  options.tolerance = 0;
  CHECK(plsh::alibi_cache_window(0.5, options) == plsh::kKeepEveryKey);
  options.tolerance = 1e-4;
  options.max_score = 1e300;  // e^{S - F} overflows: the window is beyond any position
  CHECK(plsh::alibi_cache_window(0.5, options) == plsh::kKeepEveryKey);
  options.max_score = 16;
  // The standard slopes of 8 heads at tolerance 1e-4 and |logits| <= 16: the flattest head keeps
  // ceil(256 (32 + ln 1e4)) = 10550 positions.
  options.min_logit = -16;
  CHECK(plsh::alibi_cache_window(1.0 / 256, options) ==
        static_cast<Index>(std::ceil(256 * std::log1p(std::exp(32.0) / 1e-4))));
  REQUIRE_THROWS_AS(plsh::alibi_cache_window(-1.0, options), std::invalid_argument);
  options.min_logit = 17;
  REQUIRE_THROWS_AS(plsh::alibi_cache_window(0.5, options), std::invalid_argument);
}

TEST_CASE("EvictedKeys keeps few blocks whose norms bound every dropped key", "[alibi_kv_cache]") {
  const Index first = 1000;
  plsh::detail::EvictedKeys evicted(first);
  std::vector<double> norms;
  const plsh::detail::CounterRandom random(5);
  for (Index n = 1; n <= 3000; ++n) {
    // Every seventh position is kept elsewhere (no norm); the others have norms in [0, 2).
    const double norm = n % 7 == 0 ? -1.0 : 2 * random.unit(static_cast<std::uint64_t>(n), 0);
    evicted.push(norm);
    norms.push_back(norm);
    if (n % 500 == 0) {
      evicted.raise(first + n - 300, 5.0);  // a kept key dropped later
      norms[static_cast<std::size_t>(n - 300)] = 5.0;
    }
    const auto& blocks = evicted.blocks();
    INFO("after " << n << " positions, " << blocks.size() << " blocks");
    REQUIRE(static_cast<double>(blocks.size()) <= 2 * std::log2(static_cast<double>(n)) + 2);
    REQUIRE(blocks.front().begin == first);
    REQUIRE(blocks.back().end == first + n);
    REQUIRE(evicted.end() == first + n);
    for (std::size_t b = 0; b < blocks.size(); ++b) {
      const Index length = blocks[b].end - blocks[b].begin;
      REQUIRE(length == Index{1} << blocks[b].log2_length);
      REQUIRE(length <= first + n - blocks[b].end + 1);  // no longer than what follows it, + 1
      if (b > 0) {
        REQUIRE(blocks[b].begin == blocks[b - 1].end);
        REQUIRE(blocks[b].log2_length <= blocks[b - 1].log2_length);
      }
      if (b >= 2) REQUIRE(blocks[b - 2].log2_length > blocks[b].log2_length);  // two per length
      double largest = -1;
      for (Index p = blocks[b].begin; p < blocks[b].end; ++p) {
        largest = std::max(largest, norms[static_cast<std::size_t>(p - first)]);
      }
      REQUIRE(blocks[b].norm == largest);
    }
  }
  // The bound is at least the sum of the per-key bounds e^{aK_j - m(p - j) - lse}.
  const double slope = 0.01;
  const std::vector<double> log_sums = plsh::detail::block_log_sums(slope);
  const Index position = first + 3000 + 50;
  double per_key = 0;
  for (std::size_t j = 0; j < norms.size(); ++j) {
    if (norms[j] < 0) continue;
    per_key += std::exp(0.7 * norms[j] -
                        slope * static_cast<double>(position - first - static_cast<Index>(j)) - 2);
  }
  const double bound = evicted.bound(0.7, slope, position, 2.0, log_sums);
  INFO("block bound " << bound << ", per-key bound " << per_key);
  CHECK(bound >= per_key * (1 - 1e-12));
  CHECK(bound <= per_key * 40);  // the blocks' maxima cost a bounded factor here
}

TEST_CASE("AlibiKvCache equals exact_alibi_attention bit for bit while it keeps every key",
          "[alibi_kv_cache]") {
  // At 1e-6 the standard slopes keep every key of 200 tokens (the window of slope 1/16 is 349);
  // tolerance 0 keeps every key at any slope.
  const plsh_test::Sequence<float> tokens(200, 8, 2, 16, 8, 3);
  const std::vector<std::vector<Index>> patterns = {{1}, {1, 7, 64, 3}, {70, 1}};
  for (const double tolerance : {0.0, 1e-6}) {
    const std::vector<double> slopes =
        tolerance == 0 ? std::vector<double>{0.5, 0.25, 0.125, 0.0625, 2.0, 1.0, 0.3, 0.1}
                       : plsh::alibi_slopes(8);
    for (const Index key_position : {Index{0}, Index{1000}}) {
      for (const auto& pattern : patterns) {
        plsh::AlibiCacheOptions options = declared(16, tolerance, 4);
        options.key_position = key_position;
        const Run run = run_cache(tokens, slopes, options,
                                  plsh_test::chunk_schedule(tokens.tokens, pattern), false, 0);
        INFO("tolerance " << tolerance << ", first position " << key_position << ", chunks of "
                          << pattern.front() << ": max |cache - exact| " << run.max_difference);
        CHECK(run.bit_equal);
        CHECK(run.largest_bound == 0);
        CHECK(run.certified);
        CHECK(run.all_resident);
      }
    }
  }
}

TEST_CASE(
    "AlibiKvCache at tolerance tau is within 2 tau max|v| of exact ALiBi, every step "
    "certified",
    "[alibi_kv_cache]") {
  // Four query heads on two key/value heads (kv head 0 keeps the window of slope 0.25, kv head 1
  // that of 0.0625: 202 positions at 1e-2, 276 at 1e-4); inputs in [-1, 1] satisfy the
  // declaration.
  const plsh_test::Sequence<float> tokens(500, 4, 2, 16, 8, 11);
  for (const double tolerance : {1e-2, 1e-4}) {
    for (const Index sinks : {Index{0}, Index{3}}) {
      for (const auto& pattern : std::vector<std::vector<Index>>{{1}, {5, 1, 70}}) {
        const plsh::AlibiCacheOptions options = declared(16, tolerance, sinks);
        const Run run = run_cache(tokens, kSteepSlopes, options,
                                  plsh_test::chunk_schedule(tokens.tokens, pattern), true, 1e-5);
        INFO("tolerance " << tolerance << ", " << sinks << " sinks, chunks of " << pattern.front()
                          << ": max |cache - exact| " << run.max_difference << ", largest bound "
                          << run.largest_bound << ", smallest bound/truth "
                          << run.worst_bound_ratio);
        CHECK(run.certified);
        CHECK(run.largest_bound <= tolerance);
        CHECK(run.largest_bound > 0);  // keys were dropped
        CHECK(run.max_difference <= 2 * tolerance);
        CHECK(run.max_excess <= 0);
        CHECK(run.bound_below_truth == 0);
        CHECK(run.resident_excess <= 0);
      }
    }
  }
}

TEST_CASE("AlibiKvCache in double: the bound holds the true dropped weight, grouped heads",
          "[alibi_kv_cache]") {
  const plsh_test::Sequence<double> tokens(500, 8, 2, 8, 8, 23);
  const std::vector<double> slopes = {0.5, 0.4, 0.3, 0.25, 0.2, 0.15, 0.1, 0.08};
  const plsh::AlibiCacheOptions options = declared(8, 1e-6, 2);
  const Run run = run_cache(tokens, slopes, options,
                            plsh_test::chunk_schedule(tokens.tokens, {3, 1}), true, 1e-12);
  INFO("largest bound " << run.largest_bound << ", smallest bound/truth " << run.worst_bound_ratio);
  CHECK(run.certified);
  CHECK(run.max_excess <= 0);
  CHECK(run.bound_below_truth == 0);
  CHECK(run.resident_excess <= 0);
}

TEST_CASE("AlibiKvCache pins a sink at position 0, and reports it when it cannot",
          "[alibi_kv_cache][hostile]") {
  // Key 0 of every kv head is 16 times the others' largest norm and aligned with every query's
  // first entry, which is positive: it takes a large share of every row, far beyond its window. The
  // declaration (|scale| ||q|| ||k|| <= max_score) is broken by this key only.
  plsh_test::Sequence<double> tokens(600, 4, 2, 8, 8, 31);
  for (Index t = 0; t < tokens.tokens; ++t) {
    for (Index h = 0; h < tokens.heads; ++h) tokens.query(t, h, 0) = 1.0;
  }
  for (Index g = 0; g < tokens.kv_heads; ++g) {
    for (Index e = 0; e < tokens.dim; ++e) tokens.key(0, g, e) = e == 0 ? 16 * 2.83 : 0.0;
  }
  const std::vector<double> slopes = {0.25, 0.125, 0.0625, 0.05};
  for (const Index sinks : {Index{1}, Index{0}}) {
    const plsh::AlibiCacheOptions options = declared(8, 1e-4, sinks);
    const Run run = run_cache(tokens, slopes, options,
                              plsh_test::chunk_schedule(tokens.tokens, {1}), true, 1e-12);
    INFO(sinks << " sinks: largest bound " << run.largest_bound << ", max |cache - exact| "
               << run.max_difference << ", smallest bound/truth " << run.worst_bound_ratio);
    CHECK(run.bound_below_truth == 0);
    CHECK(run.max_excess <= 0);
    CHECK(run.resident_excess <= 0);
    if (sinks == 1) {
      CHECK(run.certified);  // the sink is pinned: the dropped keys keep the declaration
      CHECK(run.max_difference <= 2e-4);
    } else {
      CHECK_FALSE(run.certified);  // dropped, and reported
      CHECK(run.largest_bound > 1e-2);
      CHECK(run.max_difference > 1e-3);  // the output did move away from exact
    }
  }
}

TEST_CASE("AlibiKvCache with growing key norms: every bound holds the true dropped weight",
          "[alibi_kv_cache][hostile]") {
  // Key j is scaled by 1 + j/50: each key leaving the window is larger than every pinned one, so
  // the pins turn over at every step and the dropped keys break the declaration more and more.
  plsh_test::Sequence<double> tokens(500, 2, 1, 8, 4, 41);
  for (Index t = 0; t < tokens.tokens; ++t) {
    for (Index e = 0; e < tokens.dim; ++e) {
      tokens.key(t, 0, e) *= 1 + static_cast<double>(t) / 50;
    }
  }
  const plsh::AlibiCacheOptions options = declared(8, 1e-4, 2);
  const Run run = run_cache(tokens, {0.25, 0.125}, options,
                            plsh_test::chunk_schedule(tokens.tokens, {1, 4}), true, 1e-12);
  INFO("largest bound " << run.largest_bound << ", smallest bound/truth " << run.worst_bound_ratio);
  CHECK(run.bound_below_truth == 0);
  CHECK(run.max_excess <= 0);
  CHECK(run.resident_excess <= 0);
  CHECK_FALSE(run.certified);
}

TEST_CASE("AlibiKvCache reports a sudden large query, and throws in strict mode",
          "[alibi_kv_cache][hostile]") {
  // At step 400 the query of head 0 is 1000 times key 100's direction, a key long dropped: in
  // exact ALiBi that key takes nearly the whole row. The bound says so at that step only.
  plsh_test::Sequence<double> tokens(420, 2, 1, 8, 4, 43);
  const Index large = 400;
  for (Index e = 0; e < tokens.dim; ++e) tokens.query(large, 0, e) = 1000 * tokens.key(100, 0, e);
  const std::vector<double> slopes = {0.25, 0.125};
  plsh::AlibiCacheOptions options = declared(8, 1e-4, 0);
  plsh::AlibiKvCache<double> cache(2, 1, 8, 4, slopes, options);
  std::vector<double> out(2 * 4);
  for (Index t = 0; t < tokens.tokens; ++t) {
    const plsh::DroppedWeight step = cache.decode(tokens.queries(t, 1), tokens.keys(t, 1),
                                                  tokens.values(t, 1), {out.data(), 1, 2, 4});
    const double truth = dropped_weight(tokens, cache, t, 0);
    INFO("step " << t << ": bound " << step.bound << ", true dropped weight " << truth);
    REQUIRE(cache.bounds()[0] >= truth);
    if (t == large) {
      CHECK(truth > 0.9);
      CHECK_FALSE(step.certified);
      CHECK(step.bound >= truth);
    } else {
      REQUIRE(step.certified);
    }
  }
  // Strict mode: the same step throws CertificateError, after writing its outputs.
  options.strict = true;
  plsh::AlibiKvCache<double> strict(2, 1, 8, 4, slopes, options);
  for (Index t = 0; t < large; ++t) {
    strict.decode(tokens.queries(t, 1), tokens.keys(t, 1), tokens.values(t, 1),
                  {out.data(), 1, 2, 4});
  }
  std::fill(out.begin(), out.end(), 0.0);
  bool thrown = false;
  try {
    strict.decode(tokens.queries(large, 1), tokens.keys(large, 1), tokens.values(large, 1),
                  {out.data(), 1, 2, 4});
  } catch (const plsh::CertificateError& error) {
    thrown = true;
    INFO(error.what());
    CHECK(error.dropped().bound > 0.9);
    CHECK_FALSE(error.dropped().certified);
  }
  CHECK(thrown);
  CHECK(strict.position() == large + 1);
  CHECK(out[0] != 0.0);
}

TEST_CASE("AlibiKvCache with non-finite keys never certifies what it cannot bound",
          "[alibi_kv_cache][nonfinite]") {
  // Key 20 has an infinite entry; without pins it is dropped once it leaves the window, and every
  // later bound of a row that could see it is infinite or NaN.
  plsh_test::Sequence<float> tokens(200, 2, 1, 8, 4, 47);
  tokens.key(20, 0, 3) = std::numeric_limits<float>::infinity();
  plsh::AlibiKvCache<float> cache(2, 1, 8, 4, {0.5, 0.25}, declared(8, 1e-4, 0));
  std::vector<float> out(2 * 4);
  bool dropped = false;
  for (Index t = 0; t < tokens.tokens; ++t) {
    const plsh::DroppedWeight step = cache.decode(tokens.queries(t, 1), tokens.keys(t, 1),
                                                  tokens.values(t, 1), {out.data(), 1, 2, 4});
    if (cache.oldest_position(0) > 20) {
      dropped = true;
      REQUIRE_FALSE(step.certified);
    }
  }
  CHECK(dropped);
}

TEST_CASE("AlibiKvCache decode equals append then attend, bit for bit", "[alibi_kv_cache]") {
  const plsh_test::Sequence<float> tokens(300, 4, 2, 16, 8, 53);
  const plsh::AlibiCacheOptions options = declared(16, 1e-4, 2);
  plsh::AlibiKvCache<float> decoded(4, 2, 16, 8, kSteepSlopes, options);
  plsh::AlibiKvCache<float> split(4, 2, 16, 8, kSteepSlopes, options);
  Index done = 0;
  for (const Index chunk :
       plsh_test::chunk_schedule(299, {1, 3, 9})) {  // 23 rounds of 13: the last chunk is 9
    std::vector<float> a(static_cast<std::size_t>(chunk * 4 * 8));
    std::vector<float> b(a.size());
    const plsh::DroppedWeight first =
        decoded.decode(tokens.queries(done, chunk), tokens.keys(done, chunk),
                       tokens.values(done, chunk), {a.data(), chunk, 4, 8});
    split.append(tokens.keys(done, chunk), tokens.values(done, chunk));
    const plsh::DroppedWeight second =
        split.attend(tokens.queries(done, chunk), {b.data(), chunk, 4, 8});
    REQUIRE(a == b);
    REQUIRE(decoded.bounds() == split.bounds());
    REQUIRE(first.bound == second.bound);
    done += chunk;
  }
  // attend of the newest query alone gives the last row of the chunk's attend, to rounding (one
  // row's products against a tile's), with the same bound.
  std::vector<float> last(4 * 8);
  split.attend(tokens.queries(done - 1, 1), {last.data(), 1, 4, 8});
  const std::vector<double> last_bounds = split.bounds();
  std::vector<float> all(static_cast<std::size_t>(9 * 4 * 8));
  split.attend(tokens.queries(done - 9, 9), {all.data(), 9, 4, 8});
  for (std::size_t i = 0; i < last.size(); ++i) {
    CHECK(std::abs(last[i] - all[all.size() - last.size() + i]) <= 1e-6);
  }
  for (std::size_t h = 0; h < 4; ++h) {
    CHECK(std::abs(last_bounds[h] - split.bounds()[8 * 4 + h]) <= 1e-6 * last_bounds[h]);
  }
}

TEST_CASE("AlibiKvCache stores bfloat16 and computes in float", "[alibi_kv_cache][half]") {
  const plsh_test::Sequence<Eigen::bfloat16> rounded(
      plsh_test::Sequence<float>(400, 4, 2, 16, 8, 59));
  const plsh::AlibiCacheOptions options = declared(16, 1e-3, 2);
  const Run run = run_cache(rounded, kSteepSlopes, options,
                            plsh_test::chunk_schedule(rounded.tokens, {1, 6}), false, 1e-2);
  INFO("largest bound " << run.largest_bound << ", max |cache - exact| " << run.max_difference);
  CHECK(run.certified);
  CHECK(run.max_excess <= 0);
  CHECK(run.resident_excess <= 0);
}

TEST_CASE("AlibiKvCache memory stays within its bound over 10^5 tokens", "[alibi_kv_cache]") {
  // Appends of 1 and 37 tokens, an attend every 997 tokens: the rows per kv head never pass
  // W_g + 37 - 1 + sinks, the blocks of dropped positions stay logarithmic, and the bytes stop
  // growing once the windows are full.
  const Index n = 100000;
  const plsh_test::Sequence<float> tokens(1000, 2, 2, 4, 4, 61);
  const plsh::AlibiCacheOptions options = declared(4, 1e-4, 3);
  plsh::AlibiKvCache<float> cache(2, 2, 4, 4, {0.5, 0.05}, options);
  std::vector<float> out(static_cast<std::size_t>(37 * 2 * 4));
  Index done = 0;
  std::size_t bytes_at_half = 0;
  Index most_resident[2] = {0, 0};
  for (const Index chunk : plsh_test::chunk_schedule(n, {1, 1, 37})) {
    const Index offset = done % (tokens.tokens - 37);
    cache.append(tokens.keys(offset, chunk), tokens.values(offset, chunk));
    if (done % 997 < chunk) {
      const plsh::DroppedWeight step =
          cache.attend(tokens.queries(offset, chunk), {out.data(), chunk, 2, 4});
      REQUIRE(step.certified);
    }
    for (Index g = 0; g < 2; ++g) {
      most_resident[g] = std::max(most_resident[g], cache.resident(g));
      REQUIRE(cache.resident(g) <= cache.window(g) + 37 - 1 + options.sinks);
    }
    done += chunk;
    if (bytes_at_half == 0 && done >= n / 2) bytes_at_half = cache.bytes();
  }
  INFO("windows " << cache.window(0) << " and " << cache.window(1) << ", most resident "
                  << most_resident[0] << " and " << most_resident[1] << ", blocks "
                  << cache.evicted_blocks(1) << ", bytes " << cache.bytes());
  CHECK(cache.position() == n);
  CHECK(cache.window(0) < cache.window(1));
  CHECK(most_resident[1] > cache.window(1));
  CHECK(static_cast<double>(cache.evicted_blocks(1)) <= 2 * std::log2(static_cast<double>(n)) + 2);
  // Blocks still merge after the half: a few dozen bytes more at most.
  CHECK(cache.bytes() <= bytes_at_half + 64 * sizeof(plsh::detail::EvictedKeys::Block));
}

TEST_CASE("AlibiKvCache rejects bad arguments and leaves the cache unchanged",
          "[alibi_kv_cache][errors]") {
  const std::vector<double> slopes = {0.5, 0.25};
  const plsh::AlibiCacheOptions good;
  const auto make = [&](Index heads, Index kv_heads, Index dim, Index value_dim,
                        std::vector<double> list, plsh::AlibiCacheOptions options) {
    return plsh::AlibiKvCache<float>(heads, kv_heads, dim, value_dim, std::move(list), options);
  };
  REQUIRE_THROWS_AS(make(0, 1, 4, 4, {}, good), std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 0, 4, 4, slopes, good), std::invalid_argument);
  REQUIRE_THROWS_AS(make(3, 2, 4, 4, {0.5, 0.25, 0.1}, good), std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 0, 4, slopes, good), std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 0, slopes, good), std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, {0.5}, good), std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, {0.5, -1.0}, good), std::invalid_argument);
  const auto with = [&](auto change) {
    plsh::AlibiCacheOptions options = good;
    change(options);
    return options;
  };
  using Options = plsh::AlibiCacheOptions;
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) { o.causal = false; })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) { o.key_position = -1; })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) { o.tolerance = 1.5; })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) { o.tolerance = -1e-3; })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) {
                           o.max_score = std::numeric_limits<double>::infinity();
                         })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) { o.min_logit = 20; })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) { o.sinks = -1; })),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(make(2, 1, 4, 4, slopes, with([](Options& o) {
                           o.scale = std::numeric_limits<double>::quiet_NaN();
                         })),
                    std::invalid_argument);
  try {
    make(2, 1, 4, 4, slopes, with([](Options& o) { o.sinks = -1; }));
  } catch (const std::invalid_argument& error) {
    CHECK(std::string(error.what()).rfind("AlibiKvCache: ", 0) == 0);
  }

  const plsh_test::Sequence<float> tokens(40, 2, 1, 4, 4, 67);
  plsh::AlibiKvCache<float> cache(2, 1, 4, 4, slopes, declared(4, 1e-4, 1));
  std::vector<float> out(static_cast<std::size_t>(40 * 2 * 4));
  for (Index t = 0; t < 30; ++t) {
    cache.decode(tokens.queries(t, 1), tokens.keys(t, 1), tokens.values(t, 1),
                 {out.data(), 1, 2, 4});
  }
  const Index position = cache.position();
  const Index resident = cache.resident(0);
  const Index oldest = cache.oldest_position(0);
  const std::vector<double> bounds = cache.bounds();
  const HeadsView<float> out1{out.data(), 1, 2, 4};
  // Shapes that disagree with the cache.
  REQUIRE_THROWS_AS(cache.append(tokens.queries(30, 1), tokens.values(30, 1)),
                    std::invalid_argument);  // 2 heads, not 1
  REQUIRE_THROWS_AS(cache.append(tokens.keys(30, 2), tokens.values(30, 1)), std::invalid_argument);
  REQUIRE_THROWS_AS(
      cache.decode(tokens.keys(30, 1), tokens.keys(30, 1), tokens.values(30, 1), out1),
      std::invalid_argument);  // q with kv_heads heads
  REQUIRE_THROWS_AS(cache.decode(tokens.queries(30, 2), tokens.keys(30, 1), tokens.values(30, 1),
                                 {out.data(), 2, 2, 4}),
                    std::invalid_argument);  // q.tokens != k.tokens
  REQUIRE_THROWS_AS(cache.decode(tokens.queries(30, 1), tokens.keys(30, 1), tokens.values(30, 1),
                                 {out.data(), 1, 2, 3}),
                    std::invalid_argument);  // out.dim
  REQUIRE_THROWS_AS(cache.attend(tokens.queries(28, 2), {out.data(), 2, 2, 4}),
                    std::invalid_argument);  // more queries than the last append
  // out overlapping q, or k of a decode.
  std::vector<float> shared(static_cast<std::size_t>(2 * 4));
  const HeadsView<const float> q_shared{shared.data(), 1, 2, 4};
  REQUIRE_THROWS_AS(cache.attend(q_shared, {shared.data(), 1, 2, 4}), std::invalid_argument);
  const HeadsView<const float> k_shared{shared.data(), 1, 1, 4};
  REQUIRE_THROWS_AS(
      cache.decode(tokens.queries(30, 1), k_shared, tokens.values(30, 1), {shared.data(), 1, 2, 4}),
      std::invalid_argument);
  CHECK(cache.position() == position);
  CHECK(cache.resident(0) == resident);
  CHECK(cache.oldest_position(0) == oldest);
  CHECK(cache.bounds() == bounds);
  REQUIRE_THROWS_AS(cache.resident(1), std::invalid_argument);  // kv_head out of range
  // n = 0 does nothing.
  cache.decode(tokens.queries(30, 0), tokens.keys(30, 0), tokens.values(30, 0),
               {out.data(), 0, 2, 4});
  CHECK(cache.position() == position);
}

}  // namespace test_alibi_kv_cache
