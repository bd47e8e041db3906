#ifndef PLSH_MPI_AGREEMENT_HPP
#define PLSH_MPI_AGREEMENT_HPP

/// \file agreement.hpp
/// What the ranks of a call must agree on, checked in one collective exchange of four 64-bit words
/// per rank before any key row is sent: whether each rank's own argument checks passed, its query
/// count (the chunk layout), its storage type, and a hash of its heads, sizes, options and slopes.
/// When one rank's arguments are wrong or the ranks disagree, every rank throws
/// std::invalid_argument. The windowed kernel also agrees on the largest query and key norms over
/// the ranks (agree_on_norms, one all-reduce), from which every rank derives the same halo.
/// Tested in tests/mpi/test_mpi.cpp ([mismatch], argument and windowed tests).

#include <mpi.h>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "../detail/check.hpp"
#include "../detail/storage.hpp"
#include "../detail/validate.hpp"
#include "../options.hpp"
#include "../tensor.hpp"
#include "halo.hpp"
#include "layout.hpp"

namespace plsh {
namespace detail {

/// The storage types of the entry points, in the order of their codes (scalar_code).
inline constexpr const char* kScalarNames[] = {"float", "double", "Eigen::bfloat16", "Eigen::half"};

/// The storage type `Scalar` as one word that ranks compare: 256 times its index in kScalarNames
/// plus its size in bytes (bfloat16 and half have the same size; the index tells them apart).
template <class Scalar>
constexpr std::int64_t scalar_code() {
  require_storage_type<Scalar>();
  const std::int64_t index = std::is_same<Scalar, float>::value             ? 0
                             : std::is_same<Scalar, double>::value          ? 1
                             : std::is_same<Scalar, Eigen::bfloat16>::value ? 2
                                                                            : 3;
  return 256 * index + static_cast<std::int64_t>(sizeof(Scalar));
}

/// The name of the type of a scalar_code, for messages.
inline std::string scalar_name(std::int64_t code) {
  const std::int64_t index = code / 256;
  return index >= 0 && index < 4 ? kScalarNames[index] : "an unknown type";
}

/// What every rank must agree on: the storage type (compared on its own, so that a disagreement
/// names the types), and the heads, sizes, options and slopes (compared by hash).
struct Signature {
  std::int64_t scalar;
  std::vector<std::int64_t> values;

  explicit Signature(std::int64_t scalar_code) : scalar(scalar_code) {}

  void add(std::int64_t value) { values.push_back(value); }
  void add_double(double value) {
    std::int64_t bits = 0;
    std::memcpy(&bits, &value, sizeof bits);
    values.push_back(bits);
  }

