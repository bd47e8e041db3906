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
/// the same bound KvCache evicts by); the windowed kernel reaches \f$W = \max_h
/// \lfloor\ln(1/\text{tolerance})/m_h\rfloor\f$ positions either way. The keys and values of that
/// interval that other ranks hold (the halo) come by point-to-point messages from their owners,
/// however many ranks it spans; then the single-process kernel runs on the rank's queries against
/// the gathered keys. The halo's width does not depend on n: for s = 20 draws of the flattest
/// standard head of 8 (slope 1/256) about a thousand positions.
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
/// Results: each rank's rows equal those rows of the single-process kernel over the whole
/// sequence to float rounding (the kernels tile the rows from the chunk's first row, and the
/// ring merges its partial results in another order); on one rank, bit for bit.
///
/// Tested with mpirun on 1, 2 and 4 ranks in tests/mpi/test_mpi.cpp against the single-process
/// kernels: plsh_attention (both kernels), windowed_alibi_attention, exact_alibi_attention and
/// plsh_attention_backward, with chunks shorter and longer than the halo, grouped heads and
/// offsets.

#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <limits>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "attention/alibi_attention.hpp"
#include "attention/backward.hpp"
#include "attention/online_softmax.hpp"
#include "attention/plsh_attention.hpp"
#include "attention/regular.hpp"
#include "detail/check.hpp"
#include "detail/parallel.hpp"
#include "detail/validate.hpp"
#include "options.hpp"
#include "partition.hpp"
#include "sampler.hpp"
#include "tensor.hpp"

namespace plsh {
namespace mpi {

/// Point-to-point traffic of one call on one rank: the key and value rows (and, backward, their
/// gradients) it received and sent, measured from the completed messages.
struct ExchangeCounts {
  std::uint64_t bytes_received = 0;
  std::uint64_t bytes_sent = 0;
  std::uint64_t messages_received = 0;
  std::uint64_t messages_sent = 0;

  ExchangeCounts& operator+=(const ExchangeCounts& other) {
    bytes_received += other.bytes_received;
    bytes_sent += other.bytes_sent;
    messages_received += other.messages_received;
    messages_sent += other.messages_sent;
    return *this;
  }
};

/// The sizes of `ranks` chunks of `tokens` tokens split evenly: the first `tokens % ranks` chunks
/// hold one token more.
/// \throws std::invalid_argument for `tokens < 0` or `ranks < 1`.
inline std::vector<Index> even_chunk_sizes(Index tokens, int ranks) {
  const char* function = "plsh::mpi::even_chunk_sizes";
  detail::require(tokens >= 0, function, "tokens must be non-negative");
  detail::require(ranks >= 1, function, "ranks must be at least 1");
  std::vector<Index> sizes(static_cast<std::size_t>(ranks), tokens / ranks);
  for (Index r = 0; r < tokens % ranks; ++r) ++sizes[static_cast<std::size_t>(r)];
  return sizes;
}

/// Which tokens every rank holds: rank r holds tokens `[chunk(r).begin, chunk(r).end)` of the
/// whole sequence, in rank order, without gaps.
class ChunkLayout {
 public:
  /// \param sizes tokens of ranks 0, 1, ...; each non-negative.
  /// \throws std::invalid_argument for an empty list or a negative size.
  explicit ChunkLayout(const std::vector<Index>& sizes) {
    const char* function = "plsh::mpi::ChunkLayout";
    detail::require(!sizes.empty(), function, "sizes must not be empty");
    offsets_.push_back(0);
    for (const Index size : sizes) {
      detail::require(size >= 0, function, "every size must be non-negative");
      detail::require(size <= kMaxPosition - offsets_.back(), function,
                      "the sizes must sum to at most kMaxPosition = 2^53");
      offsets_.push_back(offsets_.back() + size);
    }
  }

  int ranks() const { return static_cast<int>(offsets_.size()) - 1; }
  Index tokens() const { return offsets_.back(); }
  Block chunk(int rank) const {
    return Block{offsets_[static_cast<std::size_t>(rank)],
                 offsets_[static_cast<std::size_t>(rank) + 1]};
  }

