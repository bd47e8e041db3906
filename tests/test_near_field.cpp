// Tests of the near-field estimator (attention/near_field.hpp, PlshOptions::near_field): its mean
// over seeds against the ALiBi factor, the fused forward and the backward against the dense double
// references (plsh::reference::plsh_attention and plsh_attention_backward, which take the exact
// factor within each head's reach and the mean block mask beyond), the batched kernels against
// their elements, the limits (a reach past every key is exact ALiBi, reach 0 the block
// estimator), and the rejected arguments.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/near_field.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/batch.hpp>
#include <plsh/kv_cache.hpp>
#include <plsh/partition.hpp>
#include <plsh/reference.hpp>
#include <plsh/sampler.hpp>

#include "allocation_counter.hpp"
#include "attention_fixture.hpp"
#include "kernel_instances.hpp"
#include "test_kv_cache_common.hpp"

namespace test_near_field {

namespace {

using plsh::BatchedHeadsView;
using plsh::HeadsView;
using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

/// Standard errors a statistical check allows (a false alarm about once in 16,000 per entry).
constexpr double kStandardErrors = 4;

plsh::PlshOptions near_options(bool causal, Index samples, std::uint64_t seed, double near_field,
                               plsh::Sampling sampling = plsh::Sampling::Independent) {
  plsh::PlshOptions options;
  options.causal = causal;
  options.samples = samples;
  options.seed = seed;
  options.near_field = near_field;
  options.sampling = sampling;
  return options;
}

/// The fused kernel against reference::plsh_attention, with the output's padding untouched.
template <class Scalar>
void check_forward(const Shape& shape, const std::vector<double>& slopes,
                   const plsh::PlshOptions& options, std::uint64_t seed,
                   plsh_test::Layout layout = plsh_test::Layout::Packed) {
  Problem<Scalar> problem(shape, seed, layout);
  Buffer<Scalar> expected = problem.output();
  plsh::reference::plsh_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                  slopes, options);
  problem.out.fill(Scalar(7));
  plsh::plsh_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view,
                               slopes, options);
  const double error = plsh_test::max_abs_difference(problem.out.in(), expected.in());
  INFO(shape << ", " << plsh_test::describe(options) << ", s = " << options.samples
             << ", near_field " << options.near_field << ", " << plsh_test::type_name<Scalar>()
             << ": |fused - reference| = " << plsh_test::scientific(error));
  CHECK(error <= plsh_test::reference_tolerance<Scalar>());
  CHECK(problem.out.touched_padding() == 0);
}

/// A packed buffer's copy in another scalar type.
template <class To, class From>
Buffer<To> to(const Buffer<From>& from) {
  Buffer<To> copy(from.view.tokens, from.view.heads, from.view.dim);
  for (std::size_t i = 0; i < from.storage.size(); ++i) {
    copy.storage[i] = static_cast<To>(from.storage[i]);
  }
  return copy;
}

/// max |a - b| / max |b|, the error relative to the tensor's scale.
inline double relative_error(const Buffer<double>& a, const Buffer<double>& b) {
  double scale = 0;
  for (const double x : b.storage) scale = std::max(scale, std::abs(x));
  return plsh_test::max_abs_difference(a.in(), b.in()) / std::max(scale, 1e-300);
}

}  // namespace

TEST_CASE("the near field's reach: the largest distance whose factor is at least near_field",
          "[near_field]") {
  const auto reach = [](double slope, double near_field, Index largest_distance) {
    return plsh::detail::Estimator(slope, 20, near_field, largest_distance).reach();
  };
  CHECK(reach(0.5, 0, 1000) == -1);  // no near field
  CHECK(reach(0.5, 1, 1000) == 0);   // only the diagonal
  // ln(20) / (1/2) = 5.99: e^{-3} = 0.0498 < 0.05 <= e^{-2.5}.
  CHECK(reach(0.5, 0.05, 1000) == 5);
  CHECK(reach(1.0 / 256, 0.05, 1000) == 766);
  CHECK(reach(1.0 / 256, 0.05, 100) == 100);  // capped by the call's positions
  CHECK(reach(0.0, 0.05, 100) == 100);        // factor 1 everywhere
  for (const double slope : {0.01, 0.3, 2.0}) {
    for (const double near_field : {0.9, 0.05, 1e-3}) {
      const Index w = reach(slope, near_field, 1 << 20);
      CHECK(w == plsh::detail::factor_reach(slope, near_field, 1 << 20));
      CHECK(std::exp(-slope * static_cast<double>(w)) >= near_field * (1 - 1e-12));
      CHECK(std::exp(-slope * static_cast<double>(w + 1)) < near_field);
    }
  }
  // 64-bit: a reach past 2^31 positions.
  CHECK(reach(1e-12, 0.05, plsh::kMaxPosition) == 2995732273553);
}

