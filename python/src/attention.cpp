// The attention kernels: exact_alibi_attention, windowed_alibi_attention,
// truncated_alibi_attention, plsh_attention and fixed_block_attention, and their backward kernels,
// each on the batched views of plsh/batch.hpp with the GIL released; the class KeptKeys. A forward
// called with return_lse=True also returns its row log-sum-exp (plsh::RowLse) and, windowed, its
// kept keys (plsh::KeptKeys), which the backward takes as lse= and kept= instead of computing them
// again. Forward and backward share instantiations of plsh's kernel code, so one translation unit
// compiles them faster than two.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstddef>
#include <deque>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <plsh/attention/kept_keys.hpp>
#include <plsh/batch.hpp>
#include <plsh/row_lse.hpp>

#include "arguments.hpp"
#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace plsh_python {

namespace {

std::optional<std::size_t> slope_count(const Slopes* slopes) {
  if (slopes == nullptr || !*slopes) return std::nullopt;
  return (*slopes)->size();
}

// The shape of the row log-sum-exp of a call whose q is `q` ([.., n_q, H, d] in the order
// [tokens, heads]): [.., H, n_q], plsh::RowLse's [batch][heads][queries].
std::vector<py::ssize_t> lse_shape(const py::array& q) {
  std::vector<py::ssize_t> shape = shape_of(q);
  shape.pop_back();
  std::swap(shape[shape.size() - 2], shape[shape.size() - 1]);
  return shape;
}

// A forward kernel `run(q, k, v, out, lse)` on the views of q, k, v, a new or given output
// [..., n_q, H, d_v] and, with `return_lse`, a new row log-sum-exp [..., H, n_q] in the compute
// type (an empty RowLse otherwise); returns the output array, or (out, lse) with `return_lse`,
// (out, lse, extra) when `extra` is not None. `slopes` (null for a kernel without slopes) are
// checked against the heads of q.
template <class Run>
py::object forward(const Inputs& inputs, const Slopes* slopes, const OutputArguments& output,
                   const ArrayArguments& format, bool return_lse, Run&& run,
                   const py::object& extra = py::none()) {
  const Arrays arrays({{"q", inputs.q}, {"k", inputs.k}, {"v", inputs.v}},
                      declared_storage(format.dtype, format.bfloat16),
                      axis_order_of(format.layout));
  arrays.check_attention(slope_count(slopes));
  const auto call = [&](auto zero) -> py::object {
    using Scalar = decltype(zero);
    using Compute = plsh::detail::Compute<Scalar>;
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Input<Scalar> k_in = arrays.input<Scalar>(1);
    const Input<Scalar> v_in = arrays.input<Scalar>(2);
    const Output<Scalar> result =
        arrays.output<Scalar>(output.out, "out", arrays.shape_with_last(0, arrays.shape(2).back()));
    py::array lse_array;
    plsh::RowLse<Compute> lse;
    if (return_lse) {
      lse_array = py::array_t<Compute>(lse_shape(arrays.arrays[0]));
      lse = plsh::RowLse<Compute>(static_cast<Compute*>(lse_array.mutable_data()), q_in.view.batch,
                                  q_in.view.heads, q_in.view.tokens);
    }
    {
      py::gil_scoped_release release;
      run(q_in.view, k_in.view, v_in.view, result.view, lse);
    }
    if (!return_lse) return result.array;
    if (extra.is_none()) return py::make_tuple(result.array, lse_array);
    return py::make_tuple(result.array, lse_array, extra);
  };
  return dispatch(arrays.storage, call);
}

py::object exact_alibi_attention(const Inputs& inputs, const Slopes& slopes,
                                 const AttentionArguments& attention, const OutputArguments& output,
                                 bool return_lse, const ArrayArguments& format) {
  const auto options = options_of(attention);
  return forward(
      inputs, &slopes, output, format, return_lse,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& lse) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::exact_alibi_attention<Scalar>(qv, kv, vv, ov, slopes_or_default(slopes, qv.heads),
                                            options, lse);
      });
}

