// Tests of attention/alibi_attention.hpp: exact ALiBi attention, and windowed ALiBi at tolerance 0,
// against the dense reference plsh::reference::alibi_attention (the windowed kernel's certificate
// at tolerances above 0: test_windowed.cpp), and
// the argument checks shared by every attention entry point.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstring>
#include <functional>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/reference.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_alibi_attention {

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::Problem;
using plsh_test::Shape;
using plsh_test::type_name;

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
constexpr double kInfinity = std::numeric_limits<double>::infinity();

/// Exact, and windowed with tolerance 0, against reference::alibi_attention (the windowed kernel's
/// certificate: test_windowed.cpp).
template <class Scalar>
void check_alibi_kernels(const Shape& shape, const plsh::AttentionOptions& options,
                         const std::vector<double>& slopes, std::uint64_t seed,
                         Layout layout = Layout::Packed) {
  Problem<Scalar> problem(shape, seed, layout);
  const double tolerance = plsh_test::reference_tolerance<Scalar>();
  INFO(shape << ", " << plsh_test::describe(options) << ", " << type_name<Scalar>() << ", "
             << layout << " layout, seed " << seed);

  Buffer<Scalar> expected = problem.output();
  plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                   slopes, options);
  plsh::exact_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                      problem.out.view, slopes, options);
  const double exact_error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
  INFO("exact_error = " << plsh_test::scientific(exact_error));
  CHECK(exact_error <= tolerance);
  CHECK(problem.out.touched_padding() == 0);

  INFO("windowed with tolerance 0 is exact ALiBi");
  problem.out.fill(Scalar(7));
  plsh::windowed_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                         problem.out.view, slopes, 0.0, options);
  const double windowed_exact_error =
      plsh_test::max_abs_difference(problem.out.in(), expected.in());
  INFO("windowed_exact_error = " << plsh_test::scientific(windowed_exact_error));
  CHECK(windowed_exact_error <= tolerance);
  CHECK(problem.out.touched_padding() == 0);
}

template <class Scalar>
void sweep_edge_shapes() {
  std::uint64_t seed = 1000;
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    for (const Index n : plsh_test::edge_lengths()) {
      check_alibi_kernels<Scalar>(Shape{n, n, 4, 2, 16, 12}, options, plsh::alibi_slopes(4),
                                  ++seed);
    }
    // Grouped-query heads: 8 query heads on 2 and on 1 key/value head.
    check_alibi_kernels<Scalar>(Shape{65, 65, 8, 2, 8, 12}, options, plsh::alibi_slopes(8), ++seed);
    check_alibi_kernels<Scalar>(Shape{130, 130, 8, 1, 8, 3}, options, plsh::alibi_slopes(8),
                                ++seed);
    // Non-default strides for every view.
    check_alibi_kernels<Scalar>(Shape{130, 130, 4, 2, 16, 12}, options, plsh::alibi_slopes(4),
                                ++seed, Layout::HeadMajor);
    check_alibi_kernels<Scalar>(Shape{65, 257, 4, 4, 5, 9}, options, plsh::alibi_slopes(4), ++seed,
                                Layout::PaddedRows);
  }
}

}  // namespace

TEST_CASE("exact and windowed ALiBi match the dense reference on edge shapes", "[alibi]") {
  SECTION("double") { sweep_edge_shapes<double>(); }
  SECTION("float") { sweep_edge_shapes<float>(); }
}

TEST_CASE("exact and windowed ALiBi with query and key positions apart", "[alibi]") {
  std::uint64_t seed = 2000;
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        const Shape shape{c.n_q, c.n_k, 4, 2, 8, 6};
        check_alibi_kernels<double>(shape, options, plsh::alibi_slopes(4), ++seed);
        check_alibi_kernels<float>(shape, options, plsh::alibi_slopes(4), ++seed);
      });
}