TEST_CASE("factor_reach below 5.6e-309: the documented reach, from -ln f", "[near_field]") {
  // -ln(1e-310) = 713.8 and -ln(5e-324) = 744.4 (5e-324 is the smallest denormal): ln(1 / f)
  // is infinite for both, 1 / f overflowing, which would make every reach the cap.
  using plsh::detail::factor_reach;
  const Index cap = plsh::kMaxPosition;
  CHECK(factor_reach(8, 1e-310, cap) == 89);
  CHECK(factor_reach(4, 1e-310, cap) == 178);
  CHECK(factor_reach(8, 5e-324, cap) == 93);
  CHECK(factor_reach(4, 5e-324, cap) == 186);
  CHECK(factor_reach(1.0 / 256, 5e-324, cap) == 190576);
  CHECK(factor_reach(1e-310, 5e-324, cap) == cap);  // a slope so small that every key is near
  // truncated_alibi_attention's band is the same function of its tolerance (0: every key).
  for (const double threshold : {1.0, 0.05, 1e-6, 1e-310, 5e-324, 0.0}) {
    for (const double slope : {0.0, 1.0 / 256, 0.5, 4.0, 8.0}) {
      INFO("slope " << slope << ", threshold " << threshold);
      CHECK(plsh::detail::factor_window(slope, threshold) ==
            factor_reach(slope, threshold, plsh::detail::kNoWindow));
      // The band the reference keeps, written from the definition.
      const Index expected = slope == 0 || threshold == 0
                                 ? plsh::detail::kNoWindow
                                 : static_cast<Index>(std::floor(-std::log(threshold) / slope));
      CHECK(plsh::detail::factor_window(slope, threshold) == expected);
    }
  }
  CHECK(plsh::detail::factor_window(4, 1e-310) == 178);
  CHECK(plsh::detail::factor_window(4, 0) == plsh::detail::kNoWindow);
}

TEST_CASE("a denormal near_field leaves a far key to the block estimator", "[near_field]") {
  // One query 2^27 positions after one key of value 1, slopes 8 and 4: far beyond the reach at
  // f = 1e-310 or 5e-324 (at most 186 positions) and beyond every block of these slopes, so the
  // key's count is 0 and the row sees no key: 0. A near key would make the row its value, 1.
  const std::vector<double> slopes{8, 4};
  Problem<float> p(Shape{1, 1, 2, 2, 4, 4}, 5);
  p.v.fill(1.0f);
  Problem<double> dense(Shape{1, 1, 2, 2, 4, 4}, 5);
  dense.v.fill(1.0);
  for (const double near_field : {1e-310, 5e-324}) {
    for (const bool causal : {true, false}) {
      INFO("near_field " << near_field << (causal ? ", causal" : ", bidirectional"));
      plsh::PlshOptions options;
      options.causal = causal;
      options.near_field = near_field;
      options.query_position = Index{1} << 27;
      p.out.fill(-1.0f);
      plsh::plsh_attention<float>(p.q.in(), p.k.in(), p.v.in(), p.out.view, slopes, options);
      plsh::reference::plsh_attention<double>(dense.q.in(), dense.k.in(), dense.v.in(),
                                              dense.out.view, slopes, options);
      for (Index h = 0; h < 2; ++h) {
        for (Index e = 0; e < 4; ++e) {
          CHECK(p.out.at(0, h, e) == 0.0f);
          CHECK(dense.out.at(0, h, e) == 0.0);
        }
      }
    }
  }
}

TEST_CASE("KvCache at a denormal near_field evicts beyond the reach", "[near_field][kv_cache]") {
  // 3000 one-token steps with slopes 8 and 4: the cache keeps the last w + 1 positions, w the
  // largest reach (178 at 1e-310, 186 at 5e-324; the blocks of these slopes reach a few positions),
  // not every token; the last row equals plsh_attention over the whole sequence.
  const Index steps = 3000;
  const plsh_test::Sequence<float> sequence(steps, 2, 2, 4, 4, 19);
  const std::vector<double> slopes{8, 4};
  const std::pair<double, Index> cases[] = {{1e-310, 178}, {5e-324, 186}};
  for (const auto& [near_field, reach] : cases) {
    INFO("near_field " << near_field);
    plsh::PlshOptions options;
    options.near_field = near_field;
    plsh::KvCache<float> cache(2, 2, 4, 4, slopes, options);
    std::vector<float> out(8);
    Index max_resident = 0;
    for (Index t = 0; t < steps; ++t) {
      cache.decode(sequence.queries(t, 1), sequence.keys(t, 1), sequence.values(t, 1),
                   HeadsView<float>{out.data(), 1, 2, 4});
      max_resident = std::max(max_resident, cache.resident());
    }
    CHECK(max_resident == reach + 1);
    CHECK(cache.resident() == reach + 1);
    std::vector<float> expected(8);
    options.query_position = steps - 1;
    plsh::plsh_attention<float>(sequence.queries(steps - 1, 1), sequence.keys(0, steps),
                                sequence.values(0, steps),
                                HeadsView<float>{expected.data(), 1, 2, 4}, slopes, options);
    for (std::size_t i = 0; i < out.size(); ++i) CHECK(std::abs(out[i] - expected[i]) <= 2e-5);
  }
}

