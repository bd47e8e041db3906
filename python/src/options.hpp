// Python arguments as plsh options: integers checked by name, the names of kernels and sampling
// schemes, and the argument groups of arguments.hpp as plsh::AttentionOptions and
// plsh::PlshOptions.

#ifndef PLSH_PYTHON_OPTIONS_HPP
#define PLSH_PYTHON_OPTIONS_HPP

#include <pybind11/pybind11.h>

#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include <plsh/batch.hpp>

#include "arguments.hpp"

namespace plsh_python {

namespace py = pybind11;
using plsh::Index;

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

Index index(const py::handle& value, const char* name);

std::uint64_t seed_of(const py::handle& value, const char* name = "seed");

// `slopes`, or the standard ALiBi slopes of `heads` heads for None.
std::vector<double> slopes_or_default(const Slopes& slopes, Index heads);

// "fused" or "passes"; ValueError for another name.
plsh::Kernel kernel_of(const std::string& kernel);

// "independent" or "latin_hypercube"; ValueError for another name.
plsh::Sampling sampling_of(const std::string& sampling);

// softmax_scale as the kernels' scale: None is 0, which plsh reads as 1/sqrt(d); a number is taken
// as it is (the kernels reject a non-finite or negative one). TypeError for another type.
double softmax_scale_of(const py::object& softmax_scale);

// `options` (AttentionOptions or PlshOptions) with causal, the scale and the positions of
// `arguments`.
template <class Options = plsh::AttentionOptions>
Options options_of(const AttentionArguments& arguments, Options options = Options()) {
  options.causal = arguments.causal;
  options.scale = softmax_scale_of(arguments.softmax_scale);
  options.query_position = index(arguments.query_position, "query_position");
  options.key_position = index(arguments.key_position, "key_position");
  return options;
}

// `options` with the draws (samples, seed, sampling) of `arguments`.
plsh::PlshOptions with_draws(const DrawArguments& arguments, plsh::PlshOptions options = {});

// PlshOptions with the attention options and the draws set (the rest default).
inline plsh::PlshOptions plsh_options_of(const AttentionArguments& attention,
                                         const DrawArguments& draws) {
  return with_draws(draws, options_of<plsh::PlshOptions>(attention));
}

}  // namespace plsh_python

#endif  // PLSH_PYTHON_OPTIONS_HPP
