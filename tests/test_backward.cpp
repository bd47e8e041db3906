// Tests of attention/backward.hpp: the gradients of exact ALiBi, truncated ALiBi and Positional
// LSH attention against central finite differences of the forward kernels, against the dense
// double reference (plsh::reference::*_backward), the convergence of the Positional LSH gradients
// to the exact ones as the number of draws grows, the one sweep against the two sweeps,
// independence from the thread count (of either path), and every rejected argument.
//
// The loss is L = sum(dout o out) for a fixed random dout, so dL/dout = dout and the backward's
// dq, dk, dv are dL/dq, dL/dk, dL/dv. Errors are measured per tensor as
// max |x - x_ref| / max |x_ref|, the error relative to the tensor's scale.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/detail/random.hpp>
#include <plsh/reference.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"
#include "thread_count.hpp"

namespace test_backward {

namespace {

using plsh::HeadsView;
using plsh::Index;

using plsh_test::Buffer;
using plsh_test::Shape;

/// The attention fixture's problem (q, k uniform in [-amplitude, amplitude], v in [-1, 1], out),
/// packed `[tokens][heads][dim]`, with the output gradient dout in [-1, 1] and the gradients dq,
/// dk, dv.
template <class Scalar>
struct Problem : plsh_test::Problem<Scalar> {
  using Base = plsh_test::Problem<Scalar>;
  using Base::k;
  using Base::out;
  using Base::q;
  using Base::shape;
  using Base::v;
  Buffer<Scalar> dout, dq, dk, dv;

  Problem(const Shape& s, std::uint64_t seed, double amplitude)
      : Base(s, seed, plsh_test::Layout::Packed, amplitude, amplitude),
        dout(this->output()),
        dq(s.n_q, s.heads, s.dim),
        dk(s.n_k, s.kv_heads, s.dim),
        dv(s.n_k, s.kv_heads, s.value_dim) {
    dout.fill_random(plsh::detail::mix64(seed * 4 + 3));
    out.fill(Scalar(0));
    // Gradients start as garbage: the backward must overwrite, not accumulate.
    dq.fill(Scalar(7));
    dk.fill(Scalar(7));
    dv.fill(Scalar(7));
  }

  /// The same values in another scalar type.
  template <class Other>
  Problem<Other> cast() const {
    Problem<Other> other(shape, 0, 1.0);
    const auto convert = [](const Buffer<Scalar>& from, Buffer<Other>& to) {
      for (std::size_t i = 0; i < from.storage.size(); ++i) {
        to.storage[i] = static_cast<Other>(from.storage[i]);
      }
    };
    convert(q, other.q);
    convert(k, other.k);
    convert(v, other.v);
    convert(out, other.out);
    convert(dout, other.dout);
    return other;
  }