TEST_CASE("a query 2^26 or 2^50 positions after its keys: the value and scratch of the tile",
          "[near_field]") {
  // One query at 2^gap, keys at 0 and 1, near_field 0.05, heads of slope 0 and 1e-12 on one
  // key/value head. Slope 0: every key near, weight s (plain attention). Slope 1e-12: near at
  // 2^26 (the reach ln(20) / m = 3.0e12 is capped by the call's width), weight s e^{-m d}; beyond
  // the reach at 2^50, where no block of mean pitch 2 / m spans the gap (count 0): a zero row. The
  // weights' table covers the distances within a tile, so no allocation of the forward or the
  // backward grows with the gap.
  const std::vector<double> slopes{0.0, 1e-12};
  const Shape shape{1, 2, 2, 1, 4, 4};
  const Problem<double> p(shape, 71);
  Buffer<double> dout = p.output();
  dout.fill_random(72);
  const double scale = 0.5;  // 1 / sqrt(4)
  for (const int gap : {26, 50}) {
    for (const bool causal : {true, false}) {
      INFO("gap 2^" << gap << (causal ? ", causal" : ", bidirectional"));
      plsh::PlshOptions options;
      options.causal = causal;
      options.query_position = Index{1} << gap;
      // The estimator's output: sum_j w_j v_j / sum_j w_j, w_j = e^{S_j} times the factor.
      Buffer<double> expected = p.output();
      for (Index h = 0; h < 2; ++h) {
        const double slope = slopes[static_cast<std::size_t>(h)];
        const bool near = slope == 0 || gap == 26;
        double total = 0;
        std::vector<double> sum(4, 0.0);
        for (Index j = 0; j < 2; ++j) {
          double score = 0;
          for (Index e = 0; e < 4; ++e) score += scale * p.q.at(0, h, e) * p.k.at(j, 0, e);
          const double distance = static_cast<double>(options.query_position - j);
          const double weight = near ? std::exp(score - slope * distance) : 0.0;
          total += weight;
          for (Index e = 0; e < 4; ++e)
            sum[static_cast<std::size_t>(e)] += weight * p.v.at(j, 0, e);
        }
        for (Index e = 0; e < 4; ++e) {
          expected.at(0, h, e) = total > 0 ? sum[static_cast<std::size_t>(e)] / total : 0.0;
        }
      }
      Buffer<double> reference = p.output();
      plsh::reference::plsh_attention<double>(p.q.in(), p.k.in(), p.v.in(), reference.view, slopes,
                                              options);
      CHECK(plsh_test::max_abs_difference(reference.in(), expected.in()) <= 1e-13);

      Buffer<double> out = p.output();
      plsh_test::largest_allocation = 0;
      plsh::plsh_attention<double>(p.q.in(), p.k.in(), p.v.in(), out.view, slopes, options);
      CHECK(plsh_test::largest_allocation < (std::size_t{1} << 20));
      CHECK(plsh_test::max_abs_difference(out.in(), expected.in()) <= 1e-13);
      const Buffer<float> q = to<float>(p.q), k = to<float>(p.k), v = to<float>(p.v);
      Buffer<float> out_float(1, 2, 4);
      plsh_test::largest_allocation = 0;
      plsh::plsh_attention<float>(q.in(), k.in(), v.in(), out_float.view, slopes, options);
      CHECK(plsh_test::largest_allocation < (std::size_t{1} << 20));
      CHECK(plsh_test::max_abs_difference(out_float.in(), expected.in()) <= 2e-6);

      Buffer<double> dq(1, 2, 4), dk(2, 1, 4), dv(2, 1, 4);
      Buffer<double> rq = dq, rk = dk, rv = dv;
      plsh_test::largest_allocation = 0;
      plsh::plsh_attention_backward<double>(p.q.in(), p.k.in(), p.v.in(), out.in(), dout.in(),
                                            dq.view, dk.view, dv.view, slopes, options);
      CHECK(plsh_test::largest_allocation < (std::size_t{1} << 20));
      plsh::reference::plsh_attention_backward(p.q.in(), p.k.in(), p.v.in(), dout.in(), rq.view,
                                               rk.view, rv.view, slopes, options);
      CHECK(plsh_test::max_abs_difference(dq.in(), rq.in()) <= 1e-13);
      CHECK(plsh_test::max_abs_difference(dk.in(), rk.in()) <= 1e-13);
      CHECK(plsh_test::max_abs_difference(dv.in(), rv.in()) <= 1e-13);
    }
  }
}

