// Tests of the 16-bit storage types (Eigen::bfloat16, Eigen::half) in attention/plsh_attention.hpp:
// the fused kernel, the pass kernel (with RegularAttention and with a user kernel) and the
// fixed-block kernel compute in float, so on inputs that are exactly representable in the storage
// type their output is the float kernel's output rounded once to nearest even: bit for bit, and
// within the rounding bound |x - fl(x)| <= u |x| (u = 2^-8 for bfloat16, 2^-11 for half, plus
// half's subnormal spacing 2^-24 / 2 near 0). Except the fused kernel on bfloat16 in AVX-512 BF16
// builds (kBf16Scores), whose tiles' scores are summed by vdpbf16ps in another order than the
// float product's: there the bound grows by the effect of the two scores' float rounding
// (score_drift), and the bits may differ.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <stdexcept>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/attention/regular.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_fused_half {

namespace {

using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::Problem;
using plsh_test::Shape;

/// Unit roundoff of the storage type, and the absolute rounding error near 0 (half's subnormals).
template <class Half>
struct Rounding;
template <>
struct Rounding<Eigen::bfloat16> {
  static constexpr double relative = 1.0 / 256;  // 2^-8
  static constexpr double absolute = 0;          // float's range: no subnormal output here
  static constexpr const char* name = "bfloat16";
};
template <>
struct Rounding<Eigen::half> {
  static constexpr double relative = 1.0 / 2048;        // 2^-11
  static constexpr double absolute = 1.0 / 33554432.0;  // 2^-25, half of the subnormal spacing
  static constexpr const char* name = "half";
};

/// A 16-bit copy of a float buffer (same layout), after rounding the float buffer's view to the
/// 16-bit type, so that both hold the same values; padding holds -12345 rounded.
template <class Half>
struct HalfBuffer {
  std::vector<Half> storage;
  std::vector<Half> initial;
  plsh::HeadsView<Half> view{nullptr, 0, 1, 1};

  explicit HalfBuffer(Buffer<float>& wide) : storage(wide.storage.size()) {
    for (Index t = 0; t < wide.view.tokens; ++t)
      for (Index h = 0; h < wide.view.heads; ++h)
        for (Index e = 0; e < wide.view.dim; ++e) {
          wide.at(t, h, e) = static_cast<float>(static_cast<Half>(wide.at(t, h, e)));
        }
    for (std::size_t i = 0; i < storage.size(); ++i)
      storage[i] = static_cast<Half>(wide.storage[i]);
    initial = storage;
    view = plsh::HeadsView<Half>{storage.data(), wide.view.tokens,       wide.view.heads,
                                 wide.view.dim,  wide.view.token_stride, wide.view.head_stride};
  }

  plsh::HeadsView<const Half> in() const { return view; }
  Half at(Index t, Index h, Index e) const {
    return view.data[t * view.token_stride + h * view.head_stride + e];
  }

