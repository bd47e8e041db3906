// Tests of the row log-sum-exp the forwards write and the backwards take (row_lse.hpp) and of the
// windowed forward's kept keys (attention/kept_keys.hpp): every forward's lse against the dense
// row log-sum-exp in double, every backward given the forward's lse against the one that computes
// it (causal and not, grouped heads, one token, rows that see no key, queries beyond the last key
// and before the first), the windowed backward given
// the forward's kept keys against the one that runs the certificate again, the batched calls
// against the loop over the batch, and every rejected argument.

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
#include <plsh/attention/kept_keys.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/batch.hpp>
#include <plsh/detail/random.hpp>
#include <plsh/reference.hpp>
#include <plsh/row_lse.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_lse {

namespace {

using plsh::HeadsView;
using plsh::Index;
using plsh::RowLse;
using plsh_test::Buffer;
using plsh_test::Shape;

/// q, k, v, the output and its gradient dout, and the gradients, packed.
template <class Scalar>
struct Problem : plsh_test::Problem<Scalar> {
  Buffer<Scalar> dout, dq, dk, dv;

  Problem(const Shape& s, std::uint64_t seed)
      : plsh_test::Problem<Scalar>(s, seed, plsh_test::Layout::Packed, 2.0, 2.0),
        dout(this->output()),
        dq(s.n_q, s.heads, s.dim),
        dk(s.n_k, s.kv_heads, s.dim),
        dv(s.n_k, s.kv_heads, s.value_dim) {
    dout.fill_random(plsh::detail::mix64(seed * 4 + 3));
  }
};

enum class Kind { Exact, Truncated, Windowed, Fused, Passes, Fixed };

constexpr double kFactorTolerance = 1e-3;
constexpr double kTolerance = 1e-3;
constexpr Index kBlockSize = 16;

/// One kernel with the options of a case.
struct Kernel {
  std::string name;
  Kind kind;
  plsh::PlshOptions options;
};

std::vector<Kernel> kernels(bool causal, Index query_position, Index key_position) {
  std::vector<Kernel> list;
  for (const auto& [name, kind] :
       std::vector<std::pair<std::string, Kind>>{{"exact", Kind::Exact},
                                                 {"truncated", Kind::Truncated},
                                                 {"windowed", Kind::Windowed},
                                                 {"fused", Kind::Fused},
                                                 {"passes", Kind::Passes},
                                                 {"fixed", Kind::Fixed}}) {
    Kernel kernel{name, kind, {}};
    kernel.options.causal = causal;
    kernel.options.query_position = query_position;
    kernel.options.key_position = key_position;
    kernel.options.samples = 8;
    kernel.options.seed = 3;
    if (kind == Kind::Passes) {
      kernel.options.kernel = plsh::Kernel::Passes;
      kernel.options.near_field = 0;
    }
    list.push_back(kernel);
  }
  return list;
}

/// The forward of `kernel`, writing `lse` (and, windowed, `kept`).
template <class Scalar>
void forward(const Kernel& kernel, Problem<Scalar>& p, const std::vector<double>& slopes,
             RowLse<plsh::detail::Compute<Scalar>> lse, plsh::KeptKeys* kept = nullptr) {
  const auto q = p.q.in(), k = p.k.in(), v = p.v.in();
  const auto out = p.out.view;
  const plsh::AttentionOptions& options = kernel.options;
  switch (kernel.kind) {
    case Kind::Exact:
      return plsh::exact_alibi_attention<Scalar>(q, k, v, out, slopes, options, lse);
    case Kind::Truncated:
      return plsh::truncated_alibi_attention<Scalar>(q, k, v, out, slopes, kFactorTolerance,
                                                     options, lse);
    case Kind::Windowed:
      return plsh::windowed_alibi_attention<Scalar>(q, k, v, out, slopes, kTolerance, options, lse,
                                                    kept);
    case Kind::Fused:
    case Kind::Passes:
      return plsh::plsh_attention<Scalar>(q, k, v, out, slopes, kernel.options, lse);
    case Kind::Fixed:
      return plsh::fixed_block_attention<Scalar>(q, k, v, out, kBlockSize, options, lse);
  }
}

/// The backward of `kernel`, given `lse` (and, windowed, `kept`) or not.
template <class Scalar>
void backward(const Kernel& kernel, Problem<Scalar>& p, const std::vector<double>& slopes,
              RowLse<const plsh::detail::Compute<Scalar>> lse,
              const plsh::KeptKeys* kept = nullptr) {
  const auto q = p.q.in(), k = p.k.in(), v = p.v.in(), out = p.out.in(), dout = p.dout.in();
  const auto dq = p.dq.view, dk = p.dk.view, dv = p.dv.view;
  const plsh::AttentionOptions& options = kernel.options;
  switch (kernel.kind) {
    case Kind::Exact:
      return plsh::exact_alibi_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, slopes,
                                                          options, lse);
    case Kind::Truncated:
      return plsh::truncated_alibi_attention_backward<Scalar>(
          q, k, v, out, dout, dq, dk, dv, slopes, kFactorTolerance, options, lse);
    case Kind::Windowed:
      return plsh::windowed_alibi_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, slopes,
                                                             kTolerance, options, lse, kept);
    case Kind::Fused:
    case Kind::Passes:
      return plsh::plsh_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv, slopes,
                                                   kernel.options, lse);
    case Kind::Fixed:
      return plsh::fixed_block_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv,
                                                          kBlockSize, options, lse);
  }
}

