#ifndef PLSH_MPI_HPP
#define PLSH_MPI_HPP

/// \file mpi.hpp
/// Sequence-parallel attention over MPI: every rank holds a contiguous chunk of the tokens of q,
/// k and v and computes its own rows of the output (and of the gradients).
///
/// Positional LSH and windowed ALiBi only let a query see keys near it: the partitions live on
/// absolute positions, so every rank draws them from the seed and knows, for every rank, the keys
/// that rank's queries can reach. For queries at positions \f$[a, b)\f$ these are
/// \f$[\min_{h,t} \mathrm{begin}_{h,t}(a),\; b)\f$ when causal, and up to
/// \f$\max_{h,t} \mathrm{end}_{h,t}(b - 1)\f$ when bidirectional (the blocks of head h, draw t;
/// the same bound KvCache evicts by); the windowed kernel reaches W positions beyond each query's
/// nearest key, either way, where W makes its certificate hold for the ranks' largest query and
/// key norms (one all-reduce; mpi/layout.hpp certified_window), and the keys beyond the halo
/// enter each rank's certificate with the largest key norm (should a tile's certificate not hold
/// within the keys its rank holds, every rank widens the halo and computes again:
/// windowed_with_halo). The keys and values of that interval that other ranks hold (the halo)
/// come by point-to-point messages from their owners, however many ranks it spans; then the
/// single-process kernel runs on the rank's queries against the gathered keys. The halo's width
/// does not depend on n: at most the largest block pitch of the draws (or the near field's reach,
/// if larger), for the default s = 100 draws of the flattest standard head of 8 (slope 1/256)
/// about 1,700 positions.
///
/// Exact ALiBi reaches every key: exact_alibi_attention passes the chunks of k and v around the
/// ring of ranks (P - 1 steps, each overlapping the messages with the attention of the chunk in
/// hand) and merges the partial results by log-sum-exp: every rank receives n - n_r key rows.
///
/// The backward of Positional LSH gathers the same halo, runs plsh_attention_backward on it, and
/// sends the halo's key and value gradients back to their owners, who add them to their own.
///
/// Every function is collective over `comm` (every rank calls it, with the same scalar type,
/// options, slopes and head shapes); the messages go over a duplicate of `comm`, so they never
/// match the caller's. Arguments are checked on every rank before any message is sent; when one
/// rank's arguments are wrong, or the ranks disagree (another scalar type included), every rank
/// throws std::invalid_argument.
///
/// Results: for Positional LSH and exact ALiBi, each rank's rows equal those rows of the
/// single-process kernel over the whole sequence to float rounding (the kernels tile the rows from
/// the chunk's first row, and the ring merges its partial results in another order); on one rank,
/// bit for bit. For windowed ALiBi the tiles, and so the keys each visits before its certificate
/// holds, differ from the single-process kernel's: what holds is the guarantee, each rank's output
/// within \f$2\,\text{tolerance}\max_j |v_j|\f$ of exact ALiBi per entry, to rounding, as the
/// single-process kernel's (so the two lie within twice that of each other).
///
/// Files: mpi/layout.hpp (chunks and the keys each reaches), mpi/agreement.hpp (what the ranks
/// agree on before any message), mpi/halo.hpp (messages, gather and scatter of the halo); this
/// header holds the entry points. Those that gather a halo all run detail::run_with_halo (agree,
/// reach, gather, kernel); exact_alibi_attention agrees the same way, then runs its ring.
///
/// Tested with mpirun on 1, 2 and 4 ranks in tests/mpi/test_mpi.cpp against the single-process
/// kernels: plsh_attention (both kernels), windowed_alibi_attention, exact_alibi_attention and
/// plsh_attention_backward, with chunks shorter and longer than the halo, grouped heads and
/// offsets.

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/near_field.hpp"
#include "attention/online_softmax.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/regular.hpp"
#include "detail/check.hpp"
#include "detail/parallel.hpp"
#include "detail/validate.hpp"
#include "mpi/agreement.hpp"
#include "mpi/halo.hpp"
#include "mpi/layout.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

