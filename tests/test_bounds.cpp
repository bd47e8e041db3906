// Extreme arguments: positions near the end of the integer range, huge or NaN grids, huge head
// and sample counts, scales outside the scalar type, views whose offsets overflow, and argument
// checks that must not allocate when they pass. Every input here once hung, crashed, had
// undefined behaviour or gave a misleading error; now each is rejected with
// std::invalid_argument naming the function called, or computed.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/analysis.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/detail/validate.hpp>
#include <plsh/kv_cache.hpp>
#include <plsh/limits.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

// Every heap allocation of this executable is counted: the tests below count those made by
// argument checks that pass.
#include "allocation_counter.hpp"

namespace test_bounds {

namespace {

using Catch::Contains;
using plsh::Grid;
using plsh::HeadsView;
using plsh::Index;
using plsh::kMaxPosition;
using plsh_test::Buffer;

constexpr Index kIndexMax = std::numeric_limits<Index>::max();
constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// A small problem: q, k, v [n][heads][dim], out [n][heads][dim].
template <class Scalar>
struct Problem {
  Buffer<Scalar> q, k, v, out;
  explicit Problem(Index n = 6, Index heads = 2, Index dim = 4)
      : q(n, heads, dim), k(n, heads, dim), v(n, heads, dim), out(n, heads, dim) {
    q.fill_random(1);
    k.fill_random(2);
    v.fill_random(3);
  }
  std::vector<double> slopes() const { return plsh::alibi_slopes(q.view.heads); }
  void plsh(const plsh::PlshOptions& options) {
    plsh::plsh_attention<Scalar>(q.in(), k.in(), v.in(), out.view, slopes(), options);
  }
  void exact(const plsh::AttentionOptions& options) {
    plsh::exact_alibi_attention<Scalar>(q.in(), k.in(), v.in(), out.view, slopes(), options);
  }
  void backward(const plsh::PlshOptions& options) {
    Buffer<Scalar> dout = out, dq = q, dk = k, dv = v;
    plsh::plsh_attention_backward<Scalar>(q.in(), k.in(), v.in(), out.in(), dout.in(), dq.view,
                                          dk.view, dv.view, slopes(), options);
  }
};

/// The blocks of `[first, last)` straight from the bin test, one position at a time.
std::vector<plsh::Block> blocks_by_bin(const Grid& grid, Index first, Index last) {
  std::vector<plsh::Block> blocks;
  for (Index p = first; p < last; ++p) {
    if (p == first || !plsh::detail::same_bin(grid, p - 1, p)) {
      if (!blocks.empty()) blocks.back().end = p;
      blocks.push_back(plsh::Block{p, last});
    }
  }
  return blocks;
}

}  // namespace

TEST_CASE("positions: every entry point bounds position + tokens by kMaxPosition",
          "[bounds][positions]") {
  Problem<double> problem;
  const Index n = problem.q.view.tokens;
  for (const Index position : {kIndexMax - 100, kIndexMax, kMaxPosition - n + 1, kMaxPosition}) {
    INFO("position " << position);
    plsh::PlshOptions options;
    options.query_position = position;
    options.key_position = position;
    for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
      options.kernel = kernel;
      REQUIRE_THROWS_WITH(problem.plsh(options),
                          Contains("plsh_attention") && Contains("options.query_position"));
    }
    REQUIRE_THROWS_WITH(problem.exact(options), Contains("exact_alibi_attention"));
    REQUIRE_THROWS_WITH(problem.backward(options), Contains("plsh_attention_backward"));
    options.query_position = 0;
    REQUIRE_THROWS_WITH(problem.plsh(options), Contains("options.key_position"));
  }
  SECTION("up to kMaxPosition itself the kernels compute, and Fused equals Passes") {
    plsh::PlshOptions options;
    options.near_field = 0;  // the function Passes computes
    options.causal = false;
    options.query_position = kMaxPosition - n;
    options.key_position = kMaxPosition - n;
    problem.plsh(options);
    const Buffer<double> fused = problem.out;
    options.kernel = plsh::Kernel::Passes;
    problem.plsh(options);
    REQUIRE(plsh_test::all_finite(problem.out.view));
    REQUIRE(plsh_test::max_abs_difference(fused.view, problem.out.view) < 1e-12);
  }
}

