#ifndef PLSH_BATCH_HPP
#define PLSH_BATCH_HPP

/// \file batch.hpp
/// The attention kernels over a batch of BatchedHeadsView (batched_heads_view.hpp), a strided
/// `[batch][tokens][heads][dim]` tensor, FlashAttention's layout.
///
/// Every batched kernel checks the batch once (the same batch size everywhere, no element address
/// overflowing, outputs not overlapping each other or an input), then the shapes and options of
/// one element, and runs the kernel's job list over all the elements in one parallel region:
/// jobs (batch element, head, query tile) for the tiled forwards and the backward's sweep 1 and
/// lse pass, (batch element, head) for the Positional LSH passes, (batch element, key/value head,
/// key tile) for the backward's sweep 2, (batch element, key/value head) for its one sweep. The
/// draws of Positional LSH are made once per call and shared by the
/// elements. An unbatched call is the same code with a batch of one, every job computes what it
/// computes there, and every output row is written by one job, so a batched call equals the loop
/// over its elements bit for bit, for any number of threads. Cost: the sum of the elements' costs
/// (one draw of the grids, one parallel region); work estimate for the parallel threshold:
/// batch times one element's.
///
/// Tested in tests/test_batch.cpp against the loop over the batch (1 and 2 threads, strided and
/// packed layouts, grouped heads, a batch too small to run in parallel) and for every argument
/// check; the bfloat16 and half overloads in tests/test_half.cpp.

#include <algorithm>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/plsh_attention.hpp"
#include "batched_heads_view.hpp"
#include "detail/check.hpp"
#include "detail/validate.hpp"
#include "options.hpp"
#include "row_lse.hpp"
#include "tensor.hpp"

namespace plsh {

namespace detail {

/// The checks of a batched call: every view well formed and free of index overflow, the same
/// batch size everywhere, each output injective and overlapping neither an input nor another
/// output. The shapes and options of an element are checked by the kernel, on the view of
/// element 0, also when the batch is empty (the kernel then returns after its checks).
template <class Scalar, std::size_t Inputs, std::size_t Outputs>
void validate_batch(const char* function, const BatchedHeadsView<const Scalar> (&inputs)[Inputs],
                    const char* const (&input_names)[Inputs],
                    const BatchedHeadsView<Scalar> (&outputs)[Outputs],
                    const char* const (&output_names)[Outputs]) {
  for (std::size_t i = 0; i < Inputs; ++i) {
    require_batched_view(inputs[i], function, input_names[i]);
    require(inputs[i].batch == inputs[0].batch, function, [&] {
      return std::string(input_names[i]) + ".batch (" + std::to_string(inputs[i].batch) +
             ") must equal " + input_names[0] + ".batch (" + std::to_string(inputs[0].batch) + ")";
    });
  }
  for (std::size_t o = 0; o < Outputs; ++o) {
    require_batched_view(outputs[o], function, output_names[o]);
    require(outputs[o].batch == inputs[0].batch, function, [&] {
      return std::string(output_names[o]) + ".batch (" + std::to_string(outputs[o].batch) +
             ") must equal " + input_names[0] + ".batch (" + std::to_string(inputs[0].batch) + ")";
    });
  }
  require_separate(function, inputs, input_names, outputs, output_names);
}

/// validate_batch for a forward kernel (q, k, v -> out), then `run()`, which checks an element's
/// shapes and options and computes nothing for an empty batch.
template <class Scalar, class Run>
void run_forward_batch(const char* function, const BatchedHeadsView<const Scalar>& q,
                       const BatchedHeadsView<const Scalar>& k,
                       const BatchedHeadsView<const Scalar>& v, const BatchedHeadsView<Scalar>& out,
                       Run&& run) {
  const BatchedHeadsView<const Scalar> inputs[] = {q, k, v};
  const char* const input_names[] = {"q", "k", "v"};
  const BatchedHeadsView<Scalar> outputs[] = {out};
  const char* const output_names[] = {"out"};
  validate_batch(function, inputs, input_names, outputs, output_names);
  run();
}

/// validate_batch for a backward kernel (q, k, v, out, dout -> dq, dk, dv), then `run()`, as
/// run_forward_batch.
template <class Scalar, class Run>
void run_backward_batch(const char* function, const BatchedHeadsView<const Scalar>& q,
                        const BatchedHeadsView<const Scalar>& k,
                        const BatchedHeadsView<const Scalar>& v,
                        const BatchedHeadsView<const Scalar>& out,
                        const BatchedHeadsView<const Scalar>& dout,
                        const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
                        const BatchedHeadsView<Scalar>& dv, Run&& run) {
  const BatchedHeadsView<const Scalar> inputs[] = {q, k, v, out, dout};
  const char* const input_names[] = {"q", "k", "v", "out", "dout"};
  const BatchedHeadsView<Scalar> outputs[] = {dq, dk, dv};
  const char* const output_names[] = {"dq", "dk", "dv"};
  validate_batch(function, inputs, input_names, outputs, output_names);
  run();
}

}  // namespace detail

/// exact_alibi_attention on every batch element: `q [B][n_q][H][d]`, `k [B][n_k][H_kv][d]`,
/// `v [B][n_k][H_kv][d_v]`, `out [B][n_q][H][d_v]`, and, unless empty, the row log-sum-exp
/// `lse [B][H][n_q]` (row_lse.hpp); slopes and options as the unbatched kernel.
/// \throws std::invalid_argument as the unbatched kernel, and for batch sizes that disagree,
/// strides that overflow, or outputs overlapping an input.
template <class Scalar>
void exact_alibi_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                           const BatchedHeadsView<Scalar>& out, const std::vector<double>& slopes,
                           const AttentionOptions& options = {},
                           RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::run_forward_batch<Scalar>("exact_alibi_attention", q, k, v, out, [&] {
    detail::batched_exact_alibi_attention<Scalar>(q, k, v, out, slopes, options, lse);
  });
}

