#ifndef PLSH_DETAIL_PARALLEL_HPP
#define PLSH_DETAIL_PARALLEL_HPP

#include <Eigen/Core>
#include <exception>
#include <type_traits>

namespace plsh {
namespace detail {

template <class T>
struct Identity {
  using type = T;
};
/// Keeps a parameter out of template argument deduction (C++20's std::type_identity_t).
template <class T>
using NonDeduced = typename Identity<T>::type;

/// Calls `body(i)` for i in [0, count): across OpenMP threads when compiled with OpenMP, with
/// dynamic scheduling. Every `i` must write its own outputs, so the result does not depend on the
/// number of threads. The first exception thrown by a body is rethrown after the loop.
template <class Body>
void parallel_for(Eigen::Index count, Body&& body) {
  std::exception_ptr failure;
#if defined(_OPENMP)
#pragma omp parallel for schedule(dynamic, 1)
#endif
  for (Eigen::Index i = 0; i < count; ++i) {
    try {
      body(i);
    } catch (...) {
#if defined(_OPENMP)
#pragma omp critical(plsh_parallel_for_failure)
#endif
      if (!failure) failure = std::current_exception();
    }
  }
  if (failure) std::rethrow_exception(failure);
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_PARALLEL_HPP
