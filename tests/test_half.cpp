// Tests of the bfloat16 and half storage of the tiled kernels (regular.hpp, alibi_attention.hpp,
// backward.hpp, batch.hpp): exact, windowed and truncated ALiBi attention and four backward
// kernels on Eigen::bfloat16 and Eigen::half views.
//
// Oracle 1, the rounding alone: the float kernel run on the same inputs rounded to the storage
// type. A 16-bit kernel converts its tiles exactly to float and computes as the float kernel does,
// so its outputs are the float outputs rounded to nearest: within u |y| of the float result y
// (u = 2^-8 for bfloat16, 2^-11 for half), plus the float kernel's own error (3e-5 of the tensor's
// scale, as against the dense references; a copied tile may sum in another order) and half a
// subnormal step.
// Oracle 2, the error against float inputs: the 16-bit kernel on rounded inputs against the float
// kernel on the unrounded ones, relative Frobenius error; bounds derived below.

#include <catch2/catch.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/batch.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_half {

namespace {

using plsh::HeadsView;
using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::Problem;
using plsh_test::Shape;

static_assert(!plsh::detail::is_storage_type<int>, "int views are rejected at compile time");
static_assert(plsh::detail::is_storage_type<Eigen::bfloat16> &&
                  plsh::detail::is_storage_type<const Eigen::half>,
              "bfloat16 and half are storage types");

/// Unit roundoff of rounding to nearest: 2^-8 for bfloat16 (8 significant bits), 2^-11 for half.
template <class S>
constexpr double unit_roundoff() {
  return std::is_same<S, Eigen::bfloat16>::value ? 0x1p-8 : 0x1p-11;
}

template <class S>
const char* storage_name() {
  return std::is_same<S, Eigen::bfloat16>::value ? "bfloat16" : "half";
}

/// The float kernel's own error against an exact result, relative to the tensor's scale
/// (plsh_test::reference_tolerance<float>, also the backward's float bound).
constexpr double kFloatError = 3e-5;

/// Rounds every element of a float buffer to the nearest value of S, so that a float kernel and
/// an S kernel read the same numbers.
template <class S>
void round_through(Buffer<float>& buffer) {
  for (float& x : buffer.storage) x = static_cast<float>(static_cast<S>(x));
}

/// The elements of a float buffer in storage type S, in the same layout.
template <class S>
struct Stored {
  std::vector<S> storage;
  HeadsView<S> view{nullptr, 0, 1, 1};

  explicit Stored(const Buffer<float>& from) : storage(from.storage.size()) {
    for (std::size_t i = 0; i < storage.size(); ++i) storage[i] = static_cast<S>(from.storage[i]);
    view = HeadsView<S>{storage.data(), from.view.tokens,       from.view.heads,
                        from.view.dim,  from.view.token_stride, from.view.head_stride};
  }
  Stored(const Stored& other) : storage(other.storage), view(other.view) {
    view.data = storage.data();
  }
  Stored& operator=(const Stored&) = delete;

