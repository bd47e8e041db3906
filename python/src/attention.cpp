// The forward kernels: exact_alibi_attention, windowed_alibi_attention, plsh_attention and
// fixed_block_attention, each on the batched views of plsh/batch.hpp with the GIL released.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <string>
#include <vector>

#include <plsh/batch.hpp>

#include "arguments.hpp"
#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace plsh_python {

namespace {

// A forward kernel `run(q, k, v, out)` on the views of q, k, v and a new or given output
// [..., n_q, H, d_v]; returns the output array.
template <class Run>
py::array forward(const Inputs& inputs, const OutputArguments& output, Run&& run) {
  const Arrays arrays({{"q", inputs.q}, {"k", inputs.k}, {"v", inputs.v}}, output.bfloat16);
  const auto call = [&](auto zero) {
    using Scalar = decltype(zero);
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Input<Scalar> k_in = arrays.input<Scalar>(1);
    const Input<Scalar> v_in = arrays.input<Scalar>(2);
    const Output<Scalar> result =
        output_of<Scalar>(output.out, "out", arrays.shape_with_last(0, arrays.shape(2).back()));
    {
      py::gil_scoped_release release;
      run(q_in.view, k_in.view, v_in.view, result.view);
    }
    return result.array;
  };
  return dispatch(arrays.storage, call);
}

py::array exact_alibi_attention(const Inputs& inputs, const Slopes& slopes,
                                const AttentionArguments& attention,
                                const OutputArguments& output) {
  const auto options = options_of(attention);
  return forward(inputs, output,
                 [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                   using Scalar = ScalarOf<decltype(ov)>;
                   plsh::exact_alibi_attention<Scalar>(
                       qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), options);
                 });
}

py::array windowed_alibi_attention(const Inputs& inputs, const Slopes& slopes, double tolerance,
                                   const AttentionArguments& attention,
                                   const OutputArguments& output) {
  const auto options = options_of(attention);
  return forward(inputs, output,
                 [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                   using Scalar = ScalarOf<decltype(ov)>;
                   plsh::windowed_alibi_attention<Scalar>(
                       qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), tolerance, options);
                 });
}

py::array plsh_attention(const Inputs& inputs, const Slopes& slopes,
                         const AttentionArguments& attention, const DrawArguments& draws,
                         const std::string& kernel, const OutputArguments& output) {
  auto options = plsh_options_of(attention, draws);
  options.kernel = kernel_of(kernel);
  return forward(
      inputs, output, [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::plsh_attention<Scalar>(qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), options);
      });
}

py::array fixed_block_attention(const Inputs& inputs, const py::object& block_size,
                                const AttentionArguments& attention,
                                const OutputArguments& output) {
  const auto options = options_of(attention);
  const Index size = index(block_size, "block_size");
  return forward(inputs, output,
                 [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov) {
                   using Scalar = ScalarOf<decltype(ov)>;
                   plsh::fixed_block_attention<Scalar>(qv, kv, vv, ov, size, options);
                 });
}

}  // namespace

void bind_attention(py::module_& m) {
  using namespace pybind11::literals;
  const auto none = py::none();
  def_function(m, "exact_alibi_attention", &exact_alibi_attention, Inputs::arguments(),
               "slopes"_a = none, py::kw_only(), AttentionArguments::arguments(),
               OutputArguments::arguments(),
               "Exact ALiBi attention. q [.., n_q, H, d], k [.., n_k, H_kv, d], v [.., n_k, H_kv, "
               "d_v] -> out [.., n_q, H, d_v]; slopes=None means alibi_slopes(H); scale 0 means "
               "1/sqrt(d).");
  def_function(m, "windowed_alibi_attention", &windowed_alibi_attention, Inputs::arguments(),
               "slopes"_a = none, "tolerance"_a = 1e-6, py::kw_only(),
               AttentionArguments::arguments(), OutputArguments::arguments(),
               "ALiBi attention over the keys whose factor exp(-m |i - j|) is at least "
               "`tolerance`.");
  def_function(m, "plsh_attention", &plsh_attention, Inputs::arguments(), "slopes"_a = none,
               py::kw_only(), AttentionArguments::arguments(), DrawArguments::arguments(),
               "kernel"_a = "fused", OutputArguments::arguments(),
               "ALiBi attention through Positional LSH: `samples` random block partitions per "
               "head, the grids kernel_grids(slopes, samples, seed, sampling=sampling): sampling "
               "\"independent\" (head h uses RandomBinning(slopes[h], head_seed(seed, h))) or "
               "\"latin_hypercube\" (the draws of a head stratified jointly; lower error at equal "
               "samples); kernel \"fused\" or \"passes\". Every batch element uses the same "
               "draws.");
  def_function(m, "fixed_block_attention", &fixed_block_attention, Inputs::arguments(),
               "block_size"_a, py::kw_only(), AttentionArguments::arguments(),
               OutputArguments::arguments(),
               "Attention within fixed blocks of `block_size` absolute positions.");
}

}  // namespace plsh_python