py::object windowed_alibi_attention(const Inputs& inputs, const Slopes& slopes, double tolerance,
                                    const AttentionArguments& attention,
                                    const OutputArguments& output, bool return_lse,
                                    const ArrayArguments& format) {
  const auto options = options_of(attention);
  // The kept keys live in the Python object returned beside the lse.
  const py::object kept = return_lse ? py::cast(plsh::KeptKeys()) : py::none();
  plsh::KeptKeys* const kept_keys = return_lse ? kept.cast<plsh::KeptKeys*>() : nullptr;
  return forward(
      inputs, &slopes, output, format, return_lse,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& lse) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::windowed_alibi_attention<Scalar>(qv, kv, vv, ov, slopes_or_default(slopes, qv.heads),
                                               tolerance, options, lse, kept_keys);
      },
      kept);
}

py::object truncated_alibi_attention(const Inputs& inputs, const Slopes& slopes,
                                     double factor_tolerance, const AttentionArguments& attention,
                                     const OutputArguments& output, bool return_lse,
                                     const ArrayArguments& format) {
  const auto options = options_of(attention);
  return forward(
      inputs, &slopes, output, format, return_lse,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& lse) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::truncated_alibi_attention<Scalar>(qv, kv, vv, ov, slopes_or_default(slopes, qv.heads),
                                                factor_tolerance, options, lse);
      });
}

py::object plsh_attention(const Inputs& inputs, const Slopes& slopes,
                          const AttentionArguments& attention, const DrawArguments& draws,
                          const std::string& kernel, const OutputArguments& output, bool return_lse,
                          const ArrayArguments& format) {
  auto options = plsh_options_of(attention, draws);
  options.kernel = kernel_of(kernel);
  return forward(
      inputs, &slopes, output, format, return_lse,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& lse) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::plsh_attention<Scalar>(qv, kv, vv, ov, slopes_or_default(slopes, qv.heads), options,
                                     lse);
      });
}

py::object fixed_block_attention(const Inputs& inputs, const py::object& block_size,
                                 const AttentionArguments& attention, const OutputArguments& output,
                                 bool return_lse, const ArrayArguments& format) {
  const auto options = options_of(attention);
  const Index size = index(block_size, "block_size");
  return forward(
      inputs, nullptr, output, format, return_lse,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& lse) {
        using Scalar = ScalarOf<decltype(ov)>;
        plsh::fixed_block_attention<Scalar>(qv, kv, vv, ov, size, options, lse);
      });
}

// The forward's row log-sum-exp `lse` given to the backward `function` for the arrays of
// `arrays` (q first): None gives an empty view (the backward computes it); otherwise an ndarray
// (TypeError) of the compute type of the arrays (TypeError) and of q's lse_shape (ValueError),
// read through a contiguous copy if it is not contiguous, which `holder` keeps alive.
template <class Compute>
plsh::RowLse<const Compute> given_lse(const char* function, const py::object& lse,
                                      const Arrays& arrays, py::array& holder) {
  if (lse.is_none()) return {};
  const std::string prefix = std::string(function) + ": lse ";
  if (!py::isinstance<py::array>(lse)) {
    throw py::type_error(prefix + "must be a numpy.ndarray (got " +
                         py::str(py::type::of(lse).attr("__name__")).cast<std::string>() + ")");
  }
  holder = py::reinterpret_borrow<py::array>(lse);
  const Storage compute = storage_of<Compute>();
  if (!has_storage(holder, compute)) {
    throw py::type_error(prefix + "must have dtype " + storage_name(compute) +
                         ", the compute type of " + storage_name(arrays.storage) +
                         " arrays, as the forward returned it (got " + dtype_string(holder) + ")");
  }
  const py::array& q = arrays.arrays[0];
  const std::vector<py::ssize_t> expected = lse_shape(q);
  if (shape_of(holder) != expected) {
    throw py::value_error(prefix + "must have shape " + shape_string(expected) + " (" +
                          (q.ndim() == 4 ? "[batch, heads, tokens]" : "[heads, tokens]") +
                          " of q), as the forward returned it (got " +
                          shape_string(shape_of(holder)) + ")");
  }
  if (!(holder.flags() & py::array::c_style)) {
    holder = py::module_::import("numpy").attr("ascontiguousarray")(holder);
  }
  const Index tokens = q.shape(q.ndim() - 3);
  const Index heads = q.shape(q.ndim() - 2);
  const Index batch = q.ndim() == 4 ? q.shape(0) : 1;
  return plsh::RowLse<const Compute>(static_cast<const Compute*>(holder.data()), batch, heads,
                                     tokens);
}

