#ifndef PLSH_MPI_HALO_HPP
#define PLSH_MPI_HALO_HPP

/// \file halo.hpp
/// The messages of the MPI entry points: a duplicate communicator per call (CallComm), non-blocking
/// point-to-point messages in pieces of at most 1 GiB (Messages), and the halo exchange itself:
/// gather_keys brings every rank the key and value rows of its reachable interval (layout.hpp)
/// that other ranks hold, scatter_add sends the halo's gradients back to their owners, who add
/// them to their own in a fixed order. A rank receives (and sends) only rows of the halo, whose
/// width does not depend on n. Tested in tests/mpi/test_mpi.cpp (bytes and messages counted
/// against the layout's intervals, results against the single-process kernels).

#include <mpi.h>

#include <algorithm>
#include <cstdint>
#include <vector>

#include "../partition.hpp"
#include "../tensor.hpp"
#include "layout.hpp"

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

}  // namespace mpi

namespace detail {

using mpi::ExchangeCounts;

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
void pack_token_rows(const HeadsView<const Scalar>& view, Index first, Index count,
                     Scalar* packed) {
  for (Index t = 0; t < count; ++t) {
    for (Index h = 0; h < view.heads; ++h) {
      std::copy_n(view.data + (first + t) * view.token_stride + h * view.head_stride, view.dim,
                  packed + (t * view.heads + h) * view.dim);
    }
  }
}

/// Adds packed rows into rows `[first, first + count)` of a view.
template <class Scalar>
void add_token_rows(const Scalar* packed, Index first, Index count, const HeadsView<Scalar>& view) {
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

  /// Takes the shape `[row_count][head_count][width]`, keeping the storage unless it is too small:
  /// a buffer reused for rows of several shapes allocates only when one is larger than any
  /// before. The rows' contents are unspecified.
  void reshape(Index row_count, Index head_count, Index width) {
    const auto needed =
        static_cast<std::size_t>(std::max<Index>(1, row_count * head_count * width));
    if (data.size() < needed) data.resize(needed);
    tokens = row_count;
    heads = head_count;
    dim = width;
  }

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
      pack_token_rows(k, outgoing.begin - own.begin, outgoing.size(), keys.row(0));
      pack_token_rows(v, outgoing.begin - own.begin, outgoing.size(), values.row(0));
      messages.send(keys.row(0), outgoing.size() * keys.row_bytes(), r, kKeyTag);
      messages.send(values.row(0), outgoing.size() * values.row_bytes(), r, kValueTag);
    }
  }
  if (copy_own && mine.size() > 0) {
    pack_token_rows(k, mine.begin - own.begin, mine.size(), gathered.keys.row(at(mine.begin)));
    pack_token_rows(v, mine.begin - own.begin, mine.size(), gathered.values.row(at(mine.begin)));
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
    add_token_rows(gradient.data.data() + (mine.begin - rows.begin) * out.heads * out.dim,
                   mine.begin - own.begin, mine.size(), out);
  }
  const ExchangeCounts counts = messages.wait();
  for (int r = 0; r < comm.ranks(); ++r) {
    if (r == me) continue;
    const Block from = intersect(own, reachable[static_cast<std::size_t>(r)]);
    if (from.size() > 0) {
      add_token_rows(incoming[static_cast<std::size_t>(r)].data.data(), from.begin - own.begin,
                     from.size(), out);
    }
  }
  return counts;
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_MPI_HALO_HPP
