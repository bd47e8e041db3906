// Tests of PlshOptions::sampling in the kernels: with Sampling::LatinHypercube, plsh_attention
// (Passes and Fused), plsh_attention_backward and KvCache partition head h with the grids
// kernel_grids returns, so they equal the dense double references (reference::mask_attention,
// reference::factor_attention_backward with reference::mean_mask_log_factor) fed those grids; and
// every entry point rejects a value outside the enumeration, naming itself. The draws themselves
// are tested in test_sampler.cpp and test_latin_hypercube.cpp.
//
// Tolerances: reference_tolerance of the attention fixture for the forward (3e-5 float, 1e-11
// double); the backward in double sums a few hundred terms per gradient entry in another order
// than the reference, so 1e-10 relative to the tensor's scale.

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/batch.hpp>
#include <plsh/kv_cache.hpp>
#include <plsh/reference.hpp>
#include <plsh/sampler.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace test_stratified {

namespace {

using plsh::HeadsView;
using plsh::Index;
using plsh_test::Buffer;
using plsh_test::Problem;
using plsh_test::Shape;

plsh::PlshOptions latin_hypercube_options(bool causal, Index samples, std::uint64_t seed,
                                          plsh::Kernel kernel) {
  plsh::PlshOptions options;
  options.causal = causal;
  options.samples = samples;
  options.seed = seed;
  options.kernel = kernel;
  options.sampling = plsh::Sampling::LatinHypercube;
  options.near_field = 0;  // the block estimator (test_near_field.cpp tests the near field)
  return options;
}

/// max |a - b| / max |b| over two buffers of the same size.
double relative_difference(const std::vector<double>& a, const std::vector<double>& b) {
  double difference = 0;
  double scale = 0;
  for (std::size_t i = 0; i < b.size(); ++i) {
    difference = std::max(difference, std::abs(a[i] - b[i]));
    scale = std::max(scale, std::abs(b[i]));
  }
  return difference / scale;
}

/// The slopes of the kernel tests: standard slopes, a moderate, a steep (one position per block),
/// zero (one block) and a gentle one, on 8 query heads.
std::vector<double> test_slopes() {
  std::vector<double> slopes = plsh::alibi_slopes(4);
  slopes.insert(slopes.end(), {0.5, 50.0, 0.0, 1.0 / 64});
  return slopes;
}

template <class Scalar>
void check_forward_against_reference() {
  const std::vector<double> slopes = test_slopes();
  const double tolerance = plsh_test::reference_tolerance<Scalar>();
  for (const bool causal : {true, false}) {
    for (const Index n : {Index{1}, Index{65}, Index{257}}) {
      Problem<Scalar> problem(Shape{n, n, 8, 2, 16, 12}, 31 + static_cast<std::uint64_t>(n));
      for (const Index samples : {1, 3, 20}) {
        const plsh::PlshOptions options =
            latin_hypercube_options(causal, samples, 9, plsh::Kernel::Fused);
        INFO(plsh_test::type_name<Scalar>() << ", " << (causal ? "causal" : "bidirectional")
                                            << ", n = " << n << ", s = " << samples);
        Buffer<Scalar> expected = problem.output();
        plsh::reference::mask_attention(problem.q.in(), problem.k.in(), problem.v.in(),
                                        expected.view, plsh::kernel_grids(slopes, options),
                                        options);
        for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
          plsh::PlshOptions run = options;
          run.kernel = kernel;
          Buffer<Scalar> out = problem.output();
          plsh::plsh_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), out.view,
                                       slopes, run);
          const double error = plsh_test::max_abs_difference(out.in(), expected.in());
          INFO((kernel == plsh::Kernel::Fused ? "fused" : "passes")
               << ": max difference " << plsh_test::scientific(error));
          CHECK(error <= tolerance);
        }
      }
    }
  }
}

}  // namespace

TEST_CASE("Latin hypercube draws: Passes and Fused equal the dense reference on their grids",
          "[stratified]") {
  check_forward_against_reference<double>();
  check_forward_against_reference<float>();
}

TEST_CASE("Latin hypercube draws reach the kernel: other blocks than independent draws",
          "[stratified]") {
  // With s = 1 the one Latin hypercube draw is RandomBinning draw 0, so the outputs are equal;
  // with s = 20 the draws differ, and so do the outputs.
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  Problem<double> problem(Shape{130, 130, 4, 2, 8, 8}, 12);
  for (const Index samples : {1, 20}) {
    plsh::PlshOptions independent;
    independent.samples = samples;
    independent.seed = 4;
    independent.sampling = plsh::Sampling::Independent;
    plsh::PlshOptions latin_hypercube = independent;
    latin_hypercube.sampling = plsh::Sampling::LatinHypercube;
    Buffer<double> a = problem.output();
    Buffer<double> b = problem.output();
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), a.view, slopes,
                                 independent);
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), b.view, slopes,
                                 latin_hypercube);
    const double difference = plsh_test::max_abs_difference(a.in(), b.in());
    INFO("s = " << samples << ": max difference " << difference);
    if (samples == 1) {
      CHECK(a.storage == b.storage);
    } else {
      CHECK(difference > 1e-3);
    }
  }
}

