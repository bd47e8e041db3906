// Tests of the Positional LSH kernels (attention/pass_kernel.hpp, fused_kernel.hpp, fused_rows.hpp,
// arch/avx512/causal_rows.hpp) against plsh::reference::plsh_attention, which forms the mean mask
// of the same grids and computes D^-1 (exp(S) o K^) V densely, and against each other: edge
// shapes, positions apart, slope 0 and steep slopes, tile unions over several key chunks, packed
// and in-place keys, the row-by-row width. The entry points' contract is in
// test_plsh_attention_api.cpp, BlockCounts in test_block_counts.cpp.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/attention/regular.hpp>
#include <plsh/reference.hpp>
#include <plsh/sampler.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"
#include "plsh_fixture.hpp"

namespace test_plsh_attention {

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::plsh_options;
using plsh_test::Problem;
using plsh_test::run_plsh;
using plsh_test::Shape;
using plsh_test::type_name;

/// Passes and Fused against reference::plsh_attention for samples s = 1, 3, 20 and each seed.
template <class Scalar>
void check_plsh_kernels(const Shape& shape, const plsh::AttentionOptions& base,
                        const std::vector<double>& slopes, const std::vector<std::uint64_t>& seeds,
                        Layout layout = Layout::Packed) {
  const double tolerance = plsh_test::reference_tolerance<Scalar>();
  for (const std::uint64_t seed : seeds) {
    Problem<Scalar> problem(shape, seed, layout);
    for (const Index samples : {1, 3, 20}) {
      INFO(shape << ", " << plsh_test::describe(base) << ", " << type_name<Scalar>() << ", "
                 << layout << " layout, seed " << seed << ", s = " << samples);
      Buffer<Scalar> expected = problem.output();
      plsh::reference::plsh_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                      slopes,
                                      plsh_options(base, samples, seed, plsh::Kernel::Passes));

      problem.out.fill(Scalar(7));
      run_plsh(problem, problem.out, slopes,
               plsh_options(base, samples, seed, plsh::Kernel::Passes));
      const double passes_error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
      INFO("passes_error = " << plsh_test::scientific(passes_error));
      CHECK(passes_error <= tolerance);
      CHECK(problem.out.touched_padding() == 0);

      problem.out.fill(Scalar(7));
      run_plsh(problem, problem.out, slopes,
               plsh_options(base, samples, seed, plsh::Kernel::Fused));
      const double fused_error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
      INFO("fused_error = " << plsh_test::scientific(fused_error));
      CHECK(fused_error <= tolerance);
      CHECK(problem.out.touched_padding() == 0);
    }
  }
}

/// The smallest distance between a query and a key of a call of a regular kernel: 0 when the
/// position ranges overlap.
Index nearest_pair(Index query_position, Index queries, Index key_position, Index keys) {
  return std::max<Index>({0, key_position - (query_position + queries - 1),
                          query_position - (key_position + keys - 1)});
}