namespace plsh {
namespace detail {

/// The sequence of every entry point that gathers a halo, written once: agree on the layout
/// (every rank runs `check` on its own arguments, then the ranks compare `signature`), check the
/// positions of the whole sequence, find the key rows every rank reaches (`reach(call, layout)`),
/// gather this rank's from their owners, then run `kernel(call, layout, reachable, gathered,
/// local)` with the options of this rank's queries and gathered keys. Returns the exchange's
/// counts plus those `kernel` returns (the backward's scatter of gradients).
template <class Scalar, class Options, class Check, class Reach, class RankKernel>
mpi::ExchangeCounts run_with_halo(MPI_Comm comm, const char* function,
                                  const HeadsView<const Scalar>& q,
                                  const HeadsView<const Scalar>& k,
                                  const HeadsView<const Scalar>& v, const Signature& signature,
                                  const Options& options, Check&& check, Reach&& reach,
                                  RankKernel&& kernel) {
  const CallComm call(comm);
  const mpi::ChunkLayout layout = agree_on_layout(call, function, q.tokens, signature, check);
  check_sequence(function, layout, options);
  const std::vector<Block> reachable = reach(call, layout);
  GatheredKeys<Scalar> gathered = gather_keys(call, layout, reachable, k, v);
  const Options local =
      local_options(options, layout.chunk(call.rank()).begin, gathered.rows.begin);
  mpi::ExchangeCounts counts = gathered.counts;
  counts += kernel(call, layout, reachable, gathered, local);
  return counts;
}

/// The key rows every rank's queries need in Positional LSH (plsh_reachable_keys): those of the
/// kernel's own draws (kernel_grids, which follows options.sampling), and those within the reach
/// of the near field of options.near_field (near_field.hpp) over the whole sequence.
inline std::vector<Block> plsh_key_rows(const mpi::ChunkLayout& layout,
                                        const std::vector<double>& slopes,
                                        const PlshOptions& options, const char* function) {
  const auto grids = kernel_grids(slopes, options, function);
  const PositionRange range{
      std::min(options.query_position, options.key_position),
      std::max(options.query_position, options.key_position) + layout.tokens()};
  return plsh_reachable_keys(
      layout, grids, options,
      largest_reach(head_estimators(slopes, options.samples, options.near_field, range)));
}

/// mpi::windowed_alibi_attention with a halo of `window` positions beyond each rank's rows, or of
/// certified_window's for the ranks' largest norms (`window` < 0). When, on any rank, a query tile
/// has visited every key it holds without certifying the keys beyond them (its certificate counts
/// them at the largest key norm), every rank widens the halo (twice as wide, plus a key tile) and
/// computes its rows again, until every tile's certificate holds: at the latest when the halo is
/// the whole sequence. certified_window's halo holds it at the first pass, up to rounding. Returns
/// the exchanges' counts summed over the passes.
template <class Scalar>
mpi::ExchangeCounts windowed_with_halo(MPI_Comm comm, const HeadsView<const Scalar>& q,
                                       const HeadsView<const Scalar>& k,
                                       const HeadsView<const Scalar>& v,
                                       const HeadsView<Scalar>& out,
                                       const std::vector<double>& slopes, double tolerance,
                                       const AttentionOptions& options, Index window = -1) {
  const char* function = "plsh::mpi::windowed_alibi_attention";
  std::vector<double> key_norms;  // the largest over the ranks, per key/value head
  Signature signature =
      attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options);
  signature.add_double(tolerance);
  mpi::ExchangeCounts counts;
  for (bool certified = false; !certified;) {
    counts += run_with_halo(
        comm, function, q, k, v, signature, options,
        [&] {
          check_forward(function, q, k, v, out, slopes, options);
          require(tolerance >= 0 && tolerance <= 1, function, "tolerance must lie in [0, 1]");
        },
        [&](const CallComm& call, const mpi::ChunkLayout& layout) {
          if (window < 0) {
            key_norms = agree_on_norms<Scalar>(call, k, 1.0);
            const std::vector<double> query_norms =
                agree_on_norms<Scalar>(call, q, std::abs(resolved_scale(options, q.dim)));
            window = certified_window(slopes, query_norms, key_norms, tolerance);
          } else if (key_norms.empty()) {
            key_norms = agree_on_norms<Scalar>(call, k, 1.0);
          }
          return windowed_reachable_keys(layout, window, options);
        },
        [&](const CallComm& call, const mpi::ChunkLayout& layout, const auto&, const auto& gathered,
            const AttentionOptions& local) {
          // The keys outside the halo enter the certificate with the largest key norm.
          const UnheldKeys unheld{gathered.rows.begin, layout.tokens() - gathered.rows.end,
                                  key_norms};
          const BatchedHeadsView<Scalar> batched_out = batch_of_one(out);
          std::int64_t uncertified = batched_windowed_alibi_attention<Scalar>(
              batch_of_one(q), batch_of_one(gathered.keys.view()),
              batch_of_one(gathered.values.view()), &batched_out, slopes, tolerance, local, unheld);
          MPI_Allreduce(MPI_IN_PLACE, &uncertified, 1, MPI_INT64_T, MPI_SUM, call.get());
          certified = uncertified == 0;
          return mpi::ExchangeCounts{};
        });
    window = window >= kNoWindow / 2 ? kNoWindow : 2 * window + kKeyTile;
  }
  return counts;
}

}  // namespace detail

