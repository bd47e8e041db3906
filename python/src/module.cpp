// plsh._plsh: the Python binding of plsh (pybind11 + NumPy).
//
// Arrays are [tokens, heads, dim] or [batch, tokens, heads, dim], float32, float64, float16 or
// bfloat16, read through their strides when these are positive multiples of the itemsize with a
// contiguous last axis (otherwise through a contiguous copy); outputs are new C-contiguous arrays
// of the inputs' dtype or the `out=` arrays, which must have usable strides. NumPy has no
// bfloat16: a kernel called with `bfloat16=True` takes uint16 arrays holding bfloat16 bit
// patterns and returns such arrays. float16 and bfloat16 compute in float (the kernels' storage
// types, plsh/detail/storage.hpp). Every kernel runs with the GIL released, through the batched
// kernels of plsh/batch.hpp (a rank-3 array is a batch of one). C++ std::invalid_argument becomes
// ValueError with the same message; a wrong dtype is a TypeError and a wrong rank or shape a
// ValueError, both naming the argument.
//
// Tested in python/tests/.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstdint>
#include <limits>
#include <memory>
#include <mutex>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include <plsh/batch.hpp>
#include <plsh/plsh.hpp>

namespace py = pybind11;
using namespace pybind11::literals;
using plsh::Index;

namespace {

// ---------------------------------------------------------------------------------------------
// Arrays
// ---------------------------------------------------------------------------------------------

std::string shape_string(const std::vector<py::ssize_t>& shape) {
  std::ostringstream text;
  text << "(";
  for (std::size_t i = 0; i < shape.size(); ++i) {
    text << (i ? ", " : "") << shape[i];
  }
  text << (shape.size() == 1 ? ",)" : ")");
  return text.str();
}

std::vector<py::ssize_t> shape_of(const py::array& array) {
  return std::vector<py::ssize_t>(array.shape(), array.shape() + array.ndim());
}

std::string dtype_string(const py::array& array) {
  return py::str(static_cast<const py::object&>(array.dtype())).cast<std::string>();
}

py::array as_ndarray(const py::object& object, const char* name) {
  if (!py::isinstance<py::array>(object)) {
    throw py::type_error(std::string(name) + " must be a numpy.ndarray (got " +
                         py::str(py::type::of(object).attr("__name__")).cast<std::string>() + ")");
  }
  return py::reinterpret_borrow<py::array>(object);
}

// The element types of the arrays, and the C++ storage type of each.
enum class Storage { Float32, Float64, Float16, BFloat16 };

template <class Scalar>
constexpr Storage storage_of() {
  if constexpr (std::is_same<Scalar, float>::value) return Storage::Float32;
  if constexpr (std::is_same<Scalar, double>::value) return Storage::Float64;
  if constexpr (std::is_same<Scalar, Eigen::half>::value) return Storage::Float16;
  return Storage::BFloat16;
}

const char* storage_name(Storage storage) {
  switch (storage) {
    case Storage::Float32:
      return "float32";
    case Storage::Float64:
      return "float64";
    case Storage::Float16:
      return "float16";
    case Storage::BFloat16:
      return "bfloat16 (uint16 bit patterns)";
  }
  return "";
}

// The NumPy dtype holding a storage type: bfloat16 travels as its uint16 bit patterns.
py::dtype numpy_dtype(Storage storage) {
  switch (storage) {
    case Storage::Float32:
      return py::dtype::of<float>();
    case Storage::Float64:
      return py::dtype::of<double>();
    case Storage::Float16:
      return py::dtype("float16");
    case Storage::BFloat16:
      return py::dtype::of<std::uint16_t>();
  }
  return py::dtype::of<float>();
}

bool has_storage(const py::array& array, Storage storage) {
  return array.dtype().equal(numpy_dtype(storage));
}

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

template <class Scalar>
Layout layout_of(const py::array& array) {
  Layout layout;
  const auto rank = static_cast<int>(array.ndim());
  const int first = 4 - rank;
  for (int axis = 0; axis < rank; ++axis) {
    const Index size = array.shape(axis);
    const Index bytes = array.strides(axis);
    layout.shape[first + axis] = size;
    if (size <= 1) continue;
    if (bytes <= 0 || bytes % static_cast<Index>(sizeof(Scalar)) != 0) {
      layout.usable = false;
    } else {
      layout.stride[first + axis] = bytes / static_cast<Index>(sizeof(Scalar));
    }
  }
  if (layout.shape[3] > 1 && layout.stride[3] != 1) layout.usable = false;
  if (reinterpret_cast<std::uintptr_t>(array.data()) % alignof(Scalar) != 0) layout.usable = false;
  if (array.size() == 0) {
    // No element is ever read or written: any strides do; packed ones pass every check.
    layout.usable = true;
    layout.stride[3] = 1;
    layout.stride[2] = layout.shape[3];
    layout.stride[1] = layout.shape[2] * layout.stride[2];
    layout.stride[0] = layout.shape[1] * layout.stride[1];
  }
  return layout;
}

template <class Scalar>
plsh::BatchedHeadsView<Scalar> view_of(Scalar* data, const Layout& layout) {
  return plsh::BatchedHeadsView<Scalar>(
      layout.shape[0],
      plsh::HeadsView<Scalar>{data, layout.shape[1], layout.shape[2], layout.shape[3],
                              layout.stride[1], layout.stride[2]},
      layout.stride[0]);
}

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

template <class Scalar>
Output<Scalar> output_of(const py::object& out, const char* name,
                         const std::vector<py::ssize_t>& shape) {
  py::array array;
  if (out.is_none()) {
    array = py::array(numpy_dtype(storage_of<Scalar>()), shape);
  } else {
    array = as_ndarray(out, name);
    if (!has_dtype<Scalar>(array)) {
      throw py::type_error(std::string(name) + " must have dtype " + dtype_name<Scalar>() +
                           " like q (got " + dtype_string(array) + ")");
    }
    if (shape_of(array) != shape) {
      throw py::value_error(std::string(name) + " must have shape " + shape_string(shape) +
                            " (got " + shape_string(shape_of(array)) + ")");
    }
    if (!array.writeable()) throw py::value_error(std::string(name) + " is read-only");
  }
  const Layout layout = layout_of<Scalar>(array);
  if (!layout.usable) {
    throw py::value_error(std::string(name) +
                          " must have strides that are positive multiples of the itemsize and a "
                          "contiguous last axis");
  }
  return Output<Scalar>{array, view_of<Scalar>(static_cast<Scalar*>(array.mutable_data()), layout)};
}

// The arrays of one call: checks that they are ndarrays of rank 3 or 4 (all the rank of the
// first), of one dtype float32, float64, float16, or uint16 when `bfloat16` says they hold
// bfloat16 (TypeError naming the argument), with equal batch sizes.
struct Arrays {
  std::vector<py::array> arrays;
  Storage storage = Storage::Float32;