  HeadsView<const S> in() const { return view; }
};

template <class A>
double element(const HeadsView<A>& view, Index t, Index h, Index e) {
  return static_cast<double>(view.data[t * view.token_stride + h * view.head_stride + e]);
}

/// Every element of `got` within the rounding of the float result `expected`:
/// \f$|x - y| \le u|y| + \epsilon_f \max|y| + \text{denorm\_min}(S)/2\f$.
template <class S>
void require_rounded(const HeadsView<const S>& got, const HeadsView<const float>& expected,
                     const char* name) {
  REQUIRE(got.tokens == expected.tokens);
  REQUIRE(got.heads == expected.heads);
  REQUIRE(got.dim == expected.dim);
  double scale = 0;
  for (Index t = 0; t < expected.tokens; ++t)
    for (Index h = 0; h < expected.heads; ++h)
      for (Index e = 0; e < expected.dim; ++e) {
        scale = std::max(scale, std::abs(element(expected, t, h, e)));
      }
  const double floor =
      kFloatError * scale + static_cast<double>(std::numeric_limits<S>::denorm_min()) / 2;
  Index violations = 0;
  double worst = 0;  // largest |x - y| / (u |y| + floor)
  for (Index t = 0; t < expected.tokens; ++t)
    for (Index h = 0; h < expected.heads; ++h)
      for (Index e = 0; e < expected.dim; ++e) {
        const double x = element(got, t, h, e);
        const double y = element(expected, t, h, e);
        const double bound = unit_roundoff<S>() * std::abs(y) + floor;
        const double ratio = std::abs(x - y) / bound;
        if (!(ratio <= 1)) ++violations;
        if (!(ratio <= worst)) worst = std::isnan(ratio) ? ratio : std::max(worst, ratio);
      }
  INFO(name << ": scale " << scale << ", worst |x - y| / bound " << worst);
  CHECK(violations == 0);
}

/// Edge shapes: one token, a grouped head pair, ragged tiles (65 queries, 130 and 257 keys).
const Shape kShapes[] = {
    {1, 1, 2, 1, 8, 8},
    {65, 130, 4, 2, 16, 12},
    {130, 257, 2, 2, 8, 8},
};

/// Calls `check(name, kernel)` for each forward kernel; `kernel(q, k, v, out)` is generic over the
/// storage type.
template <class Check>
void for_each_forward(const std::vector<double>& slopes, const plsh::AttentionOptions& options,
                      Check&& check) {
  check("exact_alibi_attention", [&](auto q, auto k, auto v, auto out) {
    using S = std::remove_pointer_t<decltype(out.data)>;
    plsh::exact_alibi_attention<S>(q, k, v, out, slopes, options);
  });
  check("windowed_alibi_attention", [&](auto q, auto k, auto v, auto out) {
    using S = std::remove_pointer_t<decltype(out.data)>;
    plsh::windowed_alibi_attention<S>(q, k, v, out, slopes, 1e-3, options);
  });
  check("truncated_alibi_attention", [&](auto q, auto k, auto v, auto out) {
    using S = std::remove_pointer_t<decltype(out.data)>;
    plsh::truncated_alibi_attention<S>(q, k, v, out, slopes, 0.05, options);
  });
}

/// Calls `check(name, kernel)` for each backward kernel; `kernel(q, k, v, out, dout, dq, dk, dv)`.
template <class Check>
void for_each_backward(const std::vector<double>& slopes, const plsh::AttentionOptions& options,
                       Check&& check) {
  plsh::PlshOptions plsh_options;
  static_cast<plsh::AttentionOptions&>(plsh_options) = options;
  plsh_options.samples = 5;
  plsh_options.seed = 3;
  check("exact_alibi_attention_backward",
        [&](auto q, auto k, auto v, auto out, auto dout, auto dq, auto dk, auto dv) {
          using S = std::remove_pointer_t<decltype(dq.data)>;
          plsh::exact_alibi_attention_backward<S>(q, k, v, out, dout, dq, dk, dv, slopes, options);
        });
  check("truncated_alibi_attention_backward",
        [&](auto q, auto k, auto v, auto out, auto dout, auto dq, auto dk, auto dv) {
          using S = std::remove_pointer_t<decltype(dq.data)>;
          plsh::truncated_alibi_attention_backward<S>(q, k, v, out, dout, dq, dk, dv, slopes, 0.05,
                                                      options);
        });
  check("plsh_attention_backward",
        [=](auto q, auto k, auto v, auto out, auto dout, auto dq, auto dk, auto dv) {
          using S = std::remove_pointer_t<decltype(dq.data)>;
          plsh::plsh_attention_backward<S>(q, k, v, out, dout, dq, dk, dv, slopes, plsh_options);
        });
  check("fixed_block_attention_backward",
        [&](auto q, auto k, auto v, auto out, auto dout, auto dq, auto dk, auto dv) {
          using S = std::remove_pointer_t<decltype(dq.data)>;
          plsh::fixed_block_attention_backward<S>(q, k, v, out, dout, dq, dk, dv, 48, options);
        });
}

/// The problem of `shape` with q, k, v rounded to S.
template <class S>
Problem<float> rounded_problem(const Shape& shape, std::uint64_t seed, Layout layout) {
  Problem<float> problem(shape, seed, layout);
  round_through<S>(problem.q);
  round_through<S>(problem.k);
  round_through<S>(problem.v);
  return problem;
}

/// Every forward kernel in S against the float kernel on the same rounded inputs.
template <class S>
void check_forward(const Problem<float>& problem, const plsh::AttentionOptions& options) {
  const std::vector<double> slopes = plsh::alibi_slopes(problem.shape.heads);
  const Stored<S> q(problem.q), k(problem.k), v(problem.v);
  for_each_forward(slopes, options, [&](const char* name, const auto& kernel) {
    INFO(name << " in " << storage_name<S>() << ", " << problem.shape << ", "
              << plsh_test::describe(options));
    Buffer<float> expected = problem.out;
    kernel(problem.q.in(), problem.k.in(), problem.v.in(), expected.view);
    Stored<S> out(problem.out);
    kernel(q.in(), k.in(), v.in(), out.view);
    require_rounded<S>(out.in(), expected.in(), "out");
  });
}

/// Every backward kernel in S against the float kernel on the same rounded q, k, v, out, dout
/// (out is exact_alibi_attention's; any out exercises the same arithmetic).
template <class S>
void check_backward(Problem<float> problem, const plsh::AttentionOptions& options) {
  const Shape& shape = problem.shape;
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                     problem.out.view, slopes, options);
  round_through<S>(problem.out);
  Buffer<float> dout = problem.out;
  dout.fill_random(77);
  round_through<S>(dout);
  const Stored<S> q(problem.q), k(problem.k), v(problem.v), out(problem.out), dout_s(dout);
  for_each_backward(slopes, options, [&](const char* name, const auto& kernel) {
    INFO(name << " in " << storage_name<S>() << ", " << shape << ", "
              << plsh_test::describe(options));
    Buffer<float> dq = problem.q, dk = problem.k, dv = problem.v;
    kernel(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.in(), dout.in(), dq.view,
           dk.view, dv.view);
    Stored<S> dq_s(dq), dk_s(dk), dv_s(dv);
    kernel(q.in(), k.in(), v.in(), out.in(), dout_s.in(), dq_s.view, dk_s.view, dv_s.view);
    require_rounded<S>(dq_s.in(), dq.in(), "dq");
    require_rounded<S>(dk_s.in(), dk.in(), "dk");
    require_rounded<S>(dv_s.in(), dv.in(), "dv");
  });
}

