// Tests of mpi.hpp, run by ctest under mpirun on 1, 2 and 4 ranks (tests/mpi/CMakeLists.txt).
//
// Every rank builds the whole problem from the fixture's seeded generator, computes the
// single-process kernel over the whole sequence, and calls the MPI function on its chunk; its rows
// must equal the single-process rows. On one rank with queries and keys at the same positions the
// local call is the single-process call (same keys, same tiles): bit for bit. Otherwise the kernels
// tile the rows from the chunk's first row, key tiles start at the first gathered key, the ring
// merges its partial results chunk by chunk and the key gradients of a halo are summed on their
// owner: the same terms in another order, equal to float rounding (1e-12 in double, 2e-5 in
// float, relative to the largest reference value).
//
// The chunk layouts are even, skewed (one token on rank 0) and with an empty chunk; the slopes are
// the standard ones of 4 heads (the flattest, 1/256, gives halos of about a thousand positions:
// every chunk of 160 tokens is shorter, and the halo spans several ranks) and steep ones (halos of
// about ten positions, shorter than every chunk).

#include <mpi.h>
#include <catch2/catch.hpp>

#include <algorithm>
#include <cmath>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include <plsh/alibi.hpp>
#include <plsh/attention/alibi_attention.hpp>
#include <plsh/attention/backward.hpp>
#include <plsh/attention/plsh_attention.hpp>
#include <plsh/mpi.hpp>

#include "../attention_fixture.hpp"
#include "../kernel_instances.hpp"

