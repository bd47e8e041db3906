// Tests of detail/storage.hpp: compute types, conversion of input rows and rounding of output rows.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include <plsh/detail/storage.hpp>

namespace test_storage {

namespace {

using plsh::Index;
using plsh::detail::Compute;

static_assert(std::is_same<Compute<float>, float>::value, "float computes in float");
static_assert(std::is_same<Compute<double>, double>::value, "double computes in double");
static_assert(std::is_same<Compute<Eigen::bfloat16>, float>::value, "bfloat16 computes in float");
static_assert(std::is_same<Compute<const Eigen::half>, float>::value, "half computes in float");
static_assert(plsh::detail::is_storage_type<Eigen::half>, "half is a storage type");
static_assert(!plsh::detail::is_storage_type<int>, "int is not a storage type");

/// Every bit pattern of a 16-bit type converts to the float that Eigen's own conversion gives
/// (NaN to NaN).
template <class Half>
void check_every_pattern() {
  std::vector<Half> values(1 << 16);
  for (std::uint32_t bits = 0; bits < (1u << 16); ++bits) {
    values[bits] = Eigen::numext::bit_cast<Half>(static_cast<std::uint16_t>(bits));
  }
  std::vector<float> converted(values.size());
  plsh::detail::convert_to_compute(values.data(), static_cast<Index>(values.size()),
                                   converted.data());
  Index wrong = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const float expected = static_cast<float>(values[i]);
    const bool same = std::isnan(expected) ? std::isnan(converted[i]) : converted[i] == expected;
    wrong += same ? 0 : 1;
  }
  CHECK(wrong == 0);
}

/// convert_from_compute against static_cast<Half> on floats around every value of the 16-bit
/// type: each pattern of the float's high bits (every sign, exponent and kept fraction, NaN and
/// infinity included) with the dropped low bits 0, 1, just below half, exactly half (the ties),
/// just above half and all ones, and at lengths that leave a tail after 16 values.
template <class Half>
void check_rounding(int dropped_bits) {
  const std::uint32_t half_way = 1u << (dropped_bits - 1);
  const std::uint32_t ones = (1u << dropped_bits) - 1;
  const std::uint32_t low[] = {0, 1, half_way - 1, half_way, half_way + 1, ones};
  std::vector<float> values;
  for (std::uint64_t high = 0; high < (std::uint64_t{1} << (32 - dropped_bits)); ++high) {
    for (std::uint32_t bits : low) {
      values.push_back(
          Eigen::numext::bit_cast<float>(static_cast<std::uint32_t>(high << dropped_bits) | bits));
    }
  }
  values.resize(values.size() - 3);  // a tail shorter than a vector
  std::vector<Half> rounded(values.size());
  plsh::detail::convert_from_compute(values.data(), static_cast<Index>(values.size()),
                                     rounded.data());
  Index wrong = 0;
  for (std::size_t i = 0; i < values.size(); ++i) {
    const auto expected = Eigen::numext::bit_cast<std::uint16_t>(static_cast<Half>(values[i]));
    wrong += Eigen::numext::bit_cast<std::uint16_t>(rounded[i]) == expected ? 0 : 1;
  }
  CHECK(wrong == 0);
}

}  // namespace

TEST_CASE("convert_from_compute rounds as static_cast, bit for bit", "[storage]") {
  check_rounding<Eigen::bfloat16>(16);  // bfloat16 keeps the float's high 16 bits
  check_rounding<Eigen::half>(13);      // half keeps 10 of the float's 23 fraction bits
}

TEST_CASE("convert_to_compute is exact for every bfloat16 and half bit pattern", "[storage]") {
  check_every_pattern<Eigen::bfloat16>();
  check_every_pattern<Eigen::half>();
}

TEST_CASE("compute_rows maps float rows in place and converts bfloat16 rows", "[storage]") {
  // 3 rows of 4 columns in a buffer of stride 6.
  std::vector<float> data(18);
  for (std::size_t i = 0; i < data.size(); ++i) data[i] = 0.5f * static_cast<float>(i) - 3.0f;
  plsh::detail::AlignedVector<float> scratch;
  const plsh::ConstHeadMap<float> rows(data.data(), 3, 4, Eigen::OuterStride<>(6));
  const auto same = plsh::detail::compute_rows<float>(rows, scratch);
  CHECK(same.data() == data.data());
  CHECK(scratch.empty());

  std::vector<Eigen::bfloat16> narrow(data.size());
  for (std::size_t i = 0; i < data.size(); ++i) narrow[i] = Eigen::bfloat16(data[i]);
  const plsh::ConstHeadMap<Eigen::bfloat16> narrow_rows(narrow.data(), 3, 4,
                                                        Eigen::OuterStride<>(6));
  const auto converted = plsh::detail::compute_rows<Eigen::bfloat16>(narrow_rows, scratch);
  REQUIRE(converted.rows() == 3);
  REQUIRE(converted.cols() == 4);
  CHECK(converted.outerStride() == 4);
  for (Index r = 0; r < 3; ++r) {
    for (Index c = 0; c < 4; ++c) {
      INFO("row " << r << ", column " << c);
      // Multiples of 0.5 below 8 are exact in bfloat16.
      CHECK(converted(r, c) == data[static_cast<std::size_t>(r * 6 + c)]);
    }
  }
}

TEST_CASE("OutputRows rounds compute-type rows to nearest even into the output", "[storage]") {
  std::vector<Eigen::half> out(8, Eigen::half(-7.0f));
  plsh::detail::OutputRows<Eigen::half> output;
  // 2 rows of 3 columns in a buffer of stride 4: the fourth column must stay untouched.
  plsh::HeadMap<float> rows =
      output.bind(plsh::HeadMap<Eigen::half>(out.data(), 2, 3, Eigen::OuterStride<>(4)));
  // 1 + 2^-11 is halfway between the halves 1 and 1 + 2^-10: rounds to the even one, 1.
  const float halfway = 1.0f + std::ldexp(1.0f, -11);
  rows << halfway, 2.0f, std::numeric_limits<float>::infinity(), -0.25f, 65504.0f, 1e6f;
  output.store();
  CHECK(static_cast<float>(out[0]) == 1.0f);
  CHECK(static_cast<float>(out[1]) == 2.0f);
  CHECK(std::isinf(static_cast<float>(out[2])));
  CHECK(static_cast<float>(out[3]) == -7.0f);
  CHECK(static_cast<float>(out[4]) == -0.25f);
  CHECK(static_cast<float>(out[5]) == 65504.0f);
  CHECK(std::isinf(static_cast<float>(out[6])));  // 1e6 overflows half
  CHECK(static_cast<float>(out[7]) == -7.0f);

  std::vector<float> same(4, 0.0f);
  plsh::detail::OutputRows<float> direct;
  plsh::HeadMap<float> direct_rows =
      direct.bind(plsh::HeadMap<float>(same.data(), 2, 2, Eigen::OuterStride<>(2)));
  CHECK(direct_rows.data() == same.data());
}

}  // namespace test_storage