/// Calls `check(problem, options)` on the edge shapes in every layout, causal and not, and on the
/// fixture's offset cases (chunked prefill, decoding one token, queries before every key, ...).
template <class S, class Check>
void for_each_case(Check&& check) {
  for (const Shape& shape : kShapes) {
    for (const Layout layout : {Layout::Packed, Layout::HeadMajor, Layout::PaddedRows}) {
      for (const bool causal : {true, false}) {
        plsh::AttentionOptions options;
        options.causal = causal;
        INFO(layout);
        check(rounded_problem<S>(shape, 11, layout), options);
      }
    }
  }
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& options) {
        check(rounded_problem<S>(Shape{c.n_q, c.n_k, 4, 2, 16, 12}, 13, Layout::Packed), options);
      });
}

/// A packed [B][tokens][heads][dim] batch of S.
template <class S>
plsh::BatchedHeadsView<S> batch_view(std::vector<S>& storage, Index batch, Index tokens,
                                     Index heads, Index dim) {
  return plsh::BatchedHeadsView<S>(batch, HeadsView<S>{storage.data(), tokens, heads, dim});
}

}  // namespace

TEMPLATE_TEST_CASE(
    "Half storage: every kernel and backward is the float kernel on the rounded "
    "inputs, rounded",
    "[half]", Eigen::bfloat16, Eigen::half) {
  using S = TestType;
  for_each_case<S>([](const Problem<float>& problem, const plsh::AttentionOptions& options) {
    check_forward<S>(problem, options);
    check_backward<S>(problem, options);
  });
}

