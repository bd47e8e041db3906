// Prints RandomBinning draws as hex floats: the pitch and shift of a few (slope, seed, index)
// triples, and the grids of the 8 standard ALiBi heads (head h, draw t: RandomBinning(slopes[h],
// head_seed(seed, h))(t), as every kernel draws them) for two seeds, s = 20.
//
// The draws go through std::log and double arithmetic only. The ctest tests draws_golden and
// draws_other_compiler compare this output byte for byte with tests/draws/golden.txt, built with
// the configured compiler and with the other of g++ / clang++: equal output means the two
// compilers and this C library's log give the same partitions.
#include <plsh/alibi.hpp>
#include <plsh/sampler.hpp>

#include <cstdint>
#include <cstdio>
#include <vector>

namespace {

void print(const char* label, double slope, std::uint64_t seed, std::uint64_t index,
           const plsh::Grid& grid) {
  std::printf("%s slope=%a seed=%llu index=%llu pitch=%a shift=%a\n", label, slope,
              static_cast<unsigned long long>(seed), static_cast<unsigned long long>(index),
              grid.pitch, grid.shift);
}

}  // namespace

int main() {
  const double slopes[] = {1.0, 0.5, 1.0 / 16, 1.0 / 256, 0.3, 1e-3, 7.25};
  const std::uint64_t seeds[] = {0, 1, 2026, (std::uint64_t{1} << 63) + 5};
  const std::uint64_t indices[] = {0, 1, 2, 19, 1000, std::uint64_t{1} << 40};
  for (const double slope : slopes)
    for (const std::uint64_t seed : seeds)
      for (const std::uint64_t index : indices) {
        print("draw", slope, seed, index, plsh::RandomBinning(slope, seed)(index));
      }
  const std::vector<double> heads = plsh::alibi_slopes(8);
  for (const std::uint64_t seed : {std::uint64_t{0}, std::uint64_t{2026}})
    for (plsh::Index h = 0; h < 8; ++h) {
      const std::uint64_t head_seed = plsh::head_seed(seed, h);
      const plsh::RandomBinning sampler(heads[static_cast<std::size_t>(h)], head_seed);
      for (std::uint64_t t = 0; t < 20; ++t) {
        print("head", heads[static_cast<std::size_t>(h)], head_seed, t, sampler(t));
      }
    }
  return 0;
}