TEST_CASE("the near-field estimator's mean over seeds equals exp(-slope |i - j|)",
          "[near_field][statistical]") {
  // E[K^] = K: average the dense estimator (reference::near_field_log_factor, exponentiated) of
  // N = 2000 seeds. Within the reach the estimator is exp(-m|i - j|) itself: the mean must equal
  // it to rounding. Beyond, it is the mean block mask: variance p (1 - p) / s with independent
  // draws, at most s / (s - 1) times that with a Latin hypercube (Owen, 1997, as in
  // test_sampler.cpp); every entry within 4 standard errors. Pairs with m |i - j| <= 4 only, so
  // that N s p >= 180 and the normal approximation holds.
  const plsh::Sampling sampling =
      GENERATE(plsh::Sampling::Independent, plsh::Sampling::LatinHypercube);
  const Index n = 40;
  const int seeds = 2000;
  std::uint64_t head = 0;
  for (const double slope : {1.0 / 16, 1.0 / 4}) {
    for (const double near_field : {0.5, 0.2}) {
      const Index samples = 5;
      const Index reach = plsh::detail::factor_reach(slope, near_field, n);
      Eigen::MatrixXd mean = Eigen::MatrixXd::Zero(n, n);
      for (int seed = 0; seed < seeds; ++seed) {
        plsh::PlshOptions options = near_options(true, samples, 0, near_field, sampling);
        options.seed = plsh::head_seed(43, head++);
        const auto grids = plsh::kernel_grids({slope}, options);
        const std::vector<double> slopes{slope};
        const auto log_factor =
            plsh::reference::near_field_log_factor(grids, slopes, near_field, 0, n);
        for (Index i = 0; i < n; ++i) {
          for (Index j = 0; j < n; ++j) mean(i, j) += std::exp(log_factor(0, i, j));
        }
      }
      mean /= seeds;
      const double s = static_cast<double>(samples);
      const double inflation = sampling == plsh::Sampling::Independent ? 1 : s / (s - 1);
      Index near_checked = 0, far_checked = 0, outside = 0;
      double worst = 0;
      for (Index i = 0; i < n; ++i) {
        for (Index j = 0; j < n; ++j) {
          const Index distance = i > j ? i - j : j - i;
          const double r = static_cast<double>(distance);
          if (slope * r > 4) continue;
          const double p = std::exp(-slope * r);
          const double deviation = std::abs(mean(i, j) - p);
          if (distance <= reach) {
            if (deviation > 1e-12) ++outside;
            ++near_checked;
          } else {
            const double standard_error = std::sqrt(inflation * p * (1 - p) / s / seeds);
            if (deviation > kStandardErrors * standard_error) ++outside;
            worst = std::max(worst, deviation / standard_error);
            ++far_checked;
          }
        }
      }
      INFO("slope " << slope << ", near_field " << near_field << " (reach " << reach
                    << "): " << near_checked << " near and " << far_checked
                    << " far entries, largest far deviation " << worst << " standard errors");
      CHECK(reach >= 2);
      CHECK(near_checked > n);
      CHECK(far_checked > n);
      CHECK(outside == 0);
    }
  }
}

TEST_CASE("the near-field estimator has no variance within the reach and less beyond none",
          "[near_field][statistical]") {
  // Over seeds, the variance of an entry within the reach is 0, and the estimator agrees with the
  // block estimator of the same draws outside the reach: the near field changes nothing there.
  const Index n = 30;
  const double slope = 0.25;
  const double near_field = 0.3;  // reach floor(ln(1/0.3) * 4) = 4
  const std::vector<double> slopes{slope};
  for (std::uint64_t seed = 0; seed < 50; ++seed) {
    const plsh::PlshOptions options = near_options(true, 7, seed, near_field);
    const auto grids = plsh::kernel_grids(slopes, options);
    const auto near = plsh::reference::near_field_log_factor(grids, slopes, near_field, 0, n);
    const auto blocks = plsh::reference::mean_mask_log_factor(grids);
    for (Index i = 0; i < n; ++i) {
      for (Index j = 0; j < n; ++j) {
        const Index distance = i > j ? i - j : j - i;
        if (distance <= 4) {
          REQUIRE(near(0, i, j) == -slope * static_cast<double>(distance));
        } else {
          REQUIRE(near(0, i, j) == blocks(0, i, j));
        }
      }
    }
  }
}

TEST_CASE("the fused kernel with a near field matches the dense reference", "[near_field]") {
  // 8 query heads on 2 key/value heads: standard slopes, a steep one (the AVX-512 causal rows),
  // slope 0 (every key near: exact) and a gentle one; near fields from the diagonal only to wide.
  std::vector<double> slopes = plsh::alibi_slopes(4);
  slopes.insert(slopes.end(), {0.5, 3.0, 0.0, 1.0 / 64});
  std::uint64_t seed = 100;
  for (const bool causal : {true, false}) {
    for (const double near_field : {1.0, 0.5, 0.05, 1e-3}) {
      for (const Index samples : {1, 20}) {
        const plsh::PlshOptions options = near_options(causal, samples, ++seed, near_field);
        for (const Index n : {1, 2, 33, 130}) {
          check_forward<double>(Shape{n, n, 8, 2, 16, 12}, slopes, options, ++seed);
          check_forward<float>(Shape{n, n, 8, 2, 16, 12}, slopes, options, ++seed);
        }
      }
    }
    // Latin hypercube draws; a head-major layout; padded rows with fewer queries than keys.
    const plsh::PlshOptions latin =
        near_options(causal, 100, 7, 0.05, plsh::Sampling::LatinHypercube);
    check_forward<float>(Shape{300, 300, 8, 2, 16, 12}, slopes, latin, 8);
    check_forward<double>(Shape{130, 130, 4, 2, 16, 12}, plsh::alibi_slopes(4), latin, 9,
                          plsh_test::Layout::HeadMajor);
    check_forward<float>(Shape{65, 130, 4, 4, 5, 9}, plsh::alibi_slopes(4), latin, 10,
                         plsh_test::Layout::PaddedRows);
  }
}

TEST_CASE("the fused kernel with a near field, query and key positions apart", "[near_field]") {
  std::uint64_t seed = 300;
  plsh_test::for_each_offset_case(
      plsh_test::offset_cases(),
      [&](const plsh_test::OffsetCase& c, const plsh::AttentionOptions& base) {
        plsh::PlshOptions options = near_options(base.causal, 20, ++seed, 0.05);
        static_cast<plsh::AttentionOptions&>(options) = base;
        const Shape shape{c.n_q, c.n_k, 4, 2, 8, 6};
        check_forward<double>(shape, plsh::alibi_slopes(4), options, ++seed);
        check_forward<float>(shape, plsh::alibi_slopes(4), options, ++seed);
      });
}