TEST_CASE("exact and windowed ALiBi with slope 0, steep slopes and an explicit scale", "[alibi]") {
  // Slope 0 is plain attention, 2 and 50 nearly confine a query to its own position.
  const std::vector<double> slopes{0.0, 0.5, 2.0, 50.0};
  plsh::AttentionOptions options;
  for (const bool causal : {true, false}) {
    options.causal = causal;
    options.scale = causal ? 0.3 : 0.0;
    check_alibi_kernels<double>(Shape{130, 130, 4, 2, 16, 8}, options, slopes, 2100);
    check_alibi_kernels<float>(Shape{130, 130, 4, 2, 16, 8}, options, slopes, 2101);
  }
}

TEST_CASE("exact ALiBi far from the keys equals the shifted problem", "[alibi]") {
  // All keys precede all queries, so -m|p_i - p_j| = -m(p_i - p_j): moving the queries by a
  // constant changes every logit of a row by the same amount and leaves the softmax unchanged.
  // At distance ~10^4 the factors e^{-m r} underflow in the dense reference, so the kernel is
  // compared with the reference of the problem moved next to the keys. Double only: in float the
  // logits ~ -5000 carry an absolute rounding ~2.4e-4.
  Problem<double> problem(Shape{5, 64, 2, 1, 8, 4}, 2300);
  const std::vector<double> slopes{0.5, 1.0 / 3};
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions far;
    far.causal = causal;
    far.query_position = 10000;
    plsh::AttentionOptions near = far;
    near.query_position = 63;
    Buffer<double> expected = problem.output();
    plsh::reference::alibi_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                     slopes, near);
    plsh::exact_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                        problem.out.view, slopes, far);
    INFO(plsh_test::describe(far));
    CHECK(plsh_test::max_abs_difference(problem.out.in(), expected.in()) <= 1e-11);
  }
}

/// Every element of row `t` of `out` is exactly 0.
template <class Scalar>
void check_zero_row(const Buffer<Scalar>& out, Index t) {
  for (Index h = 0; h < out.view.heads; ++h)
    for (Index e = 0; e < out.view.dim; ++e) {
      INFO("out(" << t << ", " << h << ", " << e
                  << ") = " << plsh_test::scientific(static_cast<double>(out.at(t, h, e))));
      CHECK(out.at(t, h, e) == Scalar(0));
    }
}

TEST_CASE("masked keys weigh exactly zero", "[alibi]") {
  // Causal, first query: the only visible key is key 0, so out row 0 = v row 0 exactly, whatever
  // the later keys hold; with v row 0 = 0 the row must be exactly 0. A masked key that got a tiny
  // positive weight instead of 0 (e.g. exp(-inf) evaluated as the smallest normal number) shows
  // up here as a nonzero row.
  const auto check = [](auto scalar_tag) {
    using Scalar = decltype(scalar_tag);
    Problem<Scalar> problem(Shape{70, 70, 2, 2, 4, 3}, 2400);
    for (Index h = 0; h < 2; ++h)
      for (Index e = 0; e < 3; ++e) problem.v.at(0, h, e) = 0;
    INFO(type_name<Scalar>() << ", causal, slopes 1/4 and 1/2: row 0 sees only key 0");
    plsh::exact_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                        problem.out.view, {0.25, 0.5});
    check_zero_row(problem.out, 0);
    plsh::windowed_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                           problem.out.view, {0.25, 0.5}, 1e-6);
    check_zero_row(problem.out, 0);
  };
  check(double{});
  check(float{});
}