// A backward kernel `run(q, k, v, out, dout, dq, dk, dv, lse)` named `function` on the views of
// the inputs, of new or given gradients and of the given row log-sum-exp (given_lse); returns
// (dq, dk, dv).
template <class Run>
py::tuple backward(const char* function, const BackwardInputs& inputs, const Slopes* slopes,
                   const LseArguments& given, const GradientArguments& gradients,
                   const ArrayArguments& format, Run&& run) {
  const Arrays arrays({{"q", inputs.q},
                       {"k", inputs.k},
                       {"v", inputs.v},
                       {"out", inputs.out},
                       {"dout", inputs.dout}},
                      declared_storage(format.dtype, format.bfloat16),
                      axis_order_of(format.layout));
  arrays.check_attention(slope_count(slopes));
  const auto call = [&](auto zero) {
    using Scalar = decltype(zero);
    py::array lse_holder;
    const auto lse =
        given_lse<plsh::detail::Compute<Scalar>>(function, given.lse, arrays, lse_holder);
    const Input<Scalar> in[] = {arrays.input<Scalar>(0), arrays.input<Scalar>(1),
                                arrays.input<Scalar>(2), arrays.input<Scalar>(3),
                                arrays.input<Scalar>(4)};
    const Output<Scalar> dq = arrays.output<Scalar>(gradients.dq, "dq", arrays.shape(0));
    const Output<Scalar> dk = arrays.output<Scalar>(gradients.dk, "dk", arrays.shape(1));
    const Output<Scalar> dv = arrays.output<Scalar>(gradients.dv, "dv", arrays.shape(2));
    {
      py::gil_scoped_release release;
      run(in[0].view, in[1].view, in[2].view, in[3].view, in[4].view, dq.view, dk.view, dv.view,
          lse);
    }
    return py::make_tuple(dq.array, dk.array, dv.array);
  };
  return dispatch(arrays.storage, call);
}

py::tuple exact_alibi_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                         const AttentionArguments& attention,
                                         const LseArguments& given,
                                         const GradientArguments& gradients,
                                         const ArrayArguments& format) {
  const auto options = options_of(attention);
  return backward(
      "exact_alibi_attention_backward", inputs, &slopes, given, gradients, format,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& dov,
          const auto& dqv, const auto& dkv, const auto& dvv, const auto& lse) {
        using Scalar = ScalarOf<decltype(dqv)>;
        plsh::exact_alibi_attention_backward<Scalar>(
            qv, kv, vv, ov, dov, dqv, dkv, dvv, slopes_or_default(slopes, qv.heads), options, lse);
      });
}

// The kept keys `kept` given to windowed_alibi_attention_backward: None (null: the backward runs
// the certificate again) or a KeptKeys (TypeError otherwise); the backward checks that they come
// from a call of its own shapes and tolerance.
const plsh::KeptKeys* given_kept(const py::object& kept) {
  if (kept.is_none()) return nullptr;
  if (!py::isinstance<plsh::KeptKeys>(kept)) {
    throw py::type_error(
        "windowed_alibi_attention_backward: kept must be the plsh.KeptKeys that "
        "windowed_alibi_attention(..., return_lse=True) returned (got " +
        py::str(py::type::of(kept).attr("__name__")).cast<std::string>() + ")");
  }
  return kept.cast<const plsh::KeptKeys*>();
}