TEST_CASE("a near field past every key is exact ALiBi, reach 0 is the block estimator",
          "[near_field]") {
  const Shape shape{200, 200, 8, 2, 16, 12};
  const std::vector<double> slopes = plsh::alibi_slopes(8);
  for (const bool causal : {true, false}) {
    Problem<double> problem(shape, 11);
    // near_field 1e-300: every head's reach ln(1e300)/m >= 690 * 2 exceeds the 200 positions.
    plsh::PlshOptions options = near_options(causal, 20, 12, 1e-300);
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view,
                                 slopes, options);
    Buffer<double> exact = problem.output();
    plsh::AttentionOptions exact_options;
    exact_options.causal = causal;
    plsh::exact_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), exact.view,
                                        slopes, exact_options);
    CHECK(plsh_test::max_abs_difference(problem.out.in(), exact.in()) <= 1e-12);
    // near_field 1: reach 0, the diagonal, whose block count is always s: the same weights.
    options.near_field = 1;
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), problem.out.view,
                                 slopes, options);
    Buffer<double> blocks = problem.output();
    options.near_field = 0;
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), blocks.view,
                                 slopes, options);
    CHECK(plsh_test::max_abs_difference(problem.out.in(), blocks.in()) <= 1e-14);
  }
}

TEST_CASE("the backward with a near field matches the dense reference", "[near_field][backward]") {
  // Four query heads on two key/value heads, slopes from steep to 0, queries offset from keys.
  const std::vector<double> slopes = {0.3, 0.05, 0.0, 1.0 / 64};
  for (const bool causal : {true, false}) {
    for (const double near_field : {0.5, 0.05}) {
      plsh::PlshOptions options = near_options(causal, 20, 31, near_field);
      options.query_position = 30;
      options.key_position = causal ? 10 : 7;
      const Shape shape{150, 170, 4, 2, 8, 5};
      Problem<double> p(shape, 23, plsh_test::Layout::Packed, 2.0, 2.0);
      Buffer<double> dout = p.output();
      dout.fill_random(77);
      Buffer<double> dq(shape.n_q, shape.heads, shape.dim),
          dk(shape.n_k, shape.kv_heads, shape.dim), dv(shape.n_k, shape.kv_heads, shape.value_dim);
      Buffer<double> rq = dq, rk = dk, rv = dv;
      plsh::plsh_attention<double>(p.q.in(), p.k.in(), p.v.in(), p.out.view, slopes, options);
      plsh::plsh_attention_backward<double>(p.q.in(), p.k.in(), p.v.in(), p.out.in(), dout.in(),
                                            dq.view, dk.view, dv.view, slopes, options);
      plsh::reference::plsh_attention_backward(p.q.in(), p.k.in(), p.v.in(), dout.in(), rq.view,
                                               rk.view, rv.view, slopes, options);
      // As test_backward.cpp: sums of ~170 products of order 1 in double, rounding ~1e-13.
      INFO((causal ? "causal" : "bidirectional") << ", near_field " << near_field);
      CHECK(relative_error(dq, rq) <= 1e-11);
      CHECK(relative_error(dk, rk) <= 1e-11);
      CHECK(relative_error(dv, rv) <= 1e-11);
      // Float: the float kernel against the double reference of the same (rounded) inputs, bound
      // as test_backward.cpp's (logits |l| <= 11, rounding ~5e-6 relative).
      const Buffer<float> fq_in = to<float>(p.q), fk_in = to<float>(p.k), fv_in = to<float>(p.v),
                          fdout = to<float>(dout);
      Buffer<float> fout = to<float>(p.out), fq = to<float>(dq), fk = to<float>(dk),
                    fv = to<float>(dv);
      plsh::plsh_attention<float>(fq_in.in(), fk_in.in(), fv_in.in(), fout.view, slopes, options);
      plsh::plsh_attention_backward<float>(fq_in.in(), fk_in.in(), fv_in.in(), fout.in(),
                                           fdout.in(), fq.view, fk.view, fv.view, slopes, options);
      plsh::reference::plsh_attention_backward(to<double>(fq_in).in(), to<double>(fk_in).in(),
                                               to<double>(fv_in).in(), to<double>(fdout).in(),
                                               rq.view, rk.view, rv.view, slopes, options);
      CHECK(relative_error(to<double>(fq), rq) <= 3e-5);
      CHECK(relative_error(to<double>(fk), rk) <= 3e-5);
      CHECK(relative_error(to<double>(fv), rv) <= 3e-5);
    }
  }
}

