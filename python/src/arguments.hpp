// The arguments that several functions of the module share, each group written once: its C++
// members, and its Python names and defaults.
//
// A group is a struct with public members, `Fields`, the C++ types through which pybind11 passes
// the members (in their order), and `arguments()`, their py::arg annotations (same order). A
// function bound through `flatten` (or `def_function`) takes a group as one parameter; Python sees
// its members as separate arguments. So a kernel reads
//
//   py::array exact_alibi_attention(const Inputs& inputs, const Slopes& slopes,
//                                   const AttentionArguments& attention,
//                                   const OutputArguments& output,
//                                   const ArrayArguments& arrays);
//
// and is bound with the annotations of its own arguments and its groups' in the same order:
//
//   def_function(m, "exact_alibi_attention", &exact_alibi_attention, Inputs::arguments(),
//                "alibi_slopes"_a = py::none(), py::kw_only(), AttentionArguments::arguments(),
//                OutputArguments::arguments(), ArrayArguments::arguments(), "docstring");
//
// pybind11 checks at compile time that the annotations are as many as the flat parameters.

#ifndef PLSH_PYTHON_ARGUMENTS_HPP
#define PLSH_PYTHON_ARGUMENTS_HPP

#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <plsh/options.hpp>

#include <cstddef>
#include <optional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

namespace plsh_python {

namespace py = pybind11;

// Slopes (the argument alibi_slopes), one per query head; None means the standard ALiBi slopes.
using Slopes = std::optional<std::vector<double>>;

// The arrays a forward kernel reads: q [.., n_q, H, d], k [.., n_k, H_kv, d], v [.., n_k, H_kv,
// d_v].
struct Inputs {
  using Fields = std::tuple<const py::object&, const py::object&, const py::object&>;
  static auto arguments() { return std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v")); }
  py::object q;
  py::object k;
  py::object v;
};

// The arrays a backward kernel reads: the forward's inputs, its output and the gradient of a loss
// with respect to that output.
struct BackwardInputs {
  using Fields = std::tuple<const py::object&, const py::object&, const py::object&,
                            const py::object&, const py::object&>;
  static auto arguments() {
    return std::make_tuple(py::arg("q"), py::arg("k"), py::arg("v"), py::arg("out"),
                           py::arg("dout"));
  }
  py::object q;
  py::object k;
  py::object v;
  py::object out;
  py::object dout;
};

// The attention options every kernel takes (plsh::AttentionOptions): softmax_scale None means
// 1/sqrt(d) (as in FlashAttention and PyTorch's SDPA); the positions are the absolute positions of
// the first query and key rows, integers checked by name (options.hpp).
struct AttentionArguments {
  using Fields = std::tuple<bool, const py::object&, const py::object&, const py::object&>;
  static auto arguments() {
    return std::make_tuple(py::arg("causal") = true, py::arg("softmax_scale") = py::none(),
                           py::arg("query_position") = 0, py::arg("key_position") = 0);
  }
  bool causal;
  py::object softmax_scale;
  py::object query_position;
  py::object key_position;
};

// The name of a sampling, as the bindings' `sampling` arguments spell it.
inline const char* sampling_name(plsh::Sampling sampling) {
  return sampling == plsh::Sampling::LatinHypercube ? "latin_hypercube" : "independent";
}

// The estimator of the Positional LSH kernels and KvCache: `samples` partitions per head from
// `seed`, drawn as `sampling` says ("independent" or "latin_hypercube"), and the exact factor
// where it is at least `near_field`. The defaults are plsh::PlshOptions'.
struct DrawArguments {
  using Fields = std::tuple<const py::object&, const py::object&, const std::string&, double>;
  static auto arguments() {
    const plsh::PlshOptions defaults;
    return std::make_tuple(py::arg("samples") = defaults.samples, py::arg("seed") = defaults.seed,
                           py::arg("sampling") = default_sampling(),
                           py::arg("near_field") = defaults.near_field);
  }
  // The name of PlshOptions' default sampling.
  static const char* default_sampling() { return sampling_name(plsh::PlshOptions{}.sampling); }
  py::object samples;
  py::object seed;
  std::string sampling;
  double near_field = 0;
};

// How the arrays of a call are laid out and typed: `layout` "bthd" ([batch, tokens, heads, dim],
// FlashAttention's) or "bhtd" ([batch, heads, tokens, dim], PyTorch SDPA's), both read through
// strides; `dtype` None (the arrays' own) or "bfloat16" (uint16 arrays holding bfloat16 bit
// patterns), the convention KvCache shares; `bfloat16=True` is the deprecated spelling of
// dtype="bfloat16".
struct ArrayArguments {
  using Fields = std::tuple<const std::string&, const py::object&, bool>;
  static auto arguments() {
    return std::make_tuple(py::arg("layout") = "bthd", py::arg("dtype") = py::none(),
                           py::arg("bfloat16") = false);
  }
  std::string layout;
  py::object dtype;
  bool bfloat16;
};

// Where a forward kernel writes (None: a new array).
struct OutputArguments {
  using Fields = std::tuple<const py::object&>;
  static auto arguments() { return std::make_tuple(py::arg("out") = py::none()); }
  py::object out;
};

// The forward's row log-sum-exp a backward kernel takes (None: computed again), as the forward
// called with return_lse=True returned it.
struct LseArguments {
  using Fields = std::tuple<const py::object&>;
  static auto arguments() { return std::make_tuple(py::arg("lse") = py::none()); }
  py::object lse;
};

// Where a backward kernel writes dq, dk and dv (None: new arrays).
struct GradientArguments {
  using Fields = std::tuple<const py::object&, const py::object&, const py::object&>;
  static auto arguments() {
    return std::make_tuple(py::arg("dq") = py::none(), py::arg("dk") = py::none(),
                           py::arg("dv") = py::none());
  }
  py::object dq;
  py::object dk;
  py::object dv;
};

namespace detail {

template <class T, class = void>
struct IsGroup : std::false_type {};
template <class T>
struct IsGroup<T, std::void_t<typename T::Fields>> : std::true_type {};

template <class T>
using Bare = std::remove_cv_t<std::remove_reference_t<T>>;

// The parameters through which a parameter of type T reaches Python: a group's Fields, else T.
template <class T, bool = IsGroup<Bare<T>>::value>
struct FlatOf {
  using type = std::tuple<T>;
};
template <class T>
struct FlatOf<T, true> {
  using type = typename Bare<T>::Fields;
};

template <class... Tuples>
using Concatenated = decltype(std::tuple_cat(std::declval<Tuples>()...));

template <class T>
struct IsTuple : std::false_type {};
template <class... T>
struct IsTuple<std::tuple<T...>> : std::true_type {};

template <class Result, class Parameters, class Flat>
class Flattened;

// `function` called with its groups built from the flat parameters, which pybind11 binds.
template <class Result, class... Parameters, class... Flat>
class Flattened<Result, std::tuple<Parameters...>, std::tuple<Flat...>> {
 public:
  using Function = Result (*)(Parameters...);
  explicit Flattened(Function function) : function_(function) {}

