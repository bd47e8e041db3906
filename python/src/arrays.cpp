// NumPy arrays as plsh views (arrays.hpp): the checks and layouts that do not depend on the
// element type.

#include "arrays.hpp"

#include <sstream>
#include <utility>

#if defined(__linux__)
#include <sys/mman.h>

#include <fstream>
#include <iterator>
#endif

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

Storage storage_of_dtype(const py::object& dtype) {
  if (py::isinstance<py::str>(dtype) && dtype.cast<std::string>() == "bfloat16") {
    return Storage::BFloat16;
  }
  std::string name = py::repr(dtype).cast<std::string>();
  try {
    const py::dtype type = py::dtype::from_args(dtype);
    for (const Storage storage : {Storage::Float32, Storage::Float64, Storage::Float16}) {
      if (type.equal(numpy_dtype(storage))) return storage;
    }
    name = py::str(static_cast<const py::object&>(type)).cast<std::string>();
  } catch (const py::error_already_set&) {
    // Not a dtype at all: named by its repr.
  }
  throw py::type_error(
      "dtype must be numpy.float32, numpy.float64, numpy.float16 or \"bfloat16\" "
      "(got " +
      name + ")");
}

std::optional<Storage> declared_storage(const py::object& dtype, bool bfloat16) {
  if (bfloat16) {
    if (PyErr_WarnEx(PyExc_DeprecationWarning,
                     "bfloat16=True is deprecated; pass dtype=\"bfloat16\"", 1) != 0) {
      throw py::error_already_set();
    }
    if (!dtype.is_none() && storage_of_dtype(dtype) != Storage::BFloat16) {
      throw py::value_error("bfloat16=True contradicts dtype=" +
                            py::repr(dtype).cast<std::string>());
    }
    return Storage::BFloat16;
  }
  if (dtype.is_none()) return std::nullopt;
  return storage_of_dtype(dtype);
}

