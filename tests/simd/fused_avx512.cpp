// Tests of the AVX-512 pieces of the fused kernel's walk (attention/online_softmax.hpp). This file
// is compiled only into test_plsh_attention_avx512 (tests/CMakeLists.txt), with the AVX-512 flags,
// next to test_plsh_attention.cpp and test_nonfinite.cpp, which run the whole kernel through them.
//
// LogCountLookup must return the table's entries exactly through either of its branches (permute
// for s < 32, gather beyond).
// counted_weights must give a row's largest weight exactly 1 and masked keys exactly 0.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include <plsh/attention/online_softmax.hpp>

#if !defined(PLSH_FUSED_AVX512)
#error "fused_avx512.cpp needs -mavx512f (tests/CMakeLists.txt)"
#endif

namespace {

using plsh::Index;

std::uint32_t bits_of(float x) {
  std::uint32_t bits = 0;
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

}  // namespace

TEST_CASE("LogCountLookup returns the table's entry for every count, permuted or gathered",
          "[plsh][avx512]") {
  for (const Index max_count :
       {Index{1}, Index{15}, Index{16}, Index{20}, Index{31}, Index{32}, Index{40}, Index{100}}) {
    std::vector<float> table(static_cast<std::size_t>(max_count + 1));
    table[0] = -std::numeric_limits<float>::infinity();
    for (Index c = 1; c <= max_count; ++c) table[static_cast<std::size_t>(c)] = std::log(c + 0.5f);
    const plsh::detail::LogCountLookup lookup(table.data(), max_count);
    alignas(64) std::int32_t counts[16];
    alignas(64) float got[16];
    for (Index c0 = 0; c0 <= max_count; c0 += 16) {
      for (int lane = 0; lane < 16; ++lane) {
        counts[lane] = static_cast<std::int32_t>(std::min<Index>(c0 + lane, max_count));
      }
      _mm512_store_ps(got, lookup(_mm512_load_si512(counts)));
      for (int lane = 0; lane < 16; ++lane) {
        INFO("s = " << max_count << ", count " << counts[lane]);
        CHECK(bits_of(got[lane]) == bits_of(table[static_cast<std::size_t>(counts[lane])]));
      }
    }
  }
}

TEST_CASE("counted_weights: the largest weight is exactly 1, masked keys weigh exactly 0",
          "[plsh][avx512]") {
  const Index samples = 20;
  std::vector<float> table(samples + 1);
  table[0] = -std::numeric_limits<float>::infinity();
  for (Index c = 1; c <= samples; ++c) table[static_cast<std::size_t>(c)] = std::log(float(c));
  const plsh::detail::LogCountLookup lookup(table.data(), samples);
  for (const Index cols : {Index{1}, Index{7}, Index{16}, Index{17}, Index{40}}) {
    // Key 0 alone is visible (count 13); the others are masked, with scores that would win.
    std::vector<float> row(static_cast<std::size_t>(cols), 50.0f);
    std::vector<int> count(static_cast<std::size_t>(cols), 0);
    row[0] = -3.25f;
    count[0] = 13;
    float max = -std::numeric_limits<float>::infinity();
    float sum = 0;
    const float rescale =
        plsh::detail::counted_weights(row.data(), count.data(), cols, cols, lookup, max, sum);
    INFO(cols << " keys");
    CHECK(row[0] == 1.0f);
    CHECK(sum == 1.0f);
    CHECK(max == -3.25f + std::log(13.0f));
    CHECK(rescale == 0.0f);  // e^{-inf - max}: the empty accumulator is scaled by 0
    for (Index c = 1; c < cols; ++c) CHECK(row[static_cast<std::size_t>(c)] == 0.0f);
    // A NaN score on a visible key poisons the row's sum.
    if (cols > 1) {
      row.assign(static_cast<std::size_t>(cols), 1.0f);
      count.assign(static_cast<std::size_t>(cols), 2);
      row[static_cast<std::size_t>(cols - 1)] = std::numeric_limits<float>::quiet_NaN();
      max = -std::numeric_limits<float>::infinity();
      sum = 0;
      plsh::detail::counted_weights(row.data(), count.data(), cols, cols, lookup, max, sum);
      CHECK(std::isnan(sum));
    }
  }
}
