#ifndef PLSH_ATTENTION_FUSED_ROWS_HPP
#define PLSH_ATTENTION_FUSED_ROWS_HPP

/// \file fused_rows.hpp
/// The fused kernel on one tile of query rows of one head: with \f$c_{ij}\f$ the number of
/// draws in which i and j share a block (BlockCounts),
/// \f[ o_i = \frac{\sum_j c_{ij} e^{S_{ij}} v_j}{\sum_j c_{ij} e^{S_{ij}}}, \qquad
///     S_{ij} = \text{scale}\; q_i \cdot k_j, \f]
/// over the union of the blocks of the tile's rows, an interval of about \f$\ln(s)/m\f$ keys
/// plus the tile: each score is computed once, whatever s.
///
/// fused_rows takes, per chunk of kFusedKeyTile keys, one product \f$QK^\top\f$, one walk per
/// row (logits \f$S_{ij} + \log c_{ij}\f$, \f$-\infty\f$ where \f$c_{ij} = 0\f$, maximum,
/// exponentials: OnlineSoftmax::update_counted) and one product \f$PV\f$. Without the AVX-512
/// walk (kVectorWalk), a tile whose union holds at most kRowByRowKeys keys goes row by row
/// instead (fused_row_by_row: each row's scores and weighted sum by matrix-vector products over
/// its own keys), which spares the steep heads Eigen's packing. With bfloat16 storage and AVX-512
/// BF16 (kBf16Scores), the scores come from the bfloat16 rows by `vdpbf16ps`
/// (detail/arch/avx512/bf16_scores.hpp). Either way a row's largest weight is \f$e^0 = 1\f$. Cost
/// about \f$(\ln(s)/m + \text{tile})(d + d_v)\f$ per query, plus O(s) per block of the tile;
/// scratch O(tile) per thread.
///
/// Storage: float, double, or Eigen::bfloat16 / Eigen::half computed in float
/// (detail::Compute): the query tile and each key and value chunk not yet in the compute type
/// are converted once, the output rows rounded once.
///
/// Tested against plsh::reference::mask_attention (dense, in double, same grids) and against the
/// pass kernel in tests/test_plsh_attention.cpp; the 16-bit types against the float kernel in
/// tests/test_fused_half.cpp; the AVX-512 walk in test_plsh_attention_avx512.

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <vector>

#include "../detail/arch/avx512/bf16_scores.hpp"
#include "../detail/simd.hpp"
#include "../detail/storage.hpp"
#include "../options.hpp"
#include "../sampler.hpp"
#include "../tensor.hpp"
#include "block_counts.hpp"
#include "online_softmax.hpp"

