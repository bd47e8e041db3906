// NumPy arrays as plsh views: the dtype and rank checks of the arguments and the batched views
// [batch, tokens, heads, dim] the kernels of plsh/batch.hpp read and write.
//
// Arrays are [tokens, heads, dim] (a batch of one) or [batch, tokens, heads, dim] of float32,
// float64, float16, or bfloat16 held as uint16 bit patterns (NumPy has no bfloat16). An input is
// read through its strides when these are positive multiples of the itemsize with a contiguous
// last axis, otherwise through a contiguous copy; an output is a new C-contiguous array or an
// `out=` array, which must have such strides. A wrong dtype is a TypeError and a wrong rank or
// shape a ValueError, both naming the argument.

#ifndef PLSH_PYTHON_ARRAYS_HPP
#define PLSH_PYTHON_ARRAYS_HPP

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <plsh/batch.hpp>

namespace plsh_python {

namespace py = pybind11;
using plsh::Index;

std::string shape_string(const std::vector<py::ssize_t>& shape);
std::vector<py::ssize_t> shape_of(const py::array& array);
std::string dtype_string(const py::array& array);

// `object` as an ndarray; TypeError naming the argument for anything else.
py::array as_ndarray(const py::object& object, const char* name);

// The element types of the arrays, and the C++ storage type of each.
enum class Storage { Float32, Float64, Float16, BFloat16 };

template <class Scalar>
constexpr Storage storage_of() {
  if constexpr (std::is_same<Scalar, float>::value) return Storage::Float32;
  if constexpr (std::is_same<Scalar, double>::value) return Storage::Float64;
  if constexpr (std::is_same<Scalar, Eigen::half>::value) return Storage::Float16;
  return Storage::BFloat16;
}

const char* storage_name(Storage storage);

// The NumPy dtype holding a storage type: bfloat16 travels as its uint16 bit patterns.
py::dtype numpy_dtype(Storage storage);

bool has_storage(const py::array& array, Storage storage);

template <class Scalar>
bool has_dtype(const py::array& array) {
  return has_storage(array, storage_of<Scalar>());
}

template <class Scalar>
const char* dtype_name() {
  return storage_name(storage_of<Scalar>());
}

// `call(Scalar())` with the C++ storage type of `storage`.
template <class Call>
auto dispatch(Storage storage, Call&& call) {
  switch (storage) {
    case Storage::Float64:
      return call(0.0);
    case Storage::Float16:
      return call(Eigen::half());
    case Storage::BFloat16:
      return call(Eigen::bfloat16());
    case Storage::Float32:
      break;
  }
  return call(0.0f);
}

// The element strides of a rank-3 or rank-4 array as a batched view, with rank 3 a batch of one.
// `usable` is false when a stride is not a positive multiple of the itemsize, the last axis is not
// contiguous, or the data is misaligned. Axes of length 1 get stride 0 (never multiplied).
struct Layout {
  bool usable = true;
  Index shape[4] = {1, 1, 1, 1};
  Index stride[4] = {0, 0, 0, 0};
};

// The layout of `array` for elements of `itemsize` bytes aligned to `alignment`.
Layout layout_of(const py::array& array, std::size_t itemsize, std::size_t alignment);

template <class Scalar>
Layout layout_of(const py::array& array) {
  return layout_of(array, sizeof(Scalar), alignof(Scalar));
}

template <class Scalar>
plsh::BatchedHeadsView<Scalar> view_of(Scalar* data, const Layout& layout) {
  return plsh::BatchedHeadsView<Scalar>(
      layout.shape[0],
      plsh::HeadsView<Scalar>{data, layout.shape[1], layout.shape[2], layout.shape[3],
                              layout.stride[1], layout.stride[2]},
      layout.stride[0]);
}

// The element type of a view (const removed).
template <class View>
using ScalarOf = std::remove_const_t<std::remove_reference_t<decltype(*std::declval<View>().data)>>;

// An input array and its view; holds the array (or its contiguous copy) alive.
template <class Scalar>
struct Input {
  py::array array;
  plsh::BatchedHeadsView<const Scalar> view;
};

// `array` has the dtype Scalar and rank 3 or 4 (checked by the caller).
template <class Scalar>
Input<Scalar> input_of(py::array array) {
  Layout layout = layout_of<Scalar>(array);
  if (!layout.usable) {
    array = py::module_::import("numpy").attr("ascontiguousarray")(array);
    layout = layout_of<Scalar>(array);
  }
  const auto* data = static_cast<const Scalar*>(array.data());
  return Input<Scalar>{array, view_of<const Scalar>(data, layout)};
}

// An output array and its view: a new C-contiguous array for None, else `out` checked for type,
// dtype, shape, writability and strides.
template <class Scalar>
struct Output {
  py::array array;
  plsh::BatchedHeadsView<Scalar> view;
};

// The array `out` named `name` checked as above, or a new array of `storage` for None; returns it
// with its layout (usable).
std::pair<py::array, Layout> output_array(const py::object& out, const char* name,
                                          const std::vector<py::ssize_t>& shape, Storage storage,
                                          std::size_t itemsize, std::size_t alignment);

template <class Scalar>
Output<Scalar> output_of(const py::object& out, const char* name,
                         const std::vector<py::ssize_t>& shape) {
  auto [array, layout] =
      output_array(out, name, shape, storage_of<Scalar>(), sizeof(Scalar), alignof(Scalar));
  return Output<Scalar>{array, view_of<Scalar>(static_cast<Scalar*>(array.mutable_data()), layout)};
}

// The arrays of one call: checks that they are ndarrays of rank 3 or 4 (all the rank of the
// first), of one dtype float32, float64, float16, or uint16 when `bfloat16` says they hold
// bfloat16 (TypeError naming the argument), with equal batch sizes.
struct Arrays {
  std::vector<py::array> arrays;
  Storage storage = Storage::Float32;

  Arrays(std::initializer_list<std::pair<const char*, py::object>> named, bool bfloat16 = false);

  template <class Scalar>
  Input<Scalar> input(std::size_t i) const {
    return input_of<Scalar>(arrays[i]);
  }

  // The shape of array i with its last axis replaced by `last`.
  std::vector<py::ssize_t> shape_with_last(std::size_t i, py::ssize_t last) const;
  std::vector<py::ssize_t> shape(std::size_t i) const { return shape_of(arrays[i]); }
};

}  // namespace plsh_python

#endif  // PLSH_PYTHON_ARRAYS_HPP