TEST_CASE("slopes beyond float's range confine each query to its own position", "[alibi]") {
  // 1e39 and 1e300 are finite, hence valid slopes. The factor e^{-m r} is 0 for every r >= 1 in
  // both precisions, so every query attends only its own key: out = v of the same position, up to
  // the e^{-m r} that the kernels may round to the smallest normal number (~1e-308 * |v|, below
  // the last bit of these O(1) values).
  const auto check = [](auto scalar_tag) {
    using Scalar = decltype(scalar_tag);
    Problem<Scalar> problem(Shape{70, 70, 2, 2, 4, 3}, 2401);
    for (const double slope : {1e39, 1e300}) {
      for (const bool causal : {true, false}) {
        INFO(type_name<Scalar>() << ", slope " << slope << (causal ? ", causal" : ", bidirectional")
                                 << ": out = v of the query's own position");
        plsh::AttentionOptions options;
        options.causal = causal;
        plsh::exact_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                            problem.out.view, {slope, slope}, options);
        CHECK(plsh_test::max_abs_difference(problem.out.in(), problem.v.in()) == 0);
        plsh::windowed_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                               problem.out.view, {slope, slope}, 1e-6, options);
        CHECK(plsh_test::max_abs_difference(problem.out.in(), problem.v.in()) == 0);
      }
    }
  };
  check(double{});
  check(float{});
}

TEST_CASE("with a slope beyond float's range, a query whose own logit overflows sees nothing",
          "[alibi]") {
  // float, d = 1, three positions, bidirectional, slope 1e39 (beyond the largest float). The
  // middle query's own score -1e20 * 1e20 overflows to -inf in float; its neighbours' scores are
  // finite, but their biases -1e39 are -inf in float: every logit the row sees is -inf, and the
  // row is zero, as in the other kernels. (Cutting the slope to the largest float would leave
  // the neighbours' logits finite, and the row their mean value 20.) The outer rows see their
  // own keys only.
  std::vector<float> q = {1, -1e20f, 1};
  std::vector<float> k = {1, 1e20f, 1};
  std::vector<float> v = {10, 20, 30};
  std::vector<float> out(3, -1);
  plsh::AttentionOptions options;
  options.causal = false;
  plsh::exact_alibi_attention<float>({q.data(), 3, 1, 1}, {k.data(), 3, 1, 1}, {v.data(), 3, 1, 1},
                                     {out.data(), 3, 1, 1}, {1e39}, options);
  CHECK(out == std::vector<float>{10, 0, 30});
  std::fill(out.begin(), out.end(), -1.0f);
  plsh::windowed_alibi_attention<float>({q.data(), 3, 1, 1}, {k.data(), 3, 1, 1},
                                        {v.data(), 3, 1, 1}, {out.data(), 3, 1, 1}, {1e39}, 1e-6,
                                        options);
  CHECK(out == std::vector<float>{10, 0, 30});
}

TEST_CASE("mutable views are accepted where read-only views are expected", "[alibi]") {
  Problem<float> problem(Shape{65, 65, 4, 2, 8, 8}, 2500);
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  Buffer<float> from_const = problem.output();
  plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                     from_const.view, slopes);
  // HeadsView<float> converts to HeadsView<const float>; Scalar is deduced from `out` alone.
  plsh::exact_alibi_attention<float>(problem.q.view, problem.k.view, problem.v.view,
                                     problem.out.view, slopes);
  CHECK(problem.out.storage == from_const.storage);
  problem.out.fill(0);
  plsh::exact_alibi_attention(problem.q.view, problem.k.view, problem.v.view, problem.out.view,
                              slopes);
  CHECK(problem.out.storage == from_const.storage);
  problem.out.fill(0);
  plsh::windowed_alibi_attention(problem.q.view, problem.k.view, problem.v.view, problem.out.view,
                                 slopes, 0.0);
  CHECK(problem.out.storage == from_const.storage);
}