/// windowed_alibi_attention on every batch element (shapes as the batched exact_alibi_attention);
/// `kept`, when not null, receives the kept key rows for the batched backward.
template <class Scalar>
void windowed_alibi_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                              const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                              const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                              const BatchedHeadsView<Scalar>& out,
                              const std::vector<double>& slopes, double tolerance = 1e-6,
                              const AttentionOptions& options = {},
                              RowLse<detail::Compute<Scalar>> lse = {}, KeptKeys* kept = nullptr) {
  detail::run_forward_batch<Scalar>("windowed_alibi_attention", q, k, v, out, [&] {
    detail::windowed_alibi_attention_keeping<Scalar>(q, k, v, out, slopes, tolerance, options, lse,
                                                     kept);
  });
}

/// truncated_alibi_attention on every batch element (shapes as the batched
/// exact_alibi_attention).
template <class Scalar>
void truncated_alibi_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                               const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                               const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                               const BatchedHeadsView<Scalar>& out,
                               const std::vector<double>& slopes, double factor_tolerance,
                               const AttentionOptions& options = {},
                               RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::run_forward_batch<Scalar>("truncated_alibi_attention", q, k, v, out, [&] {
    detail::batched_truncated_alibi_attention<Scalar>(q, k, v, out, slopes, factor_tolerance,
                                                      options, "truncated_alibi_attention", lse);
  });
}

/// plsh_attention on every batch element (shapes as the batched exact_alibi_attention). Every
/// element uses the same draws (those of `options.seed`).
template <class Scalar>
void plsh_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                    const BatchedHeadsView<Scalar>& out, const std::vector<double>& slopes,
                    const PlshOptions& options = {}, RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::run_forward_batch<Scalar>("plsh_attention", q, k, v, out, [&] {
    detail::plsh_attention_writing_lse<Scalar>(q, k, v, out, slopes, options, lse);
  });
}

/// fixed_block_attention on every batch element (shapes as the batched exact_alibi_attention).
template <class Scalar>
void fixed_block_attention(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                           const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                           const BatchedHeadsView<Scalar>& out, Index block_size,
                           const AttentionOptions& options = {},
                           RowLse<detail::Compute<Scalar>> lse = {}) {
  detail::run_forward_batch<Scalar>("fixed_block_attention", q, k, v, out, [&] {
    detail::batched_fixed_block_attention<Scalar>(q, k, v, out, block_size, options, lse);
  });
}

