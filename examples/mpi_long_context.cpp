// A million tokens of causal Positional LSH attention over MPI.
//
//   mpirun -np 4 mpi_long_context [tokens=1048576]
//
// The sequence is split evenly over the ranks the program is started with; each rank holds only
// its chunk of q, k and v (8 query heads on 2 key/value heads, head dim 64, float) and computes
// its rows with plsh::mpi::plsh_attention (standard ALiBi slopes, s = 20). The keys and values
// its queries can reach on other ranks, the halo, arrive by point-to-point messages; its width
// depends on the slopes, not on the sequence length.
//
// Token t's q, k, v are a pure function of t (plsh's counter-based generator), so every rank can
// recompute any token. The program checks its first rows, whose halo lies on other ranks, against
// plsh_attention on one process over the keys they reach, recomputed locally (the first position
// any draw's block of the first query starts at, from plsh::draw_head_grids and grid_block), and
// fails (exit status 1) when they differ by more than float rounding or an output is not finite.
//
// Build it against an installed plsh with
//   find_package(plsh CONFIG REQUIRED COMPONENTS mpi)
//   target_link_libraries(my_program PRIVATE plsh::mpi)
// and compile with -O3 -march=native (and -fopenmp for threads on each rank).

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include <plsh/mpi.hpp>
#include <plsh/plsh.hpp>

namespace {

using plsh::Index;

constexpr Index kHeads = 8;
constexpr Index kKvHeads = 2;
constexpr Index kDim = 64;

/// Rows `[first, first + count)` of one of q (`which` 0), k (1) or v (2), `heads` heads: uniform
/// in [-1, 1], a function of the token's index only.
std::vector<float> make_rows(Index first, Index count, Index heads, int which) {
  const plsh::detail::CounterRandom random(2024 + static_cast<std::uint64_t>(which));
  std::vector<float> rows(static_cast<std::size_t>(std::max<Index>(1, count * heads * kDim)));
  for (Index t = 0; t < count; ++t) {
    for (Index e = 0; e < heads * kDim; ++e) {
      rows[static_cast<std::size_t>(t * heads * kDim + e)] = static_cast<float>(
          2 * random.unit(static_cast<std::uint64_t>(first + t), static_cast<std::uint64_t>(e)) -
          1);
    }
  }
  return rows;
}

}  // namespace

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  int rank = 0;
  int ranks = 1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  MPI_Comm_size(MPI_COMM_WORLD, &ranks);
  const Index tokens = argc > 1 ? std::atol(argv[1]) : Index(1) << 20;
  if (tokens < 1) {
    if (rank == 0) std::fprintf(stderr, "usage: mpi_long_context [tokens >= 1]\n");
    MPI_Finalize();
    return 2;
  }

  const plsh::Block chunk = plsh::mpi::even_chunk(tokens, MPI_COMM_WORLD);
  const Index n = chunk.size();
  const std::vector<float> q = make_rows(chunk.begin, n, kHeads, 0);
  const std::vector<float> k = make_rows(chunk.begin, n, kKvHeads, 1);
  const std::vector<float> v = make_rows(chunk.begin, n, kKvHeads, 2);
  std::vector<float> out(static_cast<std::size_t>(std::max<Index>(1, n * kHeads * kDim)));
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  plsh::PlshOptions options;  // causal, the default estimator, seed 0, fused kernel

  MPI_Barrier(MPI_COMM_WORLD);
  const auto start = std::chrono::steady_clock::now();
  const plsh::mpi::ExchangeCounts counts = plsh::mpi::plsh_attention<float>(
      MPI_COMM_WORLD, {q.data(), n, kHeads, kDim}, {k.data(), n, kKvHeads, kDim},
      {v.data(), n, kKvHeads, kDim}, {out.data(), n, kHeads, kDim}, slopes, options);
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

  // Softmax rows are convex combinations of values in [-1, 1].
  bool bounded = true;
  for (Index i = 0; i < n * kHeads * kDim; ++i) {
    const float x = out[static_cast<std::size_t>(i)];
    bounded = bounded && std::isfinite(x) && std::abs(x) <= 1.0f;
  }

  // The first rows against one process over the keys they reach, recomputed here.
  const Index rows = std::min<Index>(n, 16);
  double difference = 0;
  Index halo = 0;
  if (rows > 0) {
    Index first_key = chunk.begin;
    for (const auto& head : plsh::draw_head_grids(slopes, options.samples, options.seed)) {
      for (const plsh::Grid& grid : head) {
        first_key = std::min(first_key, plsh::grid_block(grid, chunk.begin, 0, tokens).begin);
      }
    }
    halo = chunk.begin - first_key;
    const Index keys = chunk.begin + rows - first_key;
    const std::vector<float> local_k = make_rows(first_key, keys, kKvHeads, 1);
    const std::vector<float> local_v = make_rows(first_key, keys, kKvHeads, 2);
    std::vector<float> expected(static_cast<std::size_t>(rows * kHeads * kDim));
    plsh::PlshOptions local = options;
    local.query_position = chunk.begin;
    local.key_position = first_key;
    plsh::plsh_attention<float>({q.data(), rows, kHeads, kDim},
                                {local_k.data(), keys, kKvHeads, kDim},
                                {local_v.data(), keys, kKvHeads, kDim},
                                {expected.data(), rows, kHeads, kDim}, slopes, local);
    for (std::size_t i = 0; i < expected.size(); ++i) {
      difference = std::max(difference, static_cast<double>(std::abs(expected[i] - out[i])));
    }
  }

  double slowest = 0;
  MPI_Reduce(&seconds, &slowest, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  double largest_difference = 0;
  MPI_Reduce(&difference, &largest_difference, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  const double received = static_cast<double>(counts.bytes_received);
  double most_received = 0;
  MPI_Reduce(&received, &most_received, 1, MPI_DOUBLE, MPI_MAX, 0, MPI_COMM_WORLD);
  const long long local_halo = halo;
  long long widest_halo = 0;
  MPI_Reduce(&local_halo, &widest_halo, 1, MPI_LONG_LONG, MPI_MAX, 0, MPI_COMM_WORLD);
  int ok = bounded && difference <= 1e-5 ? 1 : 0;
  int all_ok = 0;
  MPI_Allreduce(&ok, &all_ok, 1, MPI_INT, MPI_MIN, MPI_COMM_WORLD);
  if (rank == 0) {
    std::printf(
        "%lld tokens over %d ranks: %.2f s (slowest rank), widest halo %lld tokens, at "
        "most %.0f bytes received per rank\n",
        static_cast<long long>(tokens), ranks, slowest, widest_halo, most_received);
    std::printf("first rows against one process: max |difference| %.2e; outputs %s\n",
                largest_difference, all_ok ? "finite and bounded" : "WRONG");
  }
  MPI_Finalize();
  return all_ok ? 0 : 1;
}