namespace {

using plsh::Block;
using plsh::HeadsView;
using plsh::Index;
using plsh::mpi::ChunkLayout;
using plsh::mpi::ExchangeCounts;
using plsh_test::Buffer;
using plsh_test::Layout;
using plsh_test::Shape;

int world_rank() {
  int rank = 0;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  return rank;
}

int world_size() {
  int size = 1;
  MPI_Comm_size(MPI_COMM_WORLD, &size);
  return size;
}

constexpr Index kTokens = 160;

/// Even, skewed (rank 0 holds one token) and, on two ranks or more, with an empty chunk.
std::vector<std::vector<Index>> chunk_layouts(Index n, int ranks) {
  std::vector<std::vector<Index>> layouts{plsh::mpi::even_chunk_sizes(n, ranks)};
  if (ranks > 1) {
    std::vector<Index> skewed = plsh::mpi::even_chunk_sizes(n - 1, ranks - 1);
    skewed.insert(skewed.begin(), 1);
    layouts.push_back(skewed);
    std::vector<Index> with_empty = plsh::mpi::even_chunk_sizes(n, ranks - 1);
    with_empty.insert(with_empty.begin() + ranks / 2, 0);
    layouts.push_back(with_empty);
  }
  return layouts;
}

std::string describe_sizes(const std::vector<Index>& sizes) {
  std::string text;
  for (const Index size : sizes) text += std::to_string(size) + " ";
  return text;
}

struct SlopeCase {
  const char* name;
  std::vector<double> slopes;
};

const std::vector<SlopeCase>& slope_cases() {
  static const std::vector<SlopeCase> cases{
      {"standard (halo longer than chunks)", plsh::alibi_slopes(4)},
      {"steep (halo shorter than chunks)", {1, 0.5, 2, 0.75}}};
  return cases;
}

struct PositionCase {
  Index query_position, key_position;
};

const std::vector<PositionCase>& position_cases() {
  static const std::vector<PositionCase> cases{{0, 0}, {1000, 1000}, {100, 3}, {3, 100}};
  return cases;
}

/// max |a - b| / max(1, max |b|).
template <class A, class B>
double scaled_difference(const HeadsView<A>& a, const HeadsView<B>& b) {
  double largest = 1;
  for (Index t = 0; t < b.tokens; ++t)
    for (Index h = 0; h < b.heads; ++h)
      for (Index e = 0; e < b.dim; ++e) {
        largest = std::max(
            largest,
            std::abs(static_cast<double>(b.data[t * b.token_stride + h * b.head_stride + e])));
      }
  return plsh_test::max_abs_difference(a, b) / largest;
}

template <class Scalar>
double tolerance() {
  return sizeof(Scalar) == sizeof(float) ? 2e-5 : 1e-12;
}

/// Calls `check(sizes, slopes, options, shape)` for every layout, slope set, position case and
/// causality, with and without grouped heads.
template <class Check>
void for_each_case(Check&& check) {
  for (const std::vector<Index>& sizes : chunk_layouts(kTokens, world_size())) {
    for (const SlopeCase& slopes : slope_cases()) {
      for (std::size_t p = 0; p < position_cases().size(); ++p) {
        const PositionCase& positions = position_cases()[p];
        for (const bool causal : {true, false}) {
          {
            // Grouped heads in every other position case, so that both meet every layout.
            const Index kv_heads = (p + (causal ? 1 : 0)) % 2 == 0 ? 4 : 2;
            plsh::PlshOptions options;
            // The paper's estimator, whose halo draw_head_grids gives (the sampling and near
            // field have a test of their own below).
            options.sampling = plsh::Sampling::Independent;
            options.near_field = 0;
            options.causal = causal;
            options.query_position = positions.query_position;
            options.key_position = positions.key_position;
            const Shape shape{kTokens, kTokens, 4, kv_heads, 8, 6};
            INFO("rank " << world_rank() << " of " << world_size() << ", chunks "
                         << describe_sizes(sizes) << ", slopes " << slopes.name << ", "
                         << plsh_test::describe(options) << ", " << shape);
            check(sizes, slopes.slopes, options, shape);
          }
        }
      }
    }
  }
}

/// The rows of this rank against the single-process rows: bit for bit when the local call is
/// the single-process call, else to rounding.
template <class Scalar>
void check_rows(const HeadsView<const Scalar>& mine, const HeadsView<const Scalar>& whole,
                const Block& chunk, bool same_call) {
  const double difference = scaled_difference(mine, whole.slice(chunk.begin, chunk.size()));
  INFO("scaled difference " << plsh_test::scientific(difference));
  if (same_call) {
    CHECK(difference == 0);
  } else {
    CHECK(difference <= tolerance<Scalar>());
  }
}

bool single_call(const plsh::AttentionOptions& options) {
  return world_size() == 1 && options.query_position == options.key_position;
}

std::uint64_t row_bytes(const Shape& shape, std::size_t scalar_size) {
  return static_cast<std::uint64_t>(shape.kv_heads * (shape.dim + shape.value_dim)) * scalar_size;
}

TEMPLATE_TEST_CASE("plsh::mpi::plsh_attention equals plsh_attention over the whole sequence",
                   "[mpi][plsh]", float, double) {
  using Scalar = TestType;
  for_each_case([](const std::vector<Index>& sizes, const std::vector<double>& slopes,
                   plsh::PlshOptions options, const Shape& shape) {
    const ChunkLayout layout(sizes);
    const Block chunk = layout.chunk(world_rank());
    const plsh_test::Problem<Scalar> problem(shape, 7);
    const auto reachable = plsh::detail::plsh_reachable_keys(
        layout, plsh::draw_head_grids(slopes, options.samples, options.seed), options);
    for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
      options.kernel = kernel;
      INFO((kernel == plsh::Kernel::Fused ? "fused" : "passes"));
      Buffer<Scalar> whole = problem.output();
      plsh::plsh_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), whole.view,
                                   slopes, options);
      const Layout out_layout = kernel == plsh::Kernel::Fused ? Layout::Packed : Layout::PaddedRows;
      Buffer<Scalar> mine(chunk.size(), shape.heads, shape.value_dim, out_layout);
      const ExchangeCounts counts = plsh::mpi::plsh_attention<Scalar>(
          MPI_COMM_WORLD, problem.q.in().slice(chunk.begin, chunk.size()),
          problem.k.in().slice(chunk.begin, chunk.size()),
          problem.v.in().slice(chunk.begin, chunk.size()), mine.view, slopes, options);
      check_rows<Scalar>(mine.in(), whole.in(), chunk, single_call(options));
      CHECK(mine.touched_padding() == 0);
      CHECK(counts.bytes_received == plsh::detail::halo_bytes(layout, reachable, world_rank(),
                                                              row_bytes(shape, sizeof(Scalar))));
    }
  });
}

TEMPLATE_TEST_CASE("plsh::mpi::windowed_alibi_attention keeps the guarantee of the single kernel",
                   "[mpi][windowed]", float, double) {
  // Each rank tiles its own rows, so its windows may differ from the single-process kernel's:
  // both are within 2 tolerance max|v| of exact ALiBi (the entries of v lie in [-1, 1]), and on one
  // rank the call is the single-process call.
  using Scalar = TestType;
  for_each_case([](const std::vector<Index>& sizes, const std::vector<double>& slopes,
                   const plsh::PlshOptions& options, const Shape& shape) {
    const ChunkLayout layout(sizes);
    const Block chunk = layout.chunk(world_rank());
    const plsh_test::Problem<Scalar> problem(shape, 11);
    Buffer<Scalar> exact = problem.output();
    plsh::exact_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), exact.view,
                                        slopes, options);
    for (const double tolerance : {1e-6, 1e-2}) {
      INFO("tolerance " << tolerance);
      Buffer<Scalar> whole = problem.output();
      plsh::windowed_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(),
                                             whole.view, slopes, tolerance, options);
      Buffer<Scalar> mine(chunk.size(), shape.heads, shape.value_dim);
      const ExchangeCounts counts = plsh::mpi::windowed_alibi_attention<Scalar>(
          MPI_COMM_WORLD, problem.q.in().slice(chunk.begin, chunk.size()),
          problem.k.in().slice(chunk.begin, chunk.size()),
          problem.v.in().slice(chunk.begin, chunk.size()), mine.view, slopes, tolerance, options);
      if (single_call(options)) check_rows<Scalar>(mine.in(), whole.in(), chunk, true);
      const double error =
          plsh_test::max_abs_difference(mine.in(), exact.in().slice(chunk.begin, chunk.size()));
      INFO("against exact ALiBi: " << plsh_test::scientific(error));
      CHECK(error <= 2 * tolerance + ::tolerance<Scalar>());
      // The halo: the window of the certificate on the norms of the whole sequence.
      const plsh::detail::CallComm self(MPI_COMM_SELF);
      const double scale = 1 / std::sqrt(static_cast<double>(shape.dim));
      const Index window = plsh::detail::certified_window(
          slopes, plsh::detail::agree_on_norms<Scalar>(self, problem.q.in(), scale),
          plsh::detail::agree_on_norms<Scalar>(self, problem.k.in(), 1.0), tolerance);
      const auto reachable = plsh::detail::windowed_reachable_keys(layout, window, options);
      CHECK(counts.bytes_received == plsh::detail::halo_bytes(layout, reachable, world_rank(),
                                                              row_bytes(shape, sizeof(Scalar))));
    }
  });
}