  /// Elements outside the view that changed since construction.
  Index touched_padding() const {
    return ::touched_padding(view, storage.size(), [&](std::size_t i) {
      return std::memcmp(&storage[i], &initial[i], sizeof(Half)) != 0;
    });
  }
};

template <class View>
using ScalarOf = std::remove_const_t<std::remove_pointer_t<decltype(View::data)>>;

/// Largest magnitude in the buffer's view.
double max_abs(const Buffer<float>& buffer) {
  double largest = 0;
  for (Index t = 0; t < buffer.view.tokens; ++t)
    for (Index h = 0; h < buffer.view.heads; ++h)
      for (Index e = 0; e < buffer.view.dim; ++e) {
        largest = std::max(largest, std::abs(static_cast<double>(buffer.at(t, h, e))));
      }
  return largest;
}

/// Bound on |y_b - y_f| between two float evaluations of the fused kernel whose scores differ by
/// their summation order (kBf16Scores against the float product). Each score is within
/// (gamma_d + u) s sum_e |q_e k_e| <= (gamma_d + u) s d max|q| max|k| of s q.k (gamma_m =
/// m u / (1 - m u), u = 2^-24: d float sums and the scaling), so the two differ by at most delta,
/// twice that. Logits that move by at most delta move each softmax weight by a factor within
/// e^{+-2 delta}, and the exact weighted mean by at most (e^{2 delta} - 1) max|v|. Each
/// evaluation adds its own rounding on top: a weighted mean of at most n_k terms (the sums of
/// the weights and of the weighted values, exponentials within a few ulps), gamma_{2 n_k + 32}
/// max|v|, twice.
double score_drift(const Problem<float>& problem, double scale) {
  const double u = std::ldexp(1.0, -24);
  const auto gamma = [&](double m) { return m * u / (1 - m * u); };
  const auto dim = static_cast<double>(problem.q.view.dim);
  const double delta = 2 * (gamma(dim) + u) * scale * dim * max_abs(problem.q) * max_abs(problem.k);
  const double rounding = gamma(2.0 * static_cast<double>(problem.k.view.tokens) + 32);
  return (std::expm1(2 * delta) + 2 * rounding) * max_abs(problem.v);
}

/// Runs `attend` on the problem with its inputs rounded to `Half`, in float and in `Half`; checks
/// that the 16-bit output is the float output rounded (bit for bit), within the rounding bound,
/// and that no padding moved. `fused`: the options when `attend` is the fused kernel, whose
/// bfloat16 scores may be summed in another order (kBf16Scores): then only the bound is checked,
/// grown by score_drift.
template <class Half, class Attend>
void check_against_float(Problem<float>& problem, Attend&& attend,
                         const plsh::AttentionOptions* fused = nullptr) {
  const HalfBuffer<Half> q(problem.q);
  const HalfBuffer<Half> k(problem.k);
  const HalfBuffer<Half> v(problem.v);
  HalfBuffer<Half> out(problem.out);
  attend(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view);
  attend(q.in(), k.in(), v.in(), out.view);
  const bool reordered = fused != nullptr && plsh::detail::kBf16Scores<Half>;
  const double drift =
      reordered ? score_drift(problem, plsh::detail::resolved_scale(*fused, problem.q.view.dim))
                : 0.0;

  Index differing_bits = 0;
  double worst_excess = 0;  // largest |out - expected| - bound, <= 0 when every entry is in bound
  for (Index t = 0; t < out.view.tokens; ++t)
    for (Index h = 0; h < out.view.heads; ++h)
      for (Index e = 0; e < out.view.dim; ++e) {
        const float x = problem.out.at(t, h, e);
        const Half rounded = static_cast<Half>(x);
        const Half got = out.at(t, h, e);
        if (std::memcmp(&rounded, &got, sizeof(Half)) != 0) ++differing_bits;
        const double error = std::abs(static_cast<double>(got) - static_cast<double>(x));
        const double bound = Rounding<Half>::relative * std::abs(static_cast<double>(x)) +
                             Rounding<Half>::absolute + (1 + Rounding<Half>::relative) * drift;
        worst_excess = std::max(worst_excess, error - bound);
      }
  INFO(Rounding<Half>::name << ": worst excess over the rounding bound " << worst_excess << ", "
                            << differing_bits << " outputs not the float output rounded");
  if (!reordered) CHECK(differing_bits == 0);
  CHECK(worst_excess <= 0);
  CHECK(out.touched_padding() == 0);
}

plsh::PlshOptions plsh_options(const plsh::AttentionOptions& base, Index samples,
                               plsh::Kernel kernel) {
  plsh::PlshOptions options;
  static_cast<plsh::AttentionOptions&>(options) = base;
  options.samples = samples;
  options.seed = 77;
  options.kernel = kernel;
  if (kernel == plsh::Kernel::Passes) options.near_field = 0;  // block masks only
  return options;
}

/// The fused kernel, the pass kernel, the pass kernel with a user kernel (which gets float maps)
/// and the fixed-block kernel on one problem.
template <class Half>
void check_kernels(const Shape& shape, const plsh::AttentionOptions& base, std::uint64_t seed,
                   Layout layout) {
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
    for (const Index samples : {1, 20}) {
      Problem<float> problem(shape, seed, layout);
      INFO(shape << ", " << plsh_test::describe(base) << ", " << layout << ", s = " << samples
                 << (kernel == plsh::Kernel::Fused ? ", fused" : ", passes"));
      const plsh::PlshOptions options = plsh_options(base, samples, kernel);
      check_against_float<Half>(
          problem,
          [&](auto q, auto k, auto v, auto out) {
            using Scalar = ScalarOf<decltype(out)>;
            plsh::plsh_attention<Scalar>(q, k, v, out, slopes, options);
          },
          kernel == plsh::Kernel::Fused ? &options : nullptr);
    }
  }
  {
    Problem<float> problem(shape, seed + 1, layout);
    INFO(shape << ", " << plsh_test::describe(base) << ", " << layout << ", user kernel");
    const plsh::PlshOptions options = plsh_options(base, 3, plsh::Kernel::Passes);
    check_against_float<Half>(problem, [&](auto q, auto k, auto v, auto out) {
      using Scalar = ScalarOf<decltype(out)>;
      const auto user_kernel =
          [](const plsh::ConstHeadMap<float>& block_q, const plsh::ConstHeadMap<float>& block_k,
             const plsh::ConstHeadMap<float>& block_v, const plsh::AttentionOptions& block_options,
             plsh::HeadMap<float> block_out, plsh::LseMap<float> lse) {
            plsh::RegularAttention{}(block_q, block_k, block_v, block_options, block_out, lse);
          };
      plsh::plsh_attention<Scalar>(q, k, v, out, slopes, options, user_kernel);
    });
  }
  {
    Problem<float> problem(shape, seed + 2, layout);
    INFO(shape << ", " << plsh_test::describe(base) << ", " << layout << ", fixed blocks");
    check_against_float<Half>(problem, [&](auto q, auto k, auto v, auto out) {
      using Scalar = ScalarOf<decltype(out)>;
      plsh::fixed_block_attention<Scalar>(q, k, v, out, 16, base);
    });
  }
}

