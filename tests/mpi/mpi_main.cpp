// The main() of the MPI tests: Catch2's session between MPI_Init and MPI_Finalize. The exit status
// is the largest over the ranks, so that a failure on any rank fails the test. Compiled apart from
// the tests, like tests/catch_main.cpp.
#define CATCH_CONFIG_RUNNER
#include <mpi.h>
#include <catch2/catch.hpp>

int main(int argc, char** argv) {
  MPI_Init(&argc, &argv);
  const int result = Catch::Session().run(argc, argv);
  int worst = result;
  MPI_Allreduce(&result, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
  MPI_Finalize();
  return worst;
}
