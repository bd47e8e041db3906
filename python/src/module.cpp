// plsh._plsh: the Python binding of plsh (pybind11 + NumPy).
//
// Arrays are [tokens, heads, dim] or [batch, tokens, heads, dim] (or, with layout="bhtd", the
// heads and tokens axes swapped), float32, float64, float16 or
// bfloat16, read through their strides when these are positive multiples of the itemsize with a
// contiguous last axis (otherwise through a contiguous copy); outputs are new C-contiguous arrays
// of the inputs' dtype or the `out=` arrays, which must have usable strides (arrays.hpp). NumPy
// has no bfloat16: a kernel called with `dtype="bfloat16"` takes uint16 arrays holding bfloat16 bit
// patterns and returns such arrays. float16 and bfloat16 compute in float (the kernels' storage
// types, plsh/detail/storage.hpp). Every kernel runs with the GIL released, through the batched
// kernels of plsh/batch.hpp (a rank-3 array is a batch of one). C++ std::invalid_argument becomes
// ValueError with the same message; a wrong dtype is a TypeError and a wrong rank or shape a
// ValueError, both naming the argument.
//
// The bindings come in families, one source file each (bindings.hpp); the arguments they share
// are written once in arguments.hpp. Tested in python/tests/.

#include <pybind11/pybind11.h>

#include "arguments.hpp"
#include "bindings.hpp"

// The version of the plsh project (project(plsh VERSION ...) in the top-level CMakeLists.txt),
// passed by setup.py and python/CMakeLists.txt.
#ifndef PLSH_VERSION
#error "PLSH_VERSION must be defined (the version of the plsh project)"
#endif

PYBIND11_MODULE(_plsh, m) {
  m.doc() =
      "ALiBi attention through Positional LSH: the kernels of the plsh C++ library on NumPy "
      "arrays [batch, tokens, heads, dim] (layout \"bthd\") or [batch, heads, tokens, dim] "
      "(layout \"bhtd\"), the batch axis optional: float32, float64, float16 (computed in "
      "float32), or bfloat16 bit patterns as uint16 with dtype=\"bfloat16\" (computed in "
      "float32, returned as uint16 bfloat16).";
  m.attr("__version__") = PLSH_VERSION;
  // The defaults of the Positional LSH estimator (plsh::PlshOptions), which plsh.torch takes too.
  namespace py = pybind11;
  const plsh::PlshOptions defaults;
  m.attr("PLSH_DEFAULTS") =
      py::dict(py::arg("samples") = defaults.samples, py::arg("seed") = defaults.seed,
               py::arg("sampling") = plsh_python::sampling_name(defaults.sampling),
               py::arg("near_field") = defaults.near_field);
  plsh_python::bind_partitions(m);
  plsh_python::bind_attention(m);
  plsh_python::bind_kv_cache(m);
  plsh_python::bind_alibi_kv_cache(m);
}