 private:
  std::vector<Index> offsets_;
};

/// The chunk of this rank of `comm` when `tokens` tokens are split evenly (even_chunk_sizes).
inline Block even_chunk(Index tokens, MPI_Comm comm) {
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(comm, &rank);
  MPI_Comm_size(comm, &ranks);
  return ChunkLayout(even_chunk_sizes(tokens, ranks)).chunk(rank);
}

namespace detail {

using plsh::detail::fail;
using plsh::detail::require;

inline Block intersect(const Block& a, const Block& b) {
  const Index begin = std::max(a.begin, b.begin);
  return Block{begin, std::max(begin, std::min(a.end, b.end))};
}

/// Key rows `[begin - key_position, end - key_position)` of the positions `[begin, end)`, cut to
/// the `tokens` rows that exist (empty when they do not meet).
inline Block key_rows(Index begin, Index end, Index key_position, Index tokens) {
  return intersect(Block{begin - key_position, end - key_position}, Block{0, tokens});
}

/// The key rows that the queries of every rank's chunk reach in Positional LSH with the draws
/// `grids` (see the file comment); `options` positions are those of token 0.
inline std::vector<Block> plsh_reachable_keys(const ChunkLayout& layout,
                                              const std::vector<std::vector<Grid>>& grids,
                                              const AttentionOptions& options) {
  const Index n = layout.tokens();
  const Index first = std::min(options.query_position, options.key_position);
  const Index last = std::max(options.query_position, options.key_position) + n;
  std::vector<Block> reachable;
  for (int r = 0; r < layout.ranks(); ++r) {
    const Block chunk = layout.chunk(r);
    if (chunk.begin == chunk.end) {
      reachable.push_back(Block{0, 0});
      continue;
    }
    const Index query_begin = options.query_position + chunk.begin;
    const Index query_end = options.query_position + chunk.end;
    Index begin = query_begin;
    Index end = query_end;
    for (const std::vector<Grid>& head : grids) {
      for (const Grid& grid : head) {
        begin = std::min(begin, grid_block(grid, query_begin, first, last).begin);
        if (!options.causal) end = std::max(end, grid_block(grid, query_end - 1, first, last).end);
      }
    }
    reachable.push_back(key_rows(begin, end, options.key_position, n));
  }
  return reachable;
}

/// The key rows that the queries of every rank's chunk reach in windowed ALiBi: `window`
/// positions before (and, bidirectional, after) the chunk.
inline std::vector<Block> windowed_reachable_keys(const ChunkLayout& layout, Index window,
                                                  const AttentionOptions& options) {
  std::vector<Block> reachable;
  for (int r = 0; r < layout.ranks(); ++r) {
    const Block chunk = layout.chunk(r);
    if (chunk.begin == chunk.end) {
      reachable.push_back(Block{0, 0});
      continue;
    }
    const Index begin = options.query_position + chunk.begin - window;
    const Index end = options.query_position + chunk.end + (options.causal ? 0 : window);
    reachable.push_back(key_rows(begin, end, options.key_position, layout.tokens()));
  }
  return reachable;
}

/// The widest window of windowed_alibi_attention over the heads.
inline Index widest_window(const std::vector<double>& slopes, double tolerance) {
  Index window = 0;
  for (const double slope : slopes) {
    window = std::max(window, plsh::detail::alibi_window(slope, tolerance));
  }
  return window;
}

/// Bytes this rank receives when every rank gathers its `reachable` key rows from their owners,
/// `row_bytes` per row: the rows of the interval that other ranks hold.
inline std::uint64_t halo_bytes(const ChunkLayout& layout, const std::vector<Block>& reachable,
                                int rank, std::uint64_t row_bytes) {
  const Block own = layout.chunk(rank);
  const Block wanted = reachable[static_cast<std::size_t>(rank)];
  const Index mine = intersect(own, wanted).size();
  return static_cast<std::uint64_t>(wanted.size() - mine) * row_bytes;
}

/// Bytes a rank receives in the ring of exact_alibi_attention, `row_bytes` per row: every other
/// rank's chunk.
inline std::uint64_t ring_bytes(const ChunkLayout& layout, int rank, std::uint64_t row_bytes) {
  return static_cast<std::uint64_t>(layout.tokens() - layout.chunk(rank).size()) * row_bytes;
}

/// A duplicate of a communicator for one call's messages, freed at the end of the call.
class CallComm {
 public:
  explicit CallComm(MPI_Comm comm) {
    MPI_Comm_dup(comm, &comm_);
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &ranks_);
  }
  CallComm(const CallComm&) = delete;
  CallComm& operator=(const CallComm&) = delete;
  ~CallComm() { MPI_Comm_free(&comm_); }