namespace mpi {

/// Rows of this rank's chunk of plsh_attention over the whole sequence.
///
/// \param comm the ranks that hold the sequence, rank r the r-th chunk (sizes may differ, 0
/// included; even_chunk splits evenly). \param q, k, v this rank's chunk, `[n_r][H][d]`,
/// `[n_r][H_kv][d]`, `[n_r][H_kv][d_v]`. \param out `[n_r][H][d_v]`. \param slopes, options as
/// plsh_attention, the same on every rank; `query_position` and `key_position` are the positions
/// of the first token of the whole sequence (of rank 0's chunk).
/// \return the key and value bytes this rank received and sent.
/// \throws std::invalid_argument on every rank when the arguments of any rank are wrong (those
/// of plsh_attention, ranks that disagree, k or v with another token count than q).
template <class Scalar>
ExchangeCounts plsh_attention(MPI_Comm comm, HeadsView<const detail::NonDeduced<Scalar>> q,
                              HeadsView<const detail::NonDeduced<Scalar>> k,
                              HeadsView<const detail::NonDeduced<Scalar>> v, HeadsView<Scalar> out,
                              const std::vector<double>& slopes, const PlshOptions& options = {}) {
  const char* function = "plsh::mpi::plsh_attention";
  detail::Signature signature =
      detail::attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options);
  signature.add(options.samples);
  signature.add(static_cast<std::int64_t>(options.seed));
  signature.add(static_cast<std::int64_t>(options.sampling));
  signature.add_double(options.near_field);
  signature.add(static_cast<std::int64_t>(options.kernel));
  return detail::run_with_halo(
      comm, function, q, k, v, signature, options,
      [&] {
        detail::check_forward(function, q, k, v, out, slopes, options);
        detail::require_samples(options.samples, function, "options.samples");
      },
      [&](const auto&, const ChunkLayout& layout) {
        return detail::plsh_key_rows(layout, slopes, options, function);
      },
      [&](const auto&, const auto&, const auto&, const auto& gathered, const PlshOptions& local) {
        plsh::plsh_attention<Scalar>(q, gathered.keys.view(), gathered.values.view(), out, slopes,
                                     local);
        return ExchangeCounts{};
      });
}

/// Rows of this rank's chunk of windowed_alibi_attention over the whole sequence; arguments as
/// plsh::mpi::plsh_attention, with `tolerance` as windowed_alibi_attention.
template <class Scalar>
ExchangeCounts windowed_alibi_attention(MPI_Comm comm,
                                        HeadsView<const detail::NonDeduced<Scalar>> q,
                                        HeadsView<const detail::NonDeduced<Scalar>> k,
                                        HeadsView<const detail::NonDeduced<Scalar>> v,
                                        HeadsView<Scalar> out, const std::vector<double>& slopes,
                                        double tolerance = 1e-6,
                                        const AttentionOptions& options = {}) {
  return detail::windowed_with_halo<Scalar>(comm, q, k, v, out, slopes, tolerance, options);
}

