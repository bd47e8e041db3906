// The kernels' batched cores for the four storage types, and the inner kernels that inline code
// calls directly (KvCache's steps, regular_attention), compiled once (kernel_instances_*.cpp, in
// the library every unit test links) instead of in every test that calls them: each test file
// that includes this header only declares them (extern template), which takes most of the code
// generation out of those files' compilation. The public entry points (unbatched and batched) are
// thin wrappers around these cores, so their tests exercise exactly the code the library ships.
// A smoke build includes it first in the examples and benchmarks too (plsh_smoke_kernels).

#ifndef PLSH_TESTS_KERNEL_INSTANCES_HPP
#define PLSH_TESTS_KERNEL_INSTANCES_HPP

#include <Eigen/Core>
#include <vector>

#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/fused_kernel.hpp>
#include <plsh/attention/pass_kernel.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/attention/regular.hpp>
#include <plsh/decode/decode_step.hpp>

// PLSH_TEST_KERNEL_INSTANCES(extern template, S) declares the cores for storage type S;
// PLSH_TEST_KERNEL_INSTANCES(template, S) instantiates them.
#define PLSH_TEST_KERNEL_INSTANCES(PREFIX, S)                                                      \
  PREFIX void plsh::detail::batched_exact_alibi_attention<S>(                                      \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, const plsh::AttentionOptions&,                                   \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX void plsh::detail::batched_truncated_alibi_attention<S>(                                  \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, double, const plsh::AttentionOptions&, const char*,              \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX plsh::Index plsh::detail::batched_windowed_alibi_attention<S>(                            \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>*,                    \
      const std::vector<double>&, double, const plsh::AttentionOptions&,                           \
      const plsh::detail::UnheldKeys&, std::vector<plsh::Block>*,                                  \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX void plsh::detail::windowed_alibi_attention_keeping<S>(                                   \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, double, const plsh::AttentionOptions&,                           \
      const plsh::RowLse<plsh::detail::Compute<S>>&, plsh::KeptKeys*);                             \
  PREFIX void plsh::detail::batched_plsh_attention<S>(                                             \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, const plsh::PlshOptions&);                                       \
  PREFIX void plsh::detail::plsh_attention_writing_lse<S>(                                         \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<double>&, const plsh::PlshOptions&,                                        \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX void plsh::detail::batched_fixed_block_attention<S>(                                      \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&, plsh::Index,       \
      const plsh::AttentionOptions&, const plsh::RowLse<plsh::detail::Compute<S>>&);               \
  PREFIX void plsh::detail::batched_exact_alibi_attention_backward<S>(                             \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                          \
      const std::vector<double>&, const plsh::AttentionOptions&,                                   \
      const plsh::RowLse<const plsh::detail::Compute<S>>&);                                        \
  PREFIX void plsh::detail::batched_truncated_alibi_attention_backward<S>(                         \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                          \
      const std::vector<double>&, double, const plsh::AttentionOptions&, const char*,              \
      const plsh::RowLse<const plsh::detail::Compute<S>>&);                                        \
  PREFIX void plsh::detail::batched_windowed_alibi_attention_backward<S>(                          \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                          \
      const std::vector<double>&, double, const plsh::AttentionOptions&,                           \
      const plsh::RowLse<const plsh::detail::Compute<S>>&, const plsh::KeptKeys*);                 \
  PREFIX void plsh::detail::batched_plsh_attention_backward<S>(                                    \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                          \
      const std::vector<double>&, const plsh::PlshOptions&,                                        \
      const plsh::RowLse<const plsh::detail::Compute<S>>&);                                        \
  PREFIX void plsh::detail::block_counts_backward<S>(                                              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&,                          \
      const std::vector<double>&, const std::vector<std::vector<plsh::Grid>>&,                     \
      const plsh::AttentionOptions&, double, const plsh::RowLse<const plsh::detail::Compute<S>>&); \
  PREFIX void plsh::detail::batched_fixed_block_attention_backward<S>(                             \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const plsh::BatchedHeadsView<S>&, const plsh::BatchedHeadsView<S>&, plsh::Index,             \
      const plsh::AttentionOptions&, const plsh::RowLse<const plsh::detail::Compute<S>>&);

// PLSH_TEST_INNER_INSTANCES(PREFIX, S): the inner kernels for storage type S, which the public
// entry points reach through the cores above and KvCache (an inline class) calls itself.
#define PLSH_TEST_INNER_INSTANCES(PREFIX, S)                                                       \
  PREFIX void plsh::detail::fused_attention<S>(                                                    \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<std::vector<plsh::Grid>>&, const std::vector<double>&,                     \
      const plsh::AttentionOptions&, double, plsh::Index,                                          \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX void plsh::detail::fused_attention<S>(                                                    \
      const plsh::HeadsView<const S>&, const plsh::HeadsView<const S>&,                            \
      const plsh::HeadsView<const S>&, const plsh::HeadsView<S>&,                                  \
      const std::vector<std::vector<plsh::Grid>>&, const std::vector<double>&,                     \
      const plsh::AttentionOptions&, double, plsh::Index);                                         \
  PREFIX void plsh::detail::pass_attention<S, plsh::RegularAttention>(                             \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<std::vector<plsh::Grid>>&, const std::vector<plsh::detail::Estimator>&,    \
      const plsh::AttentionOptions&, plsh::RegularAttention&&,                                     \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX void plsh::detail::pass_attention<S, plsh::RegularAttention&>(                            \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<const S>&,              \
      const plsh::BatchedHeadsView<const S>&, const plsh::BatchedHeadsView<S>&,                    \
      const std::vector<std::vector<plsh::Grid>>&, const std::vector<plsh::detail::Estimator>&,    \
      const plsh::AttentionOptions&, plsh::RegularAttention&,                                      \
      const plsh::RowLse<plsh::detail::Compute<S>>&);                                              \
  PREFIX void plsh::detail::pass_attention<S, plsh::RegularAttention>(                             \
      const plsh::HeadsView<const S>&, const plsh::HeadsView<const S>&,                            \
      const plsh::HeadsView<const S>&, const plsh::HeadsView<S>&,                                  \
      const std::vector<std::vector<plsh::Grid>>&, const std::vector<plsh::detail::Estimator>&,    \
      const plsh::AttentionOptions&, plsh::RegularAttention&&);                                    \
  PREFIX double plsh::detail::decode_step<S>(                                                      \
      const plsh::detail::KvBuffer<S>&, const plsh::detail::BlockTracker&, plsh::Index,            \
      plsh::Index, const plsh::HeadsView<const S>&, const plsh::HeadsView<S>&, double, bool, bool, \
      plsh::detail::DecodeWorkspace<S>&, const std::vector<plsh::detail::Estimator>&);             \
  PREFIX void plsh::detail::attend_rows<S>(                                                        \
      const plsh::ConstHeadMap<S>&, const plsh::ConstHeadMap<S>&, const plsh::ConstHeadMap<S>&,    \
      const plsh::AttentionOptions&, const plsh::detail::LinearBias&, plsh::Index, plsh::Index,    \
      plsh::HeadMap<S>&, plsh::detail::Compute<S>*);                                               \
  PREFIX void plsh::detail::attend_span<S>(                                                        \
      const plsh::ConstHeadMap<S>&, const plsh::ConstHeadMap<S>&, const plsh::ConstHeadMap<S>&,    \
      const plsh::AttentionOptions&, const plsh::detail::LinearBias&, plsh::HeadMap<S>&,           \
      plsh::detail::Compute<S>*);

// regular_attention<S> takes the compute types only.
#define PLSH_TEST_REGULAR_INSTANCE(PREFIX, S)                                                   \
  PREFIX void plsh::regular_attention<S>(                                                       \
      const plsh::ConstHeadMap<S>&, const plsh::ConstHeadMap<S>&, const plsh::ConstHeadMap<S>&, \
      const plsh::AttentionOptions&, plsh::HeadMap<S>, plsh::LseMap<S>);

PLSH_TEST_KERNEL_INSTANCES(extern template, float)
PLSH_TEST_KERNEL_INSTANCES(extern template, double)
PLSH_TEST_KERNEL_INSTANCES(extern template, Eigen::bfloat16)
PLSH_TEST_KERNEL_INSTANCES(extern template, Eigen::half)
PLSH_TEST_INNER_INSTANCES(extern template, float)
PLSH_TEST_INNER_INSTANCES(extern template, double)
PLSH_TEST_INNER_INSTANCES(extern template, Eigen::bfloat16)
PLSH_TEST_INNER_INSTANCES(extern template, Eigen::half)
PLSH_TEST_REGULAR_INSTANCE(extern template, float)
PLSH_TEST_REGULAR_INSTANCE(extern template, double)

#endif  // PLSH_TESTS_KERNEL_INSTANCES_HPP
