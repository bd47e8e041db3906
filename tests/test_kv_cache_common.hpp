// Helpers of the KvCache tests (tests/test_kv_cache*.cpp): a sequence of queries, keys and values
// in a storage type; decoding it through a cache chunk by chunk against the rows of
// plsh_attention over the whole sequence; the resident bound computed from the partitions.
//
// Accuracy: the cache and the whole-sequence kernel weight the same keys by the same counts, but
// tile the keys differently, so float sums differ by rounding only. Outputs are convex
// combinations of values in [-1, 1]; a weighted mean of a few hundred terms in float errs by
// ~1e-6, below the 2e-5 bound the tests use. The 16-bit caches compute in float from the same
// rounded inputs and round each output once: against the float kernel on those inputs they
// differ by at most u |o| + 2e-5, u the unit roundoff of the type (2^-8 for bfloat16, 2^-11 for
// half).

#ifndef PLSH_TESTS_TEST_KV_CACHE_COMMON_HPP
#define PLSH_TESTS_TEST_KV_CACHE_COMMON_HPP

#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/kv_cache.hpp>
#include <plsh/partition.hpp>
#include <plsh/sampler.hpp>

#include "attention_fixture.hpp"
#include "kernel_instances.hpp"

namespace plsh_test {

using plsh::HeadsView;
using plsh::Index;

/// Queries, keys and values of a whole sequence, packed, in storage type `Scalar`: the attention
/// fixture's problem (every input uniform in [-1, 1]), or another sequence rounded to `Scalar`.
template <class Scalar>
struct Sequence {
  Index tokens, heads, kv_heads, dim, value_dim;
  std::vector<Scalar> q, k, v;

  Sequence(Index n, Index h, Index h_kv, Index d, Index d_v, std::uint64_t seed)
      : tokens(n), heads(h), kv_heads(h_kv), dim(d), value_dim(d_v) {
    const plsh_test::Problem<Scalar> problem(plsh_test::Shape{n, n, h, h_kv, d, d_v}, seed,
                                             plsh_test::Layout::Packed, 1.0);
    const auto copy = [](const HeadsView<const Scalar>& view) {
      return std::vector<Scalar>(view.data, view.data + view.tokens * view.token_stride);
    };
    q = copy(problem.q.in());
    k = copy(problem.k.in());
    v = copy(problem.v.in());
  }

  template <class Other>
  explicit Sequence(const Sequence<Other>& other)
      : tokens(other.tokens),
        heads(other.heads),
        kv_heads(other.kv_heads),
        dim(other.dim),
        value_dim(other.value_dim),
        q(converted(other.q)),
        k(converted(other.k)),
        v(converted(other.v)) {}

  template <class Other>
  static std::vector<Scalar> converted(const std::vector<Other>& values) {
    std::vector<Scalar> result(values.size());
    for (std::size_t i = 0; i < values.size(); ++i) result[i] = static_cast<Scalar>(values[i]);
    return result;
  }

  /// Element e of the query of token t, head h (tests reshape sequences into hostile inputs).
  Scalar& query(Index t, Index h, Index e) {
    return q[static_cast<std::size_t>((t * heads + h) * dim + e)];
  }
  /// Element e of the key of token t, key/value head g.
  Scalar& key(Index t, Index g, Index e) {
    return k[static_cast<std::size_t>((t * kv_heads + g) * dim + e)];
  }

