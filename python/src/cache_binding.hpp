// What the bindings of the decoding caches KvCache (kv_cache.cpp) and AlibiKvCache
// (alibi_kv_cache.cpp) share: the interface of a cache of any storage type, its implementation
// for one type (the checks of the arrays, the GIL released and a mutex held around every call of
// the cache), and the Python members of the shapes and the dtype. Tested in
// python/tests/test_kv_cache.py and python/tests/test_alibi_kv_cache.py.

#ifndef PLSH_PYTHON_CACHE_BINDING_HPP
#define PLSH_PYTHON_CACHE_BINDING_HPP

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <initializer_list>
#include <mutex>
#include <utility>
#include <vector>

#include <plsh/batch.hpp>

#include "arrays.hpp"

namespace plsh_python {

// The members of a cache that do not depend on its storage type or its kind.
class CacheInterface {
 public:
  virtual ~CacheInterface() = default;
  virtual void append(const py::object& k, const py::object& v) = 0;
  virtual py::array attend(const py::object& q, const py::object& out) = 0;
  virtual py::array decode(const py::object& q, const py::object& k, const py::object& v,
                           const py::object& out) = 0;
  virtual Index position() const = 0;
  virtual Index resident() const = 0;
  virtual std::size_t bytes() const = 0;
  virtual py::dtype dtype() const = 0;
  virtual Index heads() const = 0;
  virtual Index kv_heads() const = 0;
  virtual Index dim() const = 0;
  virtual Index value_dim() const = 0;
  virtual std::vector<double> slopes() const = 0;
};

// `Interface` (a CacheInterface) on a `Cache` (plsh::KvCache<Scalar> or
// plsh::AlibiKvCache<Scalar>) named `name` in error messages. The arrays are checked by
// cache_arrays and cache_output (arrays.hpp); every call of the cache runs with the GIL released
// and the mutex held, which keeps calls from several Python threads from racing on the cache.
template <class Interface, class Scalar, class Cache>
class CacheOf : public Interface {
 public:
  template <class Options>
  CacheOf(const char* name, Index heads, Index kv_heads, Index dim, Index value_dim,
          std::vector<double> slopes, const Options& options)
      : cache_(heads, kv_heads, dim, value_dim, std::move(slopes), options),
        name_(name),
        heads_(heads),
        value_dim_(value_dim) {}

  void append(const py::object& k, const py::object& v) override {
    const Arrays arrays = arrays_of({{"k", k}, {"v", v}});
    const Input<Scalar> k_in = arrays.input<Scalar>(0);
    const Input<Scalar> v_in = arrays.input<Scalar>(1);
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> lock(mutex_);
    cache_.append(k_in.view[0], v_in.view[0]);
  }

  py::array attend(const py::object& q, const py::object& out) override {
    const Arrays arrays = arrays_of({{"q", q}});
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Output<Scalar> result = cache_output<Scalar>(arrays, out, heads_, value_dim_);
    {
      py::gil_scoped_release release;
      const std::lock_guard<std::mutex> lock(mutex_);
      attend_rows(q_in.view[0], result.view[0]);
    }
    return result.array;
  }

  py::array decode(const py::object& q, const py::object& k, const py::object& v,
                   const py::object& out) override {
    const Arrays arrays = arrays_of({{"q", q}, {"k", k}, {"v", v}});
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Input<Scalar> k_in = arrays.input<Scalar>(1);
    const Input<Scalar> v_in = arrays.input<Scalar>(2);
    const Output<Scalar> result = cache_output<Scalar>(arrays, out, heads_, value_dim_);
    {
      py::gil_scoped_release release;
      const std::lock_guard<std::mutex> lock(mutex_);
      decode_rows(q_in.view[0], k_in.view[0], v_in.view[0], result.view[0]);
    }
    return result.array;
  }

  Index position() const override {
    return locked([&] { return cache_.position(); });
  }
  Index resident() const override {
    return locked([&] { return cache_.resident(); });
  }
  std::size_t bytes() const override {
    return locked([&] { return cache_.bytes(); });
  }
  py::dtype dtype() const override { return numpy_dtype(storage_of<Scalar>()); }
  Index heads() const override { return cache_.heads(); }
  Index kv_heads() const override { return cache_.kv_heads(); }
  Index dim() const override { return cache_.dim(); }
  Index value_dim() const override { return cache_.value_dim(); }
  std::vector<double> slopes() const override { return cache_.slopes(); }

 protected:
  using Rows = plsh::HeadsView<const Scalar>;
  using OutputRows = plsh::HeadsView<Scalar>;

  // The cache's attend and decode, called with the GIL released and the mutex held.
  virtual void attend_rows(const Rows& q, const OutputRows& out) {
    static_cast<void>(cache_.attend(q, out));
  }
  virtual void decode_rows(const Rows& q, const Rows& k, const Rows& v, const OutputRows& out) {
    static_cast<void>(cache_.decode(q, k, v, out));
  }

  // f() with the mutex held.
  template <class F>
  auto locked(F&& f) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return f();
  }

  Cache cache_;

 private:
  Arrays arrays_of(std::initializer_list<std::pair<const char*, py::object>> named) const {
    return cache_arrays<Scalar>(name_, named);
  }

  const char* name_;
  Index heads_;
  Index value_dim_;
  mutable std::mutex mutex_;
};

// The Python members of a cache class `Base` (a CacheInterface) that both caches have: position,
// the shapes, alibi_slopes and dtype.
template <class Base>
void bind_cache_members(py::class_<Base>& cache) {
  cache
      .def_property_readonly("position", &Base::position,
                             "The position of the next appended token (tokens appended so far).")
      .def_property_readonly("heads", &Base::heads)
      .def_property_readonly("kv_heads", &Base::kv_heads)
      .def_property_readonly("dim", &Base::dim)
      .def_property_readonly("value_dim", &Base::value_dim)
      .def_property_readonly("alibi_slopes", &Base::slopes, "The slopes, one per head.")
      .def_property_readonly("dtype", &Base::dtype,
                             "The NumPy dtype of the cache's arrays (uint16 for bfloat16).");
}

}  // namespace plsh_python

#endif  // PLSH_PYTHON_CACHE_BINDING_HPP