#if defined(_OPENMP)
TEST_CASE("exact and windowed ALiBi do not depend on the number of threads", "[alibi][threads]") {
  const int saved_threads = omp_get_max_threads();
  const auto run = [](auto scalar_tag, bool windowed) {
    using Scalar = decltype(scalar_tag);
    Problem<Scalar> problem(Shape{300, 300, 8, 2, 16, 16}, 2600);
    std::vector<std::vector<Scalar>> outputs;
    for (const int threads : {1, 2, 3}) {
      omp_set_num_threads(threads);
      problem.out.fill(Scalar(0));
      if (windowed) {
        plsh::windowed_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                               problem.out.view, plsh::alibi_slopes(8), 1e-4);
      } else {
        plsh::exact_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                            problem.out.view, plsh::alibi_slopes(8));
      }
      outputs.push_back(problem.out.storage);
    }
    INFO(type_name<Scalar>() << (windowed ? " windowed" : " exact")
                             << ": 1, 2 and 3 threads give the same bits");
    CHECK(std::memcmp(outputs[0].data(), outputs[1].data(), outputs[0].size() * sizeof(Scalar)) ==
          0);
    CHECK(std::memcmp(outputs[0].data(), outputs[2].data(), outputs[0].size() * sizeof(Scalar)) ==
          0);
  };
  run(float{}, false);
  run(float{}, true);
  run(double{}, false);
  run(double{}, true);
  omp_set_num_threads(saved_threads);
  CHECK(omp_get_max_threads() == saved_threads);
}
#endif

// ---------------------------------------------------------------------------------------------
// Argument checks shared by every attention entry point (detail::validate_attention), run through
// each public function that performs them.
// ---------------------------------------------------------------------------------------------

namespace {

using Views = plsh::HeadsView<const double>;
using OutView = plsh::HeadsView<double>;

struct EntryPoint {
  std::string name;  // the function name the message must carry
  bool takes_slopes;
  std::function<void(Views, Views, Views, OutView, const std::vector<double>&,
                     const plsh::AttentionOptions&)>
      call;
};

std::vector<EntryPoint> entry_points() {
  const auto plsh_with = [](plsh::Kernel kernel) {
    return [kernel](Views q, Views k, Views v, OutView out, const std::vector<double>& slopes,
                    const plsh::AttentionOptions& options) {
      plsh::PlshOptions plsh_options;
      static_cast<plsh::AttentionOptions&>(plsh_options) = options;
      plsh_options.samples = 3;
      plsh_options.kernel = kernel;
      if (kernel == plsh::Kernel::Passes) plsh_options.near_field = 0;  // block masks only
      plsh::plsh_attention<double>(q, k, v, out, slopes, plsh_options);
    };
  };
  return {
      {"exact_alibi_attention", true,
       [](Views q, Views k, Views v, OutView out, const std::vector<double>& slopes,
          const plsh::AttentionOptions& options) {
         plsh::exact_alibi_attention<double>(q, k, v, out, slopes, options);
       }},
      {"windowed_alibi_attention", true,
       [](Views q, Views k, Views v, OutView out, const std::vector<double>& slopes,
          const plsh::AttentionOptions& options) {
         plsh::windowed_alibi_attention<double>(q, k, v, out, slopes, 1e-6, options);
       }},
      {"plsh_attention", true, plsh_with(plsh::Kernel::Fused)},
      {"plsh_attention", true, plsh_with(plsh::Kernel::Passes)},
      {"plsh_attention", true,
       [](Views q, Views k, Views v, OutView out, const std::vector<double>& slopes,
          const plsh::AttentionOptions& options) {
         plsh::PlshOptions plsh_options;
         static_cast<plsh::AttentionOptions&>(plsh_options) = options;
         plsh_options.near_field = 0;  // a regular kernel sees block masks only
         plsh::plsh_attention<double>(q, k, v, out, slopes, plsh_options, plsh::RegularAttention{});
       }},
      {"fixed_block_attention", false,
       [](Views q, Views k, Views v, OutView out, const std::vector<double>&,
          const plsh::AttentionOptions& options) {
         plsh::fixed_block_attention<double>(q, k, v, out, 4, options);
       }},
  };
}

/// A valid problem, q [6][4][5], k [7][2][5], v [7][2][3], out [6][4][3], that each check below
/// spoils in one way.
struct ValidArguments {
  Problem<double> problem{Shape{6, 7, 4, 2, 5, 3}, 3000};
  Views q = problem.q.in();
  Views k = problem.k.in();
  Views v = problem.v.in();
  OutView out = problem.out.view;
  std::vector<double> slopes = plsh::alibi_slopes(4);
  plsh::AttentionOptions options;
};

/// Runs `spoil` on a fresh valid argument set, then requires every entry point to throw
/// std::invalid_argument whose message names the function and contains `argument`.
template <class Spoil>
void require_rejected(const std::string& what, const std::string& argument, Spoil&& spoil,
                      bool slopes_only = false) {
  for (const EntryPoint& entry : entry_points()) {
    if (slopes_only && !entry.takes_slopes) continue;
    ValidArguments a;
    spoil(a);
    INFO(entry.name << " with " << what);
    const auto call = [&] { entry.call(a.q, a.k, a.v, a.out, a.slopes, a.options); };
    REQUIRE_THROWS_AS(call(), std::invalid_argument);
    CHECK_THROWS_WITH(call(), Catch::Contains(entry.name) && Catch::Contains(argument));
  }
}

}  // namespace