  HeadsView<const Scalar> queries(Index begin, Index count) const {
    return HeadsView<const Scalar>{q.data(), tokens, heads, dim}.slice(begin, count);
  }
  HeadsView<const Scalar> keys(Index begin, Index count) const {
    return HeadsView<const Scalar>{k.data(), tokens, kv_heads, dim}.slice(begin, count);
  }
  HeadsView<const Scalar> values(Index begin, Index count) const {
    return HeadsView<const Scalar>{v.data(), tokens, kv_heads, value_dim}.slice(begin, count);
  }
};

/// Chunk sizes cycling through `pattern`, cut to the sequence length.
inline std::vector<Index> chunk_schedule(Index tokens, const std::vector<Index>& pattern) {
  std::vector<Index> chunks;
  for (Index done = 0, i = 0; done < tokens; ++i) {
    const Index size =
        std::min(pattern[static_cast<std::size_t>(i) % pattern.size()], tokens - done);
    chunks.push_back(size);
    done += size;
  }
  return chunks;
}

/// Largest \f$|a - b| - u|b|\f$ over the rows `[row_begin, row_begin + rows)` of a
/// `[n][heads][value_dim]` tensor `b` and the packed rows `a`: with u = 0, the largest
/// difference; with u the unit roundoff of a's storage, the error beyond rounding a once.
template <class A, class B>
double max_row_difference(const std::vector<A>& a, const std::vector<B>& b, Index row_begin,
                          Index rows, Index row_size, double roundoff = 0) {
  double difference = 0;
  for (Index i = 0; i < rows * row_size; ++i) {
    const double expected =
        static_cast<double>(b[static_cast<std::size_t>(row_begin * row_size + i)]);
    difference = std::max(difference,
                          std::abs(static_cast<double>(a[static_cast<std::size_t>(i)]) - expected) -
                              roundoff * std::abs(expected));
  }
  return difference;
}

/// \f$\max_p (p - E(p) + 1)\f$ over positions `[first, last)`, with \f$E(p)\f$ the smallest start,
/// over heads and draws, of the block of p: computed from the BlockPartition of every grid.
inline Index resident_bound(const std::vector<double>& slopes, const plsh::PlshOptions& options,
                            Index first, Index last) {
  std::vector<Index> reachable(static_cast<std::size_t>(last - first),
                               std::numeric_limits<Index>::max());
  for (std::size_t h = 0; h < slopes.size(); ++h) {
    const plsh::RandomBinning sampler(slopes[h],
                                      plsh::head_seed(options.seed, static_cast<Index>(h)));
    for (const plsh::Grid& grid : sampler.draw(options.samples)) {
      const plsh::BlockPartition partition(grid, first, last);
      for (const plsh::Block block : partition) {
        for (Index p = block.begin; p < block.end; ++p) {
          Index& start = reachable[static_cast<std::size_t>(p - first)];
          start = std::min(start, block.begin);
        }
      }
    }
  }
  Index bound = 0;
  for (Index p = first; p < last; ++p) {
    bound = std::max(bound, p - reachable[static_cast<std::size_t>(p - first)] + 1);
  }
  return bound;
}

struct DecodeResult {
  double max_difference = 0;
  Index max_resident = 0;
  Index final_resident = 0;
};

/// Appends `sequence` chunk by chunk and, after every append, attends the whole chunk and its
/// newest token; compares with the rows of `expected` (plsh_attention over the sequence): the
/// largest difference beyond `roundoff` times the expected value. `outputs`, when given, receives
/// every attended row in order.
template <class Scalar, class Expected>
DecodeResult decode(const Sequence<Scalar>& sequence, const std::vector<double>& slopes,
                    const plsh::PlshOptions& options, const std::vector<Index>& chunks,
                    const std::vector<Expected>& expected, double roundoff = 0,
                    std::vector<Scalar>* outputs = nullptr) {
  plsh::KvCache<Scalar> cache(sequence.heads, sequence.kv_heads, sequence.dim, sequence.value_dim,
                              slopes, options);
  const Index row_size = sequence.heads * sequence.value_dim;
  DecodeResult result;
  Index done = 0;
  std::vector<Scalar> out;
  for (const Index chunk : chunks) {
    cache.append(sequence.keys(done, chunk), sequence.values(done, chunk));
    done += chunk;
    REQUIRE(cache.position() == options.key_position + done);
    REQUIRE(cache.oldest_position() + cache.resident() == cache.position());
    result.max_resident = std::max(result.max_resident, cache.resident());
    for (const Index queries : {chunk, Index{1}}) {
      out.assign(static_cast<std::size_t>(queries * row_size), Scalar(0));
      cache.attend(sequence.queries(done - queries, queries),
                   HeadsView<Scalar>{out.data(), queries, sequence.heads, sequence.value_dim});
      result.max_difference =
          std::max(result.max_difference,
                   max_row_difference(out, expected, done - queries, queries, row_size, roundoff));
      if (outputs != nullptr) outputs->insert(outputs->end(), out.begin(), out.end());
    }
  }
  result.final_resident = cache.resident();
  return result;
}

template <class Scalar>
std::vector<Scalar> whole_sequence(const Sequence<Scalar>& sequence,
                                   const std::vector<double>& slopes,
                                   const plsh::PlshOptions& options) {
  std::vector<Scalar> out(
      static_cast<std::size_t>(sequence.tokens * sequence.heads * sequence.value_dim));
  plsh::PlshOptions whole = options;
  whole.query_position = options.key_position;
  plsh::plsh_attention<Scalar>(
      sequence.queries(0, sequence.tokens), sequence.keys(0, sequence.tokens),
      sequence.values(0, sequence.tokens),
      HeadsView<Scalar>{out.data(), sequence.tokens, sequence.heads, sequence.value_dim}, slopes,
      whole);
  return out;
}

}  // namespace plsh_test

#endif  // PLSH_TESTS_TEST_KV_CACHE_COMMON_HPP