/// Runs `windowed(q, k, v, mine, options)` (a windowed entry point at tolerance 1e-3 on this
/// rank's chunk of an even layout of `problem`), causal and not, checks its rows against exact
/// ALiBi within the guarantee, and hands its exchange counts to `check_counts(counts, causal,
/// layout, chunk)`.
template <class Windowed, class CheckCounts>
void check_windowed_chunks(const plsh_test::Problem<double>& problem,
                           const std::vector<double>& slopes, Windowed&& windowed,
                           CheckCounts&& check_counts) {
  const Index n = problem.shape.n_q;
  const ChunkLayout layout(plsh::mpi::even_chunk_sizes(n, world_size()));
  const Block chunk = layout.chunk(world_rank());
  for (const bool causal : {true, false}) {
    plsh::AttentionOptions options;
    options.causal = causal;
    INFO((causal ? "causal" : "bidirectional")
         << ", rank " << world_rank() << " of " << world_size());
    Buffer<double> exact = problem.output();
    plsh::exact_alibi_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), exact.view,
                                        slopes, options);
    Buffer<double> mine(chunk.size(), problem.shape.heads, problem.shape.value_dim);
    const ExchangeCounts counts =
        windowed(problem.q.in().slice(chunk.begin, chunk.size()),
                 problem.k.in().slice(chunk.begin, chunk.size()),
                 problem.v.in().slice(chunk.begin, chunk.size()), mine.view, options);
    CHECK(plsh_test::max_abs_difference(mine.in(), exact.in().slice(chunk.begin, chunk.size())) <=
          2e-3 + ::tolerance<double>());
    check_counts(counts, causal, layout, chunk);
  }
}

TEST_CASE("plsh::mpi::windowed_alibi_attention with a halo shorter than the sequence",
          "[mpi][windowed]") {
  // 1200 tokens and steep slopes: the certified window (about 340 positions) leaves every rank of
  // two or more without most of the others' keys, which its certificate counts at the largest
  // key norm. The guarantee must hold all the same.
  const Index n = 1200;
  const std::vector<double> slopes{2.0, 1.0};
  const Shape shape{n, n, 2, 1, 8, 6};
  check_windowed_chunks(
      plsh_test::Problem<double>(shape, 15), slopes,
      [&](const HeadsView<const double>& q, const HeadsView<const double>& k,
          const HeadsView<const double>& v, const HeadsView<double>& out,
          const plsh::AttentionOptions& options) {
        return plsh::mpi::windowed_alibi_attention<double>(MPI_COMM_WORLD, q, k, v, out, slopes,
                                                           1e-3, options);
      },
      [&](const ExchangeCounts& counts, bool causal, const ChunkLayout&, const Block& chunk) {
        if (world_size() == 1) return;
        if (!causal || world_rank() > 0) CHECK(counts.bytes_received > 0);
        CHECK(counts.bytes_received <
              static_cast<std::uint64_t>(n - chunk.size()) * row_bytes(shape, sizeof(double)));
      });
}