TEST_CASE("batched kernels with a near field equal their elements", "[near_field][batch]") {
  // Two elements of 70 tokens as one buffer of 140; the forward and the backward of the batch
  // against each element alone (same draws: the batch shares them).
  const Index batch = 2, tokens = 70;
  const Shape shape{batch * tokens, batch * tokens, 4, 2, 8, 6};
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  const plsh::PlshOptions options = near_options(true, 20, 5, 0.05);
  Problem<float> p(shape, 41);
  Buffer<float> dout = p.output();
  dout.fill_random(42);
  Buffer<float> dq(shape.n_q, shape.heads, shape.dim), dk(shape.n_k, shape.kv_heads, shape.dim),
      dv(shape.n_k, shape.kv_heads, shape.value_dim);
  const auto batched = [&](const auto& view) {
    using Scalar = std::remove_reference_t<decltype(*view.data)>;
    return BatchedHeadsView<Scalar>(batch, view.slice(0, tokens), tokens * view.token_stride);
  };
  plsh::plsh_attention<float>(batched(p.q.in()), batched(p.k.in()), batched(p.v.in()),
                              batched(p.out.view), slopes, options);
  plsh::plsh_attention_backward<float>(batched(p.q.in()), batched(p.k.in()), batched(p.v.in()),
                                       batched(p.out.in()), batched(dout.in()), batched(dq.view),
                                       batched(dk.view), batched(dv.view), slopes, options);
  for (Index b = 0; b < batch; ++b) {
    Buffer<float> out(tokens, shape.heads, shape.value_dim), eq(tokens, shape.heads, shape.dim),
        ek(tokens, shape.kv_heads, shape.dim), ev(tokens, shape.kv_heads, shape.value_dim);
    const auto part = [&](const auto& view) { return view.slice(b * tokens, tokens); };
    plsh::plsh_attention<float>(part(p.q.in()), part(p.k.in()), part(p.v.in()), out.view, slopes,
                                options);
    CHECK(plsh_test::max_abs_difference(out.in(), part(p.out.in())) == 0);
    plsh::plsh_attention_backward<float>(part(p.q.in()), part(p.k.in()), part(p.v.in()), out.in(),
                                         part(dout.in()), eq.view, ek.view, ev.view, slopes,
                                         options);
    CHECK(plsh_test::max_abs_difference(eq.in(), part(dq.in())) == 0);
    CHECK(plsh_test::max_abs_difference(ek.in(), part(dk.in())) == 0);
    CHECK(plsh_test::max_abs_difference(ev.in(), part(dv.in())) == 0);
  }
}

TEST_CASE("KvCache with a near field equals plsh_attention over the whole sequence",
          "[near_field][kv_cache]") {
  // Eight query heads on two key/value heads, steep slopes (eviction within 300 tokens) and the
  // standard ones; one-token steps (the single-query path, near keys by its general job) and
  // chunks of up to 64 (the fused kernel over the resident keys).
  const plsh_test::Sequence<float> sequence(300, 8, 2, 16, 8, 17);
  const std::vector<std::vector<double>> slope_lists = {
      {0.5, 0.25, 0.125, 1.0 / 16, 1.0 / 32, 0.3, 0.2, 0.1}, plsh::alibi_slopes(8)};
  for (std::size_t list = 0; list < slope_lists.size(); ++list) {
    const std::vector<double>& slopes = slope_lists[list];
    for (const double near_field : {0.5, 0.05}) {
      for (const plsh::Sampling sampling :
           {plsh::Sampling::Independent, plsh::Sampling::LatinHypercube}) {
        plsh::PlshOptions options = near_options(true, 20, 3, near_field, sampling);
        options.key_position = 1000;
        const std::vector<float> expected = plsh_test::whole_sequence(sequence, slopes, options);
        Index reach = 0;
        for (const double slope : slopes) {
          reach = std::max(reach, plsh::detail::factor_reach(slope, near_field, 1 << 20));
        }
        for (const std::vector<Index>& pattern :
             {std::vector<Index>{1}, std::vector<Index>{1, 7, 64, 3}}) {
          const plsh_test::DecodeResult result =
              plsh_test::decode(sequence, slopes, options,
                                plsh_test::chunk_schedule(sequence.tokens, pattern), expected);
          // The cache keeps the blocks' keys and the last `reach` positions: max_p (p - min(E(p),
          // p - reach) + 1) + chunk - 1.
          const Index bound =
              std::max(plsh_test::resident_bound(slopes, options, 1000, 1300), reach + 1);
          const Index largest_chunk = *std::max_element(pattern.begin(), pattern.end());
          INFO("slope list " << list << ", near_field " << near_field << ", "
                             << (sampling == plsh::Sampling::Independent ? "independent"
                                                                         : "latin hypercube")
                             << ", chunks of " << pattern.front()
                             << ": max |cache - whole| = " << result.max_difference
                             << ", max resident " << result.max_resident << ", bound " << bound);
          CHECK(result.max_difference <= 2e-5);
          CHECK(result.max_resident <= bound + largest_chunk - 1);
          if (list == 0) CHECK(result.final_resident < sequence.tokens);
        }
      }
    }
  }
}

