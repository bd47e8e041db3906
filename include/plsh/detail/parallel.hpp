#ifndef PLSH_DETAIL_PARALLEL_HPP
#define PLSH_DETAIL_PARALLEL_HPP

#include <Eigen/Core>
#include <exception>
#include <type_traits>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace plsh {
namespace detail {

template <class T>
struct Identity {
  using type = T;
};
/// Keeps a parameter out of template argument deduction (C++20's std::type_identity_t).
template <class T>
using NonDeduced = typename Identity<T>::type;

/// Below this many estimated multiply-adds a loop runs on the calling thread: opening a parallel
/// region (a few microseconds, far more on a loaded machine) would cost more than it saves, as in
/// decoding one token.
constexpr double kMinParallelWork = 1 << 20;

/// An upper bound of the multiply-adds of attention of every query row against every key:
/// \f$H\, n_q\, n_k\, (d + d_v)\f$.
template <class View>
double attention_work(const View& q, const View& k, const View& v) {
  return static_cast<double>(q.heads) * static_cast<double>(q.tokens) *
         static_cast<double>(k.tokens) * static_cast<double>(q.dim + v.dim);
}

/// The processors OpenMP may use (omp_get_num_procs; 1 without OpenMP): unlike the number of
/// threads, fixed for the process.
inline int processor_count() {
#if defined(_OPENMP)
  return omp_get_num_procs();
#else
  return 1;
#endif
}

/// How parallel_for_threads deals out the indices: `Dynamic`, one at a time to whichever thread
/// is free (uneven work); `Static`, index i to thread i for `count` equal to the number of
/// threads (the same thread for the same part from call to call, which keeps its data in that
/// core's cache).
enum class Schedule { Dynamic, Static };

/// Calls `body(i, thread)` for i in [0, count), `thread` the OpenMP thread number that runs it:
/// across OpenMP threads when compiled with OpenMP and `threaded`, with the given schedule;
/// otherwise in a plain loop on the calling thread (thread 0), without opening a parallel region.
/// Every `i` must write its own outputs, so the result does not depend on the number of threads.
/// The first exception thrown by a body reaches the caller (threaded: after the loop).
template <class Body>
void parallel_for_threads(Eigen::Index count, bool threaded, Body&& body,
                          Schedule schedule = Schedule::Dynamic) {
#if defined(_OPENMP)
  if (threaded) {
    std::exception_ptr failure;
    const auto run = [&](Eigen::Index i) {
      try {
        body(i, omp_get_thread_num());
      } catch (...) {
#pragma omp critical(plsh_parallel_for_failure)
        if (!failure) failure = std::current_exception();
      }
    };
    if (schedule == Schedule::Static) {
#pragma omp parallel for schedule(static, 1)
      for (Eigen::Index i = 0; i < count; ++i) run(i);
    } else {
#pragma omp parallel for schedule(dynamic, 1)
      for (Eigen::Index i = 0; i < count; ++i) run(i);
    }
    if (failure) std::rethrow_exception(failure);
    return;
  }
#endif
  static_cast<void>(threaded);  // unused without OpenMP
  static_cast<void>(schedule);
  for (Eigen::Index i = 0; i < count; ++i) body(i, 0);
}

/// Calls `body(i)` for i in [0, count): across OpenMP threads when compiled with OpenMP and
/// `work` (estimated multiply-adds of the whole loop) reaches kMinParallelWork
/// (parallel_for_threads).
template <class Body>
void parallel_for(Eigen::Index count, double work, Body&& body) {
  parallel_for_threads(count, work >= kMinParallelWork, [&](Eigen::Index i, int) { body(i); });
}

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_PARALLEL_HPP