TEMPLATE_TEST_CASE("Half storage: batched kernels equal the loop over the batch bit for bit",
                   "[half][batch]", Eigen::bfloat16, Eigen::half) {
  using S = TestType;
  constexpr Index kBatch = 3;
  const Shape shape{65, 130, 4, 2, 16, 12};
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  const auto filled = [](std::size_t count, std::uint64_t seed, double amplitude) {
    std::vector<S> values(count);
    const std::vector<double> draws = plsh_test::uniform_values<double>(count, seed, amplitude);
    for (std::size_t i = 0; i < count; ++i) values[i] = static_cast<S>(draws[i]);
    return values;
  };
  const Index q_size = kBatch * shape.n_q * shape.heads * shape.dim;
  const Index k_size = kBatch * shape.n_k * shape.kv_heads * shape.dim;
  const Index v_size = kBatch * shape.n_k * shape.kv_heads * shape.value_dim;
  const Index out_size = kBatch * shape.n_q * shape.heads * shape.value_dim;
  std::vector<S> q = filled(static_cast<std::size_t>(q_size), 1, 3.0);
  std::vector<S> k = filled(static_cast<std::size_t>(k_size), 2, 1.0);
  std::vector<S> v = filled(static_cast<std::size_t>(v_size), 3, 1.0);
  std::vector<S> dout = filled(static_cast<std::size_t>(out_size), 4, 1.0);
  const plsh::BatchedHeadsView<const S> q_view =
      batch_view(q, kBatch, shape.n_q, shape.heads, shape.dim);
  const plsh::BatchedHeadsView<const S> k_view =
      batch_view(k, kBatch, shape.n_k, shape.kv_heads, shape.dim);
  const plsh::BatchedHeadsView<const S> v_view =
      batch_view(v, kBatch, shape.n_k, shape.kv_heads, shape.value_dim);
  const plsh::BatchedHeadsView<const S> dout_view =
      batch_view(dout, kBatch, shape.n_q, shape.heads, shape.value_dim);
  plsh::AttentionOptions options;
  options.query_position = 65;
  for_each_forward(slopes, options, [&](const char* name, const auto& kernel) {
    INFO(name << " in " << storage_name<S>());
    std::vector<S> looped(static_cast<std::size_t>(out_size));
    std::vector<S> together(looped.size());
    const auto looped_view = batch_view(looped, kBatch, shape.n_q, shape.heads, shape.value_dim);
    for (Index b = 0; b < kBatch; ++b) kernel(q_view[b], k_view[b], v_view[b], looped_view[b]);
    kernel(q_view, k_view, v_view,
           batch_view(together, kBatch, shape.n_q, shape.heads, shape.value_dim));
    CHECK(std::memcmp(looped.data(), together.data(), looped.size() * sizeof(S)) == 0);
  });
  // Any out exercises the same arithmetic: dout serves as out.
  for_each_backward(slopes, options, [&](const char* name, const auto& kernel) {
    INFO(name << " in " << storage_name<S>());
    std::vector<S> looped(static_cast<std::size_t>(q_size + k_size + v_size));
    std::vector<S> together(looped.size());
    const auto gradients = [&](std::vector<S>& storage) {
      S* data = storage.data();
      return std::vector<plsh::BatchedHeadsView<S>>{
          plsh::BatchedHeadsView<S>(kBatch, HeadsView<S>{data, shape.n_q, shape.heads, shape.dim}),
          plsh::BatchedHeadsView<S>(
              kBatch, HeadsView<S>{data + q_size, shape.n_k, shape.kv_heads, shape.dim}),
          plsh::BatchedHeadsView<S>(kBatch, HeadsView<S>{data + q_size + k_size, shape.n_k,
                                                         shape.kv_heads, shape.value_dim})};
    };
    const auto l = gradients(looped);
    for (Index b = 0; b < kBatch; ++b) {
      kernel(q_view[b], k_view[b], v_view[b], dout_view[b], dout_view[b], l[0][b], l[1][b],
             l[2][b]);
    }
    const auto t = gradients(together);
    kernel(q_view, k_view, v_view, dout_view, dout_view, t[0], t[1], t[2]);
    CHECK(std::memcmp(looped.data(), together.data(), looped.size() * sizeof(S)) == 0);
  });
}