TEST_CASE("positions: grids and partitions are validated and never walk far",
          "[bounds][positions][partition]") {
  SECTION("grid_block rejects a grid with an infinite shift, a NaN or non-positive pitch") {
    for (const Grid grid : {Grid{3, kInf}, Grid{kNaN, 0}, Grid{0, 0}, Grid{-2, 0}, Grid{3, kNaN}}) {
      INFO("pitch " << grid.pitch << " shift " << grid.shift);
      REQUIRE_THROWS_WITH(plsh::grid_block(grid, 0, 0, 10), Contains("grid_block"));
      REQUIRE_THROWS_WITH(plsh::BlockPartition(grid, 0, 10), Contains("BlockPartition"));
      REQUIRE_THROWS_WITH(plsh::mean_mask(4, {grid}), Contains("mean_mask"));
    }
  }
  SECTION("positions beyond kMaxPosition are rejected") {
    REQUIRE_THROWS_AS(plsh::BlockPartition(Grid{1e300, 5e299}, 0, kIndexMax),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::BlockPartition(Grid{4, 0}, -kMaxPosition - 1, 0),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::grid_block(Grid{4, 0}, kIndexMax - 200, kIndexMax - 300, kIndexMax),
                      std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mean_mask(kMaxPosition + 1, {Grid{4, 0}}), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::laplacian_kernel(kMaxPosition + 1, 1.0), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mask_error(kMaxPosition + 1, 1.0, {Grid{4, 0}}), std::invalid_argument);
  }
  SECTION("a huge pitch or shift gives one block over the whole range, found at once") {
    // In double, (p - shift) / pitch is the same for every p of the range: one bin.
    for (const Grid grid : {Grid{1e300, 5e299}, Grid{2, 1e300}, Grid{2, -1e300}, Grid{1e20, 0.5}}) {
      INFO("pitch " << grid.pitch << " shift " << grid.shift);
      const plsh::BlockPartition partition(grid, -kMaxPosition, kMaxPosition);
      REQUIRE(partition.size() == (grid.pitch == 1e20 ? 2 : 1));
      REQUIRE(plsh::grid_block(grid, kMaxPosition - 1, -kMaxPosition, kMaxPosition).end ==
              kMaxPosition);
    }
  }
  SECTION("blocks equal the bin test on ill-conditioned grids and far positions") {
    // Bin edges computed from shift + k * pitch are off by many positions here; the blocks must
    // still be exactly the runs of equal bin_index.
    const Index width = 3000;
    for (const Grid grid :
         {Grid{3, 1e17}, Grid{2.5, -3e16}, Grid{1000.5, 7e15}, Grid{7.25, 0.5}, Grid{1.5, 1e15}}) {
      for (const Index first : {Index(0), kMaxPosition - width, -kMaxPosition, Index(-1500)}) {
        INFO("pitch " << grid.pitch << " shift " << grid.shift << " first " << first);
        const plsh::BlockPartition partition(grid, first, first + width);
        const std::vector<plsh::Block> expected = blocks_by_bin(grid, first, first + width);
        REQUIRE(partition.size() == static_cast<Index>(expected.size()));
        for (std::size_t b = 0; b < expected.size(); ++b) {
          REQUIRE(partition[static_cast<Index>(b)] == expected[b]);
        }
        // The look-up of KvCache's next blocks, from every position (its hint is off by many
        // positions here, so it searches).
        Index starting_at_mismatches = 0;
        for (const plsh::Block& block : expected) {
          for (Index p = block.begin; p < block.end; ++p) {
            if (plsh::detail::block_starting_at(grid, p, first + width) !=
                plsh::Block{p, block.end}) {
              ++starting_at_mismatches;
            }
          }
        }
        REQUIRE(starting_at_mismatches == 0);
      }
    }
  }
}

TEST_CASE("positions: KvCache stops at kMaxPosition and names its own functions",
          "[bounds][positions][kv_cache]") {
  const Index heads = 2;
  const Index dim = 3;
  plsh::PlshOptions options;
  options.key_position = kIndexMax - 1;
  REQUIRE_THROWS_WITH(
      plsh::KvCache<double>(heads, heads, dim, dim, plsh::alibi_slopes(heads), options),
      Contains("KvCache: options.key_position"));
  options.key_position = kMaxPosition - 3;
  plsh::KvCache<double> cache(heads, heads, dim, dim, plsh::alibi_slopes(heads), options);
  Buffer<double> k(3, heads, dim), v(3, heads, dim), q(3, heads, dim), out(3, heads, dim);
  k.fill_random(4);
  v.fill_random(5);
  q.fill_random(6);
  cache.append(k.in(), v.in());
  cache.attend(q.in(), out.view);
  REQUIRE(cache.position() == kMaxPosition);
  REQUIRE(plsh_test::all_finite(out.view));
  REQUIRE_THROWS_WITH(cache.append(k.in().slice(0, 1), v.in().slice(0, 1)),
                      Contains("KvCache::append") && Contains("kMaxPosition"));
}