/// Passes, Fused and the pass kernel with a regular kernel of the test's (a lambda calling
/// regular_attention that records the nearest pair it is given) against reference::plsh_attention
/// with the near field `near_field`, for s = 1, 3, 20. The lambda must see only pairs beyond the
/// smallest reach of the heads.
template <class Scalar>
void check_near_field_kernels(const Shape& shape, const plsh::AttentionOptions& base,
                              const std::vector<double>& slopes, double near_field,
                              std::uint64_t seed, Layout layout = Layout::Packed) {
  const double tolerance = plsh_test::reference_tolerance<Scalar>();
  Problem<Scalar> problem(shape, seed, layout);
  const plsh::detail::PositionRange range{
      std::min(base.query_position, base.key_position),
      std::max(base.query_position + shape.n_q, base.key_position + shape.n_k)};
  Index smallest_reach = std::numeric_limits<Index>::max();
  for (const double slope : slopes) {
    smallest_reach =
        std::min(smallest_reach, plsh::detail::head_estimator(slope, 1, near_field, range).reach());
  }
  for (const Index samples : {1, 3, 20}) {
    plsh::PlshOptions options = plsh_options(base, samples, seed, plsh::Kernel::Passes);
    options.near_field = near_field;
    INFO(shape << ", " << plsh_test::describe(base) << ", " << type_name<Scalar>() << ", " << layout
               << " layout, seed " << seed << ", s = " << samples << ", near_field " << near_field
               << ", smallest reach " << smallest_reach);
    Buffer<Scalar> expected = problem.output();
    plsh::reference::plsh_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                    slopes, options);

    problem.out.fill(Scalar(7));
    run_plsh(problem, problem.out, slopes, options);
    const Buffer<Scalar> passes = problem.out;
    const double passes_error = plsh_test::max_abs_difference(passes.in(), expected.in());
    INFO("passes_error = " << plsh_test::scientific(passes_error));
    CHECK(passes_error <= tolerance);
    CHECK(problem.out.touched_padding() == 0);

    options.kernel = plsh::Kernel::Fused;
    problem.out.fill(Scalar(7));
    run_plsh(problem, problem.out, slopes, options);
    const double fused_error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
    const double between = plsh_test::max_abs_difference(problem.out.in(), passes.in());
    INFO("fused_error = " << plsh_test::scientific(fused_error)
                          << ", |fused - passes| = " << plsh_test::scientific(between));
    CHECK(fused_error <= tolerance);
    CHECK(between <= 2 * tolerance);

    Index nearest = std::numeric_limits<Index>::max();
    const auto kernel = [&](const auto& q, const auto& k, const auto& v,
                            const plsh::AttentionOptions& block_options, auto out, auto lse) {
      using Compute = typename std::decay_t<decltype(q)>::Scalar;
      const Index distance = nearest_pair(block_options.query_position, q.rows(),
                                          block_options.key_position, k.rows());
#if defined(_OPENMP)
#pragma omp critical(near_field_kernel)
#endif
      nearest = std::min(nearest, distance);
      plsh::regular_attention<Compute>(q, k, v, block_options, out, lse);
    };
    problem.out.fill(Scalar(7));
    plsh::plsh_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view,
                                 slopes, options, kernel);
    const double custom_error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
    INFO("custom kernel: error = " << plsh_test::scientific(custom_error) << ", nearest pair "
                                   << nearest);
    CHECK(custom_error <= tolerance);
    CHECK(problem.out.touched_padding() == 0);
    if (nearest != std::numeric_limits<Index>::max()) CHECK(nearest > smallest_reach);
  }
}

template <class Scalar>
void sweep_edge_shapes() {
  // 8 query heads on 2 key/value heads: the standard slopes of 4 heads, then a moderate slope, a
  // steep one (one position per block), slope 0 (one block holding everything) and a gentle one.
  std::vector<double> slopes = plsh::alibi_slopes(4);
  slopes.insert(slopes.end(), {0.5, 50.0, 0.0, 1.0 / 64});
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    for (const Index n : plsh_test::edge_lengths()) {
      const std::vector<std::uint64_t> seeds =
          n <= 65 ? std::vector<std::uint64_t>{1, 2} : std::vector<std::uint64_t>{3};
      check_plsh_kernels<Scalar>(Shape{n, n, 8, 2, 16, 12}, options, slopes, seeds);
    }
    check_plsh_kernels<Scalar>(Shape{63, 63, 8, 1, 8, 3}, options, plsh::alibi_slopes(8), {6});
    check_plsh_kernels<Scalar>(Shape{130, 130, 4, 2, 16, 12}, options, plsh::alibi_slopes(4), {7},
                               Layout::HeadMajor);
    check_plsh_kernels<Scalar>(Shape{65, 130, 4, 4, 5, 9}, options, plsh::alibi_slopes(4), {8},
                               Layout::PaddedRows);
  }
}

}  // namespace