  HeadsView<const Scalar> q_view() const { return q.in(); }
  HeadsView<const Scalar> k_view() const { return k.in(); }
  HeadsView<const Scalar> v_view() const { return v.in(); }
  HeadsView<const Scalar> out_view() const { return out.in(); }
  HeadsView<Scalar> out_mutable() { return out.view; }
  HeadsView<const Scalar> dout_view() const { return dout.in(); }
  HeadsView<Scalar> dq_view() { return dq.view; }
  HeadsView<Scalar> dk_view() { return dk.view; }
  HeadsView<Scalar> dv_view() { return dv.view; }
};

enum class Method { Exact, Truncated, Plsh };

/// One forward function: exact ALiBi, ALiBi truncated at `factor_tolerance`, or Positional LSH
/// with `options.samples` draws.
struct Case {
  std::string name;
  Method method;
  plsh::PlshOptions options;
  double factor_tolerance = 0;
};

Case make_case(const std::string& name, Method method, Index samples, bool causal,
               Index query_position, Index key_position) {
  Case c{name, method, {}};
  c.options.samples = samples;
  c.options.seed = 5;
  c.options.causal = causal;
  c.options.query_position = query_position;
  c.options.key_position = key_position;
  return c;
}

Case truncated_case(const std::string& name, double factor_tolerance, bool causal,
                    Index query_position, Index key_position) {
  Case c = make_case(name, Method::Truncated, 1, causal, query_position, key_position);
  c.factor_tolerance = factor_tolerance;
  return c;
}

template <class Scalar>
void forward(const Case& c, Problem<Scalar>& p, const std::vector<double>& slopes) {
  if (c.method == Method::Exact) {
    plsh::exact_alibi_attention<Scalar>(p.q_view(), p.k_view(), p.v_view(), p.out_mutable(), slopes,
                                        c.options);
  } else if (c.method == Method::Truncated) {
    plsh::truncated_alibi_attention<Scalar>(p.q_view(), p.k_view(), p.v_view(), p.out_mutable(),
                                            slopes, c.factor_tolerance, c.options);
  } else {
    plsh::plsh_attention<Scalar>(p.q_view(), p.k_view(), p.v_view(), p.out_mutable(), slopes,
                                 c.options);
  }
}

template <class Scalar>
void backward(const Case& c, Problem<Scalar>& p, const std::vector<double>& slopes) {
  if (c.method == Method::Exact) {
    plsh::exact_alibi_attention_backward<Scalar>(p.q_view(), p.k_view(), p.v_view(), p.out_view(),
                                                 p.dout_view(), p.dq_view(), p.dk_view(),
                                                 p.dv_view(), slopes, c.options);
  } else if (c.method == Method::Truncated) {
    plsh::truncated_alibi_attention_backward<Scalar>(
        p.q_view(), p.k_view(), p.v_view(), p.out_view(), p.dout_view(), p.dq_view(), p.dk_view(),
        p.dv_view(), slopes, c.factor_tolerance, c.options);
  } else {
    plsh::plsh_attention_backward<Scalar>(p.q_view(), p.k_view(), p.v_view(), p.out_view(),
                                          p.dout_view(), p.dq_view(), p.dk_view(), p.dv_view(),
                                          slopes, c.options);
  }
}

void reference_backward(const Case& c, Problem<double>& p, const std::vector<double>& slopes) {
  if (c.method == Method::Exact) {
    plsh::reference::alibi_attention_backward<double>(p.q_view(), p.k_view(), p.v_view(),
                                                      p.dout_view(), p.dq_view(), p.dk_view(),
                                                      p.dv_view(), slopes, c.options);
  } else if (c.method == Method::Truncated) {
    plsh::reference::truncated_alibi_attention_backward<double>(
        p.q_view(), p.k_view(), p.v_view(), p.dout_view(), p.dq_view(), p.dk_view(), p.dv_view(),
        slopes, c.factor_tolerance, c.options);
  } else {
    plsh::reference::plsh_attention_backward<double>(p.q_view(), p.k_view(), p.v_view(),
                                                     p.dout_view(), p.dq_view(), p.dk_view(),
                                                     p.dv_view(), slopes, c.options);
  }
}

/// max |actual - expected| / max |expected|.
template <class A, class B>
double relative_error(const std::vector<A>& actual, const std::vector<B>& expected) {
  double difference = 0;
  double scale = 0;
  for (std::size_t i = 0; i < expected.size(); ++i) {
    difference = std::max(
        difference, std::abs(static_cast<double>(actual[i]) - static_cast<double>(expected[i])));
    scale = std::max(scale, std::abs(static_cast<double>(expected[i])));
  }
  return difference / scale;
}

/// relative_error, and 0 for equal tensors (a gradient that is exactly 0: that of the only key
/// of a row, of a query that sees one key).
template <class A, class B>
double difference(const std::vector<A>& actual, const std::vector<B>& expected) {
  return actual == expected ? 0.0 : relative_error(actual, expected);
}

double loss(const Case& c, Problem<double>& p, const std::vector<double>& slopes) {
  forward(c, p, slopes);
  double sum = 0;
  for (std::size_t i = 0; i < p.out.storage.size(); ++i)
    sum += p.dout.storage[i] * p.out.storage[i];
  return sum;
}

/// Central differences (L(x + h) - L(x - h)) / 2h of every element of `values`.
std::vector<double> finite_differences(const Case& c, Problem<double>& p, Buffer<double>& buffer,
                                       const std::vector<double>& slopes, double step) {
  std::vector<double>& values = buffer.storage;
  std::vector<double> gradient(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) {
    const double original = values[i];
    values[i] = original + step;
    const double plus = loss(c, p, slopes);
    values[i] = original - step;
    const double minus = loss(c, p, slopes);
    values[i] = original;
    gradient[i] = (plus - minus) / (2 * step);
  }
  return gradient;
}

/// The forward of case c writing its row lse to `lse` (`[H][n_q]`).
void forward_writing_lse(const Case& c, Problem<float>& p, const std::vector<double>& slopes,
                         std::vector<float>& lse) {
  lse.assign(static_cast<std::size_t>(p.shape.heads * p.shape.n_q), 0.0f);
  const plsh::RowLse<float> row_lse(lse.data(), p.shape.heads, p.shape.n_q);
  if (c.method == Method::Exact) {
    plsh::exact_alibi_attention<float>(p.q_view(), p.k_view(), p.v_view(), p.out_mutable(), slopes,
                                       c.options, row_lse);
  } else if (c.method == Method::Truncated) {
    plsh::truncated_alibi_attention<float>(p.q_view(), p.k_view(), p.v_view(), p.out_mutable(),
                                           slopes, c.factor_tolerance, c.options, row_lse);
  } else {
    plsh::plsh_attention<float>(p.q_view(), p.k_view(), p.v_view(), p.out_mutable(), slopes,
                                c.options, row_lse);
  }
}

/// The backward of case c by detail::attention_backward on the given sweeps, with the logits of
/// its public function and the forward's lse when `lse` is not empty.
void backward_by_sweeps(const Case& c, Problem<float>& p, const std::vector<double>& slopes,
                        const std::vector<float>& lse, plsh::detail::BackwardSweeps sweeps) {
  namespace detail = plsh::detail;
  const auto q = detail::batch_of_one(p.q_view());
  const auto k = detail::batch_of_one(p.k_view());
  plsh::AttentionOptions resolved = c.options;
  resolved.scale = detail::resolved_scale(c.options, p.shape.dim);
  const plsh::RowLse<const float> row_lse =
      lse.empty() ? plsh::RowLse<const float>()
                  : plsh::RowLse<const float>(lse.data(), p.shape.heads, p.shape.n_q);
  const auto run = [&](const auto& logits) {
    detail::attention_backward<float>(
        q, k, detail::batch_of_one(p.v_view()), detail::batch_of_one(p.out_view()),
        detail::batch_of_one(p.dout_view()), detail::batch_of_one(p.dq_view()),
        detail::batch_of_one(p.dk_view()), detail::batch_of_one(p.dv_view()), resolved, logits,
        row_lse, sweeps);
  };
  if (c.method == Method::Plsh) {
    const auto grids = detail::kernel_grids(slopes, c.options, "plsh_attention_backward");
    run(detail::PlshLogits<float>(slopes, grids, resolved, detail::position_range(q, k, c.options),
                                  p.shape.n_q, p.shape.n_k, c.options.near_field));
  } else {
    run(detail::AlibiLogits<float>(slopes, resolved, p.shape.n_q, p.shape.n_k, c.factor_tolerance));
  }
}

const std::vector<Case>& forward_cases() {
  static const std::vector<Case> cases = {
      make_case("exact, causal", Method::Exact, 1, true, 0, 0),
      make_case("exact, bidirectional", Method::Exact, 1, false, 0, 0),
      make_case("exact, causal, offsets", Method::Exact, 1, true, 6, 3),
      make_case("exact, bidirectional, offsets", Method::Exact, 1, false, 2, 9),
      // Factor tolerance 0.3: bands of 2 and 9 positions for the slopes 0.5 and 0.125 of the
      // finite differences, narrower than their 12 to 15 positions.
      truncated_case("truncated 0.3, causal", 0.3, true, 0, 0),
      truncated_case("truncated 0.3, bidirectional", 0.3, false, 0, 0),
      truncated_case("truncated 0.3, causal, offsets", 0.3, true, 6, 3),
      truncated_case("truncated 0.3, bidirectional, offsets", 0.3, false, 2, 9),
      make_case("plsh s = 3, causal", Method::Plsh, 3, true, 0, 0),
      make_case("plsh s = 3, bidirectional", Method::Plsh, 3, false, 0, 0),
      make_case("plsh s = 3, causal, offsets", Method::Plsh, 3, true, 6, 3),
      make_case("plsh s = 20, causal", Method::Plsh, 20, true, 0, 0),
      make_case("plsh s = 20, bidirectional, offsets", Method::Plsh, 20, false, 2, 9),
      make_case("plsh s = 20, causal, offsets", Method::Plsh, 20, true, 6, 3),
  };
  return cases;
}

}  // namespace

TEST_CASE("backward equals central finite differences of the forward", "[backward]") {
  // Steep slopes, so that n = 12 positions span several blocks and the factor varies.
  const std::vector<double> slopes = {0.5, 0.125};
  // Step: the central difference errs by h^2 |L'''| / 6 (truncation) plus about eps |L| / h
  // (rounding of L, eps = 2.2e-16). With |L|, |L'''| of order 1 the sum is smallest at
  // h = (3 eps)^(1/3) ~ 1e-5, where both terms are ~2e-11: far below the 1e-6 asked of the
  // gradients, whose scale is of order 0.1 - 1.
  const double step = 1e-5;
  for (const Case& c : forward_cases()) {
    // With offsets the query and key spans differ: 12 queries against 15 keys.
    const bool offsets = c.options.query_position != 0 || c.options.key_position != 0;
    const Shape shape{12, offsets ? 15 : 12, 2, 1, 4, 3};
    Problem<double> p(shape, 11, 1.5);
    forward(c, p, slopes);
    backward(c, p, slopes);
    Problem<double> probe = p;
    const std::vector<double> dq = finite_differences(c, probe, probe.q, slopes, step);
    const std::vector<double> dk = finite_differences(c, probe, probe.k, slopes, step);
    const std::vector<double> dv = finite_differences(c, probe, probe.v, slopes, step);
    const double error_q = relative_error(p.dq.storage, dq);
    const double error_k = relative_error(p.dk.storage, dk);
    const double error_v = relative_error(p.dv.storage, dv);
    INFO(c.name << ": max relative error dq " << error_q << ", dk " << error_k << ", dv " << error_v
                << " (step " << step << ")");
    CHECK(error_q <= 1e-6);
    CHECK(error_k <= 1e-6);
    CHECK(error_v <= 1e-6);
  }
}

TEST_CASE("backward equals the dense reference in double and in float", "[backward]") {
  // Four query heads on two key/value heads, slopes from steep to 0 (one block: plain attention),
  // more rows than one tile, queries before the first key (rows that see nothing when causal).
  const std::vector<double> slopes = {0.3, 0.05, 0.0, 1.0 / 64};
  const Shape shape{150, 170, 4, 2, 8, 5};
  std::vector<Case> cases = {
      make_case("exact, causal", Method::Exact, 1, true, 0, 0),
      make_case("exact, bidirectional, offsets", Method::Exact, 1, false, 40, 7),
      make_case("exact, causal, queries before the keys", Method::Exact, 1, true, 0, 5),
      // Bands of 7, 46, every key and 147 positions at 0.1; 23, 138, every key at 1e-3.
      truncated_case("truncated 0.1, causal", 0.1, true, 0, 0),
      truncated_case("truncated 0.1, bidirectional", 0.1, false, 0, 0),
      truncated_case("truncated 1e-3, bidirectional, offsets", 1e-3, false, 40, 7),
      truncated_case("truncated 0.1, causal, queries before the keys", 0.1, true, 0, 5),
      make_case("plsh s = 3, causal", Method::Plsh, 3, true, 0, 0),
      make_case("plsh s = 20, causal, offsets", Method::Plsh, 20, true, 30, 10),
      make_case("plsh s = 20, bidirectional, offsets", Method::Plsh, 20, false, 40, 7),
      make_case("plsh s = 20, causal, queries before the keys", Method::Plsh, 20, true, 0, 5),
  };
  for (const Case& c : cases) {
    Problem<double> p(shape, 23, 2.0);
    forward(c, p, slopes);
    backward(c, p, slopes);
    Problem<double> expected = p;
    reference_backward(c, expected, slopes);
    {
      // Double: the kernel and the reference sum the same O(n) terms in different orders; each
      // gradient is a sum of ~170 products of order 1, so rounding stays within ~1e-13.
      const double error_q = relative_error(p.dq.storage, expected.dq.storage);
      const double error_k = relative_error(p.dk.storage, expected.dk.storage);
      const double error_v = relative_error(p.dv.storage, expected.dv.storage);
      INFO(c.name << " (double): relative error dq " << error_q << ", dk " << error_k << ", dv "
                  << error_v);
      CHECK(error_q <= 1e-11);
      CHECK(error_k <= 1e-11);
      CHECK(error_v <= 1e-11);
    }
    {
      // Float: the same inputs rounded to float; the float kernel against the double reference of
      // those float inputs. A logit sums d = 8 products of size <= 4 times scale 1/sqrt(8), so
      // |l| <= 11 and its rounding is at most ~d eps_f |l| = 8 * 6e-8 * 11 = 5e-6 in the worst
      // case; exp turns that into the same relative error of P, which the gradients inherit
      // linearly (plus their own sums, ~sqrt(n) eps_f): 3e-5 leaves room for the worst case.
      Problem<float> f = p.template cast<float>();
      forward(c, f, slopes);
      backward(c, f, slopes);
      Problem<double> from_float = f.template cast<double>();
      reference_backward(c, from_float, slopes);
      const double error_q = relative_error(f.dq.storage, from_float.dq.storage);
      const double error_k = relative_error(f.dk.storage, from_float.dk.storage);
      const double error_v = relative_error(f.dv.storage, from_float.dv.storage);
      INFO(c.name << " (float): relative error dq " << error_q << ", dk " << error_k << ", dv "
                  << error_v);
      CHECK(error_q <= 3e-5);
      CHECK(error_k <= 3e-5);
      CHECK(error_v <= 3e-5);
    }
  }
}

TEST_CASE("backward with strided views equals the packed result", "[backward]") {
  // Head-major q and dq, padded token rows for the others: the same numbers must come out.
  const std::vector<double> slopes = {0.2, 0.02};
  const Shape shape{40, 40, 2, 1, 6, 4};
  const Case c = make_case("plsh s = 8, causal", Method::Plsh, 8, true, 0, 0);
  Problem<double> p(shape, 3, 1.0);
  forward(c, p, slopes);
  backward(c, p, slopes);
  // q head-major: element (t, h, e) at h * (40 * 6) + t * 6 + e.
  std::vector<double> q_head_major(p.q.storage.size());
  for (Index t = 0; t < 40; ++t) {
    for (Index h = 0; h < 2; ++h) {
      for (Index e = 0; e < 6; ++e) {
        q_head_major[static_cast<std::size_t>(h * 240 + t * 6 + e)] =
            p.q.storage[static_cast<std::size_t>(t * 12 + h * 6 + e)];
      }
    }
  }
  std::vector<double> dq_head_major(p.q.storage.size(), 7);
  std::vector<double> dk_padded(40 * 9, 7);  // token stride 9 for 6 elements
  std::vector<double> dv_padded(40 * 5, 7);  // token stride 5 for 4 elements
  plsh::plsh_attention_backward<double>(
      HeadsView<const double>{q_head_major.data(), 40, 2, 6, 6, 240}, p.k_view(), p.v_view(),
      p.out_view(), p.dout_view(), HeadsView<double>{dq_head_major.data(), 40, 2, 6, 6, 240},
      HeadsView<double>{dk_padded.data(), 40, 1, 6, 9, 6},
      HeadsView<double>{dv_padded.data(), 40, 1, 4, 5, 4}, slopes, c.options);
  for (Index t = 0; t < 40; ++t) {
    INFO("token " << t);
    for (Index e = 0; e < 6; ++e) {
      for (Index h = 0; h < 2; ++h) {
        CHECK(dq_head_major[static_cast<std::size_t>(h * 240 + t * 6 + e)] ==
              p.dq.storage[static_cast<std::size_t>(t * 12 + h * 6 + e)]);
      }
      CHECK(dk_padded[static_cast<std::size_t>(t * 9 + e)] ==
            p.dk.storage[static_cast<std::size_t>(t * 6 + e)]);
    }
    for (Index e = 0; e < 4; ++e) {
      CHECK(dv_padded[static_cast<std::size_t>(t * 5 + e)] ==
            p.dv.storage[static_cast<std::size_t>(t * 4 + e)]);
    }
    CHECK(dk_padded[static_cast<std::size_t>(t * 9 + 7)] == 7);  // padding untouched
  }
}

TEST_CASE("Positional LSH gradients approach the exact ALiBi gradients as s grows",
          "[backward][statistical]") {
  // K_hat = (1/s) sum_t M_t has independent draws, so its entries err by O(s^(-1/2)); the
  // gradients are smooth functions of K_hat (ratios of sums weighted by it), so their error is
  // O(s^(-1/2)) too, plus an O(1/s) bias of the ratio. From s = 16 to 256 to 4096 the mean error
  // should fall by sqrt(16) = 4 at each step. The check asks for a factor 2. Across seeds the
  // error has a coefficient of variation of about 0.27 at s = 16 and 0.17 beyond (measured over
  // 32 seeds), so the mean of 8 seeds has a relative standard error near 0.1 and the ratio of two
  // such means a log-spread near 0.11: a true factor 4 seen as less than 2 (a log-deviation of
  // ln 2 = 0.69) would be a > 6 sigma event.
  const std::vector<double> slopes = {0.25, 1.0 / 16};
  const Shape shape{48, 48, 2, 1, 8, 8};
  const Case exact = make_case("exact", Method::Exact, 1, true, 0, 0);
  Problem<double> reference(shape, 41, 1.0);
  forward(exact, reference, slopes);
  backward(exact, reference, slopes);
  const auto norm = [](const std::vector<double>& x) {
    double sum = 0;
    for (const double value : x) sum += value * value;
    return sum;
  };
  const double reference_norm = std::sqrt(norm(reference.dq.storage) + norm(reference.dk.storage) +
                                          norm(reference.dv.storage));
  const std::vector<Index> sample_counts = {16, 256, 4096};
  const int seeds = 8;
  std::vector<double> mean_errors;
  for (const Index samples : sample_counts) {
    double total = 0;
    for (int seed = 0; seed < seeds; ++seed) {
      Case c = make_case("plsh", Method::Plsh, samples, true, 0, 0);
      c.options.seed = static_cast<std::uint64_t>(seed);
      Problem<double> p = reference;
      forward(c, p, slopes);
      backward(c, p, slopes);
      std::vector<double> difference;
      for (std::size_t i = 0; i < p.dq.storage.size(); ++i)
        difference.push_back(p.dq.storage[i] - reference.dq.storage[i]);
      for (std::size_t i = 0; i < p.dk.storage.size(); ++i)
        difference.push_back(p.dk.storage[i] - reference.dk.storage[i]);
      for (std::size_t i = 0; i < p.dv.storage.size(); ++i)
        difference.push_back(p.dv.storage[i] - reference.dv.storage[i]);
      total += std::sqrt(norm(difference)) / reference_norm;
    }
    mean_errors.push_back(total / seeds);
  }
  INFO("mean relative error of (dq, dk, dv) over " << seeds << " seeds: s = 16: " << mean_errors[0]
                                                   << ", s = 256: " << mean_errors[1]
                                                   << ", s = 4096: " << mean_errors[2]);
  CHECK(mean_errors[1] < mean_errors[0] / 2);
  CHECK(mean_errors[2] < mean_errors[1] / 2);
  CHECK(mean_errors[0] > 0);
}

/// The gradients of two runs of one problem (on 1 and 2 threads) are identical bit for bit.
void check_same_gradients(const Problem<float>& one, const Problem<float>& two) {
  INFO("dq, dk, dv of 1 and 2 threads must be identical bit for bit");
  CHECK(std::memcmp(one.dq.storage.data(), two.dq.storage.data(),
                    one.dq.storage.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(one.dk.storage.data(), two.dk.storage.data(),
                    one.dk.storage.size() * sizeof(float)) == 0);
  CHECK(std::memcmp(one.dv.storage.data(), two.dv.storage.data(),
                    one.dv.storage.size() * sizeof(float)) == 0);
}

TEST_CASE("backward results do not depend on the number of threads", "[backward][threads]") {
  const std::vector<double> slopes = {0.5, 0.1, 1.0 / 32, 0.0};
  // One key/value head: the two sweeps on two or more processors (uses_one_sweep).
  for (const Shape& shape : {Shape{300, 300, 4, 2, 16, 16}, Shape{300, 300, 4, 1, 16, 16}}) {
    for (const Case& c : {make_case("exact", Method::Exact, 1, true, 0, 0),
                          truncated_case("truncated 0.05, bidirectional", 0.05, false, 0, 0),
                          make_case("plsh s = 20", Method::Plsh, 20, true, 0, 0),
                          make_case("plsh s = 20, bidirectional", Method::Plsh, 20, false, 0, 0)}) {
      INFO(c.name << ", " << shape);
      Problem<float> one(shape, 9, 1.5);
      forward(c, one, slopes);
      Problem<float> two = one;
      {
        const plsh_test::ThreadCount threads(1);
        backward(c, one, slopes);
      }
      {
        const plsh_test::ThreadCount threads(2);
        backward(c, two, slopes);
      }
      check_same_gradients(one, two);
    }
  }
}

TEST_CASE("the one sweep equals the two sweeps to rounding", "[backward][sweeps]") {
  using plsh::detail::BackwardSweeps;
  // Key tiles of 128 and query tiles of 32 or 64: 1 token, fewer and more queries than keys,
  // ragged last tiles (130 = 2 * 64 + 2, 257 = 2 * 128 + 1), grouped heads.
  const std::vector<Shape> shapes = {{1, 1, 2, 2, 16, 8},
                                     {70, 257, 2, 2, 16, 16},
                                     {257, 70, 2, 1, 16, 8},
                                     {130, 130, 4, 2, 16, 16},
                                     {130, 257, 6, 3, 8, 16}};
  for (const Shape& shape : shapes) {
    const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
    for (const bool causal : {true, false}) {
      for (const Case& c : {make_case("exact", Method::Exact, 1, causal, 0, 0),
                            make_case("exact, offsets", Method::Exact, 1, causal, 200, 3),
                            truncated_case("truncated 0.05", 0.05, causal, 0, 0),
                            make_case("plsh s = 20", Method::Plsh, 20, causal, 0, 0)}) {
        Problem<float> one(shape, 21, 1.5);
        std::vector<float> lse;
        forward_writing_lse(c, one, slopes, lse);
        for (const bool given : {true, false}) {
          INFO(c.name << (causal ? ", causal, " : ", bidirectional, ") << shape
                      << (given ? ", the forward's lse" : ", lse computed"));
          Problem<float> two = one;
          const std::vector<float> no_lse;
          backward_by_sweeps(c, one, slopes, given ? lse : no_lse, BackwardSweeps::One);
          backward_by_sweeps(c, two, slopes, given ? lse : no_lse, BackwardSweeps::Two);
          // Each gradient entry is a sum of at most n = max(group n_q, n_k) products of factors
          // that both paths round alike, summed in another blocking: the two sums differ by at
          // most 2 gamma_n sum|terms| (gamma_n = n u / (1 - n u), u = 2^-24), and on these
          // random inputs sum|terms| stays within 4 max|entry|.
          const double n = static_cast<double>(
              std::max(shape.heads / shape.kv_heads * shape.n_q, shape.n_k) + shape.dim);
          const double u = std::ldexp(1.0, -24);
          const double bound = 4 * 2 * n * u / (1 - n * u);
          CHECK(difference(one.dq.storage, two.dq.storage) <= bound);
          CHECK(difference(one.dk.storage, two.dk.storage) <= bound);
          CHECK(difference(one.dv.storage, two.dv.storage) <= bound);
        }
      }
    }
  }
}

TEST_CASE("the one sweep does not depend on the number of threads", "[backward][threads]") {
  using plsh::detail::BackwardSweeps;
  // Three key/value heads on two threads: one thread runs two of them.
  const Shape shape{300, 300, 6, 3, 16, 16};
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  for (const Case& c : {make_case("exact", Method::Exact, 1, true, 0, 0),
                        truncated_case("truncated 0.05, bidirectional", 0.05, false, 0, 0),
                        make_case("plsh s = 20", Method::Plsh, 20, true, 0, 0)}) {
    Problem<float> one(shape, 9, 1.5);
    std::vector<float> lse;
    forward_writing_lse(c, one, slopes, lse);
    for (const bool given : {true, false}) {
      INFO(c.name << (given ? ", the forward's lse" : ", lse computed"));
      Problem<float> two = one;
      const std::vector<float> no_lse;
      {
        const plsh_test::ThreadCount threads(1);
        backward_by_sweeps(c, one, slopes, given ? lse : no_lse, BackwardSweeps::One);
      }
      {
        const plsh_test::ThreadCount threads(2);
        backward_by_sweeps(c, two, slopes, given ? lse : no_lse, BackwardSweeps::One);
      }
      check_same_gradients(one, two);
    }
  }
}

TEST_CASE("backward of empty query or key spans", "[backward]") {
  const std::vector<double> slopes = {0.1};
  for (const Case& c : {make_case("exact", Method::Exact, 1, true, 0, 0),
                        truncated_case("truncated", 0.1, true, 0, 0),
                        make_case("plsh", Method::Plsh, 4, true, 0, 0)}) {
    INFO(c.name << ": no queries gives zero dk and dv; no keys gives zero dq");
    Problem<double> no_queries(Shape{0, 5, 1, 1, 3, 2}, 1, 1.0);
    backward(c, no_queries, slopes);
    for (const double x : no_queries.dk.storage) CHECK(x == 0);
    for (const double x : no_queries.dv.storage) CHECK(x == 0);
    Problem<double> no_keys(Shape{5, 0, 1, 1, 3, 2}, 1, 1.0);
    forward(c, no_keys, slopes);
    backward(c, no_keys, slopes);
    for (const double x : no_keys.dq.storage) CHECK(x == 0);
  }
}

TEST_CASE("truncated ALiBi's backward at the edges of its band", "[backward][truncated]") {
  const std::vector<double> slopes = {0.3, 0.05, 0.0, 1.0 / 64};
  SECTION("factor tolerance 0 is exact ALiBi's backward, bit for bit") {
    for (const bool causal : {true, false}) {
      INFO((causal ? "causal" : "bidirectional"));
      Problem<double> exact(Shape{150, 170, 4, 2, 8, 5}, 29, 2.0);
      const Case exact_case = make_case("exact", Method::Exact, 1, causal, 30, 10);
      forward(exact_case, exact, slopes);
      Problem<double> truncated = exact;
      backward(exact_case, exact, slopes);
      backward(truncated_case("truncated 0", 0.0, causal, 30, 10), truncated, slopes);
      CHECK(truncated.dq.storage == exact.dq.storage);
      CHECK(truncated.dk.storage == exact.dk.storage);
      CHECK(truncated.dv.storage == exact.dv.storage);
    }
  }
  SECTION("one query token, against the dense reference") {
    // Decoding (the last position of 257 keys, causal), and one query against one key.
    struct Edge {
      Shape shape;
      bool causal;
      Index query_position;
    };
    for (const Edge& edge :
         {Edge{Shape{1, 257, 4, 2, 8, 5}, true, 256}, Edge{Shape{1, 257, 4, 4, 8, 5}, false, 100},
          Edge{Shape{1, 1, 4, 1, 8, 5}, true, 0}}) {
      for (const double tolerance : {0.1, 1.0}) {
        const Case c = truncated_case("truncated", tolerance, edge.causal, edge.query_position, 0);
        INFO(edge.shape << ", " << plsh_test::describe(c.options) << ", factor tolerance "
                        << tolerance);
        Problem<double> p(edge.shape, 31, 2.0);
        forward(c, p, slopes);
        backward(c, p, slopes);
        Problem<double> expected = p;
        reference_backward(c, expected, slopes);
        CHECK(plsh_test::max_abs_difference(p.dq.in(), expected.dq.in()) <= 1e-13);
        CHECK(plsh_test::max_abs_difference(p.dk.in(), expected.dk.in()) <= 1e-13);
        CHECK(plsh_test::max_abs_difference(p.dv.in(), expected.dv.in()) <= 1e-13);
      }
    }
  }
  SECTION("factor tolerance 1: each query sees the key at its own position only") {
    // Softmax over one key: out_i = v_j, so dq = dk = 0 up to rounding of dP - D and dV_j sums
    // dO_i over the group's query heads at p_i = p_j. Queries 40..189 against keys 7..176, so
    // the last 13 queries have no key at their position and no gradient.
    const std::vector<double> steep = {0.3, 0.05};
    const Case c = truncated_case("truncated 1", 1.0, false, 40, 7);
    Problem<double> p(Shape{150, 170, 2, 1, 8, 5}, 37, 2.0);
    forward(c, p, steep);
    backward(c, p, steep);
    for (Index t = 0; t < 150; ++t) {
      for (Index h = 0; h < 2; ++h) {
        for (Index e = 0; e < 8; ++e) CHECK(std::abs(p.dq.at(t, h, e)) <= 1e-14);
      }
    }
    for (Index j = 0; j < 170; ++j) {
      const Index t = j + 7 - 40;  // the query row at the key's position
      INFO("key " << j);
      for (Index e = 0; e < 8; ++e) CHECK(std::abs(p.dk.at(j, 0, e)) <= 1e-14);
      for (Index e = 0; e < 5; ++e) {
        const double expected = t >= 0 ? p.dout.at(t, 0, e) + p.dout.at(t, 1, e) : 0.0;
        CHECK(p.dv.at(j, 0, e) == Approx(expected).margin(1e-15));
      }
    }
  }
  SECTION("keys outside every band get zero gradients, whatever their values") {
    // Queries at 100..119 against keys 0..199, bands of 7 and 46 positions at 0.1: no query
    // sees keys 0..53 or 166..199; NaN and infinite k, v there change nothing else.
    const std::vector<double> steep = {0.3, 0.05};
    const Case c = truncated_case("truncated 0.1", 0.1, false, 100, 0);
    Problem<double> clean(Shape{20, 200, 2, 1, 8, 5}, 41, 2.0);
    forward(c, clean, steep);
    Problem<double> poisoned = clean;
    for (Index j = 0; j < 200; ++j) {
      if (j >= 54 && j < 166) continue;
      for (Index e = 0; e < 8; ++e) poisoned.k.at(j, 0, e) = std::nan("");
      for (Index e = 0; e < 5; ++e) {
        poisoned.v.at(j, 0, e) = std::numeric_limits<double>::infinity();
      }
    }
    backward(c, clean, steep);
    backward(c, poisoned, steep);
    CHECK(poisoned.dq.storage == clean.dq.storage);
    CHECK(poisoned.dk.storage == clean.dk.storage);
    CHECK(poisoned.dv.storage == clean.dv.storage);
    for (const Index j : {Index(0), Index(53), Index(166), Index(199)}) {
      INFO("key " << j);
      for (Index e = 0; e < 8; ++e) CHECK(clean.dk.at(j, 0, e) == 0);
      for (Index e = 0; e < 5; ++e) CHECK(clean.dv.at(j, 0, e) == 0);
    }
    CHECK(clean.dk.at(54, 0, 0) != 0);  // the first key of the wider band has a gradient
  }
}

TEST_CASE("backward rejects bad arguments", "[backward][validation]") {
  const std::vector<double> slopes = {0.1, 0.2};
  const Shape shape{6, 6, 2, 1, 4, 3};
  Problem<double> p(shape, 1, 1.0);
  using View = HeadsView<const double>;
  using Out = HeadsView<double>;
  struct Arguments {
    View q, k, v, out, dout;
    Out dq, dk, dv;
    std::vector<double> slopes;
    plsh::PlshOptions options;
  };
  const Arguments good{p.q_view(),  p.k_view(),  p.v_view(),  p.out_view(), p.dout_view(),
                       p.dq_view(), p.dk_view(), p.dv_view(), slopes,       {}};
  const auto plsh_call = [](const Arguments& a) {
    plsh::plsh_attention_backward<double>(a.q, a.k, a.v, a.out, a.dout, a.dq, a.dk, a.dv, a.slopes,
                                          a.options);
  };
  const auto exact_call = [](const Arguments& a) {
    plsh::exact_alibi_attention_backward<double>(a.q, a.k, a.v, a.out, a.dout, a.dq, a.dk, a.dv,
                                                 a.slopes, a.options);
  };
  const auto truncated_call = [](const Arguments& a, double factor_tolerance = 0.1) {
    plsh::truncated_alibi_attention_backward<double>(a.q, a.k, a.v, a.out, a.dout, a.dq, a.dk, a.dv,
                                                     a.slopes, factor_tolerance, a.options);
  };
  REQUIRE_NOTHROW(plsh_call(good));
  REQUIRE_NOTHROW(exact_call(good));
  REQUIRE_NOTHROW(truncated_call(good));

  // A second buffer, large enough for any of the views below to point into.
  std::vector<double> spare(1000, 0.0);
  struct Bad {
    std::string argument;  // the message must name it
    Arguments arguments;
  };
  std::vector<Bad> bad;
  const auto add = [&](const std::string& argument, auto&& change) {
    Arguments a = good;
    change(a);
    bad.push_back(Bad{argument, a});
  };
  add("q.tokens", [](Arguments& a) { a.q.tokens = -1; });
  add("k.heads", [](Arguments& a) { a.k.heads = 0; });
  add("v.dim", [](Arguments& a) { a.v.dim = 0; });
  add("out strides", [](Arguments& a) { a.out.token_stride = -1; });
  add("dout.data", [](Arguments& a) { a.dout.data = nullptr; });
  add("dq.heads", [](Arguments& a) { a.dq.heads = 0; });
  add("dk.dim", [](Arguments& a) { a.dk.dim = 0; });
  add("dv.tokens", [](Arguments& a) { a.dv.tokens = -2; });
  add("k.dim must equal q.dim", [](Arguments& a) { a.k.dim = 3; });
  add("v.tokens must equal k.tokens", [](Arguments& a) { a.v.tokens = 5; });
  add("v.heads must equal k.heads", [&](Arguments& a) { a.v = View{spare.data(), 6, 2, 3}; });
  add("q.heads must be a multiple of k.heads", [&](Arguments& a) {
    a.k = View{spare.data(), 6, 3, 4};
    a.v = View{spare.data() + 200, 6, 3, 3};
    a.dk = Out{spare.data() + 400, 6, 3, 4};
    a.dv = Out{spare.data() + 600, 6, 3, 3};
  });
  add("out.tokens must equal q.tokens", [](Arguments& a) { a.out.tokens = 5; });
  add("out.heads must equal q.heads", [](Arguments& a) { a.out.heads = 1; });
  add("out.dim must equal v.dim", [](Arguments& a) { a.out.dim = 2; });
  add("dout.tokens must equal out.tokens", [](Arguments& a) { a.dout.tokens = 5; });
  add("dout.heads must equal out.heads", [](Arguments& a) { a.dout.heads = 1; });
  add("dout.dim must equal out.dim", [](Arguments& a) { a.dout.dim = 2; });
  add("dq.tokens must equal q.tokens", [](Arguments& a) { a.dq.tokens = 5; });
  add("dq.heads must equal q.heads", [](Arguments& a) { a.dq.heads = 1; });
  add("dq.dim must equal q.dim", [](Arguments& a) { a.dq.dim = 3; });
  add("dk.tokens must equal k.tokens", [](Arguments& a) { a.dk.tokens = 5; });
  add("dk.heads must equal k.heads", [&](Arguments& a) { a.dk = Out{spare.data(), 6, 2, 4}; });
  add("dk.dim must equal k.dim", [](Arguments& a) { a.dk.dim = 3; });
  add("dv.tokens must equal v.tokens", [](Arguments& a) { a.dv.tokens = 5; });
  add("dv.heads must equal v.heads", [&](Arguments& a) { a.dv = Out{spare.data(), 6, 2, 3}; });
  add("dv.dim must equal v.dim", [](Arguments& a) { a.dv.dim = 2; });
  add("dq strides make rows overlap", [](Arguments& a) { a.dq.token_stride = 1; });
  add("dk strides make rows overlap", [](Arguments& a) { a.dk.token_stride = 2; });
  add("dv strides make rows overlap", [](Arguments& a) { a.dv.token_stride = 1; });
  add("dq overlaps q", [&](Arguments& a) { a.dq.data = p.q.storage.data(); });
  add("dk overlaps k", [&](Arguments& a) { a.dk.data = p.k.storage.data(); });
  add("dv overlaps v", [&](Arguments& a) { a.dv.data = p.v.storage.data(); });
  add("dq overlaps out", [&](Arguments& a) { a.dq.data = p.out.storage.data(); });
  add("dk overlaps dout", [&](Arguments& a) { a.dk.data = p.dout.storage.data() + 3; });
  add("dv overlaps dq", [&](Arguments& a) { a.dv.data = p.dq.storage.data() + 10; });
  add("dk overlaps dq", [&](Arguments& a) { a.dk.data = p.dq.storage.data(); });
  add("options.query_position", [](Arguments& a) { a.options.query_position = -1; });
  add("options.key_position", [](Arguments& a) { a.options.key_position = -3; });
  add("options.scale",
      [](Arguments& a) { a.options.scale = std::numeric_limits<double>::quiet_NaN(); });
  add("slopes.size()", [](Arguments& a) { a.slopes = {0.1}; });
  add("slopes[1]", [](Arguments& a) { a.slopes = {0.1, -0.5}; });
  add("slopes[0]", [](Arguments& a) { a.slopes = {std::numeric_limits<double>::infinity(), 0.1}; });
  for (const Bad& b : bad) {
    INFO("rejected argument: " << b.argument);
    REQUIRE_THROWS_AS(plsh_call(b.arguments), std::invalid_argument);
    REQUIRE_THROWS_AS(exact_call(b.arguments), std::invalid_argument);
    REQUIRE_THROWS_AS(truncated_call(b.arguments), std::invalid_argument);
    REQUIRE_THROWS_WITH(plsh_call(b.arguments), Catch::Contains("plsh_attention_backward: ") &&
                                                    Catch::Contains(b.argument));
    REQUIRE_THROWS_WITH(
        exact_call(b.arguments),
        Catch::Contains("exact_alibi_attention_backward: ") && Catch::Contains(b.argument));
    REQUIRE_THROWS_WITH(
        truncated_call(b.arguments),
        Catch::Contains("truncated_alibi_attention_backward: ") && Catch::Contains(b.argument));
  }
  for (const double factor_tolerance : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN(),
                                        std::numeric_limits<double>::infinity()}) {
    INFO("factor_tolerance " << factor_tolerance << " is rejected by the truncated backward");
    REQUIRE_THROWS_AS(truncated_call(good, factor_tolerance), std::invalid_argument);
    REQUIRE_THROWS_WITH(truncated_call(good, factor_tolerance),
                        "truncated_alibi_attention_backward: factor_tolerance must lie in [0, 1]");
  }
  REQUIRE_NOTHROW(truncated_call(good, 0.0));
  REQUIRE_NOTHROW(truncated_call(good, 1.0));
  Arguments no_samples = good;
  no_samples.options.samples = 0;
  INFO("samples < 1 is rejected by the Positional LSH backward only");
  REQUIRE_THROWS_AS(plsh_call(no_samples), std::invalid_argument);
  REQUIRE_THROWS_WITH(plsh_call(no_samples), Catch::Contains("options.samples"));
  REQUIRE_NOTHROW(exact_call(no_samples));

  INFO("the dense reference validates like the kernels");
  REQUIRE_THROWS_AS(plsh::reference::plsh_attention_backward<double>(
                        good.q, good.k, good.v, good.dout, good.dq, good.dk,
                        Out{p.q.storage.data(), 6, 1, 3}, slopes, {}),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(plsh::reference::alibi_attention_backward<double>(
                        good.q, good.k, good.v, good.dout, good.dq, good.dk, good.dv, {0.1}, {}),
                    std::invalid_argument);
  REQUIRE_THROWS_AS(plsh::reference::truncated_alibi_attention_backward<double>(
                        good.q, good.k, good.v, good.dout, good.dq, good.dk, good.dv, {0.1}, 0.1),
                    std::invalid_argument);
}

}  // namespace test_backward
