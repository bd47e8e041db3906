// ThreadCount: the number of OpenMP threads for a scope (tests and benchmarks).

#ifndef PLSH_TESTS_THREAD_COUNT_HPP
#define PLSH_TESTS_THREAD_COUNT_HPP

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace plsh_test {

/// Sets the OpenMP threads for the lifetime of the object and restores the previous number
/// after it (nothing without OpenMP).
class ThreadCount {
 public:
  explicit ThreadCount(int threads) {
#if defined(_OPENMP)
    saved_ = omp_get_max_threads();
    omp_set_num_threads(threads);
#else
    static_cast<void>(threads);
#endif
  }
  ~ThreadCount() {
#if defined(_OPENMP)
    omp_set_num_threads(saved_);
#endif
  }
  ThreadCount(const ThreadCount&) = delete;
  ThreadCount& operator=(const ThreadCount&) = delete;

 private:
  int saved_ = 1;
};

}  // namespace plsh_test

#endif  // PLSH_TESTS_THREAD_COUNT_HPP
