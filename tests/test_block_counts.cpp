// Tests of attention/block_counts.hpp: BlockCounts' counts c_ij and their logarithms on every
// chunk of keys against the counts from each draw's grid_block, for narrow and wide unions
// (prefix sums of a difference vector and direct additions).

#include <catch2/catch.hpp>

#include <cmath>
#include <limits>
#include <vector>

#include <plsh/attention/block_counts.hpp>
#include <plsh/attention/fused_rows.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

namespace test_block_counts {

namespace {

using plsh::Index;

}  // namespace

TEST_CASE("BlockCounts adds log c_ij on every chunk, for narrow and wide unions",
          "[plsh][counts]") {
  const Index samples = 9;
  // Steep slope: unions of a few keys, many short runs (the counts as prefix sums of a
  // difference vector). Shallow: unions far wider than kFusedKeyTile, few long runs (added on
  // their keys directly).
  for (const double slope : {0.3, 0.004}) {
    for (const bool causal : {true, false}) {
      const std::vector<plsh::Grid> grids = plsh::RandomBinning(slope, 7).draw(samples);
      const Index key_begin = 5;
      const Index key_end = 1500;
      const plsh::detail::PositionRange range{0, 1600};
      const Index first = 700;
      const Index rows = 16;
      plsh::detail::BlockCounts<double> counts;
      const plsh::Block keys =
          counts.prepare(grids, range, first, rows, key_begin, key_end, causal,
                         plsh::detail::Estimator(slope, samples, 0, range.last - range.first));
      INFO("slope " << slope << (causal ? " causal" : " bidirectional") << " union [" << keys.begin
                    << ", " << keys.end << ")");
      CHECK((keys.size() > plsh::detail::kFusedKeyTile) == (slope < 0.01));
      // Chunks as the backward's key tiles make them: starting before the union, 100 wide.
      std::vector<double> storage(static_cast<std::size_t>(rows * 100));
      Index seen = 0;
      for (Index c0 = keys.begin - 30; c0 < keys.end + 30; c0 += 100) {
        Eigen::Map<plsh::RowMatrix<double>> scores(storage.data(), rows, 100);
        scores.setZero();
        counts.add_log_weights(scores, c0);
        for (Index r = 0; r < rows; ++r) {
          const Index i = first + r;
          for (Index c = 0; c < 100; ++c) {
            const Index j = c0 + c;
            int count = 0;
            if (j >= key_begin && j < key_end && (!causal || j <= i)) {
              for (const plsh::Grid& grid : grids) {
                count += plsh::grid_block(grid, i, range.first, range.last).contains(j) ? 1 : 0;
              }
            }
            const double expected =
                count == 0 ? -std::numeric_limits<double>::infinity() : std::log(double(count));
            INFO("row " << r << " key " << j);
            REQUIRE(scores(r, c) == expected);
            seen += count > 0 ? 1 : 0;
          }
        }
      }
      CHECK(seen > 0);
    }
  }
}

}  // namespace test_block_counts