TEST_CASE("every path weighs a key as Estimator::log_weight, at distances around the reach",
          "[near_field][estimator]") {
  // One head, a zero query (every score 0) and one-hot values (value row j = e_j): row i of the
  // output is then the row's weights normalised, o_ij = exp(l_ij) / sum_k exp(l_ik) with
  // l_ij = Estimator::log_weight(c_ij, |p_i - p_j|), c_ij the draws in which i and j share a
  // block (same_bin). The same draws (kernel_grids) go to BlockCounts (its indices into
  // log_weights(), compared exactly), the fused forward (slope 1/8 causal: the AVX-512 causal
  // rows where the tests are built for AVX-512; bidirectional and slope 1/64: the tiled
  // fused_rows), the single-query path (KvCache::decode, token by token) and the dense reference.
  // A key at the reach w or one past it weighed by the other rule moves its output by about
  // 1e-3 (a count against s e^{-m d}); float rounding, by a few 1e-7.
  const Index n = 48;
  const Index samples = 20;
  for (const double slope : {1.0 / 8, 1.0 / 64}) {
    // No near field, and one of reach 10 (e^{-10.5 m}).
    for (const double near_field : {0.0, std::exp(-10.5 * slope)}) {
      const plsh::PlshOptions causal_options = near_options(true, samples, 17, near_field);
      const std::vector<double> slopes{slope};
      const auto grids = plsh::kernel_grids(slopes, causal_options);
      const plsh::detail::PositionRange range{0, n};
      const plsh::detail::Estimator estimator(slope, samples, near_field, n - 1);
      INFO("slope " << slope << ", near_field " << near_field << ": reach " << estimator.reach());
      if (near_field > 0) {
        REQUIRE(estimator.reach() == plsh::detail::factor_reach(slope, near_field, n - 1));
        REQUIRE(estimator.reach() == 10);
      }
      const auto count = [&](Index i, Index j) {
        Index c = 0;
        for (const plsh::Grid& grid : grids[0]) c += plsh::detail::same_bin(grid, i, j) ? 1 : 0;
        return c;
      };
      // Keys past the reach with a count: the rule beyond the reach is exercised there.
      Index counted_past_reach = 0;
      for (Index i = 0; i + estimator.reach() + 1 < n; ++i) {
        if (count(i, i + estimator.reach() + 1) > 0) ++counted_past_reach;
      }
      CHECK(counted_past_reach > 0);

      // BlockCounts: every row's index, looked up, is log_weight rounded to float.
      for (const bool causal : {true, false}) {
        plsh::detail::BlockCounts<float> counts;
        const Index rows = 16;
        for (Index first = 0; first < n; first += rows) {
          const plsh::Block keys =
              counts.prepare(grids[0], range, first, rows, 0, n, causal, estimator);
          counts.start_chunk(keys.begin, keys.end - keys.begin);
          for (Index r = 0; r < rows; ++r) {
            Index limit = 0;
            const int* index = counts.next_row(r, limit);
            for (Index c = 0; c < keys.end - keys.begin; ++c) {
              const Index i = first + r;
              const Index j = keys.begin + c;
              const int at = c < limit ? index[c] : 0;
              const double expected = causal && j > i
                                          ? -std::numeric_limits<double>::infinity()
                                          : estimator.log_weight(count(i, j), std::abs(i - j));
              INFO("BlockCounts, row " << i << ", key " << j);
              REQUIRE(counts.log_weights()[at] == static_cast<float>(expected));
            }
          }
        }
        // The weights' table lives in the BlockCounts: walking the same tiles again allocates
        // nothing.
        const long allocations = plsh_test::allocations;
        for (Index first = 0; first < n; first += rows) {
          const plsh::Block keys =
              counts.prepare(grids[0], range, first, rows, 0, n, causal, estimator);
          counts.start_chunk(keys.begin, keys.end - keys.begin);
          for (Index r = 0; r < rows; ++r) {
            Index limit = 0;
            counts.next_row(r, limit);
          }
        }
        CHECK(plsh_test::allocations == allocations);
      }

      for (const bool causal : {true, false}) {
        const plsh::PlshOptions options = near_options(causal, samples, 17, near_field);
        Buffer<float> q(n, 1, 4);
        Buffer<float> k(n, 1, 4);
        Buffer<float> v(n, 1, n);
        q.fill(0.0f);
        for (Index t = 0; t < n; ++t) {
          for (Index e = 0; e < 4; ++e) k.at(t, 0, e) = static_cast<float>((t * 7 + e * 3) % 5);
          for (Index e = 0; e < n; ++e) v.at(t, 0, e) = e == t ? 1.0f : 0.0f;
        }
        // The expected output, in double.
        Eigen::MatrixXd expected = Eigen::MatrixXd::Zero(n, n);
        for (Index i = 0; i < n; ++i) {
          double total = 0;
          for (Index j = 0; j < n && (!causal || j <= i); ++j) {
            expected(i, j) = std::exp(estimator.log_weight(count(i, j), std::abs(i - j)));
            total += expected(i, j);
          }
          expected.row(i) /= total;
        }
        const auto check = [&](const char* path, const auto& out, double tolerance) {
          double error = 0;
          for (Index i = 0; i < n; ++i) {
            for (Index j = 0; j < n; ++j) {
              error =
                  std::max(error, std::abs(static_cast<double>(out.at(i, 0, j)) - expected(i, j)));
            }
          }
          INFO(path << (causal ? ", causal" : ", bidirectional") << ": max error " << error);
          CHECK(error <= tolerance);
        };
        Buffer<float> fused(n, 1, n);
        plsh::plsh_attention<float>(q.in(), k.in(), v.in(), fused.view, slopes, options);
        check("fused", fused, 2e-6);
        Buffer<double> dense(n, 1, n);
        plsh::reference::plsh_attention<double>(to<double>(q).in(), to<double>(k).in(),
                                                to<double>(v).in(), dense.view, slopes, options);
        check("reference", dense, 1e-12);
        if (causal) {
          plsh::KvCache<float> cache(1, 1, 4, n, slopes, options);
          Buffer<float> decoded(n, 1, n);
          for (Index t = 0; t < n; ++t) {
            cache.decode(q.in().slice(t, 1), k.in().slice(t, 1), v.in().slice(t, 1),
                         decoded.view.slice(t, 1));
          }
          check("decode", decoded, 2e-6);
        }
      }
    }
  }
}