TEST_CASE("every entry point accepts the valid problem", "[validation]") {
  for (const EntryPoint& entry : entry_points()) {
    ValidArguments a;
    INFO(entry.name);
    CHECK_NOTHROW(entry.call(a.q, a.k, a.v, a.out, a.slopes, a.options));
    CHECK(plsh_test::all_finite(a.problem.out.in()));
  }
}

TEST_CASE("every entry point rejects shapes that disagree", "[validation]") {
  require_rejected("q.dim != k.dim", "k.dim", [](ValidArguments& a) { a.k.dim = 4; });
  require_rejected("v.tokens != k.tokens", "v.tokens", [](ValidArguments& a) { a.v.tokens = 6; });
  require_rejected("v.heads != k.heads", "v.heads", [](ValidArguments& a) { a.v.heads = 1; });
  require_rejected("q.heads not a multiple of k.heads", "q.heads", [](ValidArguments& a) {
    a.q.heads = 3;
    a.out.heads = 3;
    a.slopes.resize(3);
  });
  require_rejected("out.tokens != q.tokens", "out.tokens",
                   [](ValidArguments& a) { a.out.tokens = 5; });
  require_rejected("out.heads != q.heads", "out.heads", [](ValidArguments& a) { a.out.heads = 2; });
  require_rejected("out.dim != v.dim", "out.dim", [](ValidArguments& a) { a.out.dim = 2; });
}

TEST_CASE("every entry point rejects bad sizes, strides and null data", "[validation]") {
  require_rejected("negative q.tokens", "q.tokens", [](ValidArguments& a) { a.q.tokens = -1; });
  require_rejected("negative k.tokens", "k.tokens", [](ValidArguments& a) { a.k.tokens = -2; });
  require_rejected("zero q.dim", "q.dim", [](ValidArguments& a) { a.q.dim = 0; });
  require_rejected("zero v.dim", "v.dim", [](ValidArguments& a) { a.v.dim = 0; });
  require_rejected("zero k.heads", "k.heads", [](ValidArguments& a) { a.k.heads = 0; });
  require_rejected("zero out.heads", "out.heads", [](ValidArguments& a) { a.out.heads = 0; });
  require_rejected("negative q.token_stride", "q strides",
                   [](ValidArguments& a) { a.q.token_stride = -20; });
  require_rejected("null q.data with 6 tokens", "q.data",
                   [](ValidArguments& a) { a.q.data = nullptr; });
  require_rejected("null v.data with 7 tokens", "v.data",
                   [](ValidArguments& a) { a.v.data = nullptr; });
  require_rejected("null out.data with 6 tokens", "out.data",
                   [](ValidArguments& a) { a.out.data = nullptr; });
  require_rejected("out with token_stride 0 (every token on the same row)", "out strides",
                   [](ValidArguments& a) { a.out.token_stride = 0; });
  require_rejected("out with head_stride 1 (heads overlapping)", "out strides",
                   [](ValidArguments& a) { a.out.head_stride = 1; });
}

