#ifndef PLSH_ATTENTION_PASS_KERNEL_HPP
#define PLSH_ATTENTION_PASS_KERNEL_HPP

/// \file pass_kernel.hpp
/// Kernel::Passes, the faithful form of Positional LSH: for every draw t and every block of its
/// partition, regular attention of the block's queries against the block's keys (causal inside
/// the block when causal), giving per row \f$(o_t, \mathrm{lse}_t)\f$; the passes merge as
/// \f[ o = \frac{\sum_t e^{\mathrm{lse}_t} o_t}{\sum_t e^{\mathrm{lse}_t}} \f]
/// by a running maximum (online_softmax_merge). The inner kernel is pluggable: RegularAttention
/// by default, any callable with its signature otherwise (plsh_attention's second overload).
/// Also the kernel of fixed_block_attention (one draw, `fixed_grid(b)`).
///
/// Cost \f$\sum_t \sum_{\text{blocks}} b^2 (d + d_v)\f$ per head, about \f$2s/m\f$ keys per
/// query; O(tokens) block look-ups per draw, only the blocks that hold a query being visited.
/// Parallel over (batch element, head), one OpenMP region per call; every job writes its own
/// head: the result is identical for any number of threads.
///
/// Tested against plsh::reference::mask_attention (dense, in double, same grids) and against the
/// fused kernel in tests/test_plsh_attention.cpp.

#include <Eigen/Core>
#include <algorithm>
#include <limits>
#include <vector>

#include "../batched_heads_view.hpp"
#include "../detail/parallel.hpp"
#include "../detail/scratch.hpp"
#include "../detail/storage.hpp"
#include "../detail/validate.hpp"
#include "../partition.hpp"
#include "../row_lse.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "online_softmax.hpp"
#include "options.hpp"
#include "regular.hpp"