  Arrays(std::initializer_list<std::pair<const char*, py::object>> named, bool bfloat16 = false) {
    const char* first_name = named.begin()->first;
    for (const auto& [name, object] : named) {
      py::array array = as_ndarray(object, name);
      if (arrays.empty()) {
        storage = first_storage(array, name, bfloat16);
        if (array.ndim() != 3 && array.ndim() != 4) {
          throw py::value_error(std::string(name) +
                                " must have 3 dimensions [tokens, heads, dim] or 4 [batch, "
                                "tokens, heads, dim] (got " +
                                std::to_string(array.ndim()) + ")");
        }
      } else {
        if (!has_storage(array, storage)) {
          throw py::type_error(std::string(name) + " has dtype " + dtype_string(array) + " but " +
                               first_name + " has " + storage_name(storage) +
                               "; the arrays must share one dtype");
        }
        if (array.ndim() != arrays.front().ndim()) {
          throw py::value_error(std::string(name) + " must have " +
                                std::to_string(arrays.front().ndim()) + " dimensions like " +
                                first_name + " (got " + std::to_string(array.ndim()) + ")");
        }
        if (array.ndim() == 4 && array.shape(0) != arrays.front().shape(0)) {
          throw py::value_error(std::string(name) + ".shape[0] (batch, " +
                                std::to_string(array.shape(0)) + ") must equal " + first_name +
                                ".shape[0] (" + std::to_string(arrays.front().shape(0)) + ")");
        }
      }
      arrays.push_back(array);
    }
  }

  template <class Scalar>
  Input<Scalar> input(std::size_t i) const {
    return input_of<Scalar>(arrays[i]);
  }

  // The shape of array i with its last axis replaced by `last`.
  std::vector<py::ssize_t> shape_with_last(std::size_t i, py::ssize_t last) const {
    std::vector<py::ssize_t> shape = shape_of(arrays[i]);
    shape.back() = last;
    return shape;
  }
  std::vector<py::ssize_t> shape(std::size_t i) const { return shape_of(arrays[i]); }

  Index heads() const { return arrays.front().shape(arrays.front().ndim() - 2); }