TEST_CASE("alibi_slopes bounds the head count", "[bounds][alibi]") {
  for (const Index heads : {Index(1) << 62, Index(1) << 40, plsh::kMaxHeads + 1, kIndexMax}) {
    INFO("heads " << heads);
    REQUIRE_THROWS_WITH(plsh::alibi_slopes(heads), Contains("alibi_slopes: num_heads"));
  }
  const std::vector<double> slopes = plsh::alibi_slopes(plsh::kMaxHeads);
  REQUIRE(static_cast<Index>(slopes.size()) == plsh::kMaxHeads);
  REQUIRE(slopes.front() == Approx(std::pow(2.0, -8.0 / static_cast<double>(plsh::kMaxHeads))));
  REQUIRE(slopes.back() == Approx(std::pow(2.0, -8.0)));
}

TEST_CASE("the scale must be finite and non-zero in the kernel's scalar type", "[bounds][scale]") {
  Problem<float> single;
  Problem<double> twice;
  for (const double scale : {1e300, -1e39, 1e-300}) {
    INFO("scale " << scale);
    plsh::PlshOptions options;
    options.scale = scale;
    REQUIRE_THROWS_WITH(single.plsh(options), Contains("plsh_attention: options.scale"));
    REQUIRE_THROWS_WITH(single.exact(options), Contains("exact_alibi_attention: options.scale"));
    REQUIRE_THROWS_WITH(single.backward(options),
                        Contains("plsh_attention_backward: options.scale"));
    REQUIRE_THROWS_WITH(plsh::KvCache<float>(2, 2, 4, 4, plsh::alibi_slopes(2), options),
                        Contains("KvCache: options.scale"));
    if (std::abs(scale) < 1e308) {
      twice.plsh(options);  // representable as a double
      REQUIRE(plsh_test::all_finite(twice.out.view));
    }
  }
}

TEST_CASE("samples are bounded by kMaxSamples everywhere", "[bounds][samples]") {
  Problem<double> problem;
  for (const Index samples : {plsh::kMaxSamples + 1, Index(1) << 40, kIndexMax, Index(0)}) {
    INFO("samples " << samples);
    plsh::PlshOptions options;
    options.samples = samples;
    REQUIRE_THROWS_WITH(problem.plsh(options), Contains("plsh_attention: options.samples"));
    REQUIRE_THROWS_WITH(problem.backward(options),
                        Contains("plsh_attention_backward: options.samples"));
    REQUIRE_THROWS_WITH(plsh::KvCache<double>(2, 2, 4, 4, plsh::alibi_slopes(2), options),
                        Contains("KvCache: options.samples"));
    REQUIRE_THROWS_WITH(plsh::draw_head_grids({0.5}, samples, 0),
                        Contains("draw_head_grids: samples"));
  }
  REQUIRE_THROWS_AS(plsh::RandomBinning(0.5).draw(kIndexMax), std::invalid_argument);
  plsh::PlshOptions options;
  options.samples = plsh::kMaxSamples;
  problem.plsh(options);
  REQUIRE(plsh_test::all_finite(problem.out.view));
}

TEST_CASE("draw_head_grids: head h, draw t is RandomBinning(slopes[h], head_seed(seed, h))(t)",
          "[bounds][sampler]") {
  const std::vector<double> slopes = {0.5, 0.0, 1.0 / 64, 3.0};
  const std::uint64_t seed = 97;
  const std::vector<std::vector<Grid>> grids = plsh::draw_head_grids(slopes, 7, seed);
  REQUIRE(grids.size() == slopes.size());
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    REQUIRE(grids[h].size() == 7);
    const plsh::RandomBinning sampler(slopes[h], plsh::head_seed(seed, static_cast<Index>(h)));
    for (std::size_t t = 0; t < grids[h].size(); ++t) {
      REQUIRE(grids[h][t].pitch == sampler(t).pitch);
      REQUIRE(grids[h][t].shift == sampler(t).shift);
    }
  }
  REQUIRE_THROWS_WITH(plsh::draw_head_grids({0.5, kNaN}, 3, 0),
                      Contains("draw_head_grids: slopes[1]"));
  REQUIRE(plsh::draw_head_grids({}, 3, 0).empty());
}

