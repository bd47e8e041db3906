// NumPy arrays as plsh views: the dtype and rank checks of the arguments and the batched views
// [batch, tokens, heads, dim] the kernels of plsh/batch.hpp read and write.
//
// Arrays are [tokens, heads, dim] (a batch of one) or [batch, tokens, heads, dim] (layout "bthd")
// or with the heads and tokens axes swapped (layout "bhtd", read as a transposed view), of float32,
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
#include <optional>
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

// The storage a `dtype` argument names: the string "bfloat16" (arrays of uint16 bit patterns) or a
// NumPy float dtype (float32, float64, float16); TypeError for anything else.
Storage storage_of_dtype(const py::object& dtype);

// The storage the arguments dtype (None: the arrays' own) and the deprecated bfloat16=True declare.
std::optional<Storage> declared_storage(const py::object& dtype, bool bfloat16);

// The order of the axes of a call's arrays: "bthd" [batch, tokens, heads, dim] (FlashAttention's)
// or "bhtd" [batch, heads, tokens, dim] (PyTorch SDPA's); rank 3 drops the batch axis.
enum class AxisOrder { TokensHeads, HeadsTokens };

// "bthd" or "bhtd"; ValueError for another name.
AxisOrder axis_order_of(const std::string& layout);

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
// first), of one dtype float32, float64, float16, or uint16 holding bfloat16 (TypeError naming the
// argument; `declared` is the dtype the call declares, if any), with equal batch sizes. In layout
// "bhtd" the arrays are kept as views with the heads and tokens axes swapped, so that every array
// here is [batch, tokens, heads, dim] (or [tokens, heads, dim]).
struct Arrays {
  std::vector<py::array> arrays;
  std::vector<const char*> names;
  Storage storage = Storage::Float32;
  AxisOrder order = AxisOrder::TokensHeads;

  Arrays(std::initializer_list<std::pair<const char*, py::object>> named,
         std::optional<Storage> declared = std::nullopt, AxisOrder order = AxisOrder::TokensHeads);

  template <class Scalar>
  Input<Scalar> input(std::size_t i) const {
    return input_of<Scalar>(arrays[i]);
  }

  // The shape of array i ([.., tokens, heads, dim]) with its last axis replaced by `last`.
  std::vector<py::ssize_t> shape_with_last(std::size_t i, py::ssize_t last) const;
  std::vector<py::ssize_t> shape(std::size_t i) const { return shape_of(arrays[i]); }

  // The output `out` named `name` of shape `shape` ([.., tokens, heads, dim]), checked (or new)
  // in the call's layout; the array returned is in that layout, the view is [.., tokens, heads,
  // dim].
  template <class Scalar>
  Output<Scalar> output(const py::object& out, const char* name,
                        const std::vector<py::ssize_t>& shape) const {
    auto [array, layout] = output_array(out, name, in_layout(shape), storage_of<Scalar>(),
                                        sizeof(Scalar), alignof(Scalar));
    if (order == AxisOrder::HeadsTokens) {
      layout = layout_of<Scalar>(swapped(array));
    }
    return Output<Scalar>{array,
                          view_of<Scalar>(static_cast<Scalar*>(array.mutable_data()), layout)};
  }

  // The attention checks that name axes: q [.., n_q, H, d], k [.., n_k, H_kv, d], v [.., n_k,
  // H_kv, d_v] (arrays 0, 1, 2) with H a multiple of H_kv, and `slope_count` (if given) equal to
  // H; for a backward call also out and dout (arrays 3, 4) of q's shape with v's last axis. A
  // ValueError names the arrays, the axes and the layout.
  void check_attention(std::optional<std::size_t> slope_count) const;

  // `shape` ([.., tokens, heads, dim]) in the call's layout.
  std::vector<py::ssize_t> in_layout(std::vector<py::ssize_t> shape) const;
  // `array` with its heads and tokens axes swapped (a view).
  static py::array swapped(const py::array& array);
  // "axis 2 (heads) of layout "bthd" [batch, tokens, heads, dim]" for array i's axis `axis`
  // counted from the end (-1 dim, -2 heads, -3 tokens in [.., tokens, heads, dim]).
  std::string axis_text(std::size_t i, int axis) const;
};

// The arrays of a call of the decoding cache named `cache` (KvCache, AlibiKvCache): ndarrays of
// the cache's dtype Scalar (TypeError naming the first that is not) and of 3 dimensions [tokens,
// heads, dim] (ValueError).
template <class Scalar>
Arrays cache_arrays(const char* cache,
                    std::initializer_list<std::pair<const char*, py::object>> named) {
  const char* name = named.begin()->first;
  const py::array first = as_ndarray(named.begin()->second, name);
  if (!has_dtype<Scalar>(first)) {
    throw py::type_error(std::string(name) + " must have the cache's dtype " +
                         dtype_name<Scalar>() + " (got " + dtype_string(first) + ")");
  }
  Arrays arrays(named, storage_of<Scalar>());
  if (arrays.arrays.front().ndim() != 3) {
    throw py::value_error(std::string(cache) +
                          " takes arrays of 3 dimensions [tokens, heads, dim] (got " +
                          std::to_string(arrays.arrays.front().ndim()) + ")");
  }
  return arrays;
}

// The output [q tokens, heads, value_dim] of a decoding cache's call whose first array is q:
// `out`, checked, or a new array.
template <class Scalar>
Output<Scalar> cache_output(const Arrays& arrays, const py::object& out, py::ssize_t heads,
                            py::ssize_t value_dim) {
  return output_of<Scalar>(out, "out", {arrays.shape(0)[0], heads, value_dim});
}

}  // namespace plsh_python

#endif  // PLSH_PYTHON_ARRAYS_HPP
