// Tests of the AVX-512 pieces of the fused kernel's walk (attention/online_softmax.hpp). This file
// is compiled into test_simd where the unit tests are built for AVX-512 (tests/CMakeLists.txt,
// PLSH_TEST_AVX512); in that build test_plsh_attention.cpp and test_nonfinite.cpp run the whole
// kernel through these pieces.
//
// LogWeightLookup must return the table's entries exactly through either of its branches (permute
// for s < 32, gather beyond).
// counted_weights must give a row's largest weight exactly 1 and masked keys exactly 0.
// With AVX-512 BF16 (-mavx512bf16): pack_key_panels must put every key's pairs where bf16_scores
// reads them, from bfloat16 rows and from float rows alike, and bf16_scores must be within the
// bound of a float sum of the exact products (sums in double here).

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <random>
#include <type_traits>
#include <vector>

#include <plsh/attention/online_softmax.hpp>
#include <plsh/detail/arch/avx512/bf16_scores.hpp>

#if !defined(PLSH_FUSED_AVX512)
#error "fused_avx512.cpp needs -mavx512f (tests/CMakeLists.txt)"
#endif

namespace {

using plsh::Index;

/// The bit pattern of a float (32 bits) or of a bfloat16 number (16 bits).
template <class Number>
auto bits_of(Number x) {
  std::conditional_t<sizeof(Number) == 4, std::uint32_t, std::uint16_t> bits = 0;
  static_assert(sizeof bits == sizeof x, "a float or a 16-bit number");
  std::memcpy(&bits, &x, sizeof bits);
  return bits;
}

}  // namespace