  Result operator()(Flat... flat) const {
    const std::tuple<Flat&...> all(flat...);
    return call(all, std::index_sequence_for<Parameters...>());
  }

 private:
  // How many flat parameters each parameter takes (a trailing 0 keeps the array non-empty).
  static constexpr std::size_t counts[] = {
      std::tuple_size<typename FlatOf<Parameters>::type>::value..., 0};

  static constexpr std::size_t first_of(std::size_t parameter) {
    std::size_t first = 0;
    for (std::size_t i = 0; i < parameter; ++i) first += counts[i];
    return first;
  }

  template <class All, std::size_t... I>
  Result call(const All& all, std::index_sequence<I...>) const {
    return function_(parameter<I>(all)...);
  }

  template <std::size_t I, class All>
  static decltype(auto) parameter(const All& all) {
    using Parameter = Bare<std::tuple_element_t<I, std::tuple<Parameters...>>>;
    if constexpr (IsGroup<Parameter>::value) {
      return group<Parameter, first_of(I)>(all, std::make_index_sequence<counts[I]>());
    } else {
      return std::get<first_of(I)>(all);
    }
  }

  template <class Group, std::size_t First, class All, std::size_t... J>
  static Group group(const All& all, std::index_sequence<J...>) {
    return Group{std::get<First + J>(all)...};
  }

  Function function_;
};

}  // namespace detail

// `function` with each group parameter replaced by the group's fields.
template <class Result, class... Parameters>
auto flatten(Result (*function)(Parameters...)) {
  return detail::Flattened<Result, std::tuple<Parameters...>,
                           detail::Concatenated<typename detail::FlatOf<Parameters>::type...>>(
      function);
}

// The annotations of a binding as one tuple: the tuples among `pieces` (groups' arguments())
// spliced in, the other pieces (a py::arg, py::kw_only(), the docstring) as they are.
template <class... Pieces>
auto annotations(const Pieces&... pieces) {
  const auto as_tuple = [](const auto& piece) {
    if constexpr (detail::IsTuple<std::decay_t<decltype(piece)>>::value) {
      return piece;
    } else {
      return std::make_tuple(piece);
    }
  };
  return std::tuple_cat(as_tuple(pieces)...);
}

// module.def(name, flatten(function), annotations(pieces...)...).
template <class Result, class... Parameters, class... Pieces>
void def_function(py::module_& module, const char* name, Result (*function)(Parameters...),
                  const Pieces&... pieces) {
  std::apply([&](const auto&... annotation) { module.def(name, flatten(function), annotation...); },
             annotations(pieces...));
}

}  // namespace plsh_python

#endif  // PLSH_PYTHON_ARGUMENTS_HPP