namespace {

/// A relative error of a kernel's result and the bound it is held to, in units of the roundoff.
struct NamedError {
  std::string name;
  double error;
  double bound;
};

/// Relative Frobenius errors of the S kernels on inputs rounded from float against the float
/// kernels on the float inputs, causal: every forward's output (bound 2u), then exact ALiBi's dq,
/// dk, dv (bound 3u).
template <class S>
std::vector<NamedError> errors_against_float(const Shape& shape) {
  plsh::AttentionOptions options;
  options.causal = true;
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  Problem<float> problem(shape, 21);
  const Stored<S> q(problem.q), k(problem.k), v(problem.v);
  std::vector<NamedError> errors;
  for_each_forward(slopes, options, [&](const char* name, const auto& kernel) {
    kernel(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view);
    Stored<S> out(problem.out);
    kernel(q.in(), k.in(), v.in(), out.view);
    errors.push_back({std::string(name) + " out",
                      plsh_test::relative_frobenius_error(out.in(), problem.out.in()), 2});
  });
  plsh::exact_alibi_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                     problem.out.view, slopes, options);
  Buffer<float> dout = problem.out;
  dout.fill_random(23);
  Buffer<float> dq = problem.q, dk = problem.k, dv = problem.v;
  plsh::exact_alibi_attention_backward<float>(problem.q.in(), problem.k.in(), problem.v.in(),
                                              problem.out.in(), dout.in(), dq.view, dk.view,
                                              dv.view, slopes, options);
  const Stored<S> out(problem.out), dout_s(dout);
  Stored<S> dq_s(dq), dk_s(dk), dv_s(dv);
  plsh::exact_alibi_attention_backward<S>(q.in(), k.in(), v.in(), out.in(), dout_s.in(), dq_s.view,
                                          dk_s.view, dv_s.view, slopes, options);
  errors.push_back({"exact dq", plsh_test::relative_frobenius_error(dq_s.in(), dq.in()), 3});
  errors.push_back({"exact dk", plsh_test::relative_frobenius_error(dk_s.in(), dk.in()), 3});
  errors.push_back({"exact dv", plsh_test::relative_frobenius_error(dv_s.in(), dv.in()), 3});
  return errors;
}

}  // namespace

TEMPLATE_TEST_CASE("Half storage: relative error against float inputs", "[half]", Eigen::bfloat16,
                   Eigen::half) {
  using S = TestType;
  // Each rounding errs by at most u relative, about u/sqrt(3) rms (uniform in [-u, u]). A logit
  // scale q.k with q in [-3, 3], k in [-1, 1], d = 64, scale 1/8 moves by about
  // scale sqrt(2 d E[q^2] E[k^2]) u/sqrt(3) = 0.8u absolute, which moves the weights by as much
  // relative but mostly cancels in the normalised output; the rounding of v and of out adds
  // u/sqrt(3) rms each: about 0.7u for out (measured 0.72u). The gradients sum products of two
  // such factors (P and dP - D): about 1.0u (measured 1.0-1.1u). Bounds 2u and 3u.
  for (const NamedError& e : errors_against_float<S>(Shape{512, 512, 4, 2, 64, 64})) {
    INFO(e.name << " in " << storage_name<S>() << ": " << e.error << " = "
                << e.error / unit_roundoff<S>() << " u");
    CHECK(e.error <= e.bound * unit_roundoff<S>());
  }
}

