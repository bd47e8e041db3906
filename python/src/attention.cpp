// The attention kernels: exact_alibi_attention, windowed_alibi_attention, plsh_attention and
// fixed_block_attention, and their backward kernels, each on the batched views of
// plsh/batch.hpp with the GIL released. Forward and backward share instantiations of plsh's
// kernel code, so one translation unit compiles them faster than two.

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

// A backward kernel `run(q, k, v, out, dout, dq, dk, dv)` on the views of the inputs and of new
// or given gradients; returns (dq, dk, dv).
template <class Run>
py::tuple backward(const BackwardInputs& inputs, const GradientArguments& gradients, Run&& run) {
  const Arrays arrays({{"q", inputs.q},
                       {"k", inputs.k},
                       {"v", inputs.v},
                       {"out", inputs.out},
                       {"dout", inputs.dout}},
                      gradients.bfloat16);
  const auto call = [&](auto zero) {
    using Scalar = decltype(zero);
    const Input<Scalar> in[] = {arrays.input<Scalar>(0), arrays.input<Scalar>(1),
                                arrays.input<Scalar>(2), arrays.input<Scalar>(3),
                                arrays.input<Scalar>(4)};
    const Output<Scalar> dq = output_of<Scalar>(gradients.dq, "dq", arrays.shape(0));
    const Output<Scalar> dk = output_of<Scalar>(gradients.dk, "dk", arrays.shape(1));
    const Output<Scalar> dv = output_of<Scalar>(gradients.dv, "dv", arrays.shape(2));
    {
      py::gil_scoped_release release;
      run(in[0].view, in[1].view, in[2].view, in[3].view, in[4].view, dq.view, dk.view, dv.view);
    }
    return py::make_tuple(dq.array, dk.array, dv.array);
  };
  return dispatch(arrays.storage, call);
}

py::tuple exact_alibi_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                         const AttentionArguments& attention,
                                         const GradientArguments& gradients) {
  const auto options = options_of(attention);
  return backward(inputs, gradients,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::exact_alibi_attention_backward<Scalar>(
                        qv, kv, vv, ov, dov, dqv, dkv, dvv, slopes_or_default(slopes, qv.heads),
                        options);
                  });
}

py::tuple windowed_alibi_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                            double tolerance, const AttentionArguments& attention,
                                            const GradientArguments& gradients) {
  const auto options = options_of(attention);
  return backward(inputs, gradients,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::windowed_alibi_attention_backward<Scalar>(
                        qv, kv, vv, ov, dov, dqv, dkv, dvv, slopes_or_default(slopes, qv.heads),
                        tolerance, options);
                  });
}

py::tuple plsh_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                  const AttentionArguments& attention, const DrawArguments& draws,
                                  const GradientArguments& gradients) {
  const auto options = plsh_options_of(attention, draws);
  return backward(inputs, gradients,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::plsh_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                                          slopes_or_default(slopes, qv.heads),
                                                          options);
                  });
}

py::tuple fixed_block_attention_backward(const BackwardInputs& inputs, const py::object& block_size,
                                         const AttentionArguments& attention,
                                         const GradientArguments& gradients) {
  const auto options = options_of(attention);
  const Index size = index(block_size, "block_size");
  return backward(inputs, gradients,
                  [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov,
                      const auto& dov, const auto& dqv, const auto& dkv, const auto& dvv) {
                    using Scalar = ScalarOf<decltype(dqv)>;
                    plsh::fixed_block_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                                                 size, options);
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
               "ALiBi attention that drops only keys it certifies to weigh at most `tolerance`: "
               "for every query row the exact-ALiBi weight of all its dropped keys is at most "
               "`tolerance`, so each output entry is within 2 tolerance max|v| of exact ALiBi. "
               "tolerance 0 is exact ALiBi.");
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
  def_function(m, "exact_alibi_attention_backward", &exact_alibi_attention_backward,
               BackwardInputs::arguments(), "slopes"_a = none, py::kw_only(),
               AttentionArguments::arguments(), GradientArguments::arguments(),
               "Gradients (dq, dk, dv) of exact ALiBi attention given its output `out` and the "
               "gradient `dout` of a loss with respect to it.");
  def_function(m, "windowed_alibi_attention_backward", &windowed_alibi_attention_backward,
               BackwardInputs::arguments(), "slopes"_a = none, "tolerance"_a = 1e-6, py::kw_only(),
               AttentionArguments::arguments(), GradientArguments::arguments(),
               "Gradients (dq, dk, dv) of windowed_alibi_attention as computed: exact ALiBi over "
               "the keys each query tile kept (the forward's certificate, evaluated again).");
  def_function(m, "plsh_attention_backward", &plsh_attention_backward, BackwardInputs::arguments(),
               "slopes"_a = none, py::kw_only(), AttentionArguments::arguments(),
               DrawArguments::arguments(), GradientArguments::arguments(),
               "Gradients (dq, dk, dv) of plsh_attention with the same slopes, samples, seed and "
               "sampling.");
  def_function(m, "fixed_block_attention_backward", &fixed_block_attention_backward,
               BackwardInputs::arguments(), "block_size"_a, py::kw_only(),
               AttentionArguments::arguments(), GradientArguments::arguments(),
               "Gradients (dq, dk, dv) of fixed_block_attention with the same block size.");
}

}  // namespace plsh_python