template <class Half>
void sweep() {
  std::uint64_t seed = 4000;
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    for (const Index n : plsh_test::edge_lengths()) {
      check_kernels<Half>(Shape{n, n, 4, 2, 16, 12}, options, seed += 3, Layout::Packed);
    }
    check_kernels<Half>(Shape{130, 130, 4, 2, 16, 12}, options, seed += 3, Layout::HeadMajor);
    check_kernels<Half>(Shape{65, 130, 4, 4, 5, 9}, options, seed += 3, Layout::PaddedRows);
    // Unions wider than one key chunk (slope 0 heads see everything).
    check_kernels<Half>(Shape{600, 600, 1, 1, 8, 8}, options, seed += 3, Layout::Packed);
  }
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        check_kernels<Half>(Shape{c.n_q, c.n_k, 4, 2, 8, 6}, options, seed += 3, Layout::Packed);
      });
}

}  // namespace

TEST_CASE("bfloat16 storage: every kernel is the float kernel rounded once", "[plsh][half]") {
  sweep<Eigen::bfloat16>();
}

TEST_CASE("half storage: every kernel is the float kernel rounded once", "[plsh][half]") {
  sweep<Eigen::half>();
}

TEST_CASE("16-bit storage checks the scale in float, the compute type", "[plsh][half]") {
  Problem<float> wide(Shape{6, 7, 4, 2, 5, 3}, 4100);
  const HalfBuffer<Eigen::half> q(wide.q), k(wide.k), v(wide.v);
  HalfBuffer<Eigen::half> out(wide.out);
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
    plsh::PlshOptions options = plsh_options({}, 3, kernel);
    // 1e-9 is below half's smallest subnormal (6e-8), 1e5 above its largest value (65504): both
    // are fine in float.
    for (const double scale : {1e-9, 1e5}) {
      INFO("scale = " << scale);
      options.scale = scale;
      CHECK_NOTHROW(
          plsh::plsh_attention<Eigen::half>(q.in(), k.in(), v.in(), out.view, slopes, options));
    }
    for (const double scale : {1e39, 1e-46}) {
      INFO("scale = " << scale);
      options.scale = scale;
      REQUIRE_THROWS_AS(
          plsh::plsh_attention<Eigen::half>(q.in(), k.in(), v.in(), out.view, slopes, options),
          std::invalid_argument);
      CHECK_THROWS_WITH(
          plsh::plsh_attention<Eigen::half>(q.in(), k.in(), v.in(), out.view, slopes, options),
          Catch::Contains("plsh_attention") && Catch::Contains("options.scale"));
    }
  }
  plsh::AttentionOptions options;
  options.scale = 1e5;
  CHECK_NOTHROW(
      plsh::fixed_block_attention<Eigen::half>(q.in(), k.in(), v.in(), out.view, 4, options));
  options.scale = 1e39;
  REQUIRE_THROWS_AS(
      plsh::fixed_block_attention<Eigen::half>(q.in(), k.in(), v.in(), out.view, 4, options),
      std::invalid_argument);
  CHECK_THROWS_WITH(
      plsh::fixed_block_attention<Eigen::half>(q.in(), k.in(), v.in(), out.view, 4, options),
      Catch::Contains("fixed_block_attention") && Catch::Contains("options.scale"));
}