 private:
  // The storage type of the first array, named `name`.
  static Storage first_storage(const py::array& array, const char* name, bool bfloat16) {
    if (bfloat16) {
      if (has_storage(array, Storage::BFloat16)) return Storage::BFloat16;
      throw py::type_error(std::string(name) + " has dtype " + dtype_string(array) +
                           "; with bfloat16=True the arrays hold bfloat16 bit patterns as uint16");
    }
    for (const Storage storage : {Storage::Float32, Storage::Float64, Storage::Float16}) {
      if (has_storage(array, storage)) return storage;
    }
    const std::string dtype = dtype_string(array);
    if (!py::cast<bool>(array.dtype().attr("isnative"))) {
      throw py::type_error(std::string(name) + " has dtype " + dtype +
                           ", in the other byte order than this machine's; plsh reads native "
                           "byte order (convert with " + name + ".astype(" + name +
                           ".dtype.newbyteorder(\"=\")))");
    }
    throw py::type_error(std::string(name) + " has dtype " + dtype +
                         "; plsh takes float32, float64, float16, or bfloat16 as uint16 bit "
                         "patterns with bfloat16=True" +
                         (dtype == "uint16" ? " (pass bfloat16=True if these are bfloat16)" : ""));
  }
};

// ---------------------------------------------------------------------------------------------
// Integer arguments
// ---------------------------------------------------------------------------------------------

// An integer argument as Int: a Python int or an object with __index__ (a NumPy integer), within
// the range of Int. A float or another type is a TypeError (never truncated), an integer out of
// range a ValueError naming the argument and the range; the functions called check the
// argument's own bounds.
template <class Int>
Int integer(const py::handle& value, const char* name) {
  if (!PyIndex_Check(value.ptr())) {
    throw py::type_error(std::string(name) + " must be an integer (got " +
                         py::str(py::type::of(value).attr("__name__")).cast<std::string>() + ")");
  }
  const auto number = py::reinterpret_steal<py::int_>(PyNumber_Index(value.ptr()));
  if (!number) throw py::error_already_set();
  const py::int_ low(std::numeric_limits<Int>::min());
  const py::int_ high(std::numeric_limits<Int>::max());
  if (number < low || number > high) {
    const auto text = [](const py::int_& value) {
      return py::str(static_cast<const py::object&>(value)).cast<std::string>();
    };
    throw py::value_error(std::string(name) + " must be an integer in [" + text(low) + ", " +
                          text(high) + "] (got " + text(number) + ")");
  }
  return number.cast<Int>();
}

Index index(const py::handle& value, const char* name) { return integer<Index>(value, name); }

std::uint64_t seed_of(const py::handle& value, const char* name = "seed") {
  return integer<std::uint64_t>(value, name);
}

// ---------------------------------------------------------------------------------------------
// Options
// ---------------------------------------------------------------------------------------------

std::vector<double> slopes_or_default(const std::optional<std::vector<double>>& slopes,
                                      Index heads) {
  if (slopes) return *slopes;
  // q.heads < 1 is reported by the kernel.
  return heads >= 1 ? plsh::alibi_slopes(heads) : std::vector<double>{};
}

// AttentionOptions or PlshOptions with the attention options set (the rest default).
template <class Options = plsh::AttentionOptions>
Options options_of(bool causal, double scale, const py::object& query_position,
                   const py::object& key_position) {
  Options options;
  options.causal = causal;
  options.scale = scale;
  options.query_position = index(query_position, "query_position");
  options.key_position = index(key_position, "key_position");
  return options;
}

plsh::Kernel kernel_of(const std::string& kernel) {
  if (kernel == "fused") return plsh::Kernel::Fused;
  if (kernel == "passes") return plsh::Kernel::Passes;
  throw py::value_error("kernel must be \"fused\" or \"passes\" (got \"" + kernel + "\")");
}

plsh::Sampling sampling_of(const std::string& sampling) {
  if (sampling == "independent") return plsh::Sampling::Independent;
  if (sampling == "latin_hypercube") return plsh::Sampling::LatinHypercube;
  throw py::value_error("sampling must be \"independent\" or \"latin_hypercube\" (got \"" +
                        sampling + "\")");
}

// PlshOptions with the attention options and the draws (samples, seed, sampling) set.
plsh::PlshOptions plsh_options_of(bool causal, double scale, const py::object& query_position,
                                  const py::object& key_position, const py::object& samples,
                                  const py::object& seed, const std::string& sampling) {
  auto options = options_of<plsh::PlshOptions>(causal, scale, query_position, key_position);
  options.samples = index(samples, "samples");
  options.seed = seed_of(seed);
  options.sampling = sampling_of(sampling);
  return options;
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

// A forward kernel `run(q, k, v, out)` on the views of q, k, v and a new or given output
// [..., n_q, H, d_v]; returns the output array.
template <class Run>
py::array forward(const py::object& q, const py::object& k, const py::object& v,
                  const py::object& out, bool bfloat16, Run&& run) {
  const Arrays arrays({{"q", q}, {"k", k}, {"v", v}}, bfloat16);
  const auto call = [&](auto zero) {
    using Scalar = decltype(zero);
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Input<Scalar> k_in = arrays.input<Scalar>(1);
    const Input<Scalar> v_in = arrays.input<Scalar>(2);
    const Output<Scalar> result =
        output_of<Scalar>(out, "out", arrays.shape_with_last(0, arrays.shape(2).back()));
    {
      py::gil_scoped_release release;
      run(q_in.view, k_in.view, v_in.view, result.view);
    }
    return result.array;
  };
  return dispatch(arrays.storage, call);
}

// A backward kernel `run(q, k, v, out, dout, dq, dk, dv)`; returns (dq, dk, dv).
template <class Run>
py::tuple backward(const py::object& q, const py::object& k, const py::object& v,
                   const py::object& out, const py::object& dout, const py::object& dq,
                   const py::object& dk, const py::object& dv, bool bfloat16, Run&& run) {
  const Arrays arrays({{"q", q}, {"k", k}, {"v", v}, {"out", out}, {"dout", dout}}, bfloat16);
  const auto call = [&](auto zero) {
    using Scalar = decltype(zero);
    const Input<Scalar> inputs[] = {arrays.input<Scalar>(0), arrays.input<Scalar>(1),
                                    arrays.input<Scalar>(2), arrays.input<Scalar>(3),
                                    arrays.input<Scalar>(4)};
    const Output<Scalar> dq_out = output_of<Scalar>(dq, "dq", arrays.shape(0));
    const Output<Scalar> dk_out = output_of<Scalar>(dk, "dk", arrays.shape(1));
    const Output<Scalar> dv_out = output_of<Scalar>(dv, "dv", arrays.shape(2));
    {
      py::gil_scoped_release release;
      run(inputs[0].view, inputs[1].view, inputs[2].view, inputs[3].view, inputs[4].view,
          dq_out.view, dk_out.view, dv_out.view);
    }
    return py::make_tuple(dq_out.array, dk_out.array, dv_out.array);
  };
  return dispatch(arrays.storage, call);
}

template <class View>
using ScalarOf = std::remove_const_t<std::remove_reference_t<decltype(*std::declval<View>().data)>>;

py::array exact_alibi_attention(const py::object& q, const py::object& k, const py::object& v,
                                const std::optional<std::vector<double>>& slopes, bool causal,
                                double scale, const py::object& query_position,
                                const py::object& key_position, const py::object& out,
                                bool bfloat16) {
  const auto options = options_of(causal, scale, query_position, key_position);
  return forward(q, k, v, out, bfloat16,
                 [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                   using Scalar = ScalarOf<decltype(ov)>;
                   plsh::exact_alibi_attention<Scalar>(
                       qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), options);
                 });
}

py::array windowed_alibi_attention(const py::object& q, const py::object& k, const py::object& v,
                                   const std::optional<std::vector<double>>& slopes,
                                   double tolerance, bool causal, double scale,
                                   const py::object& query_position,
                                   const py::object& key_position, const py::object& out,
                                   bool bfloat16) {
  const auto options = options_of(causal, scale, query_position, key_position);
  return forward(q, k, v, out, bfloat16,
                 [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                   using Scalar = ScalarOf<decltype(ov)>;
                   plsh::windowed_alibi_attention<Scalar>(
                       qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), tolerance, options);
                 });
}

