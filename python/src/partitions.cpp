// The random partitions and their error: alibi_slopes, Grid, RandomBinning, head_seed,
// draw_head_grids, kernel_grids, MaskError and mask_error.

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include <plsh/analysis.hpp>
#include <plsh/plsh.hpp>

#include "arguments.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace plsh_python {

using namespace pybind11::literals;

void bind_partitions(py::module_& m) {
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
        return plsh::kernel_grids(slopes, with_draws(DrawArguments{samples, seed, sampling}));
      },
      "slopes"_a, "samples"_a, "seed"_a = 0, py::kw_only(),
      "sampling"_a = DrawArguments::default_sampling(),
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
}

}  // namespace plsh_python