TEST_CASE("plsh::mpi::windowed_alibi_attention widens a halo whose certificate does not hold",
          "[mpi][windowed]") {
  // A halo of 0 positions instead of certified_window's: on two or more ranks the rows near a
  // chunk's first key (and, bidirectional, its last) cannot certify the keys they do not hold, and
  // the halo is widened until every tile's certificate holds. The guarantee holds, and the ranks
  // receive more than the halo of 0 (nothing for the causal first rank).
  const Index n = 600;
  const std::vector<double> slopes{0.05, 0.02};
  const Shape shape{n, n, 2, 1, 8, 6};
  check_windowed_chunks(
      plsh_test::Problem<double>(shape, 17), slopes,
      [&](const HeadsView<const double>& q, const HeadsView<const double>& k,
          const HeadsView<const double>& v, const HeadsView<double>& out,
          const plsh::AttentionOptions& options) {
        return plsh::detail::windowed_with_halo<double>(MPI_COMM_WORLD, q, k, v, out, slopes, 1e-3,
                                                        options, 0);
      },
      [&](const ExchangeCounts& counts, bool causal, const ChunkLayout& layout, const Block&) {
        plsh::AttentionOptions options;
        options.causal = causal;
        const std::uint64_t narrow = plsh::detail::halo_bytes(
            layout, plsh::detail::windowed_reachable_keys(layout, 0, options), world_rank(),
            row_bytes(shape, sizeof(double)));
        if (world_size() > 1 && (!causal || world_rank() > 0)) {
          CHECK(counts.bytes_received > narrow);
        }
      });
}

TEMPLATE_TEST_CASE("plsh::mpi::exact_alibi_attention (ring) equals exact_alibi_attention",
                   "[mpi][exact]", float, double) {
  using Scalar = TestType;
  for_each_case([](const std::vector<Index>& sizes, const std::vector<double>& slopes,
                   const plsh::PlshOptions& options, const Shape& shape) {
    const ChunkLayout layout(sizes);
    const Block chunk = layout.chunk(world_rank());
    const plsh_test::Problem<Scalar> problem(shape, 13);
    Buffer<Scalar> whole = problem.output();
    plsh::exact_alibi_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), whole.view,
                                        slopes, options);
    Buffer<Scalar> mine(chunk.size(), shape.heads, shape.value_dim, Layout::HeadMajor);
    const ExchangeCounts counts = plsh::mpi::exact_alibi_attention<Scalar>(
        MPI_COMM_WORLD, problem.q.in().slice(chunk.begin, chunk.size()),
        problem.k.in().slice(chunk.begin, chunk.size()),
        problem.v.in().slice(chunk.begin, chunk.size()), mine.view, slopes, options);
    // One rank: one chunk merged into zeros, the single-process tiles, whatever the positions.
    check_rows<Scalar>(mine.in(), whole.in(), chunk, world_size() == 1);
    CHECK(counts.bytes_received ==
          plsh::detail::ring_bytes(layout, world_rank(), row_bytes(shape, sizeof(Scalar))));
  });
}

TEMPLATE_TEST_CASE("plsh::mpi::plsh_attention_backward equals plsh_attention_backward",
                   "[mpi][backward]", float, double) {
  using Scalar = TestType;
  for_each_case([](const std::vector<Index>& sizes, const std::vector<double>& slopes,
                   const plsh::PlshOptions& options, const Shape& shape) {
    const ChunkLayout layout(sizes);
    const Block chunk = layout.chunk(world_rank());
    const plsh_test::Problem<Scalar> problem(shape, 17);
    Buffer<Scalar> out = problem.output();
    plsh::plsh_attention<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), out.view, slopes,
                                 options);
    Buffer<Scalar> dout = problem.output();
    dout.fill_random(plsh::detail::mix64(99));
    Buffer<Scalar> dq(shape.n_q, shape.heads, shape.dim);
    Buffer<Scalar> dk(shape.n_k, shape.kv_heads, shape.dim);
    Buffer<Scalar> dv(shape.n_k, shape.kv_heads, shape.value_dim);
    plsh::plsh_attention_backward<Scalar>(problem.q.in(), problem.k.in(), problem.v.in(), out.in(),
                                          dout.in(), dq.view, dk.view, dv.view, slopes, options);
    Buffer<Scalar> my_dq(chunk.size(), shape.heads, shape.dim);
    Buffer<Scalar> my_dk(chunk.size(), shape.kv_heads, shape.dim, Layout::PaddedRows);
    Buffer<Scalar> my_dv(chunk.size(), shape.kv_heads, shape.value_dim);
    const auto slice = [&](const Buffer<Scalar>& buffer) {
      return buffer.in().slice(chunk.begin, chunk.size());
    };
    const ExchangeCounts counts = plsh::mpi::plsh_attention_backward<Scalar>(
        MPI_COMM_WORLD, slice(problem.q), slice(problem.k), slice(problem.v), slice(out),
        slice(dout), my_dq.view, my_dk.view, my_dv.view, slopes, options);
    INFO("dq");
    check_rows<Scalar>(my_dq.in(), dq.in(), chunk, single_call(options));
    INFO("dk");
    check_rows<Scalar>(my_dk.in(), dk.in(), chunk, single_call(options));
    CHECK(my_dk.touched_padding() == 0);
    INFO("dv");
    check_rows<Scalar>(my_dv.in(), dv.in(), chunk, single_call(options));
    // The halo arrives once and its gradients go back: as many bytes sent back as received.
    const auto reachable = plsh::detail::plsh_reachable_keys(
        layout, plsh::draw_head_grids(slopes, options.samples, options.seed), options);
    const std::uint64_t halo =
        plsh::detail::halo_bytes(layout, reachable, world_rank(), row_bytes(shape, sizeof(Scalar)));
    CHECK(counts.bytes_received - halo == [&] {
      std::uint64_t returned = 0;
      for (int r = 0; r < layout.ranks(); ++r) {
        if (r == world_rank()) continue;
        const Block rows = plsh::detail::intersect(chunk, reachable[static_cast<std::size_t>(r)]);
        returned += static_cast<std::uint64_t>(rows.size()) * row_bytes(shape, sizeof(Scalar));
      }
      return returned;
    }());
  });
}