  MPI_Comm get() const { return comm_; }
  int rank() const { return rank_; }
  int ranks() const { return ranks_; }

 private:
  MPI_Comm comm_ = MPI_COMM_NULL;
  int rank_ = 0;
  int ranks_ = 1;
};

/// Non-blocking messages of one exchange step. A buffer is sent in pieces of at most
/// kMaxMessageBytes (MPI counts are int); pieces with the same source and tag arrive in order.
class Messages {
 public:
  static constexpr std::size_t kMaxMessageBytes = std::size_t(1) << 30;

  explicit Messages(MPI_Comm comm) : comm_(comm) {}
  Messages(const Messages&) = delete;
  Messages& operator=(const Messages&) = delete;
  ~Messages() {
    // Only reached without wait() when an exception unwinds: complete what was posted.
    if (!receives_.empty() || !sends_.empty()) wait();
  }

  void receive(void* data, std::size_t bytes, int source, int tag) {
    auto* bytes_data = static_cast<unsigned char*>(data);
    for (std::size_t offset = 0; offset < bytes; offset += kMaxMessageBytes) {
      const int piece = static_cast<int>(std::min(kMaxMessageBytes, bytes - offset));
      receives_.emplace_back();
      MPI_Irecv(bytes_data + offset, piece, MPI_BYTE, source, tag, comm_, &receives_.back());
    }
  }

  void send(const void* data, std::size_t bytes, int destination, int tag) {
    const auto* bytes_data = static_cast<const unsigned char*>(data);
    for (std::size_t offset = 0; offset < bytes; offset += kMaxMessageBytes) {
      const int piece = static_cast<int>(std::min(kMaxMessageBytes, bytes - offset));
      sends_.emplace_back();
      MPI_Isend(bytes_data + offset, piece, MPI_BYTE, destination, tag, comm_, &sends_.back());
      counts_.bytes_sent += static_cast<std::uint64_t>(piece);
      ++counts_.messages_sent;
    }
  }

  /// Waits for every message; returns the counts of this step and of the steps before it.
  ExchangeCounts wait() {
    std::vector<MPI_Status> statuses(receives_.size());
    MPI_Waitall(static_cast<int>(receives_.size()), receives_.data(), statuses.data());
    for (MPI_Status& status : statuses) {
      int count = 0;
      MPI_Get_count(&status, MPI_BYTE, &count);
      counts_.bytes_received += static_cast<std::uint64_t>(count);
      ++counts_.messages_received;
    }
    MPI_Waitall(static_cast<int>(sends_.size()), sends_.data(), MPI_STATUSES_IGNORE);
    receives_.clear();
    sends_.clear();
    return counts_;
  }

 private:
  MPI_Comm comm_;
  std::vector<MPI_Request> receives_;
  std::vector<MPI_Request> sends_;
  ExchangeCounts counts_;
};

/// Copies rows `[first, first + count)` of a view into packed `[count][heads][dim]` storage.
template <class Scalar>
void pack_rows(const HeadsView<const Scalar>& view, Index first, Index count, Scalar* packed) {
  for (Index t = 0; t < count; ++t) {
    for (Index h = 0; h < view.heads; ++h) {
      std::copy_n(view.data + (first + t) * view.token_stride + h * view.head_stride, view.dim,
                  packed + (t * view.heads + h) * view.dim);
    }
  }
}

/// Adds packed rows into rows `[first, first + count)` of a view.
template <class Scalar>
void add_rows(const Scalar* packed, Index first, Index count, const HeadsView<Scalar>& view) {
  for (Index t = 0; t < count; ++t) {
    for (Index h = 0; h < view.heads; ++h) {
      Scalar* row = view.data + (first + t) * view.token_stride + h * view.head_stride;
      const Scalar* source = packed + (t * view.heads + h) * view.dim;
      for (Index e = 0; e < view.dim; ++e) row[e] += source[e];
    }
  }
}

/// Packed `[tokens][heads][dim]` storage and its view.
template <class Scalar>
struct PackedRows {
  std::vector<Scalar> data;
  Index tokens = 0;
  Index heads = 1;
  Index dim = 1;