TEST_CASE("Passes and Fused match the dense reference on edge shapes", "[plsh]") {
  SECTION("double") { sweep_edge_shapes<double>(); }
  SECTION("float") { sweep_edge_shapes<float>(); }
}

TEST_CASE("Passes with a near field matches Fused and the dense reference on edge shapes",
          "[plsh][near_field]") {
  // 8 query heads on 2 key/value heads: the standard slopes of 4 heads, then a moderate slope, a
  // steep one (reach 0: the diagonal only), slope 0 (every key near: exact ALiBi) and a gentle one
  // (near_field 1e-3: a reach of 442, past every key).
  std::vector<double> slopes = plsh::alibi_slopes(4);
  slopes.insert(slopes.end(), {0.5, 50.0, 0.0, 1.0 / 64});
  std::uint64_t seed = 900;
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    for (const double near_field : {0.05, 0.5, 1e-3}) {
      for (const Index n : {1, 2, 63, 65, 257}) {
        check_near_field_kernels<double>(Shape{n, n, 8, 2, 16, 12}, options, slopes, near_field,
                                         ++seed);
#ifdef PLSH_TEST_SANITIZED
        // Under the sanitizers float stops at 65 tokens: the double runs take the same paths at
        // 257, where the dense reference is most of this test's time.
        if (n > 65) {
          ++seed;
          continue;
        }
#endif
        check_near_field_kernels<float>(Shape{n, n, 8, 2, 16, 12}, options, slopes, near_field,
                                        ++seed);
      }
    }
    // Reaches of several query tiles (slope 1/256, near_field 0.5: 177), strided and padded rows.
    check_near_field_kernels<float>(Shape{300, 300, 4, 2, 16, 12}, options, plsh::alibi_slopes(4),
                                    0.5, ++seed, Layout::HeadMajor);
    check_near_field_kernels<double>(Shape{65, 130, 4, 4, 5, 9}, options, plsh::alibi_slopes(4),
                                     0.05, ++seed, Layout::PaddedRows);
    // One slope for every head: the regular kernel must see only pairs beyond its reach.
    check_near_field_kernels<double>(Shape{257, 257, 4, 2, 8, 8}, options,
                                     std::vector<double>(4, 1.0 / 16), 0.5, ++seed);
  }
}

TEST_CASE("Passes with a near field, query and key positions apart", "[plsh][near_field]") {
  std::uint64_t seed = 950;
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        const Shape shape{c.n_q, c.n_k, 4, 2, 8, 6};
        for (const double near_field : {0.05, 0.5, 1e-3}) {
          check_near_field_kernels<double>(shape, options, plsh::alibi_slopes(4), near_field,
                                           ++seed);
          check_near_field_kernels<float>(shape, options, plsh::alibi_slopes(4), near_field,
                                          ++seed);
        }
      });
}

TEST_CASE("Kernel::Passes runs with the default options: Fused's result", "[plsh][near_field]") {
  // PlshOptions{}: s = 100 Latin hypercube draws, near_field 0.05.
  for (const bool causal : {true, false}) {
    Problem<float> problem(Shape{300, 300, 8, 2, 16, 12}, causal ? 61 : 62);
    const std::vector<double> slopes = plsh::alibi_slopes(8);
    plsh::PlshOptions options;
    options.causal = causal;
    Buffer<float> fused = problem.output();
    run_plsh(problem, fused, slopes, options);
    options.kernel = plsh::Kernel::Passes;
    REQUIRE_NOTHROW(run_plsh(problem, problem.out, slopes, options));
    Buffer<float> expected = problem.output();
    plsh::reference::plsh_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                    slopes, options);
    INFO((causal ? "causal" : "bidirectional"));
    CHECK(plsh_test::max_abs_difference(problem.out.in(), expected.in()) <=
          plsh_test::reference_tolerance<float>());
    CHECK(plsh_test::max_abs_difference(problem.out.in(), fused.in()) <=
          2 * plsh_test::reference_tolerance<float>());
  }
}