TEST_CASE("16-bit fused kernel: keys converted once per span or chunk by chunk in place agree",
          "[plsh][half]") {
  // fused_span converts the key and value rows a span of query rows may see into packed float
  // scratch once (when they are at most max_packed_keys, whatever the layout); with
  // max_packed_keys = 0 every tile converts its own chunks instead. Same arithmetic: the outputs
  // must agree bit for bit, and equal the float kernel's rounded once (within the bound of
  // check_against_float where kBf16Scores sums the scores in another order). Slopes from steep
  // to 0, causal and not, both layouts.
  const std::vector<double> slopes = {0.5, 1.0 / 40, 1.0 / 300, 0.0};
  for (const Layout layout : {Layout::Packed, Layout::HeadMajor}) {
    for (const bool causal : {true, false}) {
      plsh::AttentionOptions base;
      base.causal = causal;
      base.query_position = 40;
      const plsh::PlshOptions options = plsh_options(base, 5, plsh::Kernel::Fused);
      const auto grids = plsh::detail::kernel_grids(slopes, options, "fused_attention");
      Problem<float> problem(Shape{600, 640, 4, 2, 8, 6}, 4200, layout);
      INFO(layout << ", " << plsh_test::describe(base));
      check_against_float<Eigen::bfloat16>(
          problem,
          [&](auto q, auto k, auto v, auto out) {
            using Scalar = ScalarOf<decltype(out)>;
            plsh::plsh_attention<Scalar>(q, k, v, out, slopes, options);
          },
          &options);
      const HalfBuffer<Eigen::bfloat16> q(problem.q), k(problem.k), v(problem.v);
      HalfBuffer<Eigen::bfloat16> in_place(problem.out);
      HalfBuffer<Eigen::bfloat16> packed(problem.out);
      plsh::detail::fused_attention<Eigen::bfloat16>(q.in(), k.in(), v.in(), in_place.view, grids,
                                                     slopes, base, 0.0, 0);
      plsh::detail::fused_attention<Eigen::bfloat16>(q.in(), k.in(), v.in(), packed.view, grids,
                                                     slopes, base);
      Index differing = 0;
      for (std::size_t i = 0; i < packed.storage.size(); ++i) {
        if (std::memcmp(&packed.storage[i], &in_place.storage[i], sizeof(Eigen::bfloat16)) != 0) {
          ++differing;
        }
      }
      CHECK(differing == 0);
    }
  }
}

}  // namespace test_fused_half