TEST_CASE("LogWeightLookup returns the table's entry for every count, permuted or gathered",
          "[plsh][avx512]") {
  for (const Index max_count :
       {Index{1}, Index{15}, Index{16}, Index{20}, Index{31}, Index{32}, Index{40}, Index{100}}) {
    std::vector<float> table(static_cast<std::size_t>(max_count + 1));
    table[0] = -std::numeric_limits<float>::infinity();
    for (Index c = 1; c <= max_count; ++c) table[static_cast<std::size_t>(c)] = std::log(c + 0.5f);
    const plsh::detail::LogWeightLookup lookup(table.data(), max_count);
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
  const plsh::detail::LogWeightLookup lookup(table.data(), samples);
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

#if defined(PLSH_DECODE_AVX512_BF16)

namespace {

/// `count` rows of `dim` bfloat16 numbers, `stride` apart (the gaps hold NaN, which must never be
/// read), uniform in [-2, 2] with a few zeros and tiny and huge magnitudes.
std::vector<Eigen::bfloat16> bf16_rows(Index count, Index dim, Index stride, std::uint32_t seed) {
  std::mt19937 generator(seed);
  std::uniform_real_distribution<float> uniform(-2.0f, 2.0f);
  std::vector<Eigen::bfloat16> rows(static_cast<std::size_t>(count * stride),
                                    Eigen::bfloat16(std::numeric_limits<float>::quiet_NaN()));
  for (Index j = 0; j < count; ++j) {
    for (Index e = 0; e < dim; ++e) {
      const float x = uniform(generator);
      const float scaled = e % 7 == 3 ? x * 1e-10f : e % 11 == 5 ? x * 1e15f : x;
      rows[static_cast<std::size_t>(j * stride + e)] = Eigen::bfloat16(e % 13 == 6 ? 0.0f : scaled);
    }
  }
  return rows;
}

}  // namespace

TEST_CASE("pack_key_panels puts pair e of key 16p + l at panel p, row e, lane l",
          "[plsh][avx512]") {
  for (const Index dim : {1, 2, 3, 16, 31, 32, 33, 64, 65}) {
    for (const Index count : {1, 15, 16, 17, 40, 256}) {
      const Index stride = dim + 3;
      const std::vector<Eigen::bfloat16> keys = bf16_rows(count, dim, stride, 7);
      std::vector<float> wide(keys.size());
      for (std::size_t i = 0; i < keys.size(); ++i) wide[i] = static_cast<float>(keys[i]);
      plsh::detail::AlignedVector<std::uint32_t> from_bf16;
      plsh::detail::AlignedVector<std::uint32_t> from_float;
      plsh::detail::avx512::pack_key_panels(keys.data(), count, dim, stride, from_bf16);
      plsh::detail::avx512::pack_key_panels(wide.data(), count, dim, stride, from_float);
      const Index width = plsh::detail::avx512::bf16_pairs(dim);
      const Index panels = (count + 15) / 16;
      REQUIRE(from_bf16.size() == static_cast<std::size_t>(panels * width * 16));
      INFO("dim " << dim << ", " << count << " keys");
      CHECK(from_float == from_bf16);
      Index wrong = 0;
      for (Index p = 0; p < panels; ++p)
        for (Index e = 0; e < width; ++e)
          for (Index l = 0; l < 16; ++l) {
            const Index j = 16 * p + l;
            std::uint32_t expected = 0;
            if (j < count) {
              const auto low = static_cast<std::uint32_t>(
                  bits_of(keys[static_cast<std::size_t>(j * stride + 2 * e)]));
              const std::uint32_t high =
                  2 * e + 1 < dim ? bits_of(keys[static_cast<std::size_t>(j * stride + 2 * e + 1)])
                                  : 0u;
              expected = low | high << 16;
            }
            if (from_bf16[static_cast<std::size_t>((p * width + e) * 16 + l)] != expected) ++wrong;
          }
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("bf16_scores is the scaled dot product within the float summation bound",
          "[plsh][avx512]") {
  // Each product of two bfloat16 numbers is exact in float; the d products are added in float
  // (d roundings at most) and the sum is scaled (one more): |S - s q.k| <= gamma_{d+1} s sum_e
  // |q_e k_e| with gamma_m = m u / (1 - m u), u = 2^-24. The inputs have no denormal product.
  const float scale = 0.3f;
  for (const Index dim : {1, 2, 3, 16, 31, 32, 33, 64, 65}) {
    for (const Index rows : {1, 3, 4, 5, 8, 9, 12, 13}) {
      for (const Index count : {1, 15, 16, 17, 40, 100}) {
        const Index stride = dim + 1;
        const std::vector<Eigen::bfloat16> query = bf16_rows(rows, dim, stride, 11);
        const std::vector<Eigen::bfloat16> keys = bf16_rows(count, dim, dim, 12);
        plsh::detail::AlignedVector<std::uint32_t> pairs;
        plsh::detail::AlignedVector<std::uint32_t> panels;
        plsh::detail::avx512::pack_query_pairs(query.data(), rows, dim, stride, pairs);
        plsh::detail::avx512::pack_key_panels(keys.data(), count, dim, dim, panels);
        const Index ld = count + 5;
        std::vector<float> scores(static_cast<std::size_t>(rows * ld), -7.0f);
        plsh::detail::avx512::bf16_scores(pairs.data(), rows, panels.data(), count,
                                          plsh::detail::avx512::bf16_pairs(dim), scale,
                                          scores.data(), ld);
        const double u = std::ldexp(1.0, -24);
        const double gamma = (dim + 1) * u / (1 - (dim + 1) * u);
        double worst_excess = -1;
        for (Index r = 0; r < rows; ++r) {
          for (Index j = 0; j < count; ++j) {
            double exact = 0;
            double magnitude = 0;
            for (Index e = 0; e < dim; ++e) {
              const double product =
                  static_cast<double>(query[static_cast<std::size_t>(r * stride + e)]) *
                  static_cast<double>(keys[static_cast<std::size_t>(j * dim + e)]);
              exact += product;
              magnitude += std::abs(product);
            }
            const double got = scores[static_cast<std::size_t>(r * ld + j)];
            const double error = std::abs(got - scale * exact);
            worst_excess = std::max(worst_excess, error - gamma * scale * magnitude);
          }
          for (Index j = count; j < ld; ++j) {
            CHECK(scores[static_cast<std::size_t>(r * ld + j)] == -7.0f);  // not written
          }
        }
        INFO("dim " << dim << ", " << rows << " rows, " << count << " keys");
        CHECK(worst_excess <= 0);
      }
    }
  }
}

#endif  // PLSH_DECODE_AVX512_BF16