/// Rows of this rank's chunk of exact_alibi_attention over the whole sequence, by ring attention:
/// the chunks of k and v travel around the ring of ranks, and each rank merges the attention of
/// its queries against every chunk by log-sum-exp. Every rank receives every other rank's keys
/// and values. Arguments as plsh::mpi::plsh_attention; Scalar float or double.
template <class Scalar>
ExchangeCounts exact_alibi_attention(MPI_Comm comm, HeadsView<const detail::NonDeduced<Scalar>> q,
                                     HeadsView<const detail::NonDeduced<Scalar>> k,
                                     HeadsView<const detail::NonDeduced<Scalar>> v,
                                     HeadsView<Scalar> out, const std::vector<double>& slopes,
                                     const AttentionOptions& options = {}) {
  static_assert(std::is_floating_point<Scalar>::value,
                "plsh::mpi::exact_alibi_attention: Scalar must be float or double");
  const char* function = "plsh::mpi::exact_alibi_attention";
  const detail::CallComm call(comm);
  const ChunkLayout layout = detail::agree_on_layout(
      call, function, q.tokens,
      detail::attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options),
      [&] { detail::check_forward(function, q, k, v, out, slopes, options); });
  detail::check_sequence(function, layout, options);
  const int me = call.rank();
  const int ranks = call.ranks();
  const Index rows = q.tokens;
  const Index group = q.heads / k.heads;
  AttentionOptions resolved = options;
  resolved.scale = detail::resolved_scale(options, q.dim);
  resolved.query_position = options.query_position + layout.chunk(me).begin;
  // The chunk in hand and the one arriving, each keys then values: two buffers for the whole
  // ring, grown only when a chunk is larger than any before.
  detail::PackedRows<Scalar> keys[2];
  detail::PackedRows<Scalar> values[2];
  const auto load = [&](int slot, int owner) {
    keys[slot].reshape(layout.chunk(owner).size(), k.heads, k.dim);
    values[slot].reshape(layout.chunk(owner).size(), v.heads, v.dim);
  };
  load(0, me);
  detail::pack_token_rows(k, 0, k.tokens, keys[0].row(0));
  detail::pack_token_rows(v, 0, v.tokens, values[0].row(0));
  std::vector<Scalar> partial(static_cast<std::size_t>(std::max<Index>(1, q.heads * rows * v.dim)));
  std::vector<Scalar> partial_lse(static_cast<std::size_t>(std::max<Index>(1, q.heads * rows)));
  std::vector<Scalar> lse(partial_lse.size(), -std::numeric_limits<Scalar>::infinity());
  for (Index h = 0; h < q.heads; ++h) out.head(h).setZero();
  ExchangeCounts counts;
  detail::Messages messages(call.get());  // its counts add up over the steps
  for (int step = 0; step < ranks; ++step) {
    const int slot = step % 2;
    const int owner = (me - step + ranks) % ranks;
    if (step + 1 < ranks) {
      // The next chunk comes from the left neighbour, which holds the owner's left neighbour's.
      const int next_owner = (owner - 1 + ranks) % ranks;
      load(1 - slot, next_owner);
      const int left = (me - 1 + ranks) % ranks;
      const int right = (me + 1) % ranks;
      const detail::PackedRows<Scalar>& next_keys = keys[1 - slot];
      messages.receive(keys[1 - slot].row(0), next_keys.tokens * next_keys.row_bytes(), left,
                       detail::kKeyTag);
      messages.receive(values[1 - slot].row(0), next_keys.tokens * values[1 - slot].row_bytes(),
                       left, detail::kValueTag);
      messages.send(keys[slot].row(0), keys[slot].tokens * keys[slot].row_bytes(), right,
                    detail::kKeyTag);
      messages.send(values[slot].row(0), values[slot].tokens * values[slot].row_bytes(), right,
                    detail::kValueTag);
    }
    const Block chunk = layout.chunk(owner);
    const Index first_key = options.key_position + chunk.begin;
    const bool visible = chunk.size() > 0 && rows > 0 &&
                         !(options.causal && first_key > resolved.query_position + rows - 1);
    if (visible) {
      AttentionOptions block_options = resolved;
      block_options.key_position = first_key;
      const HeadsView<const Scalar> block_k = keys[slot].view();
      const HeadsView<const Scalar> block_v = values[slot].view();
      const double work = detail::attention_work(q, block_k, block_v);
      detail::parallel_for(q.heads, work, [&](Index h) {
        HeadMap<Scalar> head_partial(partial.data() + h * rows * v.dim, rows, v.dim,
                                     Eigen::OuterStride<>(v.dim));
        Scalar* head_lse = partial_lse.data() + h * rows;
        detail::attend_span<Scalar>(
            q.head(h), block_k.head(h / group), block_v.head(h / group), block_options,
            detail::LinearBias{slopes[static_cast<std::size_t>(h)], detail::kNoWindow},
            head_partial, head_lse);
        online_softmax_merge(out.head(h), LseMap<Scalar>(lse.data() + h * rows, rows), head_partial,
                             LseMap<Scalar>(head_lse, rows));
      });
    }
    counts = messages.wait();
  }
  return counts;
}

