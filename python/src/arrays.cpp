// NumPy arrays as plsh views (arrays.hpp): the checks and layouts that do not depend on the
// element type.

#include "arrays.hpp"

#include <sstream>

namespace plsh_python {

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

Layout layout_of(const py::array& array, std::size_t itemsize, std::size_t alignment) {
  Layout layout;
  const auto rank = static_cast<int>(array.ndim());
  const int first = 4 - rank;
  const auto item = static_cast<Index>(itemsize);
  for (int axis = 0; axis < rank; ++axis) {
    const Index size = array.shape(axis);
    const Index bytes = array.strides(axis);
    layout.shape[first + axis] = size;
    if (size <= 1) continue;
    if (bytes <= 0 || bytes % item != 0) {
      layout.usable = false;
    } else {
      layout.stride[first + axis] = bytes / item;
    }
  }
  if (layout.shape[3] > 1 && layout.stride[3] != 1) layout.usable = false;
  if (reinterpret_cast<std::uintptr_t>(array.data()) % alignment != 0) layout.usable = false;
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

std::pair<py::array, Layout> output_array(const py::object& out, const char* name,
                                          const std::vector<py::ssize_t>& shape, Storage storage,
                                          std::size_t itemsize, std::size_t alignment) {
  py::array array;
  if (out.is_none()) {
    array = py::array(numpy_dtype(storage), shape);
  } else {
    array = as_ndarray(out, name);
    if (!has_storage(array, storage)) {
      throw py::type_error(std::string(name) + " must have dtype " + storage_name(storage) +
                           " like q (got " + dtype_string(array) + ")");
    }
    if (shape_of(array) != shape) {
      throw py::value_error(std::string(name) + " must have shape " + shape_string(shape) +
                            " (got " + shape_string(shape_of(array)) + ")");
    }
    if (!array.writeable()) throw py::value_error(std::string(name) + " is read-only");
  }
  const Layout layout = layout_of(array, itemsize, alignment);
  if (!layout.usable) {
    throw py::value_error(std::string(name) +
                          " must have strides that are positive multiples of the itemsize and a "
                          "contiguous last axis");
  }
  return {array, layout};
}

namespace {

// The storage type of the first array of a call, named `name`.
Storage first_storage(const py::array& array, const char* name, bool bfloat16) {
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
                         "byte order (convert with " +
                         name + ".astype(" + name + ".dtype.newbyteorder(\"=\")))");
  }
  throw py::type_error(std::string(name) + " has dtype " + dtype +
                       "; plsh takes float32, float64, float16, or bfloat16 as uint16 bit "
                       "patterns with bfloat16=True" +
                       (dtype == "uint16" ? " (pass bfloat16=True if these are bfloat16)" : ""));
}

}  // namespace

Arrays::Arrays(std::initializer_list<std::pair<const char*, py::object>> named, bool bfloat16) {
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

std::vector<py::ssize_t> Arrays::shape_with_last(std::size_t i, py::ssize_t last) const {
  std::vector<py::ssize_t> shape = shape_of(arrays[i]);
  shape.back() = last;
  return shape;
}

}  // namespace plsh_python
