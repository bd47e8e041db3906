// Tests of partition.hpp: BlockPartition tiles [first, last) into the bins of a Grid, agrees with
// block_of, grid_block and a brute-force bin test, is consistent across chunks; dense_mask is the
// block-diagonal co-membership matrix; mean_mask converges to the Laplacian kernel.
//
// The brute-force reference is the definition of a Grid: positions p and q share a block when
// floor((p - shift) / pitch) == floor((q - shift) / pitch), or always when the pitch is infinite.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <iterator>
#include <limits>
#include <stdexcept>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

#include "brute_force.hpp"

namespace test_partition {

namespace {

using plsh::Block;
using plsh::BlockPartition;
using plsh::Grid;
using plsh::Index;

constexpr double kInfinity = std::numeric_limits<double>::infinity();
constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

/// The maximal run of positions of [first, last) that share the bin of `position`, found by
/// walking outwards with the bin test.
Block brute_force_block(const Grid& grid, Index position, Index first, Index last) {
  Index begin = position;
  while (begin > first && same_bin(grid, begin - 1, position)) --begin;
  Index end = position + 1;
  while (end < last && same_bin(grid, end, position)) ++end;
  return Block{begin, end};
}

std::vector<Block> blocks_of(const BlockPartition& partition) {
  std::vector<Block> blocks;
  for (const Block block : partition) blocks.push_back(block);
  return blocks;
}

/// Everything a partition of [first, last) must satisfy, checked against the bin test.
void check_partition(const Grid& grid, Index first, Index last) {
  const BlockPartition partition(grid, first, last);
  INFO("grid pitch " << grid.pitch << ", shift " << grid.shift << ", positions [" << first << ", "
                     << last << ")");
  CHECK(partition.first() == first);
  CHECK(partition.last() == last);
  CHECK(partition.grid().pitch == grid.pitch);
  CHECK(partition.grid().shift == grid.shift);

  const std::vector<Block> blocks = blocks_of(partition);
  REQUIRE(static_cast<Index>(blocks.size()) == partition.size());
  if (first == last) {
    CHECK(partition.size() == 0);
    return;
  }
  REQUIRE(partition.size() >= 1);
  CHECK(blocks.front().begin == first);
  CHECK(blocks.back().end == last);

  // Tiling, iteration order, operator[] and the bins: counted, then checked once per partition.
  Index gaps_or_overlaps = 0;
  Index empty_blocks = 0;
  Index index_mismatches = 0;
  Index split_or_merged = 0;
  for (std::size_t k = 0; k < blocks.size(); ++k) {
    if (blocks[k].size() < 1) ++empty_blocks;
    if (k + 1 < blocks.size() && blocks[k].end != blocks[k + 1].begin) ++gaps_or_overlaps;
    if (partition[static_cast<Index>(k)] != blocks[k]) ++index_mismatches;
    // A block is exactly one bin: its ends are bin changes (or the range ends).
    if (!same_bin(grid, blocks[k].begin, blocks[k].end - 1)) ++split_or_merged;
    if (blocks[k].end < last && same_bin(grid, blocks[k].end - 1, blocks[k].end)) {
      ++split_or_merged;
    }
  }
  CHECK(gaps_or_overlaps == 0);
  CHECK(empty_blocks == 0);
  CHECK(index_mismatches == 0);
  CHECK(split_or_merged == 0);

  // Every position: block_of, grid_block and the brute-force block agree with the tiling, and the
  // block of [p, last) that holds p (block_starting_at) is the rest of p's block.
  Index block_of_mismatches = 0;
  Index grid_block_mismatches = 0;
  Index brute_force_mismatches = 0;
  Index starting_at_mismatches = 0;
  std::size_t k = 0;
  for (Index p = first; p < last; ++p) {
    while (!blocks[k].contains(p)) ++k;
    if (partition.block_of(p) != blocks[k]) ++block_of_mismatches;
    if (plsh::grid_block(grid, p, first, last) != blocks[k]) ++grid_block_mismatches;
    if (brute_force_block(grid, p, first, last) != blocks[k]) ++brute_force_mismatches;
    if (plsh::detail::block_starting_at(grid, p, last) != Block{p, blocks[k].end}) {
      ++starting_at_mismatches;
    }
  }
  CHECK(block_of_mismatches == 0);
  CHECK(grid_block_mismatches == 0);
  CHECK(brute_force_mismatches == 0);
  CHECK(starting_at_mismatches == 0);
}

/// Grids of several slopes, as a kernel would draw them for several heads.
std::vector<Grid> random_grids(Index per_slope) {
  std::vector<Grid> grids;
  Index head = 0;
  for (const double slope : {1.0 / 64, 1.0 / 8, 1.0, 5.0}) {
    for (const Grid& grid :
         plsh::RandomBinning(slope, plsh::head_seed(17, head++)).draw(per_slope)) {
      grids.push_back(grid);
    }
  }
  return grids;
}

}  // namespace

TEST_CASE("BlockPartition tiles [first, last) with the bins of random grids", "[partition]") {
  struct Range {
    Index first;
    Index last;
  };
  const Range ranges[] = {{0, 200}, {37, 311}, {1000003, 1000153}, {5, 5}, {0, 0}, {9, 10}};
  for (const Grid& grid : random_grids(40)) {
    for (const Range& range : ranges) check_partition(grid, range.first, range.last);
  }
}

TEST_CASE("BlockPartition of fixed grids", "[partition]") {
  const Grid grids[] = {plsh::fixed_grid(1),        plsh::fixed_grid(4),
                        plsh::fixed_grid(4, 3),     plsh::fixed_grid(5, -2),
                        plsh::fixed_grid(7, 1000),  plsh::fixed_grid(2.5),
                        plsh::fixed_grid(2.5, 0.7), plsh::fixed_grid(kInfinity)};
  for (const Grid& grid : grids) {
    check_partition(grid, 0, 103);
    check_partition(grid, 21, 64);
  }

  for (const Index size : {1, 3, 4, 16}) {
    for (const double shift : {0.0, 1.0, 2.0, -5.0, 0.25}) {
      const BlockPartition partition(plsh::fixed_grid(static_cast<double>(size), shift), 10, 90);
      const std::vector<Block> blocks = blocks_of(partition);
      INFO("fixed_grid(" << size << ", " << shift << ") on [10, 90)");
      // Bins [shift + k b, shift + (k + 1) b) hold exactly b integers, starting at
      // ceil(shift + k b); only the blocks cut by the range ends are shorter.
      for (std::size_t k = 0; k < blocks.size(); ++k) {
        INFO("block " << k << " = [" << blocks[k].begin << ", " << blocks[k].end << ")");
        if (k > 0 && k + 1 < blocks.size()) CHECK(blocks[k].size() == size);
        CHECK(blocks[k].size() <= size);
        if (k > 0) {
          const double bin = std::floor((static_cast<double>(blocks[k].begin) - shift) /
                                        static_cast<double>(size));
          CHECK(blocks[k].begin ==
                static_cast<Index>(std::ceil(shift + bin * static_cast<double>(size))));
        }
      }
    }
  }

  {
    INFO("block size 2.5 from 0: blocks {0, 1, 2}, {3, 4}, {5, 6, 7}, {8, 9}, ...");
    const BlockPartition partition(plsh::fixed_grid(2.5), 0, 20);
    REQUIRE(partition.size() == 8);
    for (Index k = 0; k < partition.size(); ++k) {
      INFO("block " << k);
      CHECK(partition[k].begin == (k / 2) * 5 + (k % 2) * 3);
      CHECK(partition[k].size() == (k % 2 == 0 ? 3 : 2));
    }
  }
  {
    INFO("block size 1: every position alone");
    const BlockPartition partition(plsh::fixed_grid(1, 0.5), 3, 40);
    CHECK(partition.size() == 37);
    for (const Block block : partition) CHECK(block.size() == 1);
  }
}

TEST_CASE("BlockPartition degenerate ranges and slopes", "[partition]") {
  const Grid grid = plsh::RandomBinning(0.25, 8)(3);
  {
    INFO("first == last: no blocks");
    const BlockPartition empty(grid, 42, 42);
    CHECK(empty.size() == 0);
    CHECK(empty.begin() == empty.end());
    CHECK(empty.first() == 42);
    CHECK(empty.last() == 42);
  }
  {
    INFO("one position: one block of size 1");
    const BlockPartition single(grid, 42, 43);
    REQUIRE(single.size() == 1);
    CHECK(single[0] == Block{42, 43});
    CHECK(single.block_of(42) == Block{42, 43});
  }
  {
    INFO("slope 0: one block holding everything");
    for (const Grid& flat : plsh::RandomBinning(0.0, 1).draw(3)) {
      const BlockPartition partition(flat, 7, 1000);
      REQUIRE(partition.size() == 1);
      CHECK(partition[0] == Block{7, 1000});
      CHECK(plsh::grid_block(flat, 500, 7, 1000) == Block{7, 1000});
    }
  }
  {
    INFO("huge slopes: every block has size 1");
    for (const double slope : {1e6, 1e100, 1e300}) {
      for (const Grid& steep : plsh::RandomBinning(slope, 2).draw(50)) {
        INFO("slope " << slope << ", pitch " << steep.pitch);
        const BlockPartition partition(steep, 0, 100);
        CHECK(partition.size() == 100);
      }
    }
  }
}

TEST_CASE("BlockPartition of a grid with pitch below 1 has blocks of size 1", "[partition]") {
  // A bin [shift + k pitch, shift + (k + 1) pitch) of length pitch <= 1 holds at most one integer,
  // however small the (positive, finite) pitch: RandomBinning draws such pitches for large
  // slopes, down to subnormal ones for slopes near the largest double.
  const double pitches[] = {
      1.0, 0.5, 1e-3, 1e-300, 1e-308, 4e-310, std::numeric_limits<double>::denorm_min()};
  for (const double pitch : pitches) {
    for (const double shift : {0.0, pitch / 3}) {
      const Grid grid{pitch, shift};
      const BlockPartition partition(grid, 0, 64);
      INFO("pitch " << pitch << ", shift " << shift << ": " << partition.size()
                    << " blocks for 64 positions");
      CHECK(partition.size() == 64);
      CHECK(plsh::grid_block(grid, 40, 0, 64) == Block{40, 41});
    }
  }
  for (const double slope : {1e308, std::numeric_limits<double>::max()}) {
    const Grid grid = plsh::RandomBinning(slope, 2)(0);
    const BlockPartition partition(grid, 0, 64);
    INFO("slope " << slope << ", pitch " << grid.pitch << ": " << partition.size()
                  << " blocks for 64 positions");
    CHECK(partition.size() == 64);
  }
}

TEST_CASE("BlockPartition of a chunk is the whole partition cut at the chunk ends", "[partition]") {
  const Index length = 400;
  struct Range {
    Index first;
    Index last;
  };
  const Range chunks[] = {{0, 400}, {1, 399}, {57, 58}, {100, 300}, {133, 134}, {250, 400}};
  for (const Grid& grid : random_grids(25)) {
    const BlockPartition whole(grid, 0, length);
    for (const Range& chunk : chunks) {
      std::vector<Block> expected;
      for (const Block block : whole) {
        const Block cut{std::max(block.begin, chunk.first), std::min(block.end, chunk.last)};
        if (cut.begin < cut.end) expected.push_back(cut);
      }
      const std::vector<Block> actual = blocks_of(BlockPartition(grid, chunk.first, chunk.last));
      INFO("pitch " << grid.pitch << ", shift " << grid.shift << ", chunk [" << chunk.first << ", "
                    << chunk.last << ")");
      CHECK(actual == expected);
    }
  }
}

TEST_CASE("BlockPartition iteration and indexing", "[partition]") {
  const BlockPartition partition(plsh::fixed_grid(3, 1), 0, 11);  // {0}, {1,2,3}, ..., {10}
  REQUIRE(partition.size() == 5);
  const std::vector<Block> expected = {{0, 1}, {1, 4}, {4, 7}, {7, 10}, {10, 11}};
  {
    INFO("operator[] in order");
    for (Index k = 0; k < partition.size(); ++k) {
      CHECK(partition[k] == expected[static_cast<std::size_t>(k)]);
    }
  }
  {
    INFO("range-for, pre- and post-increment, std::distance");
    CHECK(blocks_of(partition) == expected);
    CHECK(std::distance(partition.begin(), partition.end()) == 5);
    BlockPartition::const_iterator it = partition.begin();
    const BlockPartition::const_iterator before = it++;
    CHECK(*before == expected[0]);
    CHECK(*it == expected[1]);
    CHECK(*++it == expected[2]);
    CHECK(std::next(partition.begin(), 4) != partition.end());
    CHECK(std::next(partition.begin(), 5) == partition.end());
    const std::vector<Block> copied(partition.begin(), partition.end());
    CHECK(copied == expected);
  }
  {
    INFO("block_of every position");
    for (Index p = 0; p < 11; ++p) {
      const Block block = partition.block_of(p);
      CHECK(block.contains(p));
      CHECK(block == expected[static_cast<std::size_t>(p == 0 ? 0 : (p - 1) / 3 + 1)]);
    }
  }
}

TEST_CASE("dense_mask is the block-diagonal co-membership matrix", "[partition]") {
  for (const Grid& grid : random_grids(10)) {
    for (const Index first : {0, 29}) {
      const Index last = first + 70;
      const BlockPartition partition(grid, first, last);
      const Eigen::MatrixXd mask = plsh::dense_mask(partition);
      const Eigen::MatrixXf mask_float = plsh::dense_mask<float>(partition);
      INFO("pitch " << grid.pitch << ", shift " << grid.shift << ", first " << first);
      REQUIRE(mask.rows() == 70);
      REQUIRE(mask.cols() == 70);
      Index mismatches = 0;
      for (Index i = 0; i < 70; ++i) {
        for (Index j = 0; j < 70; ++j) {
          const double expected = same_bin(grid, first + i, first + j) ? 1.0 : 0.0;
          if (mask(i, j) != expected) ++mismatches;
          if (mask_float(i, j) != static_cast<float>(expected)) ++mismatches;
        }
      }
      CHECK(mismatches == 0);
      // Row sums are the block sizes.
      for (Index i = 0; i < 70; ++i) {
        CHECK(mask.row(i).sum() == static_cast<double>(partition.block_of(first + i).size()));
      }
    }
  }
  {
    INFO("an empty partition gives a 0 x 0 mask");
    const Eigen::MatrixXd empty = plsh::dense_mask(BlockPartition(plsh::fixed_grid(2), 3, 3));
    CHECK(empty.rows() == 0);
    CHECK(empty.cols() == 0);
  }
}

TEST_CASE("mean_mask averages the dense masks", "[partition]") {
  const Index n = 50;
  const std::vector<Grid> grids = plsh::RandomBinning(0.2, 21).draw(8);
  Eigen::MatrixXd sum = Eigen::MatrixXd::Zero(n, n);
  for (const Grid& grid : grids) sum += plsh::dense_mask(BlockPartition(grid, 0, n));
  {
    INFO("one grid: mean_mask equals dense_mask");
    CHECK(plsh::mean_mask(n, {grids[0]}) == plsh::dense_mask(BlockPartition(grids[0], 0, n)));
  }
  {
    // With s = 8 every partial sum is a multiple of 1/8 below 8: exact in float and double.
    INFO("eight grids: the mean of the masks, exactly, in double and float");
    CHECK(plsh::mean_mask(n, grids) == sum / 8);
    CHECK(plsh::mean_mask<float>(n, grids) == (sum / 8).cast<float>());
  }
  {
    INFO("n = 0 gives a 0 x 0 matrix");
    CHECK(plsh::mean_mask(0, grids).rows() == 0);
  }
}

TEST_CASE("mean_mask converges to laplacian_kernel entrywise", "[partition]") {
  // Entry (i, j) of the mean of s masks is a binomial frequency with mean K_ij = exp(-m|i-j|) and
  // standard error sqrt(K (1 - K) / s). Bonferroni over the n (n - 1) / 2 distinct off-diagonal
  // entries: a two-sided 5-sigma normal tail is 5.7e-7, times 1225 entries < 1e-3 family-wise.
  // With n = 50 and m = 1/16 every K lies in [exp(-49/16), exp(-1/16)], so s K (1 - K) >= 180 and
  // the normal approximation holds. The diagonal is exactly 1 up to the rounding of s additions
  // of 1/s, at most s * eps.
  const Index n = 50;
  const double slope = 1.0 / 16;
  const Index samples = 4000;
  const double z = 5.0;
  const double rounding = static_cast<double>(samples) * std::numeric_limits<double>::epsilon();
  const Eigen::MatrixXd mean =
      plsh::mean_mask(n, plsh::RandomBinning(slope, plsh::head_seed(99, 0)).draw(samples));
  const Eigen::MatrixXd kernel = plsh::laplacian_kernel(n, slope);
  REQUIRE(mean.rows() == n);
  REQUIRE(mean.cols() == n);
  double worst_in_standard_errors = 0;
  for (Index i = 0; i < n; ++i) {
    for (Index j = 0; j < n; ++j) {
      const double k = kernel(i, j);
      const double standard_error = std::sqrt(k * (1 - k) / static_cast<double>(samples));
      const double deviation = std::abs(mean(i, j) - k);
      if (i != j)
        worst_in_standard_errors = std::max(worst_in_standard_errors, deviation / standard_error);
      INFO("entry (" << i << ", " << j << "): mean mask " << mean(i, j) << ", kernel " << k
                     << ", standard error " << standard_error);
      CHECK(deviation <= z * standard_error + rounding);
      CHECK(mean(i, j) == mean(j, i));
    }
  }
  INFO("largest off-diagonal deviation: " << worst_in_standard_errors << " standard errors");
  CHECK(worst_in_standard_errors > 0);
  CHECK(worst_in_standard_errors <= z);
}

TEST_CASE("partition functions reject invalid arguments", "[partition]") {
  const Grid grid = plsh::fixed_grid(4);
  {
    INFO("BlockPartition with first > last");
    REQUIRE_THROWS_AS(BlockPartition(grid, 5, 4), std::invalid_argument);
  }
  {
    INFO("BlockPartition with a pitch <= 0 or NaN");
    REQUIRE_THROWS_AS(BlockPartition(Grid{0.0, 0.0}, 0, 10), std::invalid_argument);
    REQUIRE_THROWS_AS(BlockPartition(Grid{-2.0, 0.0}, 0, 10), std::invalid_argument);
    REQUIRE_THROWS_AS(BlockPartition(Grid{-kInfinity, 0.0}, 0, 10), std::invalid_argument);
    REQUIRE_THROWS_AS(BlockPartition(Grid{kNaN, 0.0}, 0, 10), std::invalid_argument);
  }
  {
    INFO("BlockPartition with a non-finite shift");
    REQUIRE_THROWS_AS(BlockPartition(Grid{4.0, kNaN}, 0, 10), std::invalid_argument);
    REQUIRE_THROWS_AS(BlockPartition(Grid{4.0, kInfinity}, 0, 10), std::invalid_argument);
    REQUIRE_THROWS_AS(BlockPartition(Grid{4.0, -kInfinity}, 0, 10), std::invalid_argument);
  }
  const BlockPartition partition(grid, 10, 30);
  {
    INFO("operator[] outside [0, size())");
    REQUIRE_THROWS_AS(partition[-1], std::invalid_argument);
    REQUIRE_THROWS_AS(partition[partition.size()], std::invalid_argument);
  }
  {
    INFO("block_of outside [first, last)");
    REQUIRE_THROWS_AS(partition.block_of(9), std::invalid_argument);
    REQUIRE_THROWS_AS(partition.block_of(30), std::invalid_argument);
    REQUIRE_THROWS_AS(BlockPartition(grid, 3, 3).block_of(3), std::invalid_argument);
  }
  {
    INFO("grid_block with the position outside [first, last)");
    REQUIRE_THROWS_AS(plsh::grid_block(grid, 9, 10, 30), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::grid_block(grid, 30, 10, 30), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::grid_block(grid, 3, 3, 3), std::invalid_argument);
  }
  {
    INFO("mean_mask with n < 0, no grids, or an invalid grid");
    REQUIRE_THROWS_AS(plsh::mean_mask(-1, {grid}), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mean_mask(8, {}), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mean_mask<float>(8, {}), std::invalid_argument);
    REQUIRE_THROWS_AS(plsh::mean_mask(8, {grid, Grid{0.0, 0.0}}), std::invalid_argument);
  }
}

}  // namespace test_partition