TEST_CASE("a slope so steep that the pitch underflows still gives valid one-position blocks",
          "[bounds][sampler]") {
  const double steep = std::numeric_limits<double>::max();
  const plsh::RandomBinning sampler(steep, 5);
  for (std::uint64_t t = 0; t < 1000; ++t) REQUIRE(sampler(t).pitch > 0);
  // Causal, each query alone in its block: the output row is its own value row.
  Problem<double> problem(5, 1, 3);
  plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view,
                               {steep}, plsh::PlshOptions{});
  REQUIRE(plsh_test::max_abs_difference(problem.out.view, problem.v.view) < 1e-15);
}

TEST_CASE("errors name the function the user called", "[bounds][messages]") {
  const std::vector<Grid> grids = plsh::RandomBinning(0.5, 1).draw(3);
  REQUIRE_THROWS_WITH(plsh::mask_error(5, kNaN, grids), Contains("mask_error: slope"));
  REQUIRE_THROWS_WITH(plsh::mask_error(5, 0.5, {}), Contains("mask_error: grids"));
  REQUIRE_THROWS_WITH(plsh::mask_error(5, 0.5, {Grid{kNaN, 0}}), Contains("mask_error: "));
  REQUIRE_THROWS_WITH(plsh::KvCache<double>(2, 2, 4, 4, {0.5}, plsh::PlshOptions{}),
                      Contains("KvCache: slopes.size() (1) must equal heads (2)"));
}

TEST_CASE("view checks do not overflow", "[bounds][views]") {
  Problem<double> problem;
  const Index n = problem.q.view.tokens;
  SECTION("a token stride whose extent overflows") {
    HeadsView<double> out = problem.out.view;
    out.token_stride = kIndexMax / 2 + 1;
    REQUIRE_THROWS_WITH(plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                                     out, problem.slopes()),
                        Contains("plsh_attention: out") && Contains("overflows"));
    HeadsView<const double> q = problem.q.in();
    q.head_stride = kIndexMax / 4;
    REQUIRE_THROWS_WITH(plsh::exact_alibi_attention<double>(q, problem.k.in(), problem.v.in(),
                                                            problem.out.view, problem.slopes()),
                        Contains("exact_alibi_attention: q") && Contains("overflows"));
  }
  SECTION("the default token stride saturates instead of overflowing") {
    const HeadsView<double> huge{problem.out.view.data, 2, Index(1) << 40, Index(1) << 40};
    REQUIRE(huge.token_stride == kIndexMax);
    REQUIRE_THROWS_WITH(plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                                     huge, problem.slopes()),
                        Contains("overflows"));
  }
  SECTION("non-overlapping strided outputs are accepted, overlapping ones rejected") {
    // Heads {0, 2} of a [n][3][d] buffer: head_stride 2d, token_stride 3d.
    const Index heads = problem.out.view.heads;
    const Index d = problem.out.view.dim;
    std::vector<double> storage(static_cast<std::size_t>(n * 3 * d), -7.0);
    const HeadsView<double> strided{storage.data(), n, heads, d, 3 * d, 2 * d};
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), strided,
                                 problem.slopes());
    problem.plsh(plsh::PlshOptions{});
    REQUIRE(plsh_test::max_abs_difference(strided, problem.out.view) == 0.0);
    const HeadsView<double> overlapping{storage.data(), n, heads, d, d, d};
    REQUIRE_THROWS_WITH(plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                                     overlapping, problem.slopes()),
                        Contains("out strides make rows overlap"));
  }
  SECTION("a gradient without tokens is accepted whatever its strides") {
    // Head-major views of no keys have head_stride = tokens * dim = 0: no rows, nothing overlaps.
    const auto head_major = [](Index tokens, Index heads, Index dim) {
      return Buffer<double>(tokens, heads, dim, plsh_test::Layout::HeadMajor);
    };
    Buffer<double> q = head_major(3, 4, 2), k = head_major(0, 2, 2), v = head_major(0, 2, 5);
    Buffer<double> out = head_major(3, 4, 5), dout = head_major(3, 4, 5);
    Buffer<double> dq = head_major(3, 4, 2), dk = head_major(0, 2, 2), dv = head_major(0, 2, 5);
    q.fill_random(1);
    dout.fill_random(2);
    REQUIRE(dk.view.head_stride == 0);
    const std::vector<double> slopes = plsh::alibi_slopes(4);
    plsh::exact_alibi_attention<double>(q.in(), k.in(), v.in(), out.view, slopes);
    REQUIRE_NOTHROW(plsh::exact_alibi_attention_backward<double>(
        q.in(), k.in(), v.in(), out.in(), dout.in(), dq.view, dk.view, dv.view, slopes));
    for (Index t = 0; t < 3; ++t)
      for (Index h = 0; h < 4; ++h)
        for (Index e = 0; e < 2; ++e) REQUIRE(dq.at(t, h, e) == 0.0);
  }
  SECTION("rows_disjoint is exact: it agrees with a pairwise test on every small layout") {
    for (Index tokens = 0; tokens <= 4; ++tokens) {
      for (Index heads = 1; heads <= 4; ++heads) {
        for (Index dim = 1; dim <= 3; ++dim) {
          for (Index ts = 0; ts <= 13; ++ts) {
            for (Index hs = 0; hs <= 13; ++hs) {
              bool disjoint = true;
              for (Index a = 0; a < tokens * heads; ++a) {
                for (Index b = a + 1; b < tokens * heads; ++b) {
                  const Index start_a = (a / heads) * ts + (a % heads) * hs;
                  const Index start_b = (b / heads) * ts + (b % heads) * hs;
                  if (std::abs(start_a - start_b) < dim) disjoint = false;
                }
              }
              const HeadsView<double> view{problem.out.view.data, tokens, heads, dim, ts, hs};
              INFO("tokens " << tokens << " heads " << heads << " dim " << dim << " strides " << ts
                             << ", " << hs);
              REQUIRE(plsh::detail::rows_disjoint(view) == disjoint);
            }
          }
        }
      }
    }
  }
}