namespace plsh {
namespace detail {

/// Keys per chunk of the fused kernel: wide enough to amortise the products' packing.
constexpr Index kFusedKeyTile = 256;

/// Per-thread scratch of the fused kernel on storage type `Storage`: O(tile) whatever n.
template <class Storage>
struct FusedWorkspace {
  using Scalar = Compute<Storage>;
  using Vector = Eigen::Matrix<Scalar, Eigen::Dynamic, 1>;
  BlockCounts<Scalar> counts;
  AlignedVector<Scalar> scores;
  RowMatrix<Scalar> query;
  OnlineSoftmax<Scalar> softmax;
  AlignedVector<Scalar> query_rows;  // a tile's rows in the compute type (16-bit storage only)
  AlignedVector<Scalar> key_rows;
  AlignedVector<Scalar> value_rows;
  OutputRows<Storage> output;
  Vector logits;  // one row's scores (fused_row_by_row)
  Eigen::Array<Scalar, Eigen::Dynamic, 1> exponentials;
  Eigen::Matrix<Scalar, 1, Eigen::Dynamic> sum;  // one row's weighted sum of values
  std::vector<Index> bad;                        // value rows with a non-finite entry
  AlignedVector<std::uint32_t> query_pairs;      // a tile's query rows (kBf16Scores)
  AlignedVector<std::uint32_t> key_panels;       // a chunk's keys (kBf16Scores)
};

#if defined(PLSH_DECODE_AVX512_BF16) && defined(PLSH_FUSED_AVX512)
/// Whether fused_rows computes the scores of `Storage` tiles by `vdpbf16ps` (bf16_scores.hpp):
/// bfloat16 storage in AVX-512 BF16 builds.
template <class Storage>
constexpr bool kBf16Scores = std::is_same<Storage, Eigen::bfloat16>::value;
#else
template <class Storage>
constexpr bool kBf16Scores = false;
#endif

/// Unions of at most this many keys take fused_row_by_row, except where update_counted takes the
/// AVX-512 walk (kVectorWalk): below it, Eigen's packing for the blocked products and the
/// per-tile passes cost more than a product per row.
constexpr Index kRowByRowKeys = 80;

/// The fused kernel on a tile of `query` rows (scaled, compute type) whose union of keys is
/// narrow: per row, its scores \f$S_{ij}\f$ over the keys from its first to its last with
/// \f$c_{ij} > 0\f$ by one matrix-vector product, the logits \f$l_{ij} = S_{ij} + \log c_{ij}\f$
/// (\f$-\infty\f$ where \f$c_{ij} = 0\f$), the weights \f$w_{ij} = e^{l_{ij} - \max_j l_{ij}}\f$
/// (exactly 0 where the logit is \f$-\infty\f$) and \f$o_i = \sum_j w_{ij} v_j / \sum_j
/// w_{ij}\f$ by another product: a row that sees one key gets its value exactly. Non-finite
/// inputs as the online softmax (online_softmax.hpp): a value row with a non-finite entry is
/// added, term by term, only to the rows whose logit for it is above \f$-\infty\f$. When `lse`
/// is not null, `lse[r]` receives row r's \f$\max_j l_{ij} + \log\sum_j w_{ij}\f$.
template <class Storage>
void fused_row_by_row(FusedWorkspace<Storage>& workspace, const RowMatrix<Compute<Storage>>& query,
                      const ConstHeadMap<Compute<Storage>>& key_rows,
                      const ConstHeadMap<Compute<Storage>>& value_rows, Index first_key,
                      HeadMap<Compute<Storage>> out, bool finite_values,
                      Compute<Storage>* lse = nullptr) {
  using Scalar = Compute<Storage>;
  constexpr Scalar kMinusInfinity = -std::numeric_limits<Scalar>::infinity();
  const Index width = key_rows.rows();
  if (finite_values) {
    workspace.bad.clear();
  } else {
    find_nonfinite_rows(value_rows, workspace.bad);
  }
  workspace.counts.start_chunk(first_key, width);
  for (Index r = 0; r < query.rows(); ++r) {
    Index limit = 0;
    const int* count = workspace.counts.next_row(r, limit);
    Index first = 0;
    while (first < limit && count[first] == 0) ++first;
    Index last = limit;
    while (last > first && count[last - 1] == 0) --last;
    auto out_row = out.row(r);
    if (lse != nullptr) lse[r] = kMinusInfinity;
    if (first == last) {
      out_row.setZero();
      continue;
    }
    const Index n = last - first;
    workspace.logits.resize(n);
    workspace.logits.noalias() = key_rows.middleRows(first, n) * query.row(r).transpose();
    Scalar* logit = workspace.logits.data();
    const int* row_count = count + first;
    const Scalar* log_weight = workspace.counts.log_weights();
    for (Index c = 0; c < n; ++c) {
      logit[c] = row_count[c] == 0 ? kMinusInfinity : logit[c] + log_weight[row_count[c]];
    }
    const Scalar high = workspace.logits.maxCoeff();
    if (!(high > kMinusInfinity)) {
      // Nothing visible weighs anything, unless a NaN hid from (or is) the maximum.
      if (std::isnan(high) || workspace.logits.hasNaN()) {
        out_row.setConstant(std::numeric_limits<Scalar>::quiet_NaN());
        if (lse != nullptr) lse[r] = std::numeric_limits<Scalar>::quiet_NaN();
      } else {
        out_row.setZero();
      }
      continue;
    }
    workspace.exponentials = (workspace.logits.array() - high).exp();
    Scalar* weight = workspace.exponentials.data();
    for (Index c = 0; c < n; ++c) weight[c] = logit[c] == kMinusInfinity ? Scalar(0) : weight[c];
    const Scalar sum = workspace.exponentials.sum();
    const bool reached = std::any_of(workspace.bad.begin(), workspace.bad.end(),
                                     [&](Index c) { return c >= first && c < last; });
    if (!reached) {
      workspace.sum.noalias() =
          workspace.exponentials.matrix().transpose() * value_rows.middleRows(first, n);
    } else {
      // Term by term over the keys whose logit is above -inf: a masked key adds nothing
      // whatever its value, a visible key's non-finite value reaches the row even at weight 0.
      workspace.sum.setZero(value_rows.cols());
      for (Index c = 0; c < n; ++c) {
        if (logit[c] != kMinusInfinity) workspace.sum += weight[c] * value_rows.row(first + c);
      }
    }
    if (sum != 0) {  // NaN: seen, and poisoned
      out_row = workspace.sum / sum;
      if (lse != nullptr) lse[r] = high + std::log(sum);
    } else {
      out_row.setZero();
    }
  }
}

/// Fused kernel for query rows `[row_begin, row_end)` of one head: weights \f$c_{ij}
/// e^{S_{ij}}\f$ over the union of the rows' blocks (BlockCounts; \f$s e^{-m d} e^{S_{ij}}\f$ for
/// the keys within the near field's reach, the head's Estimator `estimator`), row by row
/// (fused_row_by_row) for a union of at most kRowByRowKeys keys (see kVectorWalk), else one
/// online softmax in chunks of kFusedKeyTile keys (OnlineSoftmax::update_counted). The key and
/// value rows are stored as `Storage` or already in the compute type (fused_span's packed
/// copies). The query tile and each key and value chunk not yet in the compute type are
/// converted once; the output rows are rounded back once. With kBf16Scores the scores come from
/// the query tile's bfloat16 pairs and each chunk's key panels (avx512::bf16_scores) instead.
template <class Storage, class KeyStorage>
void fused_rows(const ConstHeadMap<Storage>& q, const ConstHeadMap<KeyStorage>& k,
                const ConstHeadMap<KeyStorage>& v, const std::vector<Grid>& grids,
                const AttentionOptions& options, const PositionRange& range, Index row_begin,
                Index row_end, HeadMap<Storage>& out, bool finite_values,
                const Estimator& estimator, Compute<Storage>* lse = nullptr) {
  using Scalar = Compute<Storage>;
  const ScratchLease<FusedWorkspace<Storage>> workspace_lease;
  FusedWorkspace<Storage>& workspace = *workspace_lease;
  const Index rows = row_end - row_begin;
  const Block keys = workspace.counts.prepare(
      grids, range, options.query_position + row_begin, rows, options.key_position,
      options.key_position + k.rows(), options.causal, estimator);
  if (!kVectorWalk<Scalar> && keys.begin < keys.end && keys.end - keys.begin <= kRowByRowKeys) {
    workspace.query.noalias() = compute_rows(map_rows(q, row_begin, rows), workspace.query_rows) *
                                static_cast<Scalar>(options.scale);
    const Index first_key = keys.begin - options.key_position;
    const Index width = keys.end - keys.begin;
    fused_row_by_row(workspace, workspace.query,
                     compute_rows(map_rows(k, first_key, width), workspace.key_rows),
                     compute_rows(map_rows(v, first_key, width), workspace.value_rows), keys.begin,
                     workspace.output.bind(map_rows(out, row_begin, rows)), finite_values,
                     lse == nullptr ? nullptr : lse + row_begin);
    workspace.output.store();
    return;
  }
  workspace.softmax.reset(rows, v.cols());
  if (keys.begin < keys.end) {
    if constexpr (kBf16Scores<Storage>) {
#if defined(PLSH_DECODE_AVX512_BF16) && defined(PLSH_FUSED_AVX512)
      avx512::pack_query_pairs(q.data() + row_begin * q.outerStride(), rows, q.cols(),
                               q.outerStride(), workspace.query_pairs);
#endif
    } else {
      workspace.query.noalias() = compute_rows(map_rows(q, row_begin, rows), workspace.query_rows) *
                                  static_cast<Scalar>(options.scale);
    }
    workspace.scores.resize(static_cast<std::size_t>(rows * kFusedKeyTile));
    for (Index c0 = keys.begin; c0 < keys.end; c0 += kFusedKeyTile) {
      const Index cols = std::min(kFusedKeyTile, keys.end - c0);
      const Index first_key = c0 - options.key_position;
      Eigen::Map<RowMatrix<Scalar>> scores(workspace.scores.data(), rows, cols);
      if constexpr (kBf16Scores<Storage>) {
#if defined(PLSH_DECODE_AVX512_BF16) && defined(PLSH_FUSED_AVX512)
        avx512::pack_key_panels(k.data() + first_key * k.outerStride(), cols, k.cols(),
                                k.outerStride(), workspace.key_panels);
        avx512::bf16_scores(workspace.query_pairs.data(), rows, workspace.key_panels.data(), cols,
                            avx512::bf16_pairs(k.cols()), static_cast<float>(options.scale),
                            scores.data(), cols);
#endif
      } else {
        multiply_transposed(workspace.query,
                            compute_rows(map_rows(k, first_key, cols), workspace.key_rows), scores);
      }
      workspace.counts.start_chunk(c0, cols);
      workspace.softmax.update_counted(
          scores, compute_rows(map_rows(v, first_key, cols), workspace.value_rows),
          [&](Index r, Index& limit) { return workspace.counts.next_row(r, limit); },
          workspace.counts.log_weights(), workspace.counts.max_index(), finite_values);
    }
  }
  workspace.softmax.finish(workspace.output.bind(map_rows(out, row_begin, rows)),
                           lse == nullptr ? nullptr : lse + row_begin);
  workspace.output.store();
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_ATTENTION_FUSED_ROWS_HPP