TEST_CASE("every entry point rejects an output overlapping an input", "[validation]") {
  // Real buffers: out aliasing q (same buffer), sharing its tail with v, or its head with k.
  require_rejected("out on the buffer of q", "out overlaps q", [](ValidArguments& a) {
    a.q = Views{a.problem.out.view.data, 6, 4, 3};  // q with d = 3 on out's storage
    a.k = Views{a.problem.k.view.data, 7, 2, 3};
  });
  require_rejected("out starting inside v", "out overlaps v", [](ValidArguments& a) {
    a.problem.v.storage.resize(400);
    a.v = Views{a.problem.v.storage.data(), 7, 2, 3};
    a.out.data = a.problem.v.storage.data() + 30;  // v spans 42 elements
  });
  require_rejected("k starting inside out", "out overlaps k", [](ValidArguments& a) {
    a.k = Views{a.problem.out.view.data + 71, 7, 2, 5};  // out spans 72 elements
  });
}

TEST_CASE("every entry point rejects bad slopes and options", "[validation]") {
  require_rejected(
      "3 slopes for 4 heads", "slopes.size()", [](ValidArguments& a) { a.slopes.pop_back(); },
      true);
  for (const double slope : {-0.5, -kInfinity, kInfinity, kNaN}) {
    require_rejected(
        "slope " + std::to_string(slope), "slopes[1]",
        [slope](ValidArguments& a) { a.slopes[1] = slope; }, true);
  }
  require_rejected("negative query_position", "options.query_position",
                   [](ValidArguments& a) { a.options.query_position = -1; });
  require_rejected("negative key_position", "options.key_position",
                   [](ValidArguments& a) { a.options.key_position = -5; });
  for (const double scale : {kNaN, kInfinity, -kInfinity}) {
    require_rejected("scale " + std::to_string(scale), "options.scale",
                     [scale](ValidArguments& a) { a.options.scale = scale; });
  }
}

TEST_CASE("windowed ALiBi rejects a tolerance outside [0, 1]", "[validation]") {
  ValidArguments a;
  for (const double tolerance : {-1e-9, -1.0, 1.0 + 1e-12, 2.0, kNaN, kInfinity}) {
    INFO("tolerance " << tolerance);
    const auto call = [&] {
      plsh::windowed_alibi_attention<double>(a.q, a.k, a.v, a.out, a.slopes, tolerance);
    };
    REQUIRE_THROWS_AS(call(), std::invalid_argument);
    CHECK_THROWS_WITH(call(),
                      Catch::Contains("windowed_alibi_attention") && Catch::Contains("tolerance"));
  }
  for (const double tolerance : {0.0, 1e-300, 0.5, 1.0}) {
    INFO("tolerance " << tolerance << " is valid");
    CHECK_NOTHROW(
        plsh::windowed_alibi_attention<double>(a.q, a.k, a.v, a.out, a.slopes, tolerance));
  }
}

TEST_CASE("every entry point handles empty queries and empty keys", "[validation]") {
  for (const EntryPoint& entry : entry_points()) {
    INFO(entry.name << ": q.tokens == 0 does nothing (out untouched, no throw)");
    ValidArguments a;
    a.problem.out.fill(5.0);
    a.q.tokens = 0;
    a.out.tokens = 0;
    CHECK_NOTHROW(entry.call(a.q, a.k, a.v, a.out, a.slopes, a.options));
    for (const double value : a.problem.out.storage) CHECK(value == 5.0);
    a.q.data = nullptr;
    a.out.data = nullptr;
    CHECK_NOTHROW(entry.call(a.q, a.k, a.v, a.out, a.slopes, a.options));

    for (const bool causal : {true, false}) {
      INFO(entry.name << ": k.tokens == 0 gives zero rows, "
                      << (causal ? "causal" : "bidirectional"));
      ValidArguments b;
      b.problem.out.fill(5.0);
      b.k.tokens = 0;
      b.v.tokens = 0;
      b.options.causal = causal;
      CHECK_NOTHROW(entry.call(b.q, b.k, b.v, b.out, b.slopes, b.options));
      for (const double value : b.problem.out.storage) CHECK(value == 0.0);
    }
  }
}

}  // namespace test_alibi_attention
