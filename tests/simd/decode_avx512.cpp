// Tests of detail/decode_simd.hpp, the AVX-512 products of KvCache's single-query path. This file
// is compiled into test_simd where the unit tests are built for AVX-512 (tests/CMakeLists.txt,
// PLSH_TEST_AVX512); in that build the KvCache tests (test_kv_cache*.cpp) run through these
// products too.
//
// Each product is compared with its definition summed in double, over every count of keys from 1
// to past two blocks of 16, and sizes that leave every kind of tail (1, 15, 16, 17, 31, 32, 33, 64
// and 100 entries). Bounds: a float sum of n products errs by at most about n u sum|terms|
// (u = 2^-24); the products of two bfloat16 numbers are exact in float. The maximum the score
// products return is compared with the scores they wrote, exactly. exp_counts is compared with
// the counts computed one key at a time times the exponential in double.
//
// The near field: avx512::near_log_weights against its definition Estimator::log_near_weight, each
// lane equal to the scalar form rounded to float (the scalar form may be contracted into one fused
// multiply-add or not, the vector form is one: the two differ by at most one rounding in double,
// which changes the float only for the rare value within 2^-29 of a float's rounding boundary,
// and none of these inputs is one, contracted or not); the scores with a near
// field against the same scores without it plus those weights, for every place of the first near
// key (before the keys, inside them, at their end, past them); exp_counts with near keys against
// the exponential alone for them.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <plsh/detail/decode_simd.hpp>

#include "../fill.hpp"

#if !defined(PLSH_DECODE_AVX512)
#error "decode_avx512.cpp needs -mavx512f -mavx512bw -mavx512vl (tests/CMakeLists.txt)"
#endif