  /// FNV-1a over the words' bytes.
  std::int64_t hash() const {
    std::uint64_t hash = 0xcbf29ce484222325ULL;
    for (const std::int64_t value : values) {
      for (int byte = 0; byte < 8; ++byte) {
        hash ^= (static_cast<std::uint64_t>(value) >> (8 * byte)) & 0xffU;
        hash *= 0x100000001b3ULL;
      }
    }
    return static_cast<std::int64_t>(hash);
  }
};

/// The signature that every entry point starts from: the storage type, heads, sizes, options and
/// slopes (the entry points add their own options). `Scalar` cannot be deduced: every call names
/// the type the messages are sized by.
template <class Scalar>
Signature attention_signature(Index heads, Index kv_heads, Index dim, Index value_dim,
                              const std::vector<double>& slopes, const AttentionOptions& options) {
  Signature signature(scalar_code<Scalar>());
  signature.add(heads);
  signature.add(kv_heads);
  signature.add(dim);
  signature.add(value_dim);
  signature.add(options.causal ? 1 : 0);
  signature.add_double(options.scale);
  signature.add(options.query_position);
  signature.add(options.key_position);
  signature.add(static_cast<std::int64_t>(slopes.size()));
  for (const double slope : slopes) signature.add_double(slope);
  return signature;
}

/// The layout of the chunks, in one collective call: every rank runs `check` on its own
/// arguments, then shares whether it threw, its query count, its scalar type and the hash of its
/// `signature`. When any rank's check threw std::invalid_argument, every rank throws: the failing
/// ranks their own message, the others one that names the first failing rank. When the scalar
/// types or the signatures differ, every rank throws. The exchange is four 64-bit words whatever
/// the scalar type, and it comes before any message of key rows: ranks of different types throw
/// together, before one could read rows of another type or a truncated message.
template <class Check>
ChunkLayout agree_on_layout(const CallComm& comm, const char* function, Index queries,
                            const Signature& signature, Check&& check) {
  std::string message;
  try {
    check();
  } catch (const std::invalid_argument& error) {
    message = error.what();
  }
  constexpr int kWords = 4;
  const std::int64_t mine[kWords] = {message.empty() ? 0 : 1, queries, signature.scalar,
                                     signature.hash()};
  std::vector<std::int64_t> all(static_cast<std::size_t>(kWords * comm.ranks()));
  MPI_Allgather(mine, kWords, MPI_INT64_T, all.data(), kWords, MPI_INT64_T, comm.get());
  if (!message.empty()) throw std::invalid_argument(message);
  std::vector<Index> sizes;
  for (int r = 0; r < comm.ranks(); ++r) {
    const std::int64_t* other = all.data() + kWords * r;
    require(other[0] == 0, function,
            [&] { return "invalid arguments on rank " + std::to_string(r); });
    require(other[2] == mine[2], function, [&] {
      return "rank " + std::to_string(r) + " passed views of " + scalar_name(other[2]) + ", rank " +
             std::to_string(comm.rank()) + " views of " + scalar_name(mine[2]) +
             " (every rank must pass the same scalar type)";
    });
    require(other[3] == mine[3], function, [&] {
      return "rank " + std::to_string(r) +
             " passed other heads, sizes, options or slopes than rank " +
             std::to_string(comm.rank()) + " (every rank must pass the same)";
    });
    sizes.push_back(other[1]);
  }
  return ChunkLayout(sizes);
}

/// The checks of a forward on this rank's chunk (positions of the chunk's queries and keys are
/// checked through those of the whole sequence, by check_sequence).
template <class Scalar>
void check_forward(const char* function, const HeadsView<const Scalar>& q,
                   const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                   const HeadsView<Scalar>& out, const std::vector<double>& slopes,
                   const AttentionOptions& options) {
  require(k.tokens == q.tokens, function,
          "k.tokens must equal q.tokens (one chunk of the sequence)");
  require(v.tokens == q.tokens, function, "v.tokens must equal q.tokens");
  validate_attention(function, q, k, v, out, options);
  validate_slopes(function, slopes, q.heads);
}

/// Positions of the whole sequence within [0, kMaxPosition]: the same answer on every rank.
inline void check_sequence(const char* function, const ChunkLayout& layout,
                           const AttentionOptions& options) {
  validate_positions(function, options, layout.tokens(), layout.tokens());
}

/// The largest row norm per head over every rank's rows of `view` (one all-reduce), times
/// `factor`; a non-finite norm counts as \f$+\infty\f$. The certified window's bounds
/// (certified_window): \f$|\text{scale}|\max\|q_i\|\f$ per query head, \f$\max\|k_j\|\f$ per
/// key/value head.
template <class Scalar>
std::vector<double> agree_on_norms(const CallComm& comm, const HeadsView<const Scalar>& view,
                                   double factor) {
  std::vector<double> norms(static_cast<std::size_t>(view.heads), 0.0);
  std::vector<Compute<Scalar>> row(static_cast<std::size_t>(view.dim));
  for (Index t = 0; t < view.tokens; ++t) {
    for (Index h = 0; h < view.heads; ++h) {
      convert_to_compute(view.data + t * view.token_stride + h * view.head_stride, view.dim,
                         row.data());
      double sum = 0;
      for (const Compute<Scalar> x : row) sum += static_cast<double>(x) * static_cast<double>(x);
      const double norm = factor * std::sqrt(sum);
      double& high = norms[static_cast<std::size_t>(h)];
      high =
          norm <= high ? high : (std::isnan(norm) ? std::numeric_limits<double>::infinity() : norm);
    }
  }
  MPI_Allreduce(MPI_IN_PLACE, norms.data(), static_cast<int>(norms.size()), MPI_DOUBLE, MPI_MAX,
                comm.get());
  return norms;
}

/// Options of the rank's local call: its queries from `query_row`, its keys from `key_row` of the
/// whole sequence.
template <class Options>
Options local_options(const Options& options, Index query_row, Index key_row) {
  Options local = options;
  local.query_position = options.query_position + query_row;
  local.key_position = options.key_position + key_row;
  return local;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_MPI_AGREEMENT_HPP