py::array plsh_attention(const py::object& q, const py::object& k, const py::object& v,
                         const std::optional<std::vector<double>>& slopes, bool causal,
                         double scale, const py::object& query_position,
                         const py::object& key_position, const py::object& samples,
                         const py::object& seed, const std::string& sampling,
                         const std::string& kernel, const py::object& out, bool bfloat16) {
  auto options =
      plsh_options_of(causal, scale, query_position, key_position, samples, seed, sampling);
  options.kernel = kernel_of(kernel);
  return forward(
      q, k, v, out, bfloat16, [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::plsh_attention<Scalar>(qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), options);
      });
}

py::array fixed_block_attention(const py::object& q, const py::object& k, const py::object& v,
                                const py::object& block_size, bool causal, double scale,
                                const py::object& query_position, const py::object& key_position,
                                const py::object& out, bool bfloat16) {
  const auto options = options_of(causal, scale, query_position, key_position);
  const Index size = index(block_size, "block_size");
  return forward(q, k, v, out, bfloat16,
                 [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                   using Scalar = ScalarOf<decltype(ov)>;
                   plsh::fixed_block_attention<Scalar>(qv, kv, vv, ov, size, options);
                 });
}

py::tuple exact_alibi_attention_backward(
    const py::object& q, const py::object& k, const py::object& v, const py::object& out,
    const py::object& dout, const std::optional<std::vector<double>>& slopes, bool causal,
    double scale, const py::object& query_position, const py::object& key_position,
    const py::object& dq, const py::object& dk, const py::object& dv, bool bfloat16) {
  const auto options = options_of(causal, scale, query_position, key_position);
  return backward(q, k, v, out, dout, dq, dk, dv, bfloat16,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::exact_alibi_attention_backward<Scalar>(
                        qv, kv, vv, ov, dov, dqv, dkv, dvv, slopes_or_default(slopes, qv.heads),
                        options);
                  });
}