TEST_CASE("Passes and Fused with query and key positions apart", "[plsh]") {
  std::uint64_t seed = 20;
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        const Shape shape{c.n_q, c.n_k, 4, 2, 8, 6};
        check_plsh_kernels<double>(shape, options, plsh::alibi_slopes(4), {++seed});
        check_plsh_kernels<float>(shape, options, plsh::alibi_slopes(4), {++seed});
      });
}

TEST_CASE("slope 0 is plain attention for any number of samples", "[plsh]") {
  // Slope 0: every draw is one block holding everything, so K^ = 1 and the estimator is exact.
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions base;
    base.causal = causal;
    base.query_position = causal ? 10 : 0;
    const auto check = [&](auto scalar_tag) {
      using Scalar = decltype(scalar_tag);
      Problem<Scalar> problem(Shape{130, 129, 2, 1, 8, 8}, 40);
      Buffer<Scalar> expected = problem.output();
      plsh::reference::factor_attention(problem.q.in(), problem.k.in(), problem.v.in(),
                                        expected.view, base,
                                        [](Index, Index, Index) { return 0.0; });
      for (const Index samples : {1, 3, 20}) {
        for (const plsh::Kernel kernel : {plsh::Kernel::Passes, plsh::Kernel::Fused}) {
          INFO(type_name<Scalar>() << ", " << plsh_test::describe(base) << ", s = " << samples
                                   << (kernel == plsh::Kernel::Fused ? ", fused" : ", passes"));
          run_plsh(problem, problem.out, {0.0, 0.0}, plsh_options(base, samples, 41, kernel));
          CHECK(plsh_test::max_abs_difference(problem.out.in(), expected.in()) <=
                plsh_test::reference_tolerance<Scalar>());
        }
      }
    };
    check(double{});
    check(float{});
  }
}

TEST_CASE("steep slopes: every block is one position, so out = v of the query's position",
          "[plsh]") {
  // Slope 50: the pitch (E1 + E2)/50 exceeds 1 with probability (1 + 50) e^{-50} ~ 1e-20, so every
  // bin holds at most one integer and a query shares a block only with its own position. The
  // estimator then returns v of that position: exactly for Fused (one weight e^0 = 1), and for
  // Passes up to the rounding of its s log-sum-exp merges, each o <- (w_a/W) o + (w_b/W) o with
  // w_a + w_b = W: at most ~4 roundings of eps/2 relative per merge, so |out - v| <= 2 s eps |v|.
  // Rows 0, 7, 14, ... of v are zero: their output must be exactly zero (no weight leaks to the
  // keys outside the block). 1e300 and 1e307 are finite, hence valid, slopes with the same answer.
  const auto check = [](auto scalar_tag) {
    using Scalar = decltype(scalar_tag);
    const double epsilon = std::numeric_limits<Scalar>::epsilon();
    Problem<Scalar> problem(Shape{130, 130, 2, 1, 8, 5}, 50);
    for (Index t = 0; t < 130; t += 7)
      for (Index e = 0; e < 5; ++e) problem.v.at(t, 0, e) = 0;
    for (const double slope : {50.0, 1e300, 1e307}) {
      for (const bool causal : {true, false}) {
        for (const Index samples : {1, 3, 20}) {
          plsh::AttentionOptions base;
          base.causal = causal;
          base.query_position = base.key_position = 1000;  // absolute positions do not matter
          for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
            const bool fused = kernel == plsh::Kernel::Fused;
            INFO(type_name<Scalar>() << ", slope " << slope << ", " << plsh_test::describe(base)
                                     << ", s = " << samples << (fused ? ", fused" : ", passes"));
            run_plsh(problem, problem.out, {slope, slope}, plsh_options(base, samples, 51, kernel));
            double worst = 0;  // max |out - v| / (2 s eps |v|), or |out| where v = 0
            Index mismatches = 0;
            for (Index t = 0; t < 130; ++t)
              for (Index h = 0; h < 2; ++h)
                for (Index e = 0; e < 5; ++e) {
                  const double got = static_cast<double>(problem.out.at(t, h, e));
                  const double want = static_cast<double>(problem.v.at(t, 0, e));
                  const double allowed =
                      fused ? 0.0 : 2.0 * static_cast<double>(samples) * epsilon * std::abs(want);
                  if (std::abs(got - want) > allowed) {
                    ++mismatches;
                    worst = std::max(worst, std::abs(got - want));
                  }
                }
            INFO("largest excess difference " << plsh_test::scientific(worst));
            CHECK(mismatches == 0);
          }
        }
      }
    }
  };
  check(double{});
  check(float{});
}