TEST_CASE("plsh::mpi kernels draw their halo with the options' sampling and near field",
          "[mpi][plsh]") {
  // Latin hypercube draws differ from independent ones: a halo computed from independent draws
  // misses keys that the kernel's blocks reach. A near field reaches keys the blocks may not.
  const double near_field = GENERATE(0.0, 0.05);
  for_each_case([&](const std::vector<Index>& sizes, const std::vector<double>& slopes,
                    plsh::PlshOptions options, const Shape& shape) {
    options.sampling = plsh::Sampling::LatinHypercube;
    options.near_field = near_field;
    INFO("near_field " << near_field);
    const ChunkLayout layout(sizes);
    const Block chunk = layout.chunk(world_rank());
    const plsh_test::Problem<double> problem(shape, 23);
    Buffer<double> whole = problem.output();
    plsh::plsh_attention<double>(problem.q.in(), problem.k.in(), problem.v.in(), whole.view, slopes,
                                 options);
    Buffer<double> mine(chunk.size(), shape.heads, shape.value_dim);
    const auto slice = [&](const Buffer<double>& buffer) {
      return buffer.in().slice(chunk.begin, chunk.size());
    };
    const ExchangeCounts counts =
        plsh::mpi::plsh_attention<double>(MPI_COMM_WORLD, slice(problem.q), slice(problem.k),
                                          slice(problem.v), mine.view, slopes, options);
    check_rows<double>(mine.in(), whole.in(), chunk, single_call(options));
    CHECK(counts.bytes_received ==
          plsh::detail::halo_bytes(layout,
                                   plsh::detail::plsh_key_rows(layout, slopes, options, "test"),
                                   world_rank(), row_bytes(shape, sizeof(double))));
    Buffer<double> dout = problem.output();
    dout.fill_random(plsh::detail::mix64(5));
    Buffer<double> dq(shape.n_q, shape.heads, shape.dim);
    Buffer<double> dk(shape.n_k, shape.kv_heads, shape.dim);
    Buffer<double> dv(shape.n_k, shape.kv_heads, shape.value_dim);
    plsh::plsh_attention_backward<double>(problem.q.in(), problem.k.in(), problem.v.in(),
                                          whole.in(), dout.in(), dq.view, dk.view, dv.view, slopes,
                                          options);
    Buffer<double> my_dq(chunk.size(), shape.heads, shape.dim);
    Buffer<double> my_dk(chunk.size(), shape.kv_heads, shape.dim);
    Buffer<double> my_dv(chunk.size(), shape.kv_heads, shape.value_dim);
    plsh::mpi::plsh_attention_backward<double>(MPI_COMM_WORLD, slice(problem.q), slice(problem.k),
                                               slice(problem.v), slice(whole), slice(dout),
                                               my_dq.view, my_dk.view, my_dv.view, slopes, options);
    check_rows<double>(my_dq.in(), dq.in(), chunk, single_call(options));
    check_rows<double>(my_dk.in(), dk.in(), chunk, single_call(options));
    check_rows<double>(my_dv.in(), dv.in(), chunk, single_call(options));
  });
}

TEST_CASE("the halo of short chunks spans several ranks, of long chunks one neighbour",
          "[mpi][halo]") {
  const ChunkLayout layout(plsh::mpi::even_chunk_sizes(kTokens, 4));
  plsh::PlshOptions options;
  for (const SlopeCase& slopes : slope_cases()) {
    const auto reachable = plsh::detail::plsh_reachable_keys(
        layout, plsh::draw_head_grids(slopes.slopes, options.samples, options.seed), options);
    INFO(slopes.name);
    const Block last = reachable[3];
    CHECK(last.end == kTokens);
    if (slopes.slopes.front() < 0.5) {
      CHECK(last.begin < layout.chunk(2).begin);  // from rank 1 or 0
    } else {
      CHECK(last.begin >= layout.chunk(2).begin);
      CHECK(last.begin < layout.chunk(3).begin);
    }
  }
}

