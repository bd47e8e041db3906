// Consumer of an installed plsh::mpi, run as a single MPI process: plsh::mpi::plsh_attention on
// one rank equals plsh_attention. Exit status 0 when it does.

#include <mpi.h>

#include <cstdio>
#include <vector>

#include <plsh/mpi.hpp>
#include <plsh/plsh.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const plsh::Index n = 100, heads = 2, dim = 4;
  std::vector<double> q(n * heads * dim), k(q.size()), v(q.size()), out(q.size()), mine(q.size());
  for (std::size_t i = 0; i < q.size(); ++i) {
    q[i] = static_cast<double>(i % 7) / 7;
    k[i] = static_cast<double>(i % 5) / 5;
    v[i] = static_cast<double>(i % 3) / 3;
  }
  const std::vector<double> slopes = plsh::alibi_slopes(heads);
  plsh::plsh_attention<double>({q.data(), n, heads, dim}, {k.data(), n, heads, dim},
                               {v.data(), n, heads, dim}, {out.data(), n, heads, dim}, slopes);
  plsh::mpi::plsh_attention<double>(MPI_COMM_WORLD, {q.data(), n, heads, dim},
                                    {k.data(), n, heads, dim}, {v.data(), n, heads, dim},
                                    {mine.data(), n, heads, dim}, slopes);
  MPI_Finalize();
  if (mine != out) {
    std::printf("plsh::mpi::plsh_attention differs from plsh_attention on one rank\n");
    return 1;
  }
  std::printf("plsh::mpi consumer: ok\n");
  return 0;
}