namespace {

using plsh::Index;
namespace avx512 = plsh::detail::avx512;

constexpr double kFloatRoundoff = 0x1p-24;
const std::vector<Index> kSizes = {1, 15, 16, 17, 31, 32, 33, 64, 100};

/// `count` rows of `size` entries, `stride` apart (the gap holds NaN, which must never be read),
/// uniform in [-1, 1], rounded to Storage.
template <class Storage>
std::vector<Storage> rows(Index count, Index size, Index stride, std::uint64_t seed) {
  const std::vector<float> uniform =
      plsh_test::uniform_values<float>(static_cast<std::size_t>(count * stride), seed);
  std::vector<Storage> result(static_cast<std::size_t>(count * stride));
  for (Index j = 0; j < count; ++j) {
    for (Index d = 0; d < stride; ++d) {
      const std::size_t i = static_cast<std::size_t>(j * stride + d);
      result[i] = d < size ? static_cast<Storage>(uniform[i]) : static_cast<Storage>(NAN);
    }
  }
  return result;
}

/// \f$\sum_i a_i b_i\f$ in double, and \f$\sum_i |a_i b_i|\f$: `n` terms, `b` read every
/// `b_step` entries.
struct ExactSum {
  double value = 0;
  double magnitude = 0;
};

template <class A, class B>
ExactSum exact_dot(const A* a, const B* b, Index n, Index b_step) {
  ExactSum sum;
  for (Index i = 0; i < n; ++i) {
    const double term = static_cast<double>(a[i]) * static_cast<double>(b[i * b_step]);
    sum.value += term;
    sum.magnitude += std::abs(term);
  }
  return sum;
}

/// `compute(keys, count, dim, stride, query, out)` must write `scale` times the dot products of
/// the query with `count` key rows into out[0, count) and nothing past them, and return their
/// maximum; `roundings` beyond the dim of the sum (the scale's multiplication) widen the bound by
/// one u each.
template <class Storage, class Query, class Compute>
void check_scores(std::uint64_t seed, double scale, Index roundings, Compute&& compute) {
  for (const Index dim : kSizes) {
    const Index stride = dim + 3;
    for (Index count = 1; count <= 40; ++count) {
      const std::vector<Storage> keys = rows<Storage>(count, dim, stride, seed + count);
      const std::vector<Query> query = rows<Query>(1, dim, dim, seed + 1000 + dim);
      std::vector<float> scores(static_cast<std::size_t>(count) + 1, -7.0f);
      const float max = compute(keys.data(), count, dim, stride, query.data(), scores.data());
      INFO("dim " << dim << ", count " << count << ": the maximum returned");
      CHECK(max == *std::max_element(scores.begin(), scores.begin() + count));
      for (Index j = 0; j < count; ++j) {
        const ExactSum exact =
            exact_dot(query.data(), &keys[static_cast<std::size_t>(j * stride)], dim, 1);
        INFO("dim " << dim << ", count " << count << ", key " << j);
        CHECK(std::abs(scores[static_cast<std::size_t>(j)] - scale * exact.value) <=
              static_cast<double>(dim + roundings) * kFloatRoundoff * scale * exact.magnitude +
                  1e-30);
      }
      INFO("dim " << dim << ", count " << count << ": nothing written past the last key");
      CHECK(scores[static_cast<std::size_t>(count)] == -7.0f);
    }
  }
}

template <class Storage>
void check_weighted_sum(std::uint64_t seed) {
  for (const Index value_dim : kSizes) {
    const Index stride = value_dim + 5;
    for (Index count = 1; count <= 40; ++count) {
      const std::vector<Storage> values = rows<Storage>(count, value_dim, stride, seed + count);
      const std::vector<float> weights =
          plsh_test::uniform_values<float>(static_cast<std::size_t>(count), seed + 77 + count);
      std::vector<float> out(static_cast<std::size_t>(value_dim) + 1, -7.0f);
      avx512::weighted_sum(values.data(), count, value_dim, stride, weights.data(), out.data());
      for (Index c = 0; c < value_dim; ++c) {
        const ExactSum exact =
            exact_dot(weights.data(), &values[static_cast<std::size_t>(c)], count, stride);
        INFO("value_dim " << value_dim << ", count " << count << ", column " << c);
        CHECK(std::abs(out[static_cast<std::size_t>(c)] - exact.value) <=
              static_cast<double>(count + 1) * kFloatRoundoff * exact.magnitude + 1e-30);
      }
      INFO("value_dim " << value_dim << ", count " << count << ": nothing written past the end");
      CHECK(out[static_cast<std::size_t>(value_dim)] == -7.0f);
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("avx512::scores equals the dot products summed in double", "[simd]", float,
                   Eigen::bfloat16, Eigen::half) {
  check_scores<TestType, float>(100, 1.0, 0,
                                [](auto... arguments) { return avx512::scores(arguments...); });
}

TEMPLATE_TEST_CASE("avx512::weighted_sum equals the weighted sum in double", "[simd]", float,
                   Eigen::bfloat16, Eigen::half) {
  check_weighted_sum<TestType>(200);
}

#if defined(PLSH_DECODE_AVX512_BF16)
TEST_CASE("avx512::scores_bf16 (vdpbf16ps) equals the scaled dot products", "[simd][bf16]") {
  const float scale = 0.3f;
  check_scores<Eigen::bfloat16, Eigen::bfloat16>(
      300, scale, 1,
      [&](const Eigen::bfloat16* keys, Index count, Index dim, Index stride,
          const Eigen::bfloat16* query,
          float* out) { return avx512::scores_bf16(keys, count, dim, stride, query, scale, out); });
}
#else
TEST_CASE("avx512::scores_bf16 needs AVX-512 BF16", "[simd][bf16]") {
  WARN("skipped: this build has no AVX-512 BF16 (bfloat16 keys are widened in registers)");
}
#endif

TEST_CASE("avx512::scores passes over NaN scores in its maximum", "[simd]") {
  const Index dim = 16;
  std::vector<float> keys(static_cast<std::size_t>(3 * dim), 0.0f);
  keys[0] = 2.0f;                                   // score 2
  keys[static_cast<std::size_t>(dim)] = NAN;        // score NaN
  keys[static_cast<std::size_t>(2 * dim)] = -1.0f;  // score -1
  std::vector<float> query(static_cast<std::size_t>(dim), 0.0f);
  query[0] = 1.0f;
  std::vector<float> scores(3);
  CHECK(avx512::scores(keys.data(), 3, dim, dim, query.data(), scores.data()) == 2.0f);
  CHECK(std::isnan(scores[1]));
  keys[0] = NAN;
  CHECK(avx512::scores(keys.data(), 2, dim, dim, query.data(), scores.data()) ==
        -std::numeric_limits<float>::infinity());
}

TEST_CASE("avx512::exp_counts weighs each exponential by the number of block starts reached",
          "[simd]") {
  // Starts before, inside and after the keys' positions, repeated starts, and none inside.
  const std::vector<std::vector<Index>> begin_lists = {{1000},
                                                       {980, 990, 1000},
                                                       {1000, 1000, 1003, 1017, 1017, 1040},
                                                       {1001, 1005, 1016, 1033},
                                                       {900, 1100, 1200}};
  const Index first = 1000;
  for (const auto& begins : begin_lists) {
    for (Index count = 1; count <= 40; ++count) {
      // Scores in [-8, 8]: exponentials from e^-16 to 1 after the shift by the maximum.
      std::vector<float> weights = plsh_test::uniform_values<float>(
          static_cast<std::size_t>(count), 500 + static_cast<std::uint64_t>(count), 8.0);
      const std::vector<float> scores = weights;
      const float max = *std::max_element(scores.begin(), scores.end());
      const float sum = avx512::exp_counts(weights.data(), count, first, begins.data(),
                                           static_cast<Index>(begins.size()), max);
      double exact_sum = 0;
      for (Index j = 0; j < count; ++j) {
        const auto reached = std::count_if(begins.begin(), begins.end(),
                                           [&](Index begin) { return begin <= first + j; });
        const double shifted = static_cast<double>(scores[static_cast<std::size_t>(j)] - max);
        const double expected = static_cast<double>(reached) * std::exp(shifted);
        // The shifted score x is one rounding (|x| u / 2 relative in e^x), Eigen's exp is within
        // a few units in the last place and the product by the count is one more rounding:
        // (4 + |x|) u relative in all.
        INFO("begins from " << begins.front() << ", count " << count << ", key " << j);
        CHECK(std::abs(weights[static_cast<std::size_t>(j)] - expected) <=
              (4.0 + std::abs(shifted)) * kFloatRoundoff * expected);
        exact_sum += expected;
      }
      CHECK(std::abs(sum - exact_sum) <=
            (static_cast<double>(count) + 4.0 + 16.0) * kFloatRoundoff * exact_sum);
    }
  }
}

namespace {

/// Slopes of the near-field tests: powers of two, others whose products with a distance round in
/// double, zero (every key near) and a steep one.
const std::vector<double> kNearSlopes = {1.0 / 256, 0.3, 1e-4 * 3.14159, 0.0, 3.0, 0.0421};

/// `near` for the query at `position`, with its near keys from `first` on, s = `samples`.
plsh::detail::DecodeNear near_field(Index first, Index position, double slope, Index samples) {
  plsh::detail::DecodeNear near;
  near.first = first;
  near.position = position;
  // The near field's threshold does not matter here: `first` says which keys are near.
  near.estimator = plsh::detail::Estimator(slope, samples, 0.05, position);
  return near;
}

}  // namespace

TEST_CASE("avx512::near_log_weights is Estimator::log_near_weight rounded to float",
          "[simd][near]") {
  // Distances from 0 to past 2000, at positions near 0 and far from it.
  for (const double slope : kNearSlopes) {
    for (const Index samples : {Index{1}, Index{20}, Index{100}, Index{7}}) {
      for (const Index position : {Index{2047}, Index{1} << 40}) {
        const plsh::detail::DecodeNear near = near_field(0, position, slope, samples);
        for (Index key = position - 2047; key <= position - 15; key += 13) {
          alignas(64) float lanes[16];
          _mm512_store_ps(lanes, avx512::near_log_weights(near, key));
          for (Index l = 0; l < 16; ++l) {
            const float expected = static_cast<float>(near.log_weight(key + l));
            INFO("slope " << slope << ", s = " << samples << ", distance " << position - key - l
                          << ": " << lanes[l] << " against " << expected);
            CHECK(lanes[l] == expected);
          }
        }
      }
    }
  }
}

TEMPLATE_TEST_CASE("avx512::scores with a near field adds the near keys' log weights",
                   "[simd][near]", float, Eigen::bfloat16, Eigen::half) {
  const Index dim = 64;
  const Index position = 5000;  // of the first key
  for (const double slope : kNearSlopes) {
    for (Index count = 1; count <= 40; ++count) {
      const std::vector<TestType> keys = rows<TestType>(count, dim, dim + 3, 700 + count);
      const std::vector<float> query = rows<float>(1, dim, dim, 701);
      std::vector<float> plain(static_cast<std::size_t>(count));
      avx512::scores(keys.data(), count, dim, dim + 3, query.data(), plain.data());
      for (const Index near_from :
           {Index{-5}, Index{0}, Index{1}, count / 2, count - 1, count, count + 3}) {
        const plsh::detail::DecodeNear near =
            near_field(position + near_from, position + count + 2, slope, 20);
        std::vector<float> logits(static_cast<std::size_t>(count) + 1, -7.0f);
        const float max = avx512::scores(keys.data(), count, dim, dim + 3, query.data(),
                                         logits.data(), position, near);
        INFO("slope " << slope << ", count " << count << ", near from key " << near_from);
        CHECK(max == *std::max_element(logits.begin(), logits.begin() + count));
        CHECK(logits[static_cast<std::size_t>(count)] == -7.0f);
        for (Index j = 0; j < count; ++j) {
          const float raw = plain[static_cast<std::size_t>(j)];
          const float got = logits[static_cast<std::size_t>(j)];
          INFO("key " << j);
          if (j < near_from) {
            CHECK(got == raw);
          } else {
            CHECK(got == raw + static_cast<float>(near.log_weight(position + j)));
          }
        }
      }
    }
  }
}

#if defined(PLSH_DECODE_AVX512_BF16)
TEST_CASE("avx512::scores_bf16 with a near field adds the near keys' log weights",
          "[simd][near][bf16]") {
  const Index dim = 64;
  const Index position = 300;
  const float scale = 0.125f;
  for (Index count = 1; count <= 40; ++count) {
    const std::vector<Eigen::bfloat16> keys = rows<Eigen::bfloat16>(count, dim, dim, 800 + count);
    const std::vector<Eigen::bfloat16> query = rows<Eigen::bfloat16>(1, dim, dim, 801);
    std::vector<float> plain(static_cast<std::size_t>(count));
    avx512::scores_bf16(keys.data(), count, dim, dim, query.data(), scale, plain.data());
    for (const Index near_from : {Index{0}, count / 3, count - 1, count}) {
      const plsh::detail::DecodeNear near =
          near_field(position + near_from, position + count - 1, 0.3, 100);
      std::vector<float> logits(static_cast<std::size_t>(count) + 1, -7.0f);
      const float max = avx512::scores_bf16(keys.data(), count, dim, dim, query.data(), scale,
                                            logits.data(), position, near);
      INFO("count " << count << ", near from key " << near_from);
      CHECK(max == *std::max_element(logits.begin(), logits.begin() + count));
      CHECK(logits[static_cast<std::size_t>(count)] == -7.0f);
      for (Index j = 0; j < count; ++j) {
        const float raw = plain[static_cast<std::size_t>(j)];
        INFO("key " << j);
        CHECK(logits[static_cast<std::size_t>(j)] ==
              (j < near_from ? raw : raw + static_cast<float>(near.log_weight(position + j))));
      }
    }
  }
}
#endif

TEST_CASE("avx512::exp_counts takes the near keys' weights from their logits", "[simd][near]") {
  // Starts before, among the counted keys and among the near keys (which must not count).
  const std::vector<std::vector<Index>> begin_lists = {
      {1000}, {990, 1003, 1017, 1017, 1030, 1039}, {1001, 1005, 1016, 1033}};
  const Index first = 1000;
  for (const auto& begins : begin_lists) {
    for (Index count = 1; count <= 40; ++count) {
      for (const Index near_from : {Index{0}, Index{1}, count / 2, Index{16}, count - 1, count}) {
        if (near_from > count) continue;
        std::vector<float> weights = plsh_test::uniform_values<float>(
            static_cast<std::size_t>(count), 900 + static_cast<std::uint64_t>(count), 8.0);
        const std::vector<float> logits = weights;
        const float max = *std::max_element(logits.begin(), logits.end());
        const float sum = avx512::exp_counts(weights.data(), count, first, begins.data(),
                                             static_cast<Index>(begins.size()), max, near_from);
        double exact_sum = 0;
        for (Index j = 0; j < count; ++j) {
          const auto reached = j < near_from
                                   ? std::count_if(begins.begin(), begins.end(),
                                                   [&](Index begin) { return begin <= first + j; })
                                   : 1;
          const double shifted = static_cast<double>(logits[static_cast<std::size_t>(j)] - max);
          const double expected = static_cast<double>(reached) * std::exp(shifted);
          INFO("begins from " << begins.front() << ", count " << count << ", near from "
                              << near_from << ", key " << j);
          CHECK(std::abs(weights[static_cast<std::size_t>(j)] - expected) <=
                (4.0 + std::abs(shifted)) * kFloatRoundoff * expected);
          exact_sum += expected;
        }
        CHECK(std::abs(sum - exact_sum) <=
              (static_cast<double>(count) + 4.0 + 16.0) * kFloatRoundoff * exact_sum);
      }
    }
  }
}