TEST_CASE("Fused agrees with Passes on a sweep of random shapes", "[plsh]") {
  // 32 configurations drawn from CounterRandom: sizes 1..150, 1..4 key/value heads with groups of
  // 1..3, d and d_v in 1..24, offsets, causal or not, s in 1..40, slopes standard or log-uniform
  // in [2^-9, 2^2]. Both evaluate the same estimator; they differ by summation order only.
  const plsh::detail::CounterRandom random(60);
  const auto pick = [&](std::uint64_t counter, std::uint64_t lane, Index low, Index high) {
    return low +
           static_cast<Index>(random.unit(counter, lane) * static_cast<double>(high - low + 1));
  };
  double largest_float = 0;
  double largest_double = 0;
  for (std::uint64_t c = 0; c < 32; ++c) {
    const std::uint64_t counter = 8 * c;
    const Index kv_heads = pick(counter, 0, 1, 4);
    const Index heads = kv_heads * pick(counter, 1, 1, 3);
    const Shape shape{pick(counter, 2, 1, 150),    pick(counter, 3, 1, 150),   heads, kv_heads,
                      pick(counter + 1, 0, 1, 24), pick(counter + 1, 1, 1, 24)};
    plsh::AttentionOptions base;
    base.causal = random.unit(counter + 1, 2) < 0.7;
    base.query_position = pick(counter + 1, 3, 0, 3) == 0 ? 0 : pick(counter + 2, 0, 0, 200);
    base.key_position = pick(counter + 2, 1, 0, 3) == 0 ? 0 : pick(counter + 2, 2, 0, 200);
    const Index samples = pick(counter + 2, 3, 1, 40);
    std::vector<double> slopes = plsh::alibi_slopes(heads);
    if (random.unit(counter + 3, 0) < 0.5) {
      for (Index h = 0; h < heads; ++h) {
        slopes[static_cast<std::size_t>(h)] =
            std::exp2(-9.0 + 11.0 * random.unit(counter + 4 + static_cast<std::uint64_t>(h / 4),
                                                static_cast<std::uint64_t>(h % 4)));
      }
    }
    INFO("configuration " << c << ": " << shape << ", " << plsh_test::describe(base)
                          << ", s = " << samples);
    const auto compare = [&](auto scalar_tag, double bound, double& largest) {
      using Scalar = decltype(scalar_tag);
      Problem<Scalar> problem(shape, 600 + c);
      Buffer<Scalar> passes = problem.output();
      run_plsh(problem, passes, slopes, plsh_options(base, samples, c, plsh::Kernel::Passes));
      run_plsh(problem, problem.out, slopes, plsh_options(base, samples, c, plsh::Kernel::Fused));
      const double fused_vs_passes = plsh_test::max_abs_difference(problem.out.in(), passes.in());
      INFO(type_name<Scalar>());
      INFO("fused_vs_passes = " << plsh_test::scientific(fused_vs_passes));
      CHECK(fused_vs_passes <= bound);
      largest = std::max(largest, fused_vs_passes);
    };
    compare(float{}, 2e-5, largest_float);
    compare(double{}, 1e-11, largest_double);
  }
  INFO("largest |fused - passes|: float " << largest_float << ", double " << largest_double);
  CHECK(largest_float > 0);  // the two really are different code paths
}