// The figures of the README (8 heads, d = 64, n = 2048, causal): run with
// `build/release/tests/plsh_unit_tests "[.report]"`.
TEMPLATE_TEST_CASE("Half storage: error against float inputs on the benchmark problem", "[.report]",
                   Eigen::bfloat16, Eigen::half) {
  using S = TestType;
  const std::vector<NamedError> errors = errors_against_float<S>(Shape{2048, 2048, 8, 8, 64, 64});
  for (const NamedError& e : errors) {
    WARN(storage_name<S>() << " " << e.name << ": relative error " << e.error);
  }
  // The fused Positional LSH kernel (the defaults) on the same problem.
  Problem<float> problem(Shape{2048, 2048, 8, 8, 64, 64}, 21);
  const std::vector<double> slopes = plsh::alibi_slopes(8);
  plsh::PlshOptions plsh_options;
  plsh_options.causal = true;
  plsh::plsh_attention<float>(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view,
                              slopes, plsh_options);
  const Stored<S> q(problem.q), k(problem.k), v(problem.v);
  Stored<S> out(problem.out);
  plsh::plsh_attention<S>(q.in(), k.in(), v.in(), out.view, slopes, plsh_options);
  const double fused = plsh_test::relative_frobenius_error(out.in(), problem.out.in());
  WARN(storage_name<S>() << " fused out (the defaults): relative error " << fused);
  const double bound = std::is_same<S, Eigen::bfloat16>::value ? 1e-2 : 2e-3;
  CHECK(errors.front().error <= bound);
  CHECK(fused <= bound);
}

TEMPLATE_TEST_CASE("Half storage: the scale is checked in float, the compute type", "[half]",
                   Eigen::bfloat16, Eigen::half) {
  using S = TestType;
  Problem<float> problem(Shape{3, 3, 2, 2, 4, 4}, 5);
  const Stored<S> q(problem.q), k(problem.k), v(problem.v);
  Stored<S> out(problem.out);
  const std::vector<double> slopes = plsh::alibi_slopes(2);
  plsh::AttentionOptions options;
  options.scale = 1e39;  // finite in double, infinite in float
  REQUIRE_THROWS_WITH(
      plsh::exact_alibi_attention<S>(q.in(), k.in(), v.in(), out.view, slopes, options),
      Catch::Contains("options.scale must be finite and non-zero in the compute "
                      "type"));
  Stored<S> dq(problem.q), dk(problem.k), dv(problem.v);
  REQUIRE_THROWS_AS(
      plsh::exact_alibi_attention_backward<S>(q.in(), k.in(), v.in(), out.in(), out.in(), dq.view,
                                              dk.view, dv.view, slopes, options),
      std::invalid_argument);
  // 1e-30 would be zero in half; in float, where the kernels compute, it is a usable scale.
  options.scale = 1e-30;
  REQUIRE_NOTHROW(
      plsh::exact_alibi_attention<S>(q.in(), k.in(), v.in(), out.view, slopes, options));
  REQUIRE_NOTHROW(plsh::exact_alibi_attention_backward<S>(
      q.in(), k.in(), v.in(), out.in(), out.in(), dq.view, dk.view, dv.view, slopes, options));
}

TEMPLATE_TEST_CASE("Half storage: argument errors name the argument", "[half]", Eigen::bfloat16,
                   Eigen::half) {
  using S = TestType;
  Problem<float> problem(Shape{3, 4, 2, 2, 4, 4}, 5);
  const Stored<S> q(problem.q), k(problem.k), v(problem.v);
  Stored<S> out(problem.out);
  HeadsView<S> short_out = out.view;
  short_out.tokens = 2;
  REQUIRE_THROWS_WITH(
      plsh::windowed_alibi_attention<S>(q.in(), k.in(), v.in(), short_out, plsh::alibi_slopes(2)),
      Catch::Contains("out.tokens must equal q.tokens"));
  Stored<S> dq(problem.q), dk(problem.k);
  REQUIRE_THROWS_WITH(plsh::fixed_block_attention_backward<S>(
                          q.in(), k.in(), v.in(), out.in(), out.in(), dq.view, dk.view, dq.view, 4),
                      Catch::Contains("dv"));
}

}  // namespace test_half