/// The dense row log-sum-exp in double of the logits \f$S_{ij} + \log F_{ij}\f$ with
/// `log_factor(h, p_i, p_j)` (\f$-\infty\f$: masked), `[H][n_q]`.
template <class Scalar, class LogFactor>
std::vector<double> dense_lse(const Problem<Scalar>& p, const plsh::AttentionOptions& options,
                              LogFactor&& log_factor) {
  const Shape& s = p.shape;
  const double scale = 1.0 / std::sqrt(static_cast<double>(s.dim));
  const Index group = s.heads / s.kv_heads;
  std::vector<double> lse;
  for (Index h = 0; h < s.heads; ++h) {
    for (Index i = 0; i < s.n_q; ++i) {
      const Index pi = options.query_position + i;
      std::vector<double> logits;
      for (Index j = 0; j < s.n_k; ++j) {
        const Index pj = options.key_position + j;
        if (options.causal && pj > pi) continue;
        const double log_f = log_factor(h, pi, pj);
        if (log_f == -std::numeric_limits<double>::infinity()) continue;
        double score = 0;
        for (Index e = 0; e < s.dim; ++e) {
          score +=
              static_cast<double>(p.q.at(i, h, e)) * static_cast<double>(p.k.at(j, h / group, e));
        }
        logits.push_back(log_f + scale * score);
      }
      if (logits.empty()) {
        lse.push_back(-std::numeric_limits<double>::infinity());
        continue;
      }
      const double high = *std::max_element(logits.begin(), logits.end());
      double sum = 0;
      for (const double l : logits) sum += std::exp(l - high);
      lse.push_back(high + std::log(sum));
    }
  }
  return lse;
}

/// The reference row lse of `kernel`: exact ALiBi's for the exact and windowed kernels (the
/// windowed one drops a weight of at most the tolerance), the band's for the truncated one, the
/// counts' \f$\log c_{ij} = \log s + \log \hat K_{ij}\f$ for Positional LSH, 0 or masked for fixed
/// blocks.
template <class Scalar>
std::vector<double> reference_lse(const Kernel& kernel, const Problem<Scalar>& p,
                                  const std::vector<double>& slopes) {
  const auto alibi = [&](Index h, Index i, Index j) {
    return plsh::reference::alibi_log_factor(slopes[static_cast<std::size_t>(h)], i, j);
  };
  switch (kernel.kind) {
    case Kind::Exact:
    case Kind::Windowed:
      return dense_lse(p, kernel.options, alibi);
    case Kind::Truncated:
      return dense_lse(p, kernel.options, [&](Index h, Index i, Index j) {
        const Index window =
            plsh::detail::factor_window(slopes[static_cast<std::size_t>(h)], kFactorTolerance);
        return std::abs(i - j) > window ? -std::numeric_limits<double>::infinity() : alibi(h, i, j);
      });
    case Kind::Fused:
    case Kind::Passes: {
      const auto grids = plsh::detail::kernel_grids(slopes, kernel.options, "test");
      const double log_samples = std::log(static_cast<double>(kernel.options.samples));
      const auto [first, last] =
          plsh::reference::call_positions(p.q.in(), p.k.in(), kernel.options);
      const auto near = plsh::reference::near_field_log_factor(
          grids, slopes, kernel.options.near_field, first, last);
      return dense_lse(p, kernel.options,
                       [&](Index h, Index i, Index j) { return near(h, i, j) + log_samples; });
    }
    case Kind::Fixed:
      return dense_lse(p, kernel.options,
                       plsh::reference::fixed_block_log_factor(kBlockSize, "test"));
  }
  return {};
}