TEST_CASE("Fused agrees with Passes when tile unions span several key chunks", "[plsh]") {
  // A tile's union wider than plsh::detail::kFusedKeyTile is taken in several chunks of keys by
  // the online softmax. Slope 0 makes the union every visible key, so with n_k >
  // 2 kFusedKeyTile that is certain; shallow slopes (unions of ~3.5/m keys) take it too.
  static_assert(plsh::detail::kFusedKeyTile < 300, "the shapes below must exceed one chunk");
  const std::vector<double> slopes = {0.0, 1.0 / 512, 1.0 / 128, 1.0 / 64};
  for (const bool causal : {true, false}) {
    for (const Index samples : {Index{5}, Index{20}}) {
      plsh::AttentionOptions base;
      base.causal = causal;
      base.query_position = 450;  // the last 700 of 1150 key positions: chunked prefill
      INFO((causal ? "causal" : "bidirectional") << ", s = " << samples);
      const auto compare = [&](auto scalar_tag, double bound) {
        using Scalar = decltype(scalar_tag);
        Problem<Scalar> problem(Shape{700, 1150, 4, 2, 16, 8}, 900 + samples);
        Buffer<Scalar> passes = problem.output();
        run_plsh(problem, passes, slopes, plsh_options(base, samples, 3, plsh::Kernel::Passes));
        run_plsh(problem, problem.out, slopes, plsh_options(base, samples, 3, plsh::Kernel::Fused));
        const double fused_vs_passes = plsh_test::max_abs_difference(problem.out.in(), passes.in());
        INFO(type_name<Scalar>() << ": |fused - passes| = "
                                 << plsh_test::scientific(fused_vs_passes));
        CHECK(fused_vs_passes <= bound);
      };
      compare(float{}, 2e-5);
      compare(double{}, 1e-11);
    }
  }
}

TEST_CASE("Fused packs the keys of each span of a head's rows: the same as in place", "[plsh]") {
  // The fused kernel copies the keys and values that a job's span of query rows of one head may
  // see (fused_span_rows: up to kFusedSpanRows, fewer when that leaves fewer than 32 jobs) into
  // packed scratch when the head's rows are strided (Layout::Packed with several heads) and those
  // keys are at most max_packed_keys; it reads head-major rows, and wider key ranges, in place.
  // 2200 queries of 4 heads make spans of 256 rows, the last one ragged; slope 0 makes a span's
  // keys every visible key. All three ways must give the passes kernel's result.
  CHECK(plsh::detail::fused_span_rows(8, 16384) == plsh::detail::kFusedSpanRows);
  CHECK(plsh::detail::fused_span_rows(1, 100) == 64);
  REQUIRE(plsh::detail::fused_span_rows(4, 2200) == 256);
  const std::vector<double> slopes = {0.5, 1.0 / 40, 1.0 / 300, 0.0};
  const Shape shape{2200, 2300, 4, 2, 8, 6};
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions base;
    base.causal = causal;
    base.query_position = 100;  // the last 2200 of 2300 key positions
    const plsh::PlshOptions options = plsh_options(base, 5, 8, plsh::Kernel::Fused);
    INFO((causal ? "causal" : "bidirectional"));
    Problem<float> packed(shape, 95, Layout::Packed);
    Problem<float> head_major(shape, 95, Layout::HeadMajor);
    Buffer<float> passes = packed.output();
    run_plsh(packed, passes, slopes, plsh_options(base, 5, 8, plsh::Kernel::Passes));
    run_plsh(packed, packed.out, slopes, options);
    run_plsh(head_major, head_major.out, slopes, options);
    Buffer<float> in_place = packed.output();
    const auto grids = plsh::detail::kernel_grids(slopes, options, "fused_attention");
    plsh::detail::fused_attention<float>(packed.q.in(), packed.k.in(), packed.v.in(), in_place.view,
                                         grids, slopes, base, 0.0, 0);
    const double packed_error = plsh_test::max_abs_difference(packed.out.in(), passes.in());
    const double head_major_error = plsh_test::max_abs_difference(head_major.out.in(), passes.in());
    const double in_place_error = plsh_test::max_abs_difference(in_place.in(), passes.in());
    INFO("|fused - passes|: packed spans " << plsh_test::scientific(packed_error) << ", head-major "
                                           << plsh_test::scientific(head_major_error)
                                           << ", strided in place "
                                           << plsh_test::scientific(in_place_error));
    CHECK(packed_error <= 2e-5);
    CHECK(head_major_error <= 2e-5);
    CHECK(in_place_error <= 2e-5);
    CHECK(plsh_test::max_abs_difference(packed.out.in(), in_place.in()) <= 2e-6);
  }
}