/// Gradients of plsh::mpi::plsh_attention: this rank's rows of dq, dk and dv of
/// plsh_attention_backward over the whole sequence. The halo's key and value gradients go back
/// to the ranks that own those keys, which add them to their own.
///
/// \param q, k, v, out as the forward (out its result), \param dout `[n_r][H][d_v]`, \param dq
/// like q, \param dk like k, \param dv like v (overwritten). \return the bytes of the halo's keys
/// and values received and sent, and of the gradients sent back.
/// \throws std::invalid_argument on every rank as plsh::mpi::plsh_attention, and for the
/// gradients' shapes and overlaps as plsh_attention_backward.
template <class Scalar>
ExchangeCounts plsh_attention_backward(MPI_Comm comm, HeadsView<const detail::NonDeduced<Scalar>> q,
                                       HeadsView<const detail::NonDeduced<Scalar>> k,
                                       HeadsView<const detail::NonDeduced<Scalar>> v,
                                       HeadsView<const detail::NonDeduced<Scalar>> out,
                                       HeadsView<const detail::NonDeduced<Scalar>> dout,
                                       HeadsView<Scalar> dq, HeadsView<Scalar> dk,
                                       HeadsView<Scalar> dv, const std::vector<double>& slopes,
                                       const PlshOptions& options = {}) {
  const char* function = "plsh::mpi::plsh_attention_backward";
  detail::Signature signature =
      detail::attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options);
  signature.add(options.samples);
  signature.add(static_cast<std::int64_t>(options.seed));
  signature.add(static_cast<std::int64_t>(options.sampling));
  signature.add_double(options.near_field);
  return detail::run_with_halo(
      comm, function, q, k, v, signature, options,
      [&] {
        detail::require(k.tokens == q.tokens, function,
                        "k.tokens must equal q.tokens (one chunk of the sequence)");
        detail::validate_backward(function, q, k, v, out, dout, dq, dk, dv, options);
        detail::validate_slopes(function, slopes, q.heads);
      },
      [&](const auto&, const ChunkLayout& layout) {
        return detail::plsh_key_rows(layout, slopes, options, function);
      },
      [&](const detail::CallComm& call, const ChunkLayout& layout,
          const std::vector<Block>& reachable, const auto& gathered, const PlshOptions& local) {
        detail::PackedRows<Scalar> key_gradient(gathered.rows.size(), k.heads, k.dim);
        detail::PackedRows<Scalar> value_gradient(gathered.rows.size(), v.heads, v.dim);
        plsh::plsh_attention_backward<Scalar>(q, gathered.keys.view(), gathered.values.view(), out,
                                              dout, dq, key_gradient.view(), value_gradient.view(),
                                              slopes, local);
        ExchangeCounts counts =
            detail::scatter_add(call, layout, reachable, key_gradient, dk, detail::kKeyTag);
        counts +=
            detail::scatter_add(call, layout, reachable, value_gradient, dv, detail::kValueTag);
        return counts;
      });
}

}  // namespace mpi
}  // namespace plsh

#endif  // PLSH_MPI_HPP