TEST_CASE("Latin hypercube draws: plsh_attention_backward equals the dense reference",
          "[stratified]") {
  const std::vector<double> slopes = test_slopes();
  for (const bool causal : {true, false}) {
    const Shape shape{70, 70, 8, 2, 8, 6};
    Problem<double> problem(shape, 5, plsh_test::Layout::Packed, 1.5, 1.5);
    Buffer<double> dout = problem.output();
    dout.fill_random(plsh::detail::mix64(77));
    const plsh::PlshOptions options = latin_hypercube_options(causal, 20, 13, plsh::Kernel::Fused);
    Buffer<double> out = problem.output();
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.view, slopes,
                                 options);
    Buffer<double> dq(shape.n_q, shape.heads, shape.dim), dk(shape.n_k, shape.kv_heads, shape.dim),
        dv(shape.n_k, shape.kv_heads, shape.value_dim);
    plsh::plsh_attention_backward<double>(problem.q.in(), problem.k.in(), problem.v.in(), out.in(),
                                          dout.in(), dq.view, dk.view, dv.view, slopes, options);
    Buffer<double> dq_ref = dq, dk_ref = dk, dv_ref = dv;
    const auto grids = plsh::kernel_grids(slopes, options);
    plsh::reference::factor_attention_backward(
        problem.q.in(), problem.k.in(), problem.v.in(), dout.in(), dq_ref.view, dk_ref.view,
        dv_ref.view, options, plsh::reference::mean_mask_log_factor(grids));
    const double error_q = relative_difference(dq.storage, dq_ref.storage);
    const double error_k = relative_difference(dk.storage, dk_ref.storage);
    const double error_v = relative_difference(dv.storage, dv_ref.storage);
    INFO((causal ? "causal" : "bidirectional")
         << ": relative errors dq " << error_q << ", dk " << error_k << ", dv " << error_v);
    CHECK(error_q <= 1e-10);
    CHECK(error_k <= 1e-10);
    CHECK(error_v <= 1e-10);
  }
}

TEST_CASE("Latin hypercube draws: KvCache equals the dense reference on their grids",
          "[stratified]") {
  // Decode token by token (chunks of 1, 5, 2): after each append the newest query attends the
  // cache; the reference attends all queries of the sequence at once with the same grids.
  const std::vector<double> slopes = {0.5, 0.25, 0.125, 1.0 / 16};
  const Index n = 150;
  Problem<double> problem(Shape{n, n, 4, 2, 8, 6}, 21, plsh_test::Layout::Packed, 1.0);
  plsh::PlshOptions options = latin_hypercube_options(true, 20, 8, plsh::Kernel::Fused);
  options.key_position = 1000;
  options.query_position = 1000;
  Buffer<double> expected = problem.output();
  plsh::reference::mask_attention(problem.q.in(), problem.k.in(), problem.v.in(), expected.view,
                                  plsh::kernel_grids(slopes, options), options);
  plsh::KvCache<double> cache(4, 2, 8, 6, slopes, options);
  const Index pattern[] = {1, 5, 2};
  double largest = 0;
  Buffer<double> out(1, 4, 6);
  for (Index done = 0, i = 0; done < n; ++i) {
    const Index chunk = std::min(pattern[i % 3], n - done);
    cache.append(problem.k.in().slice(done, chunk), problem.v.in().slice(done, chunk));
    done += chunk;
    cache.attend(problem.q.in().slice(done - 1, 1), out.view);
    largest = std::max(largest,
                       plsh_test::max_abs_difference(out.in(), expected.in().slice(done - 1, 1)));
  }
  INFO("largest difference from the reference " << largest);
  CHECK(largest <= plsh_test::reference_tolerance<double>());
}

TEST_CASE("every entry point rejects a sampling outside the enumeration", "[stratified]") {
  using Catch::Matchers::Contains;
  const std::vector<double> slopes = {0.5, 0.25};
  Problem<double> problem(Shape{8, 8, 2, 1, 4, 4}, 3);
  Buffer<double> out = problem.output();
  Buffer<double> dq(8, 2, 4), dk(8, 1, 4), dv(8, 1, 4);
  plsh::PlshOptions options;
  options.sampling = static_cast<plsh::Sampling>(7);
  for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
    options.kernel = kernel;
    REQUIRE_THROWS_WITH(plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                                     out.view, slopes, options),
                        Contains("plsh_attention: options.sampling must be"));
  }
  REQUIRE_THROWS_WITH(
      plsh::plsh_attention<double>(plsh::BatchedHeadsView<const double>(1, problem.q.in()),
                                   plsh::BatchedHeadsView<const double>(1, problem.k.in()),
                                   plsh::BatchedHeadsView<const double>(1, problem.v.in()),
                                   plsh::BatchedHeadsView<double>(1, out.view), slopes, options),
      Contains("plsh_attention: options.sampling must be"));
  REQUIRE_THROWS_WITH(plsh::plsh_attention_backward<double>(
                          problem.q.in(), problem.k.in(), problem.v.in(), out.in(), out.in(),
                          dq.view, dk.view, dv.view, slopes, options),
                      Contains("plsh_attention_backward: options.sampling must be"));
  REQUIRE_THROWS_WITH(
      plsh::plsh_attention_backward<double>(
          plsh::BatchedHeadsView<const double>(1, problem.q.in()),
          plsh::BatchedHeadsView<const double>(1, problem.k.in()),
          plsh::BatchedHeadsView<const double>(1, problem.v.in()),
          plsh::BatchedHeadsView<const double>(1, out.in()),
          plsh::BatchedHeadsView<const double>(1, out.in()),
          plsh::BatchedHeadsView<double>(1, dq.view), plsh::BatchedHeadsView<double>(1, dk.view),
          plsh::BatchedHeadsView<double>(1, dv.view), slopes, options),
      Contains("plsh_attention_backward: options.sampling must be"));
  REQUIRE_THROWS_WITH(plsh::KvCache<double>(2, 1, 4, 4, slopes, options),
                      Contains("KvCache: options.sampling must be"));
  REQUIRE_THROWS_WITH(plsh::kernel_grids(slopes, options),
                      Contains("kernel_grids: options.sampling must be"));
  INFO("a rejected call leaves the output untouched");
  CHECK(out.storage == problem.output().storage);
}

}  // namespace test_stratified
