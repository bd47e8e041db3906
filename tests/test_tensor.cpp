// Tests of tensor.hpp: HeadsView strides, construction, const conversion, head() and slice().
//
// Buffers hold their own offsets (data[i] = i), so a value read through a view names the element
// it came from.

#include <catch2/catch.hpp>

#include <numeric>
#include <type_traits>
#include <utility>
#include <vector>

#include <plsh/tensor.hpp>

namespace test_tensor {

namespace {

using plsh::HeadsView;
using plsh::Index;

std::vector<double> offsets(Index size) {
  std::vector<double> data(static_cast<std::size_t>(size));
  std::iota(data.begin(), data.end(), 0.0);
  return data;
}

/// Every element (t, h, e) of `view`, read through head(h), is the buffer element at
/// t * token_stride + h * head_stride + e; the map of head h starts at h * head_stride.
template <class Scalar>
void check_layout(const HeadsView<Scalar>& view) {
  Index wrong_values = 0;
  for (Index h = 0; h < view.heads; ++h) {
    const auto head = view.head(h);
    REQUIRE(head.rows() == view.tokens);
    REQUIRE(head.cols() == view.dim);
    CHECK(head.outerStride() == view.token_stride);
    CHECK(head.innerStride() == 1);
    CHECK(head.data() == view.data + h * view.head_stride);
    for (Index t = 0; t < view.tokens; ++t) {
      for (Index e = 0; e < view.dim; ++e) {
        const Index offset = t * view.token_stride + h * view.head_stride + e;
        if (head(t, e) != view.data[offset]) ++wrong_values;
      }
    }
  }
  CHECK(wrong_values == 0);
}

}  // namespace

namespace overloads {

/// An overload set on the const views of two scalars, as a user's non-template API would have;
/// resolves_overload<T> tells whether `accepts_view(x)` resolves for an argument of type T.
void accepts_view(HeadsView<const float> view);
void accepts_view(HeadsView<const double> view);

template <class T, class = void>
struct resolves_overload : std::false_type {};
template <class T>
struct resolves_overload<T, decltype(accepts_view(std::declval<T>()))> : std::true_type {};

}  // namespace overloads

TEST_CASE("HeadsView default strides describe a packed [tokens][heads][dim] tensor", "[tensor]") {
  std::vector<double> data = offsets(5 * 3 * 4);
  const HeadsView<double> view{data.data(), 5, 3, 4};
  INFO("token_stride = heads * dim, head_stride = dim");
  CHECK(view.data == data.data());
  CHECK(view.tokens == 5);
  CHECK(view.heads == 3);
  CHECK(view.dim == 4);
  CHECK(view.token_stride == 12);
  CHECK(view.head_stride == 4);
  check_layout(view);

  const HeadsView<const float> single{nullptr, 0, 1, 7};
  CHECK(single.token_stride == 7);
  CHECK(single.head_stride == 7);
}

TEST_CASE("HeadsView with explicit strides", "[tensor]") {
  const Index tokens = 6, heads = 3, dim = 5;
  {
    INFO("head-major layout: (t, h, e) at h * tokens * dim + t * dim + e");
    std::vector<double> data = offsets(tokens * heads * dim);
    const HeadsView<double> view{data.data(), tokens, heads, dim, dim, tokens * dim};
    CHECK(view.token_stride == dim);
    CHECK(view.head_stride == tokens * dim);
    check_layout(view);
    CHECK(view.head(2)(4, 1) == 2 * tokens * dim + 4 * dim + 1);
  }
  {
    INFO("token-major with padding: token_stride = heads * dim + 3, head_stride = dim + 1");
    const Index token_stride = heads * (dim + 1) + 3;
    std::vector<double> data = offsets(tokens * token_stride);
    const HeadsView<double> view{data.data(), tokens, heads, dim, token_stride, dim + 1};
    check_layout(view);
    CHECK(view.head(1)(5, 4) == 5 * token_stride + 1 * (dim + 1) + 4);
  }
}

TEST_CASE("HeadsView head() writes through to the buffer", "[tensor]") {
  std::vector<double> data(4 * 2 * 3, 0.0);
  const HeadsView<double> view{data.data(), 4, 2, 3};
  view.head(1).setConstant(7.0);
  view.head(0)(2, 1) = -1.0;
  for (Index t = 0; t < 4; ++t) {
    for (Index h = 0; h < 2; ++h) {
      for (Index e = 0; e < 3; ++e) {
        INFO("element (" << t << ", " << h << ", " << e << ")");
        const double expected = h == 1 ? 7.0 : (t == 2 && e == 1 ? -1.0 : 0.0);
        CHECK(data[static_cast<std::size_t>(t * 6 + h * 3 + e)] == expected);
      }
    }
  }
  INFO("head(h) of a const view is read-only");
  const HeadsView<const double> read_only = view;
  static_assert(!std::is_assignable<decltype(read_only.head(0)(0, 0)), double>::value,
                "a HeadsView<const T> must not allow writes");
  static_assert(std::is_assignable<decltype(view.head(0)(0, 0)), double>::value,
                "a HeadsView<T> allows writes");
  CHECK(read_only.head(1)(3, 2) == 7.0);
}

TEST_CASE("HeadsView<T> converts to HeadsView<const T>", "[tensor]") {
  static_assert(std::is_convertible<HeadsView<float>, HeadsView<const float>>::value,
                "mutable to const view");
  static_assert(!std::is_convertible<HeadsView<const float>, HeadsView<float>>::value,
                "no const to mutable view");
  std::vector<double> data = offsets(4 * 40);
  const HeadsView<double> view{data.data(), 4, 2, 3, 40, 11};
  const HeadsView<const double> converted = view;
  INFO("every member is carried over");
  CHECK(converted.data == data.data());
  CHECK(converted.tokens == 4);
  CHECK(converted.heads == 2);
  CHECK(converted.dim == 3);
  CHECK(converted.token_stride == 40);
  CHECK(converted.head_stride == 11);
  check_layout(converted);
}

TEST_CASE("HeadsView converts only to the const view of the same scalar", "[tensor]") {
  // A conversion operator that is declared for every HeadsView<const U> makes overloads on the
  // const views of different scalars ambiguous for a mutable view.
  {
    INFO("HeadsView<float> must not claim to convert to HeadsView<const double> or <const int>");
    CHECK_FALSE(std::is_convertible<HeadsView<float>, HeadsView<const double>>::value);
    CHECK_FALSE(std::is_convertible<HeadsView<float>, HeadsView<const int>>::value);
    CHECK_FALSE(std::is_convertible<HeadsView<const float>, HeadsView<const double>>::value);
  }
  {
    INFO("accepts_view(HeadsView<const float>) and accepts_view(HeadsView<const double>) resolve");
    CHECK(overloads::resolves_overload<HeadsView<const float>>::value);
    CHECK(overloads::resolves_overload<HeadsView<float>>::value);
    CHECK(overloads::resolves_overload<HeadsView<double>>::value);
    CHECK_FALSE(overloads::resolves_overload<HeadsView<int>>::value);
  }
}

TEST_CASE("HeadsView slice selects a range of tokens", "[tensor]") {
  const Index tokens = 10, heads = 3, dim = 4;
  std::vector<double> data = offsets(tokens * heads * dim);
  for (const bool head_major : {false, true}) {
    const HeadsView<double> view =
        head_major ? HeadsView<double>{data.data(), tokens, heads, dim, dim, tokens * dim}
                   : HeadsView<double>{data.data(), tokens, heads, dim};
    for (const Index begin : {0, 3, 9}) {
      for (const Index count : {Index{0}, Index{1}, tokens - begin}) {
        const HeadsView<double> slice = view.slice(begin, count);
        INFO((head_major ? "head-major" : "token-major")
             << " slice(" << begin << ", " << count << ")");
        CHECK(slice.data == view.data + begin * view.token_stride);
        CHECK(slice.tokens == count);
        CHECK(slice.heads == heads);
        CHECK(slice.dim == dim);
        CHECK(slice.token_stride == view.token_stride);
        CHECK(slice.head_stride == view.head_stride);
        Index mismatches = 0;
        for (Index h = 0; h < heads; ++h) {
          for (Index t = 0; t < count; ++t) {
            for (Index e = 0; e < dim; ++e) {
              if (slice.head(h)(t, e) != view.head(h)(begin + t, e)) ++mismatches;
            }
          }
        }
        CHECK(mismatches == 0);
      }
    }
  }
  INFO("slice of a const view, and a slice of a slice");
  const HeadsView<const double> read_only = HeadsView<double>{data.data(), tokens, heads, dim};
  const HeadsView<const double> inner = read_only.slice(2, 6).slice(1, 3);
  CHECK(inner.tokens == 3);
  CHECK(inner.data == data.data() + 3 * heads * dim);
  CHECK(inner.head(2)(1, 3) == (3 + 1) * heads * dim + 2 * dim + 3);
}

}  // namespace test_tensor