AxisOrder axis_order_of(const std::string& layout) {
  if (layout == "bthd") return AxisOrder::TokensHeads;
  if (layout == "bhtd") return AxisOrder::HeadsTokens;
  throw py::value_error(
      "layout must be \"bthd\" ([batch, tokens, heads, dim], FlashAttention's) "
      "or \"bhtd\" ([batch, heads, tokens, dim], PyTorch SDPA's) (got \"" +
      layout + "\")");
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

namespace {

#if defined(__linux__)
// The size of a huge page of x86-64 and of most aarch64 kernels: the mappings of new_array are
// aligned to it, so that every whole huge page of the array can be one.
constexpr std::size_t kHugePageBytes = std::size_t{2} << 20;

// New arrays of at least this size get a mapping of their own (new_array).
constexpr std::size_t kMappedArrayBytes = std::size_t{4} << 20;

// An anonymous mapping of new_array: its start and length, which munmap takes back.
struct Mapping {
  void* start;
  std::size_t bytes;
};

// Whether the kernel gives transparent huge pages to a mapping advised MADV_HUGEPAGE (its setting
// is "always" or "madvise"), read once.
bool huge_pages_available() {
  static const bool available = [] {
    std::ifstream file("/sys/kernel/mm/transparent_hugepage/enabled");
    const std::string setting((std::istreambuf_iterator<char>(file)),
                              std::istreambuf_iterator<char>());
    return setting.find("[always]") != std::string::npos ||
           setting.find("[madvise]") != std::string::npos;
  }();
  return available;
}

// `bytes` rounded up to whole huge pages, mapped from a huge-page boundary and advised
// MADV_HUGEPAGE; null when the system refuses the mapping.
Mapping* map_huge_pages(std::size_t bytes) {
  const std::size_t length = (bytes + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  void* wide = mmap(nullptr, length + kHugePageBytes, PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (wide == MAP_FAILED) return nullptr;
  // Keep the aligned `length` bytes inside, unmap the rest on both sides.
  const auto base = reinterpret_cast<std::uintptr_t>(wide);
  const std::uintptr_t start = (base + kHugePageBytes - 1) / kHugePageBytes * kHugePageBytes;
  if (start > base) munmap(wide, start - base);
  const std::uintptr_t end = start + length;
  munmap(reinterpret_cast<void*>(end), base + length + kHugePageBytes - end);
#if defined(MADV_HUGEPAGE)
  madvise(reinterpret_cast<void*>(start), length, MADV_HUGEPAGE);
#endif
  return new Mapping{reinterpret_cast<void*>(start), length};
}
#endif

// A new C-contiguous array of `dtype` and `shape`. On Linux with transparent huge pages, from
// kMappedArrayBytes on, its memory is an anonymous mapping of its own in huge pages
// (map_huge_pages), unmapped when the array is freed: a kernel writes every entry of a new output
// at once, and faulting a 4 KiB page in costs more than writing it (the C library returns such
// blocks to the system when they are freed, so every training step would fault its outputs in
// again). Smaller arrays, those the system refuses to map, and every array where transparent huge
// pages are off (a mapping of 4 KiB pages per array would fault in every time) come from NumPy.
py::array new_array(const py::dtype& dtype, const std::vector<py::ssize_t>& shape) {
  std::size_t bytes = static_cast<std::size_t>(dtype.itemsize());
  for (const py::ssize_t extent : shape) bytes *= static_cast<std::size_t>(extent);
#if defined(__linux__)
  if (bytes >= kMappedArrayBytes && huge_pages_available()) {
    if (Mapping* mapping = map_huge_pages(bytes)) {
      const auto unmap = [](void* pointer) {
        auto* freed = static_cast<Mapping*>(pointer);
        munmap(freed->start, freed->bytes);
        delete freed;
      };
      py::capsule owner;
      try {
        owner = py::capsule(mapping, unmap);
      } catch (...) {
        unmap(mapping);
        throw;
      }
      return py::array(dtype, shape, {}, mapping->start, owner);
    }
  }
#endif
  return py::array(dtype, shape);
}

}  // namespace

std::pair<py::array, Layout> output_array(const py::object& out, const char* name,
                                          const std::vector<py::ssize_t>& shape, Storage storage,
                                          std::size_t itemsize, std::size_t alignment) {
  py::array array;
  if (out.is_none()) {
    array = new_array(numpy_dtype(storage), shape);
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
Storage first_storage(const py::array& array, const char* name, std::optional<Storage> declared) {
  if (declared) {
    if (has_storage(array, *declared)) return *declared;
    if (*declared == Storage::BFloat16) {
      throw py::type_error(std::string(name) + " has dtype " + dtype_string(array) +
                           "; with dtype=\"bfloat16\" the arrays hold bfloat16 bit patterns as "
                           "uint16");
    }
    throw py::type_error(std::string(name) + " has dtype " + dtype_string(array) +
                         " but dtype= says " + storage_name(*declared));
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
  throw py::type_error(
      std::string(name) + " has dtype " + dtype +
      "; plsh takes float32, float64, float16, or bfloat16 as uint16 bit "
      "patterns with dtype=\"bfloat16\"" +
      (dtype == "uint16" ? " (pass dtype=\"bfloat16\" if these are bfloat16)" : ""));
}

const char* layout_axes(AxisOrder order, py::ssize_t rank) {
  if (order == AxisOrder::TokensHeads) {
    return rank == 4 ? "[batch, tokens, heads, dim]" : "[tokens, heads, dim]";
  }
  return rank == 4 ? "[batch, heads, tokens, dim]" : "[heads, tokens, dim]";
}

}  // namespace

Arrays::Arrays(std::initializer_list<std::pair<const char*, py::object>> named,
               std::optional<Storage> declared, AxisOrder axis_order)
    : order(axis_order) {
  const char* first_name = named.begin()->first;
  for (const auto& [name, object] : named) {
    py::array array = as_ndarray(object, name);
    if (arrays.empty()) {
      storage = first_storage(array, name, declared);
      if (array.ndim() != 3 && array.ndim() != 4) {
        throw py::value_error(std::string(name) + " must have 3 dimensions " +
                              layout_axes(order, 3) + " or 4 " + layout_axes(order, 4) + " (got " +
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
    arrays.push_back(order == AxisOrder::HeadsTokens ? swapped(array) : array);
    names.push_back(name);
  }
}

py::array Arrays::swapped(const py::array& array) {
  return py::reinterpret_borrow<py::array>(array.attr("swapaxes")(-3, -2));
}

std::vector<py::ssize_t> Arrays::shape_with_last(std::size_t i, py::ssize_t last) const {
  std::vector<py::ssize_t> shape = shape_of(arrays[i]);
  shape.back() = last;
  return shape;
}

std::vector<py::ssize_t> Arrays::in_layout(std::vector<py::ssize_t> shape) const {
  if (order == AxisOrder::HeadsTokens) {
    std::swap(shape[shape.size() - 3], shape[shape.size() - 2]);
  }
  return shape;
}

std::string Arrays::axis_text(std::size_t i, int axis) const {
  const py::ssize_t rank = arrays[i].ndim();
  int position = axis;  // from the end in [.., tokens, heads, dim]
  if (order == AxisOrder::HeadsTokens && (axis == -2 || axis == -3)) position = -5 - axis;
  static const char* const kinds[] = {"", "dim", "heads", "tokens", "batch"};
  return "axis " + std::to_string(rank + position) + " (" + kinds[-axis] + ") of layout \"" +
         (order == AxisOrder::TokensHeads ? "bthd\" " : "bhtd\" ") + layout_axes(order, rank);
}

void Arrays::check_attention(std::optional<std::size_t> slope_count) const {
  const auto size = [&](std::size_t i, int axis) {
    return arrays[i].shape(arrays[i].ndim() + axis);
  };
  const auto number = [](py::ssize_t value) { return std::to_string(value); };
  const std::string hint =
      order == AxisOrder::TokensHeads
          ? "; tensors in PyTorch SDPA's order [batch, heads, tokens, dim] need layout=\"bhtd\""
          : "";
  for (const int axis : {-2, -3}) {
    if (size(1, axis) != size(2, axis)) {
      throw py::value_error(std::string("k and v disagree on their ") +
                            (axis == -2 ? "heads" : "tokens") + " axis: k has " +
                            number(size(1, axis)) + ", v has " + number(size(2, axis)) + " (" +
                            axis_text(1, axis) + ")");
    }
  }
  if (size(0, -1) != size(1, -1)) {
    throw py::value_error("q and k disagree on their last axis (dim): q has " +
                          number(size(0, -1)) + ", k has " + number(size(1, -1)) + " (" +
                          axis_text(0, -1) + ")");
  }
  if (size(1, -2) > 0 && size(0, -2) % size(1, -2) != 0) {
    throw py::value_error("q has " + number(size(0, -2)) + " heads and k and v have " +
                          number(size(1, -2)) + " (" + axis_text(0, -2) +
                          "); the heads of q must be a multiple of those of k and v "
                          "(grouped-query attention)" +
                          hint);
  }
  if (slope_count && static_cast<py::ssize_t>(*slope_count) != size(0, -2)) {
    throw py::value_error("alibi_slopes has " + std::to_string(*slope_count) +
                          " entries but q has " + number(size(0, -2)) + " heads (" +
                          axis_text(0, -2) + "); give one slope per query head" + hint);
  }
  for (std::size_t i = 3; i < arrays.size(); ++i) {
    const std::vector<py::ssize_t> expected = shape_with_last(0, size(2, -1));
    if (shape(i) != expected) {
      throw py::value_error(std::string(names[i]) + " must have the forward output's shape " +
                            shape_string(in_layout(expected)) + ", q's with v's last axis (got " +
                            shape_string(in_layout(shape(i))) + ")");
    }
  }
}

}  // namespace plsh_python