py::tuple plsh_attention_backward(const py::object& q, const py::object& k, const py::object& v,
                                  const py::object& out, const py::object& dout,
                                  const std::optional<std::vector<double>>& slopes, bool causal,
                                  double scale, const py::object& query_position,
                                  const py::object& key_position, const py::object& samples,
                                  const py::object& seed, const std::string& sampling,
                                  const py::object& dq, const py::object& dk, const py::object& dv,
                                  bool bfloat16) {
  const auto options =
      plsh_options_of(causal, scale, query_position, key_position, samples, seed, sampling);
  return backward(q, k, v, out, dout, dq, dk, dv, bfloat16,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::plsh_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                                          slopes_or_default(slopes, qv.heads),
                                                          options);
                  });
}

py::tuple fixed_block_attention_backward(const py::object& q, const py::object& k,
                                         const py::object& v, const py::object& out,
                                         const py::object& dout, const py::object& block_size,
                                         bool causal, double scale,
                                         const py::object& query_position,
                                         const py::object& key_position, const py::object& dq,
                                         const py::object& dk, const py::object& dv,
                                         bool bfloat16) {
  const auto options = options_of(causal, scale, query_position, key_position);
  const Index size = index(block_size, "block_size");
  return backward(q, k, v, out, dout, dq, dk, dv, bfloat16,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::fixed_block_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                                                 size, options);
                  });
}

// ---------------------------------------------------------------------------------------------
// KvCache
// ---------------------------------------------------------------------------------------------

// The Python KvCache: a plsh::KvCache of float, double, Eigen::half or Eigen::bfloat16 behind one
// interface. A mutex keeps calls from several Python threads (the GIL is released inside) from
// racing on the cache.
class KvCacheBase {
 public:
  virtual ~KvCacheBase() = default;
  virtual void append(const py::object& k, const py::object& v) = 0;
  virtual py::array attend(const py::object& q, const py::object& out) = 0;
  virtual py::array decode(const py::object& q, const py::object& k, const py::object& v,
                           const py::object& out) = 0;
  virtual Index position() const = 0;
  virtual Index resident() const = 0;
  virtual Index oldest_position() const = 0;
  virtual std::size_t bytes() const = 0;
  virtual py::dtype dtype() const = 0;
};

template <class Scalar>
class KvCacheOf : public KvCacheBase {
 public:
  KvCacheOf(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
            const plsh::PlshOptions& options)
      : heads_(heads),
        value_dim_(value_dim),
        cache_(heads, kv_heads, dim, value_dim, std::move(slopes), options) {}

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
    const Output<Scalar> result = output_for(arrays, out);
    {
      py::gil_scoped_release release;
      const std::lock_guard<std::mutex> lock(mutex_);
      cache_.attend(q_in.view[0], result.view[0]);
    }
    return result.array;
  }

  py::array decode(const py::object& q, const py::object& k, const py::object& v,
                   const py::object& out) override {
    const Arrays arrays = arrays_of({{"q", q}, {"k", k}, {"v", v}});
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Input<Scalar> k_in = arrays.input<Scalar>(1);
    const Input<Scalar> v_in = arrays.input<Scalar>(2);
    const Output<Scalar> result = output_for(arrays, out);
    {
      py::gil_scoped_release release;
      const std::lock_guard<std::mutex> lock(mutex_);
      cache_.decode(q_in.view[0], k_in.view[0], v_in.view[0], result.view[0]);
    }
    return result.array;
  }

  Index position() const override {
    return locked([&] { return cache_.position(); });
  }
  Index resident() const override {
    return locked([&] { return cache_.resident(); });
  }
  Index oldest_position() const override {
    return locked([&] { return cache_.oldest_position(); });
  }
  std::size_t bytes() const override {
    return locked([&] { return cache_.bytes(); });
  }
  py::dtype dtype() const override { return numpy_dtype(storage_of<Scalar>()); }

 private:
  template <class F>
  auto locked(F&& f) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return f();
  }

  // The arrays of a call: ndarrays of the cache's dtype (TypeError naming the first that is not)
  // and of 3 dimensions.
  static Arrays arrays_of(std::initializer_list<std::pair<const char*, py::object>> named) {
    const char* name = named.begin()->first;
    const py::array first = as_ndarray(named.begin()->second, name);
    if (!has_dtype<Scalar>(first)) {
      throw py::type_error(std::string(name) + " must have the cache's dtype " +
                           dtype_name<Scalar>() + " (got " + dtype_string(first) + ")");
    }
    Arrays arrays(named, storage_of<Scalar>() == Storage::BFloat16);
    if (arrays.arrays.front().ndim() != 3) {
      throw py::value_error("KvCache takes arrays of 3 dimensions [tokens, heads, dim] (got " +
                            std::to_string(arrays.arrays.front().ndim()) + ")");
    }
    return arrays;
  }

  // The output [q tokens, heads, value_dim]: `out`, checked, or a new array.
  Output<Scalar> output_for(const Arrays& arrays, const py::object& out) const {
    return output_of<Scalar>(out, "out",
                             {arrays.shape(0)[0], static_cast<py::ssize_t>(heads_),
                              static_cast<py::ssize_t>(value_dim_)});
  }

  Index heads_;
  Index value_dim_;
  plsh::KvCache<Scalar> cache_;
  mutable std::mutex mutex_;
};