TEST_CASE("near_field arguments are checked", "[near_field][validation]") {
  const Shape shape{16, 16, 2, 2, 4, 4};
  Problem<float> p(shape, 3);
  const std::vector<double> slopes = plsh::alibi_slopes(2);
  for (const double bad : {-0.1, 1.5, std::numeric_limits<double>::quiet_NaN()}) {
    plsh::PlshOptions options;
    options.near_field = bad;
    CHECK_THROWS_AS(
        plsh::plsh_attention<float>(p.q.in(), p.k.in(), p.v.in(), p.out.view, slopes, options),
        std::invalid_argument);
  }
}

TEST_CASE("the backward of Passes with a near field is the gradient of its forward",
          "[near_field][backward]") {
  // The backward does not depend on the forward's kernel: with Kernel::Passes and a near field it
  // is the gradient of the near-field estimator, which the pass kernel's forward computes (to
  // rounding, the fused kernel's output). Unbatched and batched entry points alike.
  const Shape shape{70, 70, 4, 2, 8, 5};
  Problem<double> p(shape, 3);
  const std::vector<double> slopes = {0.3, 0.05, 0.0, 1.0 / 64};
  Buffer<double> dout = p.output();
  dout.fill_random(9);
  for (const bool causal : {true, false}) {
    plsh::PlshOptions passes = near_options(causal, 20, 5, 0.05);
    passes.kernel = plsh::Kernel::Passes;
    plsh::PlshOptions fused = passes;
    fused.kernel = plsh::Kernel::Fused;
    Buffer<double> out_fused = p.output();
    plsh::plsh_attention<double>(p.q.in(), p.k.in(), p.v.in(), out_fused.view, slopes, fused);
    plsh::plsh_attention<double>(p.q.in(), p.k.in(), p.v.in(), p.out.view, slopes, passes);
    INFO((causal ? "causal" : "bidirectional"));
    CHECK(plsh_test::max_abs_difference(p.out.in(), out_fused.in()) <= 1e-12);
    const auto backward = [&](const plsh::PlshOptions& options, bool batched) {
      Buffer<double> dq(70, 4, 8), dk(70, 2, 8), dv(70, 2, 5);
      if (batched) {
        const auto one = [](const auto& view) {
          using Element = std::remove_pointer_t<decltype(view.data)>;
          return BatchedHeadsView<Element>(1, view);
        };
        plsh::plsh_attention_backward<double>(one(p.q.in()), one(p.k.in()), one(p.v.in()),
                                              one(p.out.in()), one(dout.in()), one(dq.view),
                                              one(dk.view), one(dv.view), slopes, options);
      } else {
        plsh::plsh_attention_backward<double>(p.q.in(), p.k.in(), p.v.in(), p.out.in(), dout.in(),
                                              dq.view, dk.view, dv.view, slopes, options);
      }
      return std::vector<Buffer<double>>{dq, dk, dv};
    };
    Buffer<double> rq(70, 4, 8), rk(70, 2, 8), rv(70, 2, 5);
    plsh::reference::plsh_attention_backward(p.q.in(), p.k.in(), p.v.in(), dout.in(), rq.view,
                                             rk.view, rv.view, slopes, passes);
    const std::vector<Buffer<double>> reference{rq, rk, rv};
    for (const bool batched : {false, true}) {
      std::vector<Buffer<double>> from_passes;
      REQUIRE_NOTHROW(from_passes = backward(passes, batched));
      const std::vector<Buffer<double>> from_fused = backward(fused, batched);
      for (std::size_t i = 0; i < 3; ++i) {
        INFO((batched ? "batched" : "unbatched") << ", gradient "
                                                 << "qkv"[i]);
        CHECK(from_passes[i].storage == from_fused[i].storage);
        CHECK(relative_error(from_passes[i], reference[i]) <= 1e-11);
      }
    }
  }
}

TEST_CASE("KvCache with Kernel::Passes and a near field equals plsh_attention",
          "[near_field][kv_cache]") {
  // Chunks longer than the single-query path go to the pass kernel over the resident keys.
  const plsh_test::Sequence<float> sequence(300, 8, 2, 16, 8, 19);
  const std::vector<double> slopes = plsh::alibi_slopes(8);
  plsh::PlshOptions options = near_options(true, 20, 3, 0.05);
  options.key_position = 1000;
  const std::vector<float> expected = plsh_test::whole_sequence(sequence, slopes, options);
  options.kernel = plsh::Kernel::Passes;
  const plsh_test::DecodeResult result =
      plsh_test::decode(sequence, slopes, options,
                        plsh_test::chunk_schedule(sequence.tokens, {1, 7, 64, 3}), expected);
  INFO("max |cache - whole| = " << result.max_difference);
  CHECK(result.max_difference <= 2e-5);
}

}  // namespace test_near_field