TEST_CASE("PackedRows::reshape keeps its storage unless a larger shape needs more",
          "[mpi][layout]") {
  // The ring's receive buffers: one pair for the whole call, reshaped at every step.
  plsh::detail::PackedRows<double> rows(5, 2, 3);
  const double* storage = rows.data.data();
  rows.reshape(2, 2, 3);
  CHECK(rows.tokens == 2);
  CHECK(rows.row_bytes() == 6 * sizeof(double));
  CHECK(rows.view().tokens == 2);
  rows.reshape(0, 2, 3);
  CHECK(rows.tokens == 0);
  rows.reshape(3, 1, 10);  // 30 elements, as many as the first shape
  CHECK(rows.data.data() == storage);
  CHECK(rows.row_bytes() == 10 * sizeof(double));
  CHECK(rows.row(2) == storage + 20);
  rows.reshape(7, 2, 3);  // 42 elements: grows
  CHECK(rows.data.size() >= 42);
  CHECK(rows.tokens == 7);
  CHECK(rows.row(6) == rows.data.data() + 36);
}

TEST_CASE("even_chunk_sizes and ChunkLayout", "[mpi][layout]") {
  CHECK(plsh::mpi::even_chunk_sizes(10, 4) == std::vector<Index>{3, 3, 2, 2});
  CHECK(plsh::mpi::even_chunk_sizes(2, 3) == std::vector<Index>{1, 1, 0});
  const ChunkLayout layout({3, 0, 4});
  CHECK(layout.ranks() == 3);
  CHECK(layout.tokens() == 7);
  CHECK(layout.chunk(1) == Block{3, 3});
  CHECK(layout.chunk(2) == Block{3, 7});
  CHECK(plsh::mpi::even_chunk(10, MPI_COMM_WORLD) ==
        ChunkLayout(plsh::mpi::even_chunk_sizes(10, world_size())).chunk(world_rank()));
  REQUIRE_THROWS_WITH(plsh::mpi::even_chunk_sizes(-1, 2),
                      "plsh::mpi::even_chunk_sizes: tokens must be non-negative");
  REQUIRE_THROWS_WITH(plsh::mpi::even_chunk_sizes(5, 0),
                      "plsh::mpi::even_chunk_sizes: ranks must be at least 1");
  REQUIRE_THROWS_WITH(ChunkLayout(std::vector<Index>{}),
                      "plsh::mpi::ChunkLayout: sizes must not be empty");
  REQUIRE_THROWS_WITH(ChunkLayout({3, -1}),
                      "plsh::mpi::ChunkLayout: every size must be non-negative");
  REQUIRE_THROWS_WITH(ChunkLayout({plsh::kMaxPosition, 1}),
                      "plsh::mpi::ChunkLayout: the sizes must sum to at most kMaxPosition = 2^53");
}