TEST_CASE("Fused causal rows of steep heads, whatever the blocks: the passes kernel's result",
          "[plsh]") {
  // Causal heads with slope above 1/kCausalRowsReach go row by row in the AVX-512 build
  // (fused_causal_rows: the block starts carried from row to row, all draws at once), and a tile
  // of 32 rows with a row wider than kCausalRowKeys keys through fused_rows. The grids are given,
  // whatever the slopes: head 0 mixes blocks of one (pitch at most 1), small, wide and infinite
  // ones (one block: from row 128 on, every tile falls back); head 1 only blocks of one, so each
  // row is its own key's value, exactly (or zero past the last key); head 2 moderate blocks.
  // Queries 37..356 against keys 11..330: the first blocks are cut at position 11, and the last
  // 26 rows see no key past 330. Compared with the passes kernel on the same grids.
  REQUIRE(plsh::detail::kCausalRowsReach * 0.25 > 1);
  const std::vector<double> slopes = {0.5, 0.25, 0.5};
  const std::vector<std::vector<plsh::Grid>> grids = {
      {{0.5, 0.25},
       {1.0, 0.0},
       {3.0, 1.7},
       {250.0, 40.5},
       {std::numeric_limits<double>::infinity(), 0.0},
       {40.0, 3.3}},
      {{0.5, 0.1}, {0.75, 0.6}, {1.0, 0.5}},
      {{2.5, 0.3}, {7.0, 5.5}, {13.0, 2.0}, {31.0, 17.25}}};
  const Shape shape{320, 320, 3, 1, 16, 12};
  plsh::AttentionOptions options;
  options.causal = true;
  options.query_position = 37;
  options.key_position = 11;
  for (const Layout layout : {Layout::Packed, Layout::HeadMajor}) {
    INFO(layout << " layout");
    Problem<float> problem(shape, 77, layout);
    Buffer<float> passes = problem.output();
    plsh::detail::pass_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(), passes.view,
                                        grids, {}, options, plsh::RegularAttention{});
    plsh::detail::fused_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                         problem.out.view, grids, slopes, options);
    const double error = plsh_test::max_abs_difference(problem.out.in(), passes.in());
    INFO("|fused - passes| = " << plsh_test::scientific(error));
    CHECK(error <= 2e-5);
    CHECK(problem.out.touched_padding() == 0);
    Index exact = 0;
    Index zero = 0;
    for (Index i = 0; i < shape.n_q; ++i) {
      const Index key = options.query_position + i - options.key_position;
      for (Index c = 0; c < shape.value_dim; ++c) {
        const float got =
            problem.out.in()
                .data[i * problem.out.in().token_stride + problem.out.in().head_stride + c];
        if (key < shape.n_k) {
          exact += got == problem.v.in().data[key * problem.v.in().token_stride + c] ? 1 : 0;
        } else {
          zero += got == 0.0f ? 1 : 0;
        }
      }
    }
    CHECK(exact == (shape.n_k - (options.query_position - options.key_position)) * shape.value_dim);
    CHECK(zero == (shape.n_q - shape.n_k + (options.query_position - options.key_position)) *
                      shape.value_dim);
  }
}