py::tuple windowed_alibi_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                            double tolerance, const AttentionArguments& attention,
                                            const LseArguments& given, const py::object& kept,
                                            const GradientArguments& gradients,
                                            const ArrayArguments& format) {
  const auto options = options_of(attention);
  const plsh::KeptKeys* const kept_keys = given_kept(kept);
  return backward(
      "windowed_alibi_attention_backward", inputs, &slopes, given, gradients, format,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& dov,
          const auto& dqv, const auto& dkv, const auto& dvv, const auto& lse) {
        using Scalar = ScalarOf<decltype(dqv)>;
        plsh::windowed_alibi_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                                        slopes_or_default(slopes, qv.heads),
                                                        tolerance, options, lse, kept_keys);
      });
}

py::tuple truncated_alibi_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                             double factor_tolerance,
                                             const AttentionArguments& attention,
                                             const LseArguments& given,
                                             const GradientArguments& gradients,
                                             const ArrayArguments& format) {
  const auto options = options_of(attention);
  return backward(
      "truncated_alibi_attention_backward", inputs, &slopes, given, gradients, format,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& dov,
          const auto& dqv, const auto& dkv, const auto& dvv, const auto& lse) {
        using Scalar = ScalarOf<decltype(dqv)>;
        plsh::truncated_alibi_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                                         slopes_or_default(slopes, qv.heads),
                                                         factor_tolerance, options, lse);
      });
}

py::tuple plsh_attention_backward(const BackwardInputs& inputs, const Slopes& slopes,
                                  const AttentionArguments& attention, const DrawArguments& draws,
                                  const LseArguments& given, const GradientArguments& gradients,
                                  const ArrayArguments& format) {
  const auto options = plsh_options_of(attention, draws);
  return backward(
      "plsh_attention_backward", inputs, &slopes, given, gradients, format,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& dov,
          const auto& dqv, const auto& dkv, const auto& dvv, const auto& lse) {
        using Scalar = ScalarOf<decltype(dqv)>;
        plsh::plsh_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv,
                                              slopes_or_default(slopes, qv.heads), options, lse);
      });
}

py::tuple fixed_block_attention_backward(const BackwardInputs& inputs, const py::object& block_size,
                                         const AttentionArguments& attention,
                                         const LseArguments& given,
                                         const GradientArguments& gradients,
                                         const ArrayArguments& format) {
  const auto options = options_of(attention);
  const Index size = index(block_size, "block_size");
  return backward(
      "fixed_block_attention_backward", inputs, nullptr, given, gradients, format,
      [&](const auto& qv, const auto& kv, const auto& vv, const auto& ov, const auto& dov,
          const auto& dqv, const auto& dkv, const auto& dvv, const auto& lse) {
        using Scalar = ScalarOf<decltype(dqv)>;
        plsh::fixed_block_attention_backward<Scalar>(qv, kv, vv, ov, dov, dqv, dkv, dvv, size,
                                                     options, lse);
      });
}

}  // namespace