TEST_CASE("argument checks that pass allocate nothing", "[bounds][allocations]") {
  Problem<float> problem(5, 4, 8);
  Buffer<float> dout = problem.out, dq = problem.q, dk = problem.k, dv = problem.v;
  const std::vector<double> slopes = problem.slopes();
  plsh::PlshOptions options;
  options.query_position = 40;
  options.key_position = 38;
  const std::vector<std::vector<Grid>> grids = plsh::draw_head_grids(slopes, 4, 0);
  const long before = plsh_test::allocations.load();
  plsh::detail::validate_plsh("plsh_attention", problem.q.in(), problem.k.in(), problem.v.in(),
                              problem.out.view, slopes, options);
  plsh::detail::validate_backward("plsh_attention_backward", problem.q.in(), problem.k.in(),
                                  problem.v.in(), problem.out.in(), dout.in(), dq.view, dk.view,
                                  dv.view, options);
  plsh::detail::validate_slopes("KvCache", slopes, 4, "heads");
  for (const Grid& grid : grids[0]) {
    for (Index p = 0; p < 50; ++p) plsh::grid_block(grid, p, -3, 60);
  }
  REQUIRE(plsh_test::allocations.load() - before == 0);
  plsh::PlshOptions bad = options;
  bad.samples = 0;
  REQUIRE_THROWS_AS(plsh::detail::validate_plsh("plsh_attention", problem.q.in(), problem.k.in(),
                                                problem.v.in(), problem.out.view, slopes, bad),
                    std::invalid_argument);
  // The counter sees the failing check's message.
  REQUIRE(plsh_test::allocations.load() - before > 0);
}

TEST_CASE("Passes visits only the blocks that hold a query, however far the keys are",
          "[bounds][positions]") {
  // The pass kernel walked every block from the first query to the last key: with queries at 0
  // and keys near kMaxPosition, about 2^52 blocks of slope 1. No key shares a block with a query
  // there, so every row is zero, as in the fused kernel.
  plsh_test::Problem<double> problem(plsh_test::Shape{4, 4, 1, 1, 3, 2}, 3);
  plsh_test::Buffer<double> passes = problem.output();
  plsh_test::Buffer<double> fused = problem.output();
  plsh::PlshOptions options;
  options.causal = false;
  options.samples = 4;
  options.near_field = 0;  // the function Passes computes
  options.key_position = plsh::kMaxPosition - 4;
  options.kernel = plsh::Kernel::Passes;
  plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), passes.view, {1.0},
                               options);
  options.kernel = plsh::Kernel::Fused;
  plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), fused.view, {1.0},
                               options);
  for (Index t = 0; t < 4; ++t) {
    for (Index e = 0; e < 2; ++e) {
      CHECK(passes.at(t, 0, e) == 0.0);
      CHECK(fused.at(t, 0, e) == 0.0);
    }
  }
}

}  // namespace test_bounds
