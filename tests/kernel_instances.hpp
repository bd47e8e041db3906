// The kernels' batched cores for the four storage types, compiled once (kernel_instances.cpp, in
// the library every unit test links) instead of in every test that calls them: each test file
// that includes this header only declares them (extern template), which takes most of the code
// generation out of those files' compilation. The public entry points (unbatched and batched) are
// thin wrappers around these cores, so their tests exercise exactly the code the library ships.

#ifndef PLSH_TESTS_KERNEL_INSTANCES_HPP
#define PLSH_TESTS_KERNEL_INSTANCES_HPP

#include <Eigen/Core>
#include <vector>

#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>

// PLSH_TEST_KERNEL_INSTANCES(extern template, S) declares the cores for storage type S;
// PLSH_TEST_KERNEL_INSTANCES(template, S) instantiates them.
#define PLSH_TEST_KERNEL_INSTANCES(PREFIX, S)                                                \
  PREFIX void plsh::detail::batched_exact_alibi_attention<S>(                                \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,              \
      const std::vector<double>&, const plsh::AttentionOptions&);                            \
  PREFIX void plsh::detail::batched_windowed_alibi_attention<S>(                             \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>*,              \
      const std::vector<double>&, double, const plsh::AttentionOptions&,                     \
      const plsh::detail::UnheldKeys&, std::vector<plsh::Block>*);                           \
  PREFIX void plsh::detail::batched_plsh_attention<S>(                                       \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,              \
      const std::vector<double>&, const plsh::PlshOptions&);                                 \
  PREFIX void plsh::detail::batched_fixed_block_attention<S>(                                \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&, plsh::Index, \
      const plsh::AttentionOptions&);                                                        \
  PREFIX void plsh::detail::batched_exact_alibi_attention_backward<S>(                       \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,              \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, const plsh::AttentionOptions&);                            \
  PREFIX void plsh::detail::batched_windowed_alibi_attention_backward<S>(                    \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,              \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, double, const plsh::AttentionOptions&);                    \
  PREFIX void plsh::detail::batched_plsh_attention_backward<S>(                              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,              \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, const plsh::PlshOptions&);                                 \
  PREFIX void plsh::detail::batched_fixed_block_attention_backward<S>(                       \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,        \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,              \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&, plsh::Index,       \
      const plsh::AttentionOptions&);

PLSH_TEST_KERNEL_INSTANCES(extern template, float)
PLSH_TEST_KERNEL_INSTANCES(extern template, double)
PLSH_TEST_KERNEL_INSTANCES(extern template, Eigen::bfloat16)
PLSH_TEST_KERNEL_INSTANCES(extern template, Eigen::half)

#endif  // PLSH_TESTS_KERNEL_INSTANCES_HPP