TEST_CASE("Fused matches the reference on both sides of the row-by-row width", "[plsh]") {
  // Tiles whose union holds at most kRowByRowKeys keys take fused_row_by_row (a product per
  // row), wider ones the blocked products and online softmax (in the AVX-512 build of the tests
  // both take the latter, kVectorWalk). Slopes 1/5 .. 1/48 give unions on both sides; the test
  // counts the tiles of each kind (as the kernel tiles the rows) to be sure.
  const std::vector<double> slopes = {1.0 / 5, 1.0 / 9, 1.0 / 30, 1.0 / 48};
  const Index n = 200;
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions base;
    base.causal = causal;
    base.query_position = 37;
    base.key_position = 11;
    const Index samples = 7;
    Index narrow = 0;
    Index wide = 0;
    const auto grids = plsh::draw_head_grids(slopes, samples, 5);
    std::vector<plsh::detail::BlockRun> runs;
    for (std::size_t h = 0; h < slopes.size(); ++h) {
      const Index height = plsh::detail::fused_tile_rows(slopes[h]);
      for (Index r0 = 0; r0 < n; r0 += height) {
        runs.clear();
        const plsh::Block keys = plsh::detail::tile_block_runs(
            grids[h], plsh::detail::PositionRange{11, 37 + n}, 37 + r0,
            std::min(n, r0 + height) - r0, 11, 11 + n, causal, runs);
        ++(keys.size() <= plsh::detail::kRowByRowKeys ? narrow : wide);
      }
    }
    INFO((causal ? "causal" : "bidirectional")
         << ": " << narrow << " row-by-row tiles, " << wide << " blocked");
    CHECK(narrow >= 8);
    CHECK(wide >= 8);
    Problem<double> problem(Shape{n, n, 4, 2, 16, 12}, 41);
    Buffer<double> expected = problem.output();
    plsh::reference::plsh_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                    slopes, plsh_options(base, samples, 5, plsh::Kernel::Passes));
    run_plsh(problem, problem.out, slopes, plsh_options(base, samples, 5, plsh::Kernel::Fused));
    const double error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
    INFO("|fused - reference| = " << plsh_test::scientific(error));
    CHECK(error <= plsh_test::reference_tolerance<double>());
  }
}

TEST_CASE("Fused matches the reference for value widths around the vector blocks", "[plsh]") {
  // The AVX-512 build of the tests computes a wide tile's weights and weighted
  // sum of values by register blocks (online_softmax.hpp: rows by 6, value columns by 64, keys
  // by 16 with masked tails); the default build by Eigen. Widths 1, 15, 64, 70 and 130 leave
  // every kind of tail, 100 rows tiles of 64 and 36 rows, a union wider than one key chunk
  // (slopes 0, 1/64) its last chunk ragged; the rows see up to a few hundred keys.
  const std::vector<double> slopes = {0.0, 1.0 / 64, 1.0 / 20, 0.5};
  for (const Index value_dim : {Index{1}, Index{15}, Index{64}, Index{70}, Index{130}}) {
    for (const bool causal : {true, false}) {
      plsh::AttentionOptions base;
      base.causal = causal;
      base.query_position = 300;  // the last 100 of 400 key positions
      check_plsh_kernels<float>(Shape{100, 400, 4, 2, 7, value_dim}, base, slopes,
                                {static_cast<std::uint64_t>(60 + value_dim)});
    }
  }
}

}  // namespace test_plsh_attention