std::unique_ptr<KvCacheBase> make_kv_cache(const py::object& heads_arg,
                                           const py::object& kv_heads_arg,
                                           const py::object& dim_arg,
                                           const py::object& value_dim_arg,
                                           const std::optional<std::vector<double>>& slopes,
                                           const py::object& samples, const py::object& seed,
                                           const std::string& sampling, double scale,
                                           const py::object& key_position,
                                           const std::string& kernel, const py::object& dtype) {
  const Index heads = index(heads_arg, "heads");
  const Index kv_heads = index(kv_heads_arg, "kv_heads");
  const Index dim = index(dim_arg, "dim");
  const Index value_dim = index(value_dim_arg, "value_dim");
  auto options =
      plsh_options_of(true, scale, py::int_(0), key_position, samples, seed, sampling);
  options.kernel = kernel_of(kernel);
  const std::vector<double> slope_list = slopes_or_default(slopes, heads);
  const auto make = [&](auto scalar) -> std::unique_ptr<KvCacheBase> {
    using Scalar = decltype(scalar);
    return std::make_unique<KvCacheOf<Scalar>>(heads, kv_heads, dim, value_dim, slope_list,
                                               options);
  };
  if (py::isinstance<py::str>(dtype) && dtype.cast<std::string>() == "bfloat16") {
    return make(Eigen::bfloat16());
  }
  const py::dtype type = py::dtype::from_args(dtype);
  for (const Storage storage : {Storage::Float32, Storage::Float64, Storage::Float16}) {
    if (type.equal(numpy_dtype(storage))) {
      return dispatch(storage, [&](auto scalar) { return make(scalar); });
    }
  }
  throw py::type_error("dtype must be float32, float64, float16 or \"bfloat16\" (got " +
                       py::str(static_cast<const py::object&>(type)).cast<std::string>() + ")");
}

}  // namespace