template <class Scalar>
double max_relative_difference(const Buffer<Scalar>& a, const Buffer<Scalar>& b) {
  double difference = 0, scale = 0;
  for (std::size_t i = 0; i < a.storage.size(); ++i) {
    difference = std::max(difference, std::abs(static_cast<double>(a.storage[i]) -
                                               static_cast<double>(b.storage[i])));
    scale = std::max(scale, std::abs(static_cast<double>(b.storage[i])));
  }
  return scale == 0 ? difference : difference / scale;
}

template <class Scalar>
bool same_bits(const Buffer<Scalar>& a, const Buffer<Scalar>& b) {
  return std::memcmp(a.storage.data(), b.storage.data(), a.storage.size() * sizeof(Scalar)) == 0;
}

/// (query_position, key_position) of the cases of a shape: the last query level with the last
/// key; the queries beyond the last key, and before the first key, where the ALiBi logits carry
/// a row constant (regular.hpp's apply_linear_bias).
std::vector<std::pair<Index, Index>> positions(const Shape& s) {
  return {{s.n_k - s.n_q, 0}, {s.n_k - s.n_q + 37, 3}, {0, 21}};
}

const std::vector<Shape>& shapes() {
  static const std::vector<Shape> list = {
      {150, 150, 4, 2, 16, 8},  // grouped heads, query and key tiles that end mid-tile
      {1, 1, 2, 2, 8, 8},       // one token
      {70, 200, 2, 1, 8, 8},    // more keys than queries
  };
  return list;
}

/// Calls `check(shape, slopes, kernel)` for every shape, causal or not, every positions case and
/// every kernel, with the case named in Catch's messages.
template <class Check>
void for_each_case(Check&& check) {
  for (const Shape& shape : shapes()) {
    const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
    for (const bool causal : {true, false}) {
      for (const auto& [query_position, key_position] : positions(shape)) {
        for (const Kernel& kernel : kernels(causal, query_position, key_position)) {
          INFO(kernel.name << ", " << shape << (causal ? ", causal" : ", not causal")
                           << ", positions " << query_position << ", " << key_position);
          check(shape, slopes, kernel);
        }
      }
    }
  }
}

}  // namespace

TEMPLATE_TEST_CASE("every forward's lse is the dense row log-sum-exp", "[lse]", float, double) {
  using Scalar = TestType;
  using C = plsh::detail::Compute<Scalar>;
  const double tolerance = std::is_same<C, float>::value ? 2e-5 : 1e-11;
  for_each_case([&](const Shape& shape, const std::vector<double>& slopes, const Kernel& kernel) {
    Problem<Scalar> p(shape, 11);
    std::vector<C> lse(static_cast<std::size_t>(shape.heads * shape.n_q), C(7));
    forward<Scalar>(kernel, p, slopes, {lse.data(), shape.heads, shape.n_q});
    const std::vector<double> expected = reference_lse(kernel, p, slopes);
    // The windowed kernel drops keys of total weight at most the tolerance.
    const double allowed = kernel.kind == Kind::Windowed ? 2 * kTolerance : tolerance;
    double worst = 0;
    for (std::size_t i = 0; i < lse.size(); ++i) {
      worst = std::max(worst, std::abs(static_cast<double>(lse[i]) - expected[i]) /
                                  std::max(1.0, std::abs(expected[i])));
    }
    INFO("largest relative difference " << worst);
    CHECK(worst <= allowed);
  });
}

TEMPLATE_TEST_CASE("every backward given the forward's lse equals the one that computes it",
                   "[lse]", float, double) {
  using Scalar = TestType;
  using C = plsh::detail::Compute<Scalar>;
  const double tolerance = std::is_same<C, float>::value ? 1e-4 : 1e-11;
  for_each_case([&](const Shape& shape, const std::vector<double>& slopes, const Kernel& kernel) {
    Problem<Scalar> computed(shape, 12);
    std::vector<C> lse(static_cast<std::size_t>(shape.heads * shape.n_q));
    plsh::KeptKeys kept;
    forward<Scalar>(kernel, computed, slopes, {lse.data(), shape.heads, shape.n_q}, &kept);
    Problem<Scalar> given = computed;
    backward<Scalar>(kernel, computed, slopes, {});
    backward<Scalar>(kernel, given, slopes, RowLse<C>(lse.data(), shape.heads, shape.n_q));
    CHECK(max_relative_difference(given.dq, computed.dq) <= tolerance);
    CHECK(max_relative_difference(given.dk, computed.dk) <= tolerance);
    CHECK(max_relative_difference(given.dv, computed.dv) <= tolerance);
    if (kernel.kind == Kind::Windowed) {
      // The forward's kept keys are the certificate's: the same code path, the same bits.
      Problem<Scalar> kept_given = computed;
      backward<Scalar>(kernel, kept_given, slopes, {}, &kept);
      CHECK(same_bits(kept_given.dq, computed.dq));
      CHECK(same_bits(kept_given.dk, computed.dk));
      CHECK(same_bits(kept_given.dv, computed.dv));
      Problem<Scalar> both = computed;
      backward<Scalar>(kernel, both, slopes, RowLse<C>(lse.data(), shape.heads, shape.n_q), &kept);
      CHECK(same_bits(both.dq, given.dq));
      CHECK(same_bits(both.dk, given.dk));
      CHECK(same_bits(both.dv, given.dv));
    }
  });
}