void bind_attention(py::module_& m) {
  using namespace pybind11::literals;
  const auto none = py::none();
  py::class_<plsh::KeptKeys>(
      m, "KeptKeys",
      "The key rows each query tile of a windowed_alibi_attention call kept, with the shapes and "
      "tolerance of that call; returned by windowed_alibi_attention(..., return_lse=True) and "
      "taken by windowed_alibi_attention_backward(..., kept=), which then does not run the "
      "certificate again. Opaque.")
      .def(py::init<>())
      .def_property_readonly("empty", &plsh::KeptKeys::empty, "Whether no forward has filled it.");
  // The arguments every kernel shares, said once in every docstring.
  const std::string common =
      "\n\nq [B, T, H, D] (or [T, H, D]), k [B, T_k, H_kv, D], v [B, T_k, H_kv, D_v] with H a "
      "multiple of H_kv (grouped-query attention), all of one dtype: float32, float64, float16, or "
      "uint16 bfloat16 bit patterns with dtype=\"bfloat16\" (16-bit types computed in float32). "
      "layout=\"bhtd\" takes every array (outputs and gradients too) as [B, H, T, D], PyTorch "
      "SDPA's order, read through its strides without a copy. alibi_slopes: one slope per query "
      "head, None for the standard ALiBi slopes alibi_slopes(H) (plsh's default; FlashAttention's "
      "None means no bias: pass [0.0] * H for that). softmax_scale None means 1/sqrt(D). "
      "query_position, key_position: absolute positions of the first query and key rows. Results "
      "are new arrays or the out= (dq=, dk=, dv=) arrays; a shape that does not fit raises a "
      "ValueError naming the axes. A forward with return_lse=True returns (out, lse) "
      "(windowed_alibi_attention: (out, lse, kept)), lse [B, H, T] (or [H, T]) the row "
      "log-sum-exp of the logits (FlashAttention's softmax_lse), float64 for float64 arrays and "
      "float32 otherwise, -inf for a row that sees no key; a backward given lse= (and kept=) "
      "uses them instead of computing them again.";
  const auto doc = [&](const char* text) {
    // pybind11 keeps the pointer: the docstrings live as long as the module.
    static std::deque<std::string> texts;
    texts.push_back(std::string(text) + common);
    return texts.back().c_str();
  };
  def_function(m, "exact_alibi_attention", &exact_alibi_attention, Inputs::arguments(),
               "alibi_slopes"_a = none, py::kw_only(), AttentionArguments::arguments(),
               OutputArguments::arguments(), "return_lse"_a = false, ArrayArguments::arguments(),
               doc("Exact ALiBi attention: softmax(softmax_scale q k^T - m_h |i - j|) v per head, "
                   "-> out [B, T, H, D_v]."));
  def_function(
      m, "windowed_alibi_attention", &windowed_alibi_attention, Inputs::arguments(),
      "alibi_slopes"_a = none, "tolerance"_a = 1e-6, py::kw_only(), AttentionArguments::arguments(),
      OutputArguments::arguments(), "return_lse"_a = false, ArrayArguments::arguments(),
      doc("ALiBi attention that drops only keys it certifies to weigh at most `tolerance`: "
          "for every query row the exact-ALiBi weight of all its dropped keys is at most "
          "`tolerance`, so each output entry is within 2 tolerance max|v| of exact "
          "ALiBi. tolerance 0 is exact ALiBi."));
  def_function(
      m, "truncated_alibi_attention", &truncated_alibi_attention, Inputs::arguments(),
      "alibi_slopes"_a, "factor_tolerance"_a, py::kw_only(), AttentionArguments::arguments(),
      OutputArguments::arguments(), "return_lse"_a = false, ArrayArguments::arguments(),
      doc("ALiBi truncated where the factor exp(-m_h |i - j|) falls below `factor_tolerance`: "
          "head h keeps the keys with |i - j| <= floor(ln(1/factor_tolerance) / m_h). No bound "
          "on the error (a far key of high score keeps a large weight under exact ALiBi); "
          "windowed_alibi_attention is the kernel whose tolerance is a guarantee. "
          "factor_tolerance in [0, 1], 0 is exact ALiBi. alibi_slopes and factor_tolerance "
          "are both required (alibi_slopes=None: the standard slopes)."));
  def_function(m, "plsh_attention", &plsh_attention, Inputs::arguments(), "alibi_slopes"_a = none,
               py::kw_only(), AttentionArguments::arguments(), DrawArguments::arguments(),
               "kernel"_a = "fused", OutputArguments::arguments(), "return_lse"_a = false,
               ArrayArguments::arguments(),
               doc("ALiBi attention through Positional LSH: `samples` random block partitions per "
                   "head, the grids kernel_grids(slopes, samples, seed, sampling=sampling): "
                   "sampling \"independent\" (head h uses RandomBinning(slopes[h], "
                   "head_seed(seed, h))) or \"latin_hypercube\" (the draws of a head stratified "
                   "jointly; lower error at equal samples); near_field f in [0, 1]: the exact "
                   "factor exp(-m_h |i - j|) where it is at least f, the block masks beyond (same "
                   "mean, no variance near the diagonal; 0: none); kernel \"fused\" or "
                   "\"passes\", which compute the same function. Every batch element uses the "
                   "same draws."));
  def_function(m, "fixed_block_attention", &fixed_block_attention, Inputs::arguments(),
               "block_size"_a, py::kw_only(), AttentionArguments::arguments(),
               OutputArguments::arguments(), "return_lse"_a = false, ArrayArguments::arguments(),
               doc("Attention within fixed blocks of `block_size` absolute positions (no bias)."));
  def_function(m, "exact_alibi_attention_backward", &exact_alibi_attention_backward,
               BackwardInputs::arguments(), "alibi_slopes"_a = none, py::kw_only(),
               AttentionArguments::arguments(), LseArguments::arguments(),
               GradientArguments::arguments(), ArrayArguments::arguments(),
               doc("Gradients (dq, dk, dv) of exact ALiBi attention given its output `out` and the "
                   "gradient `dout` of a loss with respect to it."));
  def_function(m, "windowed_alibi_attention_backward", &windowed_alibi_attention_backward,
               BackwardInputs::arguments(), "alibi_slopes"_a = none, "tolerance"_a = 1e-6,
               py::kw_only(), AttentionArguments::arguments(), LseArguments::arguments(),
               "kept"_a = none, GradientArguments::arguments(), ArrayArguments::arguments(),
               doc("Gradients (dq, dk, dv) of windowed_alibi_attention as computed: exact ALiBi "
                   "over the keys each query tile kept: kept=, the KeptKeys the forward returned "
                   "with return_lse=True, or else the forward's certificate evaluated again. "
                   "kept from a call of other shapes or another tolerance is a ValueError."));
  def_function(m, "truncated_alibi_attention_backward", &truncated_alibi_attention_backward,
               BackwardInputs::arguments(), "alibi_slopes"_a, "factor_tolerance"_a, py::kw_only(),
               AttentionArguments::arguments(), LseArguments::arguments(),
               GradientArguments::arguments(), ArrayArguments::arguments(),
               doc("Gradients (dq, dk, dv) of truncated_alibi_attention with the same "
                   "alibi_slopes and factor_tolerance: exact ALiBi's over each head's band, zero "
                   "from the keys outside it."));
  def_function(m, "plsh_attention_backward", &plsh_attention_backward, BackwardInputs::arguments(),
               "alibi_slopes"_a = none, py::kw_only(), AttentionArguments::arguments(),
               DrawArguments::arguments(), LseArguments::arguments(),
               GradientArguments::arguments(), ArrayArguments::arguments(),
               doc("Gradients (dq, dk, dv) of plsh_attention with the same alibi_slopes, samples, "
                   "seed, sampling and near_field."));
  def_function(m, "fixed_block_attention_backward", &fixed_block_attention_backward,
               BackwardInputs::arguments(), "block_size"_a, py::kw_only(),
               AttentionArguments::arguments(), LseArguments::arguments(),
               GradientArguments::arguments(), ArrayArguments::arguments(),
               doc("Gradients (dq, dk, dv) of fixed_block_attention with the same block size."));
}

}  // namespace plsh_python
