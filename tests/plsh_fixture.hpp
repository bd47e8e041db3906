#ifndef PLSH_TESTS_PLSH_FIXTURE_HPP
#define PLSH_TESTS_PLSH_FIXTURE_HPP

// Calls of plsh_attention on the problems of attention_fixture.hpp, shared by the Positional LSH
// tests.

#include <cstdint>
#include <vector>

#include <plsh/attention/plsh_attention.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace plsh_test {

/// PlshOptions from attention options and the three Positional LSH settings, with independent
/// draws and no near field (PlshOptions::paper(), the paper's estimator; test_stratified.cpp and
/// test_near_field.cpp test the others).
inline plsh::PlshOptions plsh_options(const plsh::AttentionOptions& base, Index samples,
                                      std::uint64_t seed, plsh::Kernel kernel) {
  plsh::PlshOptions options = plsh::PlshOptions::paper();
  static_cast<plsh::AttentionOptions&>(options) = base;
  options.samples = samples;
  options.seed = seed;
  options.kernel = kernel;
  return options;
}

/// plsh_attention of `problem` into `out`.
template <class Scalar>
void run_plsh(Problem<Scalar>& problem, Buffer<Scalar>& out, const std::vector<double>& slopes,
              const plsh::PlshOptions& options) {
  plsh::plsh_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), out.view, slopes,
                               options);
}

}  // namespace plsh_test

#endif  // PLSH_TESTS_PLSH_FIXTURE_HPP