TEST_CASE("rows that see no key: lse -inf, zero gradients, with or without the lse", "[lse]") {
  const Shape shape{40, 40, 2, 2, 8, 8};
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  // Causal, every key after every query.
  for (const Kernel& kernel : kernels(true, 0, 100)) {
    INFO(kernel.name);
    Problem<float> p(shape, 13);
    std::vector<float> lse(static_cast<std::size_t>(shape.heads * shape.n_q), 7.0f);
    plsh::KeptKeys kept;
    forward<float>(kernel, p, slopes, {lse.data(), shape.heads, shape.n_q}, &kept);
    CHECK(std::all_of(lse.begin(), lse.end(),
                      [](float x) { return x == -std::numeric_limits<float>::infinity(); }));
    backward<float>(kernel, p, slopes, RowLse<float>(lse.data(), shape.heads, shape.n_q),
                    kernel.kind == Kind::Windowed ? &kept : nullptr);
    for (const Buffer<float>* gradient : {&p.dq, &p.dk, &p.dv}) {
      CHECK(std::all_of(gradient->storage.begin(), gradient->storage.end(),
                        [](float x) { return x == 0.0f; }));
    }
  }
}

TEST_CASE("batched: the lse and gradients given it equal the loop over the batch", "[lse]") {
  const Shape shape{100, 100, 4, 2, 8, 8};
  const Index batch = 2;
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  for (const Kernel& kernel : kernels(true, 0, 0)) {
    if (kernel.kind != Kind::Exact && kernel.kind != Kind::Windowed && kernel.kind != Kind::Fused) {
      continue;
    }
    INFO(kernel.name);
    std::vector<Problem<float>> elements{Problem<float>(shape, 21), Problem<float>(shape, 22)};
    const auto packed = [&](auto member) {
      std::vector<float> all;
      for (const auto& e : elements) {
        const auto& buffer = e.*member;
        all.insert(all.end(), buffer.storage.begin(), buffer.storage.end());
      }
      return all;
    };
    std::vector<float> q = packed(&Problem<float>::q), k = packed(&Problem<float>::k),
                       v = packed(&Problem<float>::v), dout = packed(&Problem<float>::dout);
    std::vector<float> out(q.size()), dq(q.size()), dk(k.size()), dv(v.size());
    std::vector<float> lse(static_cast<std::size_t>(batch * shape.heads * shape.n_q));
    const auto view = [&](std::vector<float>& data, Index tokens, Index heads, Index dim) {
      return plsh::BatchedHeadsView<float>(batch, {data.data(), tokens, heads, dim});
    };
    const auto in = [&](std::vector<float>& data, Index tokens, Index heads, Index dim) {
      return plsh::BatchedHeadsView<const float>(view(data, tokens, heads, dim));
    };
    const RowLse<float> lse_view(lse.data(), batch, shape.heads, shape.n_q);
    plsh::KeptKeys kept;
    const auto bq = in(q, shape.n_q, shape.heads, shape.dim);
    const auto bk = in(k, shape.n_k, shape.kv_heads, shape.dim);
    const auto bv = in(v, shape.n_k, shape.kv_heads, shape.value_dim);
    const auto bout = view(out, shape.n_q, shape.heads, shape.value_dim);
    if (kernel.kind == Kind::Exact) {
      plsh::exact_alibi_attention<float>(bq, bk, bv, bout, slopes, kernel.options, lse_view);
    } else if (kernel.kind == Kind::Windowed) {
      plsh::windowed_alibi_attention<float>(bq, bk, bv, bout, slopes, kTolerance, kernel.options,
                                            lse_view, &kept);
    } else {
      plsh::plsh_attention<float>(bq, bk, bv, bout, slopes, kernel.options, lse_view);
    }
    const auto bdout = in(dout, shape.n_q, shape.heads, shape.value_dim);
    const auto bdq = view(dq, shape.n_q, shape.heads, shape.dim);
    const auto bdk = view(dk, shape.n_k, shape.kv_heads, shape.dim);
    const auto bdv = view(dv, shape.n_k, shape.kv_heads, shape.value_dim);
    const auto bout_in = in(out, shape.n_q, shape.heads, shape.value_dim);
    if (kernel.kind == Kind::Exact) {
      plsh::exact_alibi_attention_backward<float>(bq, bk, bv, bout_in, bdout, bdq, bdk, bdv, slopes,
                                                  kernel.options, lse_view);
    } else if (kernel.kind == Kind::Windowed) {
      plsh::windowed_alibi_attention_backward<float>(bq, bk, bv, bout_in, bdout, bdq, bdk, bdv,
                                                     slopes, kTolerance, kernel.options, lse_view,
                                                     &kept);
    } else {
      plsh::plsh_attention_backward<float>(bq, bk, bv, bout_in, bdout, bdq, bdk, bdv, slopes,
                                           kernel.options, lse_view);
    }
    for (Index b = 0; b < batch; ++b) {
      Problem<float>& e = elements[static_cast<std::size_t>(b)];
      std::vector<float> element_lse(static_cast<std::size_t>(shape.heads * shape.n_q));
      plsh::KeptKeys element_kept;
      forward<float>(kernel, e, slopes, {element_lse.data(), shape.heads, shape.n_q},
                     &element_kept);
      backward<float>(kernel, e, slopes, RowLse<float>(element_lse.data(), shape.heads, shape.n_q),
                      kernel.kind == Kind::Windowed ? &element_kept : nullptr);
      const auto offset = static_cast<std::ptrdiff_t>(b * shape.heads * shape.n_q);
      CHECK(std::equal(element_lse.begin(), element_lse.end(), lse.begin() + offset));
      const auto same = [&](const Buffer<float>& element, const std::vector<float>& all) {
        const auto start =
            static_cast<std::ptrdiff_t>(static_cast<std::size_t>(b) * element.storage.size());
        return std::memcmp(element.storage.data(), all.data() + start,
                           element.storage.size() * sizeof(float)) == 0;
      };
      CHECK(same(e.out, out));
      CHECK(same(e.dq, dq));
      CHECK(same(e.dk, dk));
      CHECK(same(e.dv, dv));
    }
  }
}