namespace plsh {
namespace detail {

/// Per-thread scratch of the pass kernel (detail/scratch.hpp), leased for a (batch element, head)
/// job, the calls of the regular kernel included: one block's output and lse, and its rows in the
/// compute type (16-bit storage), as large as the widest block the thread has seen. (The head's
/// merged output and lse, O(n) each, belong to the job.)
template <class Storage>
struct PassWorkspace {
  using Scalar = Compute<Storage>;
  std::vector<Scalar> pass_out;
  std::vector<Scalar> pass_lse;
  AlignedVector<Scalar> query_rows, key_rows, value_rows;
};

/// The pass kernel: per batch element and head, per grid, per block, `kernel` on the block's
/// queries and keys, merged into `out` by log-sum-exp. `grids[h]` are the partitions of head h,
/// shared by the batch elements. Parallel over (batch element, head) in one parallel region.
/// Storage S is read and written through the compute type C = Compute<S>: each block's rows are
/// converted once (compute_rows) and `kernel` gets `ConstHeadMap<C>` maps; the merged output of a
/// head is kept in C and rounded to S at the end (OutputRows, a head of scratch per thread when
/// S is a 16-bit type). The merged row lse goes to `lse_out` unless it is empty.
template <class Storage, class RegularKernel>
void pass_attention(const BatchedHeadsView<const Storage>& q,
                    const BatchedHeadsView<const Storage>& k,
                    const BatchedHeadsView<const Storage>& v, const BatchedHeadsView<Storage>& out,
                    const std::vector<std::vector<Grid>>& grids, const AttentionOptions& options,
                    RegularKernel&& kernel, const RowLse<Compute<Storage>>& lse_out = {}) {
  using Scalar = Compute<Storage>;
  if (q.batch == 0 || q.tokens == 0) return;
  AttentionOptions resolved = options;
  resolved.scale = resolved_scale(options, q.dim);
  const Index group = q.heads / k.heads;
  const PositionRange range = position_range(q, k, options);
  const Index query_end = options.query_position + q.tokens;
  const Index key_end = options.key_position + k.tokens;
  const double work = static_cast<double>(q.batch) * attention_work(q[0], k[0], v[0]);
  parallel_for(q.batch * q.heads, work, [&](Index job) {
    const Index b = job / q.heads;
    const Index h = job % q.heads;
    const ConstHeadMap<Storage> q_head = q[b].head(h);
    const ConstHeadMap<Storage> k_head = k[b].head(h / group);
    const ConstHeadMap<Storage> v_head = v[b].head(h / group);
    // A regular kernel that calls the pass kernel again on this thread would overwrite these:
    // the lease throws std::logic_error instead.
    const ScratchLease<PassWorkspace<Storage>> lease;
    PassWorkspace<Storage>& workspace = *lease;
    OutputRows<Storage> output;
    HeadMap<Scalar> out_head = output.bind(out[b].head(h));
    out_head.setZero();
    Eigen::Matrix<Scalar, Eigen::Dynamic, 1> lse =
        Eigen::Matrix<Scalar, Eigen::Dynamic, 1>::Constant(
            q.tokens, -std::numeric_limits<Scalar>::infinity());
    std::vector<Scalar>& pass_out = workspace.pass_out;
    std::vector<Scalar>& pass_lse = workspace.pass_lse;
    AlignedVector<Scalar>& query_rows = workspace.query_rows;
    AlignedVector<Scalar>& key_rows = workspace.key_rows;
    AlignedVector<Scalar>& value_rows = workspace.value_rows;
    for (const Grid& grid : grids[static_cast<std::size_t>(h)]) {
      // Only blocks that hold a query matter: visiting them costs O(q.tokens) per draw, whatever
      // the distance between the query and key ranges.
      Block block{options.query_position, options.query_position};
      for (Index p = options.query_position; p < query_end; p = block.end) {
        block = grid_block(grid, p, range.first, range.last);
        const Index query_begin = std::max(block.begin, options.query_position);
        const Index query_stop = std::min(block.end, query_end);
        const Index key_begin = std::max(block.begin, options.key_position);
        const Index key_stop = std::min(block.end, key_end);
        if (query_begin >= query_stop || key_begin >= key_stop) continue;
        if (options.causal && key_begin >= query_stop) continue;  // every key after every query
        const Index rows = query_stop - query_begin;
        const Index first_row = query_begin - options.query_position;
        const Index first_key = key_begin - options.key_position;
        const Index keys = key_stop - key_begin;
        pass_out.resize(static_cast<std::size_t>(rows * v.dim));
        pass_lse.resize(static_cast<std::size_t>(rows));
        HeadMap<Scalar> block_out(pass_out.data(), rows, v.dim, Eigen::OuterStride<>(v.dim));
        AttentionOptions block_options = resolved;
        block_options.query_position = query_begin;
        block_options.key_position = key_begin;
        kernel(compute_rows(map_rows(q_head, first_row, rows), query_rows),
               compute_rows(map_rows(k_head, first_key, keys), key_rows),
               compute_rows(map_rows(v_head, first_key, keys), value_rows), block_options,
               block_out, LseMap<Scalar>(pass_lse.data(), rows));
        online_softmax_merge(out_head.middleRows(first_row, rows), lse.segment(first_row, rows),
                             block_out, pass_lse);
      }
    }
    output.store();
    if (!lse_out.empty()) std::copy(lse.data(), lse.data() + q.tokens, lse_out.row(b, h));
  });
}

/// pass_attention on one element (a batch of one), as the KV cache's decoding step calls it.
template <class Scalar, class RegularKernel>
void pass_attention(const HeadsView<const Scalar>& q, const HeadsView<const Scalar>& k,
                    const HeadsView<const Scalar>& v, const HeadsView<Scalar>& out,
                    const std::vector<std::vector<Grid>>& grids, const AttentionOptions& options,
                    RegularKernel&& kernel) {
  pass_attention(batch_of_one(q), batch_of_one(k), batch_of_one(v), batch_of_one(out), grids,
                 options, kernel);
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_PASS_KERNEL_HPP