TEST_CASE("bad arguments on any rank throw on every rank", "[mpi][errors]") {
  const Shape shape{kTokens, kTokens, 4, 2, 8, 6};
  const plsh_test::Problem<double> problem(shape, 23);
  const Block chunk = plsh::mpi::even_chunk(kTokens, MPI_COMM_WORLD);
  const auto q = problem.q.in().slice(chunk.begin, chunk.size());
  const auto k = problem.k.in().slice(chunk.begin, chunk.size());
  const auto v = problem.v.in().slice(chunk.begin, chunk.size());
  Buffer<double> out(chunk.size(), shape.heads, shape.value_dim);
  const std::vector<double> slopes = plsh::alibi_slopes(4);
  const int last = world_size() - 1;
  using Catch::Contains;

  SECTION("k with another token count than q") {
    REQUIRE_THROWS_WITH(
        plsh::mpi::plsh_attention<double>(MPI_COMM_WORLD, q, k.slice(0, 0), v, out.view, slopes),
        "plsh::mpi::plsh_attention: k.tokens must equal q.tokens (one chunk of "
        "the sequence)");
    REQUIRE_THROWS_WITH(plsh::mpi::exact_alibi_attention<double>(MPI_COMM_WORLD, q, k,
                                                                 v.slice(0, 0), out.view, slopes),
                        "plsh::mpi::exact_alibi_attention: v.tokens must equal q.tokens");
  }
  SECTION("ranks that disagree on the slopes or options") {
    if (world_size() > 1) {
      std::vector<double> mine = slopes;
      if (world_rank() == 0) mine[1] = 0.3;
      REQUIRE_THROWS_WITH(
          plsh::mpi::windowed_alibi_attention<double>(MPI_COMM_WORLD, q, k, v, out.view, mine),
          Contains("passed other heads, sizes, options or slopes than rank " +
                   std::to_string(world_rank())));
      plsh::PlshOptions options;
      options.seed = world_rank() == last ? 5 : 0;
      REQUIRE_THROWS_WITH(
          plsh::mpi::plsh_attention<double>(MPI_COMM_WORLD, q, k, v, out.view, slopes, options),
          Contains("(every rank must pass the same)"));
      // Rank 0's own check fails: it names the argument, the others name rank 0.
      const std::vector<double> fewer(slopes.begin(), slopes.end() - (world_rank() == 0 ? 1 : 0));
      REQUIRE_THROWS_WITH(
          plsh::mpi::exact_alibi_attention<double>(MPI_COMM_WORLD, q, k, v, out.view, fewer),
          world_rank() == 0
              ? "plsh::mpi::exact_alibi_attention: slopes.size() (3) must equal q.heads (4)"
              : "plsh::mpi::exact_alibi_attention: invalid arguments on rank 0");
    }
  }
  SECTION("a bad output on the last rank") {
    // The last rank writes into its own q: it names the overlap, the others name that rank.
    const HeadsView<double> bad = world_rank() == last
                                      ? HeadsView<double>{const_cast<double*>(q.data),
                                                          q.tokens,
                                                          q.heads,
                                                          shape.value_dim,
                                                          q.token_stride,
                                                          q.head_stride}
                                      : out.view;
    const std::string expected =
        world_rank() == last
            ? "plsh::mpi::plsh_attention: out overlaps q"
            : "plsh::mpi::plsh_attention: invalid arguments on rank " + std::to_string(last);
    REQUIRE_THROWS_WITH(plsh::mpi::plsh_attention<double>(MPI_COMM_WORLD, q, k, v, bad, slopes),
                        expected);
  }
  SECTION("the checks of the single-process kernels") {
    plsh::PlshOptions options;
    options.samples = 0;
    REQUIRE_THROWS_WITH(
        plsh::mpi::plsh_attention<double>(MPI_COMM_WORLD, q, k, v, out.view, slopes, options),
        Contains("options.samples"));
    REQUIRE_THROWS_WITH(
        plsh::mpi::windowed_alibi_attention<double>(MPI_COMM_WORLD, q, k, v, out.view, slopes, 2.0),
        "plsh::mpi::windowed_alibi_attention: tolerance must lie in [0, 1]");
    REQUIRE_THROWS_WITH(plsh::mpi::exact_alibi_attention<double>(MPI_COMM_WORLD, q, k, v, out.view,
                                                                 std::vector<double>{1, 2, 3, -1}),
                        Contains("slopes[3] must be finite and non-negative"));
    plsh::AttentionOptions far;
    far.query_position = plsh::kMaxPosition - kTokens + 1;
    REQUIRE_THROWS_WITH(
        plsh::mpi::exact_alibi_attention<double>(MPI_COMM_WORLD, q, k, v, out.view, slopes, far),
        Contains("options.query_position + q.tokens must lie in [0, kMaxPosition = 2^53]"));
    Buffer<double> dq(chunk.size(), shape.heads, shape.dim);
    Buffer<double> dk(chunk.size(), shape.kv_heads, shape.dim);
    Buffer<double> dv(chunk.size(), shape.kv_heads, shape.value_dim);
    REQUIRE_THROWS_WITH(plsh::mpi::plsh_attention_backward<double>(
                            MPI_COMM_WORLD, q, k, v, out.in(), out.in(), dq.view, dk.view,
                            HeadsView<double>{dk.view.data, dv.view.tokens, dv.view.heads,
                                              dv.view.dim, dk.view.token_stride, dv.view.dim},
                            slopes),
                        "plsh::mpi::plsh_attention_backward: dv overlaps dk");
  }
}

/// The name of a storage type in the messages of mpi.hpp.
template <class S>
std::string scalar_name() {
  if (std::is_same<S, float>::value) return "float";
  if (std::is_same<S, double>::value) return "double";
  if (std::is_same<S, Eigen::bfloat16>::value) return "Eigen::bfloat16";
  return "Eigen::half";
}