PYBIND11_MODULE(_plsh, m) {
  m.doc() =
      "ALiBi attention through Positional LSH: the kernels of the plsh C++ library on NumPy "
      "arrays [tokens, heads, dim] or [batch, tokens, heads, dim]: float32, float64, float16 "
      "(computed in float32), or bfloat16 bit patterns as uint16 with bfloat16=True (computed "
      "in float32, returned as uint16 bfloat16).";

  m.def("alibi_slopes", &plsh::alibi_slopes, "num_heads"_a,
        "The ALiBi slopes of Press et al. for `num_heads` heads (geometric, 2^(-8/num_heads) "
        "first).");

  py::class_<plsh::Grid>(m, "Grid",
                         "A regular grid on the line: bins [shift + k pitch, shift + "
                         "(k + 1) pitch); an infinite pitch is one bin.")
      .def(py::init([](double pitch, double shift) {
             return plsh::Grid{pitch, shift};
           }),
           "pitch"_a, "shift"_a)
      .def_readwrite("pitch", &plsh::Grid::pitch)
      .def_readwrite("shift", &plsh::Grid::shift)
      .def("__eq__", [](const plsh::Grid& a,
                        const plsh::Grid& b) { return a.pitch == b.pitch && a.shift == b.shift; })
      .def("__repr__", [](const plsh::Grid& grid) {
        return "Grid(pitch=" + py::repr(py::float_(grid.pitch)).cast<std::string>() +
               ", shift=" + py::repr(py::float_(grid.shift)).cast<std::string>() + ")";
      });

  py::class_<plsh::RandomBinning>(
      m, "RandomBinning",
      "Random grids whose bins co-locate two positions x, y with probability exp(-slope |x - y|); "
      "draw t is a pure function of (slope, seed, t).")
      .def(py::init([](double slope, const py::object& seed) {
             return plsh::RandomBinning(slope, seed_of(seed));
           }),
           "slope"_a, "seed"_a = 0)
      .def(
          "__call__",
          [](const plsh::RandomBinning& binning, const py::object& draw) {
            return binning(seed_of(draw, "index"));
          },
          "index"_a, "Draw number `index`.")
      .def(
          "draw",
          [](const plsh::RandomBinning& binning, const py::object& count, const py::object& first) {
            return binning.draw(index(count, "count"), seed_of(first, "first"));
          },
          "count"_a, "first"_a = 0, "Draws first, first + 1, ..., first + count - 1.")
      .def_property_readonly("slope", &plsh::RandomBinning::slope)
      .def_property_readonly("seed", &plsh::RandomBinning::seed);

  m.def(
      "head_seed",
      [](const py::object& seed, const py::object& head) {
        return plsh::head_seed(seed_of(seed), index(head, "head"));
      },
      "seed"_a, "head"_a,
        "The seed of head `head` in a kernel run with `seed`: head h, draw t uses "
        "RandomBinning(slopes[h], head_seed(seed, h))(t).");
  m.def(
      "draw_head_grids",
      [](const std::vector<double>& slopes, const py::object& samples, const py::object& seed) {
        return plsh::draw_head_grids(slopes, index(samples, "samples"), seed_of(seed));
      },
      "slopes"_a, "samples"_a, "seed"_a,
        "The grids the Positional LSH kernels use with independent draws: [head][draw]; "
        "grids[h][t] is RandomBinning(slopes[h], head_seed(seed, h))(t).");
  m.def(
      "kernel_grids",
      [](const std::vector<double>& slopes, const py::object& samples, const py::object& seed,
         const std::string& sampling) {
        // kernel_grids reads only samples, seed and sampling.
        return plsh::kernel_grids(slopes, plsh_options_of(true, 0.0, py::int_(0), py::int_(0),
                                                          samples, seed, sampling));
      },
      "slopes"_a, "samples"_a, "seed"_a = 0, py::kw_only(), "sampling"_a = "independent",
      "The grids plsh_attention, plsh_attention_backward and KvCache use with these samples, "
      "seed and sampling: [head][draw]. sampling \"independent\": draw_head_grids(slopes, "
      "samples, seed); \"latin_hypercube\": the draws of head h jointly, each of the three "
      "uniforms of a draw in a different stratum [k/samples, (k+1)/samples) (seed "
      "head_seed(seed, h)).");

  py::class_<plsh::MaskError>(m, "MaskError", "Norms of the mean mask minus the Laplacian kernel.")
      .def_readonly("spectral", &plsh::MaskError::spectral)
      .def_readonly("max", &plsh::MaskError::max)
      .def("__repr__", [](const plsh::MaskError& error) {
        return "MaskError(spectral=" + py::repr(py::float_(error.spectral)).cast<std::string>() +
               ", max=" + py::repr(py::float_(error.max)).cast<std::string>() + ")";
      });
  m.def(
      "mask_error",
      [](const py::object& n, double slope, const std::vector<plsh::Grid>& grids) {
        const Index size = index(n, "n");
        py::gil_scoped_release release;
        return plsh::mask_error(size, slope, grids);
      },
      "n"_a, "slope"_a, "grids"_a,
      "Spectral and max-abs norms of mean_mask(n, grids) - laplacian_kernel(n, slope) (dense, "
      "O(n^3)).");

  const auto none = py::none();
  m.def("exact_alibi_attention", &exact_alibi_attention, "q"_a, "k"_a, "v"_a, "slopes"_a = none,
        py::kw_only(), "causal"_a = true, "scale"_a = 0.0, "query_position"_a = 0,
        "key_position"_a = 0, "out"_a = none, "bfloat16"_a = false,
        "Exact ALiBi attention. q [.., n_q, H, d], k [.., n_k, H_kv, d], v [.., n_k, H_kv, d_v] -> "
        "out [.., n_q, H, d_v]; slopes=None means alibi_slopes(H); scale 0 means 1/sqrt(d).");
  m.def("windowed_alibi_attention", &windowed_alibi_attention, "q"_a, "k"_a, "v"_a,
        "slopes"_a = none, "tolerance"_a = 1e-6, py::kw_only(), "causal"_a = true, "scale"_a = 0.0,
        "query_position"_a = 0, "key_position"_a = 0, "out"_a = none, "bfloat16"_a = false,
        "ALiBi attention over the keys whose factor exp(-m |i - j|) is at least `tolerance`.");
  m.def("plsh_attention", &plsh_attention, "q"_a, "k"_a, "v"_a, "slopes"_a = none, py::kw_only(),
        "causal"_a = true, "scale"_a = 0.0, "query_position"_a = 0, "key_position"_a = 0,
        "samples"_a = 20, "seed"_a = 0, "sampling"_a = "independent", "kernel"_a = "fused",
        "out"_a = none, "bfloat16"_a = false,
        "ALiBi attention through Positional LSH: `samples` random block partitions per head, "
        "the grids kernel_grids(slopes, samples, seed, sampling=sampling): sampling "
        "\"independent\" (head h uses RandomBinning(slopes[h], head_seed(seed, h))) or "
        "\"latin_hypercube\" (the draws of a head stratified jointly; lower error at equal "
        "samples); kernel \"fused\" or \"passes\". Every batch element uses the same draws.");
  m.def("fixed_block_attention", &fixed_block_attention, "q"_a, "k"_a, "v"_a, "block_size"_a,
        py::kw_only(), "causal"_a = true, "scale"_a = 0.0, "query_position"_a = 0,
        "key_position"_a = 0, "out"_a = none, "bfloat16"_a = false,
        "Attention within fixed blocks of `block_size` absolute positions.");
  m.def("exact_alibi_attention_backward", &exact_alibi_attention_backward, "q"_a, "k"_a, "v"_a,
        "out"_a, "dout"_a, "slopes"_a = none, py::kw_only(), "causal"_a = true, "scale"_a = 0.0,
        "query_position"_a = 0, "key_position"_a = 0, "dq"_a = none, "dk"_a = none, "dv"_a = none,
        "bfloat16"_a = false,
        "Gradients (dq, dk, dv) of exact ALiBi attention given its output `out` and the gradient "
        "`dout` of a loss with respect to it.");
  m.def("plsh_attention_backward", &plsh_attention_backward, "q"_a, "k"_a, "v"_a, "out"_a, "dout"_a,
        "slopes"_a = none, py::kw_only(), "causal"_a = true, "scale"_a = 0.0,
        "query_position"_a = 0, "key_position"_a = 0, "samples"_a = 20, "seed"_a = 0,
        "sampling"_a = "independent", "dq"_a = none, "dk"_a = none, "dv"_a = none,
        "bfloat16"_a = false,
        "Gradients (dq, dk, dv) of plsh_attention with the same slopes, samples, seed and "
        "sampling.");

  m.def("fixed_block_attention_backward", &fixed_block_attention_backward, "q"_a, "k"_a, "v"_a,
        "out"_a, "dout"_a, "block_size"_a, py::kw_only(), "causal"_a = true, "scale"_a = 0.0,
        "query_position"_a = 0, "key_position"_a = 0, "dq"_a = none, "dk"_a = none, "dv"_a = none,
        "bfloat16"_a = false,
        "Gradients (dq, dk, dv) of fixed_block_attention with the same block size.");

  py::class_<KvCacheBase>(
      m, "KvCache",
      "Key/value cache for incremental causal Positional LSH decoding that forgets the keys no "
      "later query can reach. append(k, v) with k [n, kv_heads, dim], v [n, kv_heads, "
      "value_dim]; attend(q) for the queries at the newest positions, q [n, heads, dim] -> [n, "
      "heads, value_dim]; decode(q, k, v) both in one step. samples, seed and sampling choose "
      "the draws as in plsh_attention. dtype float32, float64, float16, or \"bfloat16\" "
      "(arrays of uint16 bit patterns): the 16-bit types store the cache in half the bytes and "
      "compute in float32.")
      .def(py::init(&make_kv_cache), "heads"_a, "kv_heads"_a, "dim"_a, "value_dim"_a,
           "slopes"_a = none, py::kw_only(), "samples"_a = 20, "seed"_a = 0,
           "sampling"_a = "independent", "scale"_a = 0.0, "key_position"_a = 0,
           "kernel"_a = "fused", "dtype"_a = py::module_::import("numpy").attr("float32"))
      .def("append", &KvCacheBase::append, "k"_a, "v"_a,
           "Appends the keys and values of positions position .. position + n - 1 (k [n, "
           "kv_heads, dim], v [n, kv_heads, value_dim]), after forgetting the keys no query at "
           "`position` or later can reach.")
      .def("attend", &KvCacheBase::attend, "q"_a, "out"_a = none,
           "Outputs [n, heads, value_dim] of the queries q [n, heads, dim] at positions "
           "position - n .. position - 1; n at most the tokens of the last append. Equal (to "
           "rounding) to those rows of plsh_attention over the whole sequence.")
      .def("decode", &KvCacheBase::decode, "q"_a, "k"_a, "v"_a, "out"_a = none,
           "One decoding step: append(k, v) then attend(q) for the same n tokens, with the same "
           "result; every argument is checked before the cache changes, so a call that raises "
           "leaves it as it was.")
      .def_property_readonly("bytes", &KvCacheBase::bytes,
                             "Bytes of the key and value buffers (resident rows and room for "
                             "later appends); half as many for float16 and bfloat16 as for "
                             "float32.")
      .def_property_readonly("position", &KvCacheBase::position)
      .def_property_readonly("resident", &KvCacheBase::resident)
      .def_property_readonly("oldest_position", &KvCacheBase::oldest_position)
      .def_property_readonly("dtype", &KvCacheBase::dtype,
                             "The NumPy dtype of the cache's arrays (uint16 for bfloat16).");
}
