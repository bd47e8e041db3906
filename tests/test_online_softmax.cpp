// Tests of attention/online_softmax.hpp: the streaming softmax over key tiles and the log-sum-exp
// merge of partial attention results, against a one-shot softmax written from the definition.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <ios>
#include <limits>
#include <vector>

#include <plsh/attention/online_softmax.hpp>
#include <plsh/detail/random.hpp>

namespace test_online_softmax {

namespace {

using plsh::Index;
template <class Scalar>
using Matrix = plsh::RowMatrix<Scalar>;
template <class Scalar>
using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;

constexpr double kInfinity = std::numeric_limits<double>::infinity();

/// rows x cols matrix with entries offset + amplitude * (2U - 1), U from CounterRandom(seed).
Matrix<double> random_matrix(Index rows, Index cols, std::uint64_t seed, double amplitude = 1.0,
                             double offset = 0.0) {
  const plsh::detail::CounterRandom random(seed);
  Matrix<double> result(rows, cols);
  for (Index r = 0; r < rows; ++r)
    for (Index c = 0; c < cols; ++c)
      result(r, c) =
          offset + amplitude * (2.0 * random.unit(static_cast<std::uint64_t>(r * cols + c), 0) - 1);
  return result;
}

/// The definition, row by row: \f$o = \sum_j e^{s_j - \mu} v_j / \sum_j e^{s_j - \mu}\f$ and
/// \f$\mathrm{lse} = \mu + \log \sum_j e^{s_j - \mu}\f$ with \f$\mu = \max_j s_j\f$, in long
/// double. A row whose logits are all \f$-\infty\f$ gets zeros and \f$-\infty\f$.
void one_shot_softmax(const Matrix<double>& logits, const Matrix<double>& values,
                      Matrix<double>& out, Vector<double>& lse) {
  out.setZero(logits.rows(), values.cols());
  lse.setConstant(logits.rows(), -kInfinity);
  for (Index r = 0; r < logits.rows(); ++r) {
    const long double max_logit = logits.row(r).maxCoeff();
    if (max_logit == -kInfinity) continue;
    long double total = 0;
    std::vector<long double> sum(static_cast<std::size_t>(values.cols()), 0.0L);
    for (Index j = 0; j < logits.cols(); ++j) {
      const long double weight = std::exp(static_cast<long double>(logits(r, j)) - max_logit);
      total += weight;
      for (Index e = 0; e < values.cols(); ++e)
        sum[static_cast<std::size_t>(e)] += weight * values(j, e);
    }
    for (Index e = 0; e < values.cols(); ++e)
      out(r, e) = static_cast<double>(sum[static_cast<std::size_t>(e)] / total);
    lse[r] = static_cast<double>(max_logit + std::log(total));
  }
}

/// Streams the key columns through OnlineSoftmax<Scalar> in tiles of the given widths.
template <class Scalar>
void streamed_softmax(const Matrix<double>& logits, const Matrix<double>& values,
                      const std::vector<Index>& tile_widths, Matrix<Scalar>& out,
                      Vector<Scalar>& lse) {
  plsh::OnlineSoftmax<Scalar> softmax;
  softmax.reset(logits.rows(), values.cols());
  Index begin = 0;
  for (const Index width : tile_widths) {
    Matrix<Scalar> tile = logits.middleCols(begin, width).cast<Scalar>();
    const Matrix<Scalar> tile_values = values.middleRows(begin, width).cast<Scalar>();
    softmax.update(tile, tile_values);
    begin += width;
  }
  REQUIRE(begin == logits.cols());
  out.resize(logits.rows(), values.cols());
  lse.resize(logits.rows());
  softmax.finish(out, lse.data());
}

/// \f$\max |a - b|\f$ where equal infinities count as 0; NaN gives infinity.
template <class A, class B>
double max_abs_difference(const A& a, const B& b) {
  double largest = 0;
  for (Index i = 0; i < a.size(); ++i) {
    const double x = static_cast<double>(a.data()[i]);
    const double y = static_cast<double>(b.data()[i]);
    if (std::isnan(x) || std::isnan(y)) return kInfinity;
    if (x == y) continue;  // also equal infinities
    largest = std::max(largest, std::abs(x - y));
  }
  return largest;
}

template <class A>
bool has_nan(const A& a) {
  for (Index i = 0; i < a.size(); ++i)
    if (std::isnan(a.data()[i])) return true;
  return false;
}

/// A partial attention result over the key columns `[begin, begin + count)`.
struct Partial {
  Matrix<double> out;
  Vector<double> lse;
};

Partial partial_over(const Matrix<double>& logits, const Matrix<double>& values, Index begin,
                     Index count) {
  Partial partial;
  one_shot_softmax(logits.middleCols(begin, count), values.middleRows(begin, count), partial.out,
                   partial.lse);
  return partial;
}

}  // namespace

TEST_CASE("OnlineSoftmax over several key tiles equals a one-shot softmax", "[online_softmax]") {
  // 6 rows, 37 keys: rows 0-2 all visible, row 3 with masked keys in every tile, row 4 with only
  // the last key visible, row 5 with no visible key at all.
  Matrix<double> logits = random_matrix(6, 37, 11, 4.0);
  const Matrix<double> values = random_matrix(37, 5, 12);
  for (Index j = 0; j < 37; j += 3) logits(3, j) = -kInfinity;
  logits.row(4).head(36).setConstant(-kInfinity);
  logits.row(5).setConstant(-kInfinity);
  Matrix<double> expected;
  Vector<double> expected_lse;
  one_shot_softmax(logits, values, expected, expected_lse);

  const std::vector<std::vector<Index>> tilings{
      {37}, {10, 10, 10, 7}, {1, 36}, {36, 1}, {5, 1, 13, 2, 16}, std::vector<Index>(37, 1)};
  for (const auto& tiling : tilings) {
    INFO("tiles of widths starting " << tiling.front() << ", " << tiling.size() << " tiles");
    Matrix<double> out;
    Vector<double> lse;
    streamed_softmax<double>(logits, values, tiling, out, lse);
    INFO("double, every row against the definition; bound 1e-13 (a few ulps of O(1) values)");
    CHECK(max_abs_difference(out, expected) <= 1e-13);
    CHECK(max_abs_difference(lse, expected_lse) <= 1e-13);
    CHECK_FALSE(has_nan(out));
    INFO("the row with no visible key: zeros and lse = -inf");
    CHECK(out.row(5).isZero(0));
    CHECK(lse[5] == -kInfinity);
    CHECK(std::isfinite(lse[4]));

    Matrix<float> out_float;
    Vector<float> lse_float;
    streamed_softmax<float>(logits, values, tiling, out_float, lse_float);
    INFO("float: rounding of the inputs and of exp, ~1e-7 relative, over 37 terms");
    CHECK(max_abs_difference(out_float, expected) <= 2e-6);
    CHECK(max_abs_difference(lse_float, expected_lse) <= 2e-6);
  }
}

TEST_CASE("OnlineSoftmax: a row with no visible key stays zero until a tile brings keys",
          "[online_softmax]") {
  const Matrix<double> values = random_matrix(12, 3, 21);
  Matrix<double> logits = random_matrix(2, 12, 22, 2.0);
  // Row 0: nothing visible in the first two tiles (keys 0..7), visible keys in the third.
  logits.row(0).head(8).setConstant(-kInfinity);
  // Row 1: nothing visible anywhere.
  logits.row(1).setConstant(-kInfinity);

  plsh::OnlineSoftmax<double> softmax;
  softmax.reset(2, 3);
  Matrix<double> out(2, 3);
  Vector<double> lse(2);
  for (Index tile = 0; tile < 3; ++tile) {
    Matrix<double> scores = logits.middleCols(4 * tile, 4);
    softmax.update(scores, values.middleRows(4 * tile, 4));
    out.setConstant(7.0);
    softmax.finish(out, lse.data());
    INFO("after tile " << tile << ": no NaN, the empty row is zeros with lse = -inf");
    CHECK_FALSE(has_nan(out));
    CHECK_FALSE(has_nan(lse));
    CHECK(out.row(1).isZero(0));
    CHECK(lse[1] == -kInfinity);
    if (tile < 2) {
      CHECK(out.row(0).isZero(0));
      CHECK(lse[0] == -kInfinity);
    }
  }
  Matrix<double> expected;
  Vector<double> expected_lse;
  one_shot_softmax(logits, values, expected, expected_lse);
  INFO("row 0 equals the softmax over the keys of the last tile");
  CHECK(max_abs_difference(out, expected) <= 1e-14);
  CHECK(max_abs_difference(lse, expected_lse) <= 1e-14);

  INFO("finish without lse writes only the output");
  Matrix<double> out_only(2, 3);
  softmax.finish(out_only, nullptr);
  CHECK(out_only == out);
}

TEST_CASE("OnlineSoftmax gives masked logits a weight of exactly zero", "[online_softmax]") {
  // Each row has one visible key whose value is 0 and masked keys (-inf) whose values are 1: the
  // output is exactly 0 only if exp(-inf - max) is exactly 0. A vectorised exp that clamps its
  // argument returns the smallest normal number instead and leaks ~1e-308 (double) or ~1e-38
  // (float) of every masked value into the row.
  const auto check = [](auto scalar_tag) {
    using Scalar = decltype(scalar_tag);
    constexpr Index kKeys = 40;  // wide enough for the vectorised path of any packet size
    Matrix<Scalar> scores =
        Matrix<Scalar>::Constant(3, kKeys, -std::numeric_limits<Scalar>::infinity());
    scores(0, 0) = 0;          // visible key first
    scores(1, kKeys - 1) = 5;  // visible key last
    scores(2, 17) = -3;        // visible key in the middle
    Matrix<Scalar> values = Matrix<Scalar>::Ones(kKeys, 2);
    for (const Index visible : {Index{0}, kKeys - 1, Index{17}}) {
      values(visible, 0) = 0;
      values(visible, 1) = 0;
    }
    plsh::OnlineSoftmax<Scalar> softmax;
    softmax.reset(3, 2);
    softmax.update(scores, values);
    Matrix<Scalar> out(3, 2);
    Vector<Scalar> lse(3);
    softmax.finish(out, lse.data());
    for (Index r = 0; r < 3; ++r)
      for (Index e = 0; e < 2; ++e) {
        INFO((sizeof(Scalar) == 4 ? "float" : "double")
             << ", row " << r << ": out = " << std::scientific << static_cast<double>(out(r, e)));
        CHECK(out(r, e) == Scalar(0));
      }
    CHECK(lse[0] == Scalar(0));
    CHECK(lse[1] == Scalar(5));
    CHECK(lse[2] == Scalar(-3));
  };
  check(double{});
  check(float{});
}

TEST_CASE("OnlineSoftmax rescales on a new maximum without overflow", "[online_softmax]") {
  // Logits around 0 first, then a tile reaching `high`, then a tile back near high - 10.
  // exp(800) overflows double (> e^709.8) and exp(100) overflows float (> e^88.7): a kernel that
  // exponentiated raw logits, or rescaled by exp(new max) instead of exp(old - new), returns
  // inf/NaN here.
  const auto check_large = [](auto scalar_tag, double high, double bound) {
    using Scalar = decltype(scalar_tag);
    Matrix<double> logits(3, 30);
    logits.leftCols(10) = random_matrix(3, 10, 31, 1.0);
    logits.middleCols(10, 10) = random_matrix(3, 10, 32, 1.0, high);
    logits.rightCols(10) = random_matrix(3, 10, 33, 1.0, high - 10);
    logits.row(2).head(20).setConstant(-kInfinity);  // first visible keys arrive at high - 10
    const Matrix<double> values = random_matrix(30, 4, 34);
    Matrix<double> expected;
    Vector<double> expected_lse;
    one_shot_softmax(logits, values, expected, expected_lse);
    Matrix<Scalar> out;
    Vector<Scalar> lse;
    streamed_softmax<Scalar>(logits, values, {10, 10, 10}, out, lse);
    INFO("largest logit " << high << ", " << (sizeof(Scalar) == 4 ? "float" : "double"));
    CHECK_FALSE(has_nan(out));
    CHECK(out.allFinite());
    CHECK(lse.allFinite());
    CHECK(max_abs_difference(out, expected) <= bound);
    // lse ~ high: its rounding is relative to |lse|.
    CHECK(max_abs_difference(lse, expected_lse) <= bound * high);
  };
  check_large(double{}, 800.0, 1e-13);
  check_large(float{}, 100.0, 2e-6);
  // A sequence of ever larger maxima: each tile rescales the previous state.
  Matrix<double> logits(1, 40);
  for (Index j = 0; j < 40; ++j) logits(0, j) = 20.0 * static_cast<double>(j);  // up to 780
  const Matrix<double> values = random_matrix(40, 2, 35);
  Matrix<double> expected;
  Vector<double> expected_lse;
  one_shot_softmax(logits, values, expected, expected_lse);
  Matrix<double> out;
  Vector<double> lse;
  streamed_softmax<double>(logits, values, std::vector<Index>(40, 1), out, lse);
  INFO("a new maximum in every one-key tile, up to 780");
  CHECK(out.allFinite());
  CHECK(max_abs_difference(out, expected) <= 1e-13);
  CHECK(std::abs(lse[0] - expected_lse[0]) <= 1e-13 * 780);
}

TEST_CASE("online_softmax_merge of disjoint partial results equals attention over the union",
          "[online_softmax]") {
  Matrix<double> logits = random_matrix(5, 40, 41, 5.0);
  const Matrix<double> values = random_matrix(40, 6, 42);
  logits.row(3).head(25).setConstant(-kInfinity);  // row 3 has no key in the first partial
  logits.row(4).tail(15).setConstant(-kInfinity);  // row 4 has no key in the second partial
  logits.row(2).tail(15).array() += 700;  // second partial dominates row 2: exp(700 + ...) in lse
  Matrix<double> expected;
  Vector<double> expected_lse;
  one_shot_softmax(logits, values, expected, expected_lse);

  Partial first = partial_over(logits, values, 0, 25);
  const Partial second = partial_over(logits, values, 25, 15);
  REQUIRE(first.lse[3] == -kInfinity);
  REQUIRE(second.lse[4] == -kInfinity);
  plsh::online_softmax_merge(first.out, first.lse, second.out, second.lse);
  INFO("merged (out, lse) against the one-shot softmax over all 40 keys, double");
  CHECK_FALSE(has_nan(first.out));
  CHECK(max_abs_difference(first.out, expected) <= 1e-13);
  CHECK(max_abs_difference(first.lse, expected_lse) <= 1e-13 * 710);

  INFO("merging into row blocks of a larger matrix (the kernels merge into middleRows)");
  Matrix<double> big = Matrix<double>::Zero(9, 6);
  Vector<double> big_lse = Vector<double>::Constant(9, -kInfinity);
  const Partial a = partial_over(logits, values, 0, 25);
  plsh::online_softmax_merge(big.middleRows(2, 5), big_lse.segment(2, 5), a.out, a.lse);
  plsh::online_softmax_merge(big.middleRows(2, 5), big_lse.segment(2, 5), second.out, second.lse);
  CHECK(max_abs_difference(big.middleRows(2, 5).eval(), expected) <= 1e-13);
  CHECK(big.topRows(2).isZero(0));
  CHECK(big.bottomRows(2).isZero(0));
  CHECK(big_lse[0] == -kInfinity);
}

TEST_CASE("online_softmax_merge: an empty partial is the identity, merging is associative",
          "[online_softmax]") {
  const Matrix<double> logits = random_matrix(4, 30, 51, 3.0);
  const Matrix<double> values = random_matrix(30, 3, 52);
  const Partial a = partial_over(logits, values, 0, 10);
  const Partial b = partial_over(logits, values, 10, 7);
  const Partial c = partial_over(logits, values, 17, 13);
  const Partial empty{Matrix<double>::Zero(4, 3), Vector<double>::Constant(4, -kInfinity)};

  SECTION("merging an lse = -inf partial leaves the result unchanged, bit for bit") {
    Partial merged = a;
    plsh::online_softmax_merge(merged.out, merged.lse, empty.out, empty.lse);
    CHECK(merged.out == a.out);
    CHECK(merged.lse == a.lse);
  }
  SECTION("merging into an lse = -inf state copies the partial, bit for bit") {
    Partial merged = empty;
    plsh::online_softmax_merge(merged.out, merged.lse, b.out, b.lse);
    CHECK(merged.out == b.out);
    CHECK(merged.lse == b.lse);
  }
  SECTION("two empty partials stay empty, without NaN") {
    Partial merged = empty;
    plsh::online_softmax_merge(merged.out, merged.lse, empty.out, empty.lse);
    CHECK(merged.out.isZero(0));
    CHECK(merged.lse == empty.lse);
  }
  SECTION("(a + b) + c equals a + (b + c) to rounding, and the one-shot union") {
    Partial left = a;
    plsh::online_softmax_merge(left.out, left.lse, b.out, b.lse);
    plsh::online_softmax_merge(left.out, left.lse, c.out, c.lse);
    Partial right_inner = b;
    plsh::online_softmax_merge(right_inner.out, right_inner.lse, c.out, c.lse);
    Partial right = a;
    plsh::online_softmax_merge(right.out, right.lse, right_inner.out, right_inner.lse);
    Matrix<double> expected;
    Vector<double> expected_lse;
    one_shot_softmax(logits, values, expected, expected_lse);
    CHECK(max_abs_difference(left.out, right.out) <= 1e-14);
    CHECK(max_abs_difference(left.lse, right.lse) <= 1e-14);
    CHECK(max_abs_difference(left.out, expected) <= 1e-13);
    CHECK(max_abs_difference(left.lse, expected_lse) <= 1e-13);
  }
  SECTION("a partial merged with itself: same output, lse + log 2 (the doubled weighting)") {
    Partial merged = a;
    plsh::online_softmax_merge(merged.out, merged.lse, a.out, a.lse);
    CHECK(max_abs_difference(merged.out, a.out) <= 1e-15);
    CHECK(max_abs_difference(merged.lse, (a.lse.array() + std::log(2.0)).matrix().eval()) <= 1e-14);
  }
  SECTION("float partials with lse near 100 merge without overflow") {
    Matrix<float> out = a.out.cast<float>();
    Vector<float> lse = (a.lse.array() + 100).matrix().cast<float>();
    const Matrix<float> out_b = b.out.cast<float>();
    const Vector<float> lse_b = (b.lse.array() + 95).matrix().cast<float>();
    plsh::online_softmax_merge(out, lse, out_b, lse_b);
    CHECK(out.allFinite());
    CHECK(lse.allFinite());
    // Expected: weights e^{lse_a + 100}, e^{lse_b + 95}, formed in double from the shifted logs.
    for (Index r = 0; r < 4; ++r) {
      const double la = a.lse[r] + 100;
      const double lb = b.lse[r] + 95;
      const double high = std::max(la, lb);
      const double wa = std::exp(la - high);
      const double wb = std::exp(lb - high);
      for (Index e = 0; e < 3; ++e) {
        const double expected = (wa * a.out(r, e) + wb * b.out(r, e)) / (wa + wb);
        CHECK(std::abs(out(r, e) - expected) <= 1e-6);
      }
      CHECK(std::abs(lse[r] - (high + std::log(wa + wb))) <= 1e-4);
    }
  }
}

TEST_CASE("OnlineSoftmax follows the non-finite contract", "[online_softmax][nonfinite]") {
  const auto check = [](auto scalar_tag) {
    using Scalar = decltype(scalar_tag);
    constexpr Scalar kInf = std::numeric_limits<Scalar>::infinity();
    constexpr Scalar kNaN = std::numeric_limits<Scalar>::quiet_NaN();
    constexpr Index kKeys = 40;
    Matrix<Scalar> scores = Matrix<Scalar>::Zero(5, kKeys);
    scores.row(0).setConstant(-kInf);
    scores(0, 3) = kNaN;   // NaN hidden among masked logits: max(-inf, NaN) must not drop it
    scores(1, 7) = kInf;   // +inf logit
    scores(2, 9) = -kInf;  // visible -inf logit on the NaN value row: weighs 0, adds nothing
    scores(3, 9) = -kInf;
    scores(3, 10) = -1000;             // visible, weight underflows to 0, value row is infinite
    scores.row(4).setConstant(-kInf);  // no visible key
    Matrix<Scalar> values = Matrix<Scalar>::Ones(kKeys, 2);
    values.row(9).setConstant(kNaN);
    values.row(10).setConstant(kInf);
    plsh::OnlineSoftmax<Scalar> softmax;
    softmax.reset(5, 2);
    Matrix<Scalar> tile = scores;
    // Row 2 sees key 10 with logit 0: its infinite value shows; row 3 sees it with -1000.
    tile(2, 10) = -kInf;
    softmax.update(tile, values);
    Matrix<Scalar> out(5, 2);
    Vector<Scalar> lse(5);
    softmax.finish(out, lse.data());
    INFO((sizeof(Scalar) == 4 ? "float" : "double"));
    CHECK(std::isnan(out(0, 0)));
    CHECK(std::isnan(lse[0]));
    CHECK(std::isnan(out(1, 0)));
    CHECK(std::isnan(lse[1]));
    CHECK(out(2, 0) == Scalar(1));  // every other visible value is 1
    CHECK(out(2, 1) == Scalar(1));
    CHECK(std::isfinite(lse[2]));
    CHECK_FALSE(std::isfinite(out(3, 0)));
    CHECK(out(4, 0) == Scalar(0));
    CHECK(lse[4] == -kInf);
  };
  check(double{});
  check(float{});
}

TEST_CASE("online_softmax_merge: a NaN partial makes the row NaN, an empty one is dropped",
          "[online_softmax][nonfinite]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  Matrix<double> out = Matrix<double>::Constant(3, 2, 0.5);
  Vector<double> lse(3);
  lse << 0.0, -kInfinity, 1.0;
  Matrix<double> out_b(3, 2);
  out_b << nan, nan, nan, nan, 0.25, 0.25;
  Vector<double> lse_b(3);
  lse_b << nan, nan, -kInfinity;
  plsh::online_softmax_merge(out, lse, out_b, lse_b);
  CHECK(std::isnan(out(0, 0)));
  CHECK(std::isnan(lse[0]));
  CHECK(std::isnan(out(1, 1)));
  CHECK(std::isnan(lse[1]));
  CHECK(out(2, 0) == 0.5);
  CHECK(lse[2] == 1.0);
}

}  // namespace test_online_softmax