/// Every MPI entry point that accepts views of `Mine` (exact_alibi_attention: float and double
/// only), called on this rank's chunk of one problem (n = 40, 2 heads, d = 4, standard slopes)
/// stored as `Mine`, while the ranks of the other parity pass `Theirs`. Every call must throw
/// std::invalid_argument on every rank, naming the function, the first rank of the other type and
/// both types, before any key row is sent: a rank that reads another type's rows gets wrong
/// results or a truncated message, and one that does not throw leaves the others waiting (ctest's
/// timeout of the "[mismatch]" entries).
template <class Mine, class Theirs>
void require_every_entry_point_rejects_mixed_types() {
  const Shape shape{40, 40, 2, 2, 4, 4};
  const plsh_test::Problem<double> problem(shape, 31);
  Buffer<double> dout_values = problem.output();
  dout_values.fill_random(plsh::detail::mix64(37));
  const Block chunk = plsh::mpi::even_chunk(shape.n_q, MPI_COMM_WORLD);
  // Packed copies of this rank's rows, stored as Mine.
  const auto stored = [&](const Buffer<double>& buffer) {
    std::vector<Mine> rows(static_cast<std::size_t>(
        std::max<Index>(1, chunk.size() * buffer.view.heads * buffer.view.dim)));
    for (Index t = 0; t < chunk.size(); ++t)
      for (Index h = 0; h < buffer.view.heads; ++h)
        for (Index e = 0; e < buffer.view.dim; ++e) {
          rows[static_cast<std::size_t>((t * buffer.view.heads + h) * buffer.view.dim + e)] =
              static_cast<Mine>(buffer.at(chunk.begin + t, h, e));
        }
    return rows;
  };
  std::vector<Mine> q = stored(problem.q), k = stored(problem.k), v = stored(problem.v);
  std::vector<Mine> dout = stored(dout_values);
  std::vector<Mine> out(dout.size()), dq(q.size()), dk(k.size()), dv(v.size());
  const auto view = [&](std::vector<Mine>& rows, Index heads, Index dim) {
    return HeadsView<Mine>{rows.data(), chunk.size(), heads, dim};
  };
  const auto in = [&](const std::vector<Mine>& rows, Index heads, Index dim) {
    return HeadsView<const Mine>{rows.data(), chunk.size(), heads, dim};
  };
  const HeadsView<const Mine> q_in = in(q, shape.heads, shape.dim);
  const HeadsView<const Mine> k_in = in(k, shape.kv_heads, shape.dim);
  const HeadsView<const Mine> v_in = in(v, shape.kv_heads, shape.value_dim);
  const std::vector<double> slopes = plsh::alibi_slopes(shape.heads);
  // The first rank of the other parity is 1 for even ranks, 0 for odd ones.
  const int other = world_rank() % 2 == 0 ? 1 : 0;
  const auto expected = [&](const std::string& function) {
    return Catch::Message("plsh::mpi::" + function + ": rank " + std::to_string(other) +
                          " passed views of " + scalar_name<Theirs>() + ", rank " +
                          std::to_string(world_rank()) + " views of " + scalar_name<Mine>() +
                          " (every rank must pass the same scalar type)");
  };
  INFO("rank " << world_rank() << " of " << world_size() << " passes " << scalar_name<Mine>()
               << ", rank " << other << " " << scalar_name<Theirs>());

  plsh::PlshOptions options;
  options.near_field = 0;  // the function Passes computes
  for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
    options.kernel = kernel;
    REQUIRE_THROWS_MATCHES(
        plsh::mpi::plsh_attention<Mine>(MPI_COMM_WORLD, q_in, k_in, v_in,
                                        view(out, shape.heads, shape.value_dim), slopes, options),
        std::invalid_argument, expected("plsh_attention"));
  }
  REQUIRE_THROWS_MATCHES(plsh::mpi::windowed_alibi_attention<Mine>(
                             MPI_COMM_WORLD, q_in, k_in, v_in,
                             view(out, shape.heads, shape.value_dim), slopes, 1e-6, options),
                         std::invalid_argument, expected("windowed_alibi_attention"));
  if constexpr (std::is_floating_point<Mine>::value && std::is_floating_point<Theirs>::value) {
    REQUIRE_THROWS_MATCHES(plsh::mpi::exact_alibi_attention<Mine>(
                               MPI_COMM_WORLD, q_in, k_in, v_in,
                               view(out, shape.heads, shape.value_dim), slopes, options),
                           std::invalid_argument, expected("exact_alibi_attention"));
  }
  REQUIRE_THROWS_MATCHES(
      plsh::mpi::plsh_attention_backward<Mine>(
          MPI_COMM_WORLD, q_in, k_in, v_in, in(dout, shape.heads, shape.value_dim),
          in(dout, shape.heads, shape.value_dim), view(dq, shape.heads, shape.dim),
          view(dk, shape.kv_heads, shape.dim), view(dv, shape.kv_heads, shape.value_dim), slopes,
          options),
      std::invalid_argument, expected("plsh_attention_backward"));
}

TEST_CASE("ranks that pass another scalar type throw on every rank", "[mpi][errors][mismatch]") {
  // One rank cannot disagree with itself: nothing to check.
  if (world_size() < 2) return;
  SECTION("float on even ranks, double on odd ones") {
    if (world_rank() % 2 == 0) {
      require_every_entry_point_rejects_mixed_types<float, double>();
    } else {
      require_every_entry_point_rejects_mixed_types<double, float>();
    }
  }
  SECTION("Eigen::bfloat16 on even ranks, Eigen::half on odd ones (both 2 bytes)") {
    if (world_rank() % 2 == 0) {
      require_every_entry_point_rejects_mixed_types<Eigen::bfloat16, Eigen::half>();
    } else {
      require_every_entry_point_rejects_mixed_types<Eigen::half, Eigen::bfloat16>();
    }
  }
  SECTION("float on even ranks, Eigen::bfloat16 on odd ones") {
    if (world_rank() % 2 == 0) {
      require_every_entry_point_rejects_mixed_types<float, Eigen::bfloat16>();
    } else {
      require_every_entry_point_rejects_mixed_types<Eigen::bfloat16, float>();
    }
  }
}

}  // namespace
