#ifndef PLSH_DETAIL_DEFERRED_HPP
#define PLSH_DETAIL_DEFERRED_HPP

/// \file deferred.hpp
/// Deferred<T, Tag>: the type T, named through a template parameter.
///
/// plsh is header-only, so the body of a non-template function in a header is compiled in every
/// file that includes it, with every template it uses: a function that runs Eigen's eigenvalue
/// solver, Spectra's Lanczos solver or the double-precision attention kernels costs every file that
/// includes it seconds of compile time, whether or not it calls the function. Such a function is
/// a template over an unused `Tag = void` and names its types through Deferred<T, Tag>: they then
/// depend on Tag, and what uses them is compiled only where the function is called.

namespace plsh {
namespace detail {

template <class T, class Tag>
struct DeferredType {
  using type = T;
};

template <class T, class Tag>
using Deferred = typename DeferredType<T, Tag>::type;

}  // namespace detail
}  // namespace plsh

#endif  // PLSH_DETAIL_DEFERRED_HPP
