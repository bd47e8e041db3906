// Python arguments as plsh options (options.hpp).

#include "options.hpp"

#include <plsh/plsh.hpp>

namespace plsh_python {

Index index(const py::handle& value, const char* name) { return integer<Index>(value, name); }

std::uint64_t seed_of(const py::handle& value, const char* name) {
  return integer<std::uint64_t>(value, name);
}

double softmax_scale_of(const py::object& softmax_scale) {
  if (softmax_scale.is_none()) return 0.0;
  if (py::isinstance<py::bool_>(softmax_scale) ||
      !(py::isinstance<py::float_>(softmax_scale) || PyIndex_Check(softmax_scale.ptr()) ||
        py::hasattr(softmax_scale, "__float__"))) {
    throw py::type_error("softmax_scale must be None or a number (got " +
                         py::str(py::type::of(softmax_scale).attr("__name__")).cast<std::string>() +
                         ")");
  }
  return py::float_(softmax_scale).cast<double>();
}

std::vector<double> slopes_or_default(const Slopes& slopes, Index heads) {
  if (slopes) return *slopes;
  // q.heads < 1 is reported by the kernel.
  return heads >= 1 ? plsh::alibi_slopes(heads) : std::vector<double>{};
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

plsh::PlshOptions with_draws(const DrawArguments& arguments, plsh::PlshOptions options) {
  options.samples = index(arguments.samples, "samples");
  options.seed = seed_of(arguments.seed);
  options.sampling = sampling_of(arguments.sampling);
  options.near_field = arguments.near_field;
  return options;
}

}  // namespace plsh_python