TEST_CASE("an lse or kept keys of other shapes are rejected", "[lse]") {
  const Shape shape{30, 30, 2, 2, 8, 8};
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  Problem<float> p(shape, 14);
  std::vector<float> lse(static_cast<std::size_t>(2 * shape.heads * shape.n_q));
  const RowLse<float> wrong_heads(lse.data(), shape.heads + 1, shape.n_q);
  const RowLse<float> wrong_batch(lse.data(), 2, shape.heads, shape.n_q);
  for (const Kernel& kernel : kernels(true, 0, 0)) {
    INFO(kernel.name);
    REQUIRE_THROWS_AS(forward<float>(kernel, p, slopes, wrong_heads), std::invalid_argument);
    REQUIRE_THROWS_AS(forward<float>(kernel, p, slopes, wrong_batch), std::invalid_argument);
    REQUIRE_THROWS_AS(backward<float>(kernel, p, slopes, wrong_heads), std::invalid_argument);
    REQUIRE_THROWS_WITH(backward<float>(kernel, p, slopes, wrong_batch),
                        Catch::Contains("_backward") && Catch::Contains("lse"));
  }
  const Kernel windowed = kernels(true, 0, 0)[2];
  plsh::KeptKeys empty;
  REQUIRE_THROWS_WITH(backward<float>(windowed, p, slopes, {}, &empty), Catch::Contains("kept"));
  // Kept keys of a call with other shapes.
  Problem<float> longer(Shape{40, 40, 2, 2, 8, 8}, 15);
  plsh::KeptKeys other;
  forward<float>(windowed, longer, slopes, {}, &other);
  REQUIRE_THROWS_WITH(
      backward<float>(windowed, p, slopes, {}, &other),
      Catch::Contains("windowed_alibi_attention_backward") && Catch::Contains("kept"));
  // Kept keys of a call with another tolerance.
  plsh::KeptKeys looser;
  plsh::windowed_alibi_attention<float>(p.q.in(), p.k.in(), p.v.in(), p.out.view, slopes, 1e-2,
                                        windowed.options, {}, &looser);
  REQUIRE_THROWS_WITH(backward<float>(windowed, p, slopes, {}, &looser),
                      Catch::Contains("tolerance"));
}

}  // namespace test_lse