  PackedRows() = default;
  PackedRows(Index row_count, Index head_count, Index width)
      : data(static_cast<std::size_t>(std::max<Index>(1, row_count * head_count * width))),
        tokens(row_count),
        heads(head_count),
        dim(width) {}

  Scalar* row(Index t) { return data.data() + t * heads * dim; }
  std::size_t row_bytes() const { return static_cast<std::size_t>(heads * dim) * sizeof(Scalar); }
  HeadsView<Scalar> view() { return HeadsView<Scalar>{data.data(), tokens, heads, dim}; }
  HeadsView<const Scalar> view() const {
    return HeadsView<const Scalar>{data.data(), tokens, heads, dim};
  }
};

constexpr int kKeyTag = 1;
constexpr int kValueTag = 2;

/// Keys and values of the rows `reachable[rank]`, gathered from their owners: this rank sends
/// its rows that each other rank reaches, and receives the rows of its interval that others hold.
/// Its own rows of the interval are copied in too, unless `copy_own` is false (the benchmark
/// counts the messages only).
template <class Scalar>
struct GatheredKeys {
  Block rows;
  PackedRows<Scalar> keys;
  PackedRows<Scalar> values;
  ExchangeCounts counts;
};

template <class Scalar>
GatheredKeys<Scalar> gather_keys(const CallComm& comm, const ChunkLayout& layout,
                                 const std::vector<Block>& reachable,
                                 const HeadsView<const Scalar>& k, const HeadsView<const Scalar>& v,
                                 bool copy_own = true) {
  const int me = comm.rank();
  const Block own = layout.chunk(me);
  GatheredKeys<Scalar> gathered;
  gathered.rows = reachable[static_cast<std::size_t>(me)];
  const Block mine = intersect(own, gathered.rows);
  // Without the own rows, the buffers hold the rows before and after them only.
  const Index skipped = copy_own ? 0 : mine.size();
  const auto at = [&](Index row) {
    return row - gathered.rows.begin - (row >= mine.end ? skipped : 0);
  };
  gathered.keys = PackedRows<Scalar>(gathered.rows.size() - skipped, k.heads, k.dim);
  gathered.values = PackedRows<Scalar>(gathered.rows.size() - skipped, v.heads, v.dim);
  Messages messages(comm.get());
  std::vector<PackedRows<Scalar>> outgoing_keys(static_cast<std::size_t>(comm.ranks()));
  std::vector<PackedRows<Scalar>> outgoing_values(outgoing_keys.size());
  for (int r = 0; r < comm.ranks(); ++r) {
    if (r == me) continue;
    const Block incoming = intersect(layout.chunk(r), gathered.rows);
    if (incoming.size() > 0) {
      const Index row = at(incoming.begin);
      messages.receive(gathered.keys.row(row), incoming.size() * gathered.keys.row_bytes(), r,
                       kKeyTag);
      messages.receive(gathered.values.row(row), incoming.size() * gathered.values.row_bytes(), r,
                       kValueTag);
    }
    const Block outgoing = intersect(own, reachable[static_cast<std::size_t>(r)]);
    if (outgoing.size() > 0) {
      PackedRows<Scalar>& keys = outgoing_keys[static_cast<std::size_t>(r)];
      PackedRows<Scalar>& values = outgoing_values[static_cast<std::size_t>(r)];
      keys = PackedRows<Scalar>(outgoing.size(), k.heads, k.dim);
      values = PackedRows<Scalar>(outgoing.size(), v.heads, v.dim);
      pack_rows(k, outgoing.begin - own.begin, outgoing.size(), keys.row(0));
      pack_rows(v, outgoing.begin - own.begin, outgoing.size(), values.row(0));
      messages.send(keys.row(0), outgoing.size() * keys.row_bytes(), r, kKeyTag);
      messages.send(values.row(0), outgoing.size() * values.row_bytes(), r, kValueTag);
    }
  }
  if (copy_own && mine.size() > 0) {
    pack_rows(k, mine.begin - own.begin, mine.size(), gathered.keys.row(at(mine.begin)));
    pack_rows(v, mine.begin - own.begin, mine.size(), gathered.values.row(at(mine.begin)));
  }
  gathered.counts = messages.wait();
  return gathered;
}

/// The inverse of gather_keys for gradients: every rank sends the rows of `gradient` (rows
/// `reachable[rank]` of the sequence) that other ranks own back to them; each owner sets its
/// rows of `out` to the sum of the contributions, its own first, then the other ranks' in rank
/// order.
template <class Scalar>
ExchangeCounts scatter_add(const CallComm& comm, const ChunkLayout& layout,
                           const std::vector<Block>& reachable, const PackedRows<Scalar>& gradient,
                           const HeadsView<Scalar>& out, int tag) {
  const int me = comm.rank();
  const Block own = layout.chunk(me);
  const Block rows = reachable[static_cast<std::size_t>(me)];
  Messages messages(comm.get());
  std::vector<PackedRows<Scalar>> incoming(static_cast<std::size_t>(comm.ranks()));
  for (int r = 0; r < comm.ranks(); ++r) {
    if (r == me) continue;
    const Block from = intersect(own, reachable[static_cast<std::size_t>(r)]);
    if (from.size() > 0) {
      PackedRows<Scalar>& buffer = incoming[static_cast<std::size_t>(r)];
      buffer = PackedRows<Scalar>(from.size(), out.heads, out.dim);
      messages.receive(buffer.row(0), from.size() * buffer.row_bytes(), r, tag);
    }
    const Block to = intersect(layout.chunk(r), rows);
    if (to.size() > 0) {
      messages.send(gradient.data.data() + (to.begin - rows.begin) * out.heads * out.dim,
                    to.size() * gradient.row_bytes(), r, tag);
    }
  }
  for (Index t = 0; t < out.tokens; ++t) {
    for (Index h = 0; h < out.heads; ++h) {
      std::fill_n(out.data + t * out.token_stride + h * out.head_stride, out.dim, Scalar(0));
    }
  }
  const Block mine = intersect(own, rows);
  if (mine.size() > 0) {
    add_rows(gradient.data.data() + (mine.begin - rows.begin) * out.heads * out.dim,
             mine.begin - own.begin, mine.size(), out);
  }
  const ExchangeCounts counts = messages.wait();
  for (int r = 0; r < comm.ranks(); ++r) {
    if (r == me) continue;
    const Block from = intersect(own, reachable[static_cast<std::size_t>(r)]);
    if (from.size() > 0) {
      add_rows(incoming[static_cast<std::size_t>(r)].data.data(), from.begin - own.begin,
               from.size(), out);
    }
  }
  return counts;
}

/// The storage types of the entry points, in the order of their codes (scalar_code).
inline constexpr const char* kScalarNames[] = {"float", "double", "Eigen::bfloat16", "Eigen::half"};

/// The storage type `Scalar` as one word that ranks compare: 256 times its index in kScalarNames
/// plus its size in bytes (bfloat16 and half have the same size; the index tells them apart).
template <class Scalar>
constexpr std::int64_t scalar_code() {
  plsh::detail::require_storage_type<Scalar>();
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
  plsh::detail::validate_attention(function, q, k, v, out, options);
  plsh::detail::validate_slopes(function, slopes, q.heads);
}

/// Positions of the whole sequence within [0, kMaxPosition]: the same answer on every rank.
inline void check_sequence(const char* function, const ChunkLayout& layout,
                           const AttentionOptions& options) {
  plsh::detail::validate_positions(function, options, layout.tokens(), layout.tokens());
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
ExchangeCounts plsh_attention(MPI_Comm comm, HeadsView<const plsh::detail::NonDeduced<Scalar>> q,
                              HeadsView<const plsh::detail::NonDeduced<Scalar>> k,
                              HeadsView<const plsh::detail::NonDeduced<Scalar>> v,
                              HeadsView<Scalar> out, const std::vector<double>& slopes,
                              const PlshOptions& options = {}) {
  const char* function = "plsh::mpi::plsh_attention";
  const detail::CallComm call(comm);
  detail::Signature signature =
      detail::attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options);
  signature.add(options.samples);
  signature.add(static_cast<std::int64_t>(options.seed));
  signature.add(static_cast<std::int64_t>(options.sampling));
  signature.add(static_cast<std::int64_t>(options.kernel));
  const ChunkLayout layout = detail::agree_on_layout(call, function, q.tokens, signature, [&] {
    detail::check_forward(function, q, k, v, out, slopes, options);
    plsh::detail::require_samples(options.samples, function, "options.samples");
  });
  detail::check_sequence(function, layout, options);
  // The kernel draws the same grids (kernel_grids): the halo must follow options.sampling.
  const auto grids = plsh::detail::kernel_grids(slopes, options, function);
  const auto reachable = detail::plsh_reachable_keys(layout, grids, options);
  const auto gathered = detail::gather_keys(call, layout, reachable, k, v);
  const PlshOptions local =
      detail::local_options(options, layout.chunk(call.rank()).begin, gathered.rows.begin);
  plsh::plsh_attention<Scalar>(q, gathered.keys.view(), gathered.values.view(), out, slopes, local);
  return gathered.counts;
}

/// Rows of this rank's chunk of windowed_alibi_attention over the whole sequence; arguments as
/// plsh::mpi::plsh_attention, with `tolerance` as windowed_alibi_attention.
template <class Scalar>
ExchangeCounts windowed_alibi_attention(MPI_Comm comm,
                                        HeadsView<const plsh::detail::NonDeduced<Scalar>> q,
                                        HeadsView<const plsh::detail::NonDeduced<Scalar>> k,
                                        HeadsView<const plsh::detail::NonDeduced<Scalar>> v,
                                        HeadsView<Scalar> out, const std::vector<double>& slopes,
                                        double tolerance = 1e-6,
                                        const AttentionOptions& options = {}) {
  const char* function = "plsh::mpi::windowed_alibi_attention";
  const detail::CallComm call(comm);
  detail::Signature signature =
      detail::attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options);
  signature.add_double(tolerance);
  const ChunkLayout layout = detail::agree_on_layout(call, function, q.tokens, signature, [&] {
    detail::check_forward(function, q, k, v, out, slopes, options);
    detail::require(tolerance >= 0 && tolerance <= 1, function, "tolerance must lie in [0, 1]");
  });
  detail::check_sequence(function, layout, options);
  const auto reachable =
      detail::windowed_reachable_keys(layout, detail::widest_window(slopes, tolerance), options);
  const auto gathered = detail::gather_keys(call, layout, reachable, k, v);
  const AttentionOptions local =
      detail::local_options(options, layout.chunk(call.rank()).begin, gathered.rows.begin);
  plsh::windowed_alibi_attention<Scalar>(q, gathered.keys.view(), gathered.values.view(), out,
                                         slopes, tolerance, local);
  return gathered.counts;
}

/// Rows of this rank's chunk of exact_alibi_attention over the whole sequence, by ring attention:
/// the chunks of k and v travel around the ring of ranks, and each rank merges the attention of
/// its queries against every chunk by log-sum-exp. Every rank receives every other rank's keys
/// and values. Arguments as plsh::mpi::plsh_attention; Scalar float or double.
template <class Scalar>
ExchangeCounts exact_alibi_attention(MPI_Comm comm,
                                     HeadsView<const plsh::detail::NonDeduced<Scalar>> q,
                                     HeadsView<const plsh::detail::NonDeduced<Scalar>> k,
                                     HeadsView<const plsh::detail::NonDeduced<Scalar>> v,
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
  resolved.scale = plsh::detail::resolved_scale(options, q.dim);
  resolved.query_position = options.query_position + layout.chunk(me).begin;
  // The chunk in hand and the one arriving, each keys then values.
  detail::PackedRows<Scalar> keys[2];
  detail::PackedRows<Scalar> values[2];
  const auto load = [&](int slot, int owner) {
    keys[slot] = detail::PackedRows<Scalar>(layout.chunk(owner).size(), k.heads, k.dim);
    values[slot] = detail::PackedRows<Scalar>(layout.chunk(owner).size(), v.heads, v.dim);
  };
  load(0, me);
  detail::pack_rows(k, 0, k.tokens, keys[0].row(0));
  detail::pack_rows(v, 0, v.tokens, values[0].row(0));
  std::vector<Scalar> partial(static_cast<std::size_t>(std::max<Index>(1, q.heads * rows * v.dim)));
  std::vector<Scalar> partial_lse(static_cast<std::size_t>(std::max<Index>(1, q.heads * rows)));
  std::vector<Scalar> lse(partial_lse.size(), -std::numeric_limits<Scalar>::infinity());
  for (Index h = 0; h < q.heads; ++h) out.head(h).setZero();
  ExchangeCounts counts;
  for (int step = 0; step < ranks; ++step) {
    const int slot = step % 2;
    const int owner = (me - step + ranks) % ranks;
    detail::Messages messages(call.get());
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
      const double work = plsh::detail::attention_work(q, block_k, block_v);
      plsh::detail::parallel_for(q.heads, work, [&](Index h) {
        HeadMap<Scalar> head_partial(partial.data() + h * rows * v.dim, rows, v.dim,
                                     Eigen::OuterStride<>(v.dim));
        Scalar* head_lse = partial_lse.data() + h * rows;
        plsh::detail::attend_span<Scalar>(
            q.head(h), block_k.head(h / group), block_v.head(h / group), block_options,
            plsh::detail::LinearBias{slopes[static_cast<std::size_t>(h)], plsh::detail::kNoWindow},
            head_partial, head_lse);
        online_softmax_merge(out.head(h), LseMap<Scalar>(lse.data() + h * rows, rows), head_partial,
                             LseMap<Scalar>(head_lse, rows));
      });
    }
    counts += messages.wait();
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
ExchangeCounts plsh_attention_backward(MPI_Comm comm,
                                       HeadsView<const plsh::detail::NonDeduced<Scalar>> q,
                                       HeadsView<const plsh::detail::NonDeduced<Scalar>> k,
                                       HeadsView<const plsh::detail::NonDeduced<Scalar>> v,
                                       HeadsView<const plsh::detail::NonDeduced<Scalar>> out,
                                       HeadsView<const plsh::detail::NonDeduced<Scalar>> dout,
                                       HeadsView<Scalar> dq, HeadsView<Scalar> dk,
                                       HeadsView<Scalar> dv, const std::vector<double>& slopes,
                                       const PlshOptions& options = {}) {
  const char* function = "plsh::mpi::plsh_attention_backward";
  const detail::CallComm call(comm);
  detail::Signature signature =
      detail::attention_signature<Scalar>(q.heads, k.heads, q.dim, v.dim, slopes, options);
  signature.add(options.samples);
  signature.add(static_cast<std::int64_t>(options.seed));
  signature.add(static_cast<std::int64_t>(options.sampling));
  const ChunkLayout layout = detail::agree_on_layout(call, function, q.tokens, signature, [&] {
    detail::require(k.tokens == q.tokens, function,
                    "k.tokens must equal q.tokens (one chunk of the sequence)");
    plsh::detail::validate_backward(function, q, k, v, out, dout, dq, dk, dv, options);
    plsh::detail::validate_slopes(function, slopes, q.heads);
  });
  detail::check_sequence(function, layout, options);
  // The kernel draws the same grids (kernel_grids): the halo must follow options.sampling.
  const auto grids = plsh::detail::kernel_grids(slopes, options, function);
  const auto reachable = detail::plsh_reachable_keys(layout, grids, options);
  auto gathered = detail::gather_keys(call, layout, reachable, k, v);
  const PlshOptions local =
      detail::local_options(options, layout.chunk(call.rank()).begin, gathered.rows.begin);
  detail::PackedRows<Scalar> key_gradient(gathered.rows.size(), k.heads, k.dim);
  detail::PackedRows<Scalar> value_gradient(gathered.rows.size(), v.heads, v.dim);
  plsh::plsh_attention_backward<Scalar>(q, gathered.keys.view(), gathered.values.view(), out, dout,
                                        dq, key_gradient.view(), value_gradient.view(), slopes,
                                        local);
  ExchangeCounts counts = gathered.counts;
  counts += detail::scatter_add(call, layout, reachable, key_gradient, dk, detail::kKeyTag);
  counts += detail::scatter_add(call, layout, reachable, value_gradient, dv, detail::kValueTag);
  return counts;
}

}  // namespace mpi
}  // namespace plsh

#endif  // PLSH_MPI_HPP