/// exact_alibi_attention_backward on every batch element: inputs q, k, v, out, dout and gradients
/// dq (like q), dk (like k), dv (like v), each `[B][...]`; `lse [B][H][n_q]`, the forward's, or
/// empty.
template <class Scalar>
void exact_alibi_attention_backward(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
                                    const BatchedHeadsView<Scalar>& dq,
                                    const BatchedHeadsView<Scalar>& dk,
                                    const BatchedHeadsView<Scalar>& dv,
                                    const std::vector<double>& slopes,
                                    const AttentionOptions& options = {},
                                    RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::run_backward_batch<Scalar>("exact_alibi_attention_backward", q, k, v, out, dout, dq, dk,
                                     dv, [&] {
                                       detail::batched_exact_alibi_attention_backward<Scalar>(
                                           q, k, v, out, dout, dq, dk, dv, slopes, options, lse);
                                     });
}

/// windowed_alibi_attention_backward on every batch element (shapes as the batched
/// exact_alibi_attention_backward).
template <class Scalar>
void windowed_alibi_attention_backward(
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
    const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
    const BatchedHeadsView<Scalar>& dv, const std::vector<double>& slopes, double tolerance = 1e-6,
    const AttentionOptions& options = {}, RowLse<const detail::Compute<Scalar>> lse = {},
    const KeptKeys* kept = nullptr) {
  detail::run_backward_batch<Scalar>(
      "windowed_alibi_attention_backward", q, k, v, out, dout, dq, dk, dv, [&] {
        detail::batched_windowed_alibi_attention_backward<Scalar>(
            q, k, v, out, dout, dq, dk, dv, slopes, tolerance, options, lse, kept);
      });
}

/// truncated_alibi_attention_backward on every batch element (shapes as the batched
/// exact_alibi_attention_backward).
template <class Scalar>
void truncated_alibi_attention_backward(
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
    const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
    const BatchedHeadsView<Scalar>& dv, const std::vector<double>& slopes, double factor_tolerance,
    const AttentionOptions& options = {}, RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::run_backward_batch<Scalar>("truncated_alibi_attention_backward", q, k, v, out, dout, dq,
                                     dk, dv, [&] {
                                       detail::batched_truncated_alibi_attention_backward<Scalar>(
                                           q, k, v, out, dout, dq, dk, dv, slopes, factor_tolerance,
                                           options, "truncated_alibi_attention_backward", lse);
                                     });
}

/// plsh_attention_backward on every batch element (shapes as the batched
/// exact_alibi_attention_backward).
template <class Scalar>
void plsh_attention_backward(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
                             const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
                             const BatchedHeadsView<Scalar>& dq, const BatchedHeadsView<Scalar>& dk,
                             const BatchedHeadsView<Scalar>& dv, const std::vector<double>& slopes,
                             const PlshOptions& options = {},
                             RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::run_backward_batch<Scalar>("plsh_attention_backward", q, k, v, out, dout, dq, dk, dv,
                                     [&] {
                                       detail::batched_plsh_attention_backward<Scalar>(
                                           q, k, v, out, dout, dq, dk, dv, slopes, options, lse);
                                     });
}

/// fixed_block_attention_backward on every batch element (shapes as the batched
/// exact_alibi_attention_backward).
template <class Scalar>
void fixed_block_attention_backward(const BatchedHeadsView<const detail::NonDeduced<Scalar>>& q,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& k,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& v,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& out,
                                    const BatchedHeadsView<const detail::NonDeduced<Scalar>>& dout,
                                    const BatchedHeadsView<Scalar>& dq,
                                    const BatchedHeadsView<Scalar>& dk,
                                    const BatchedHeadsView<Scalar>& dv, Index block_size,
                                    const AttentionOptions& options = {},
                                    RowLse<const detail::Compute<Scalar>> lse = {}) {
  detail::run_backward_batch<Scalar>(
      "fixed_block_attention_backward", q, k, v, out, dout, dq, dk, dv, [&] {
        detail::batched_fixed_block_attention_backward<Scalar>(q, k, v, out, dout, dq, dk, dv,
                                                               block_size, options, lse);
      });
}

}  // namespace plsh

#endif  // PLSH_BATCH_HPP
