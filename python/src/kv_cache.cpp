// KvCache: plsh::KvCache for incremental causal decoding, of float, double, Eigen::half or
// Eigen::bfloat16 behind one Python class.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include <plsh/plsh.hpp>

#include "arguments.hpp"
#include "arrays.hpp"
#include "bindings.hpp"
#include "cache_binding.hpp"
#include "options.hpp"

namespace plsh_python {

namespace {

// The Python KvCache: a plsh::KvCache of float, double, Eigen::half or Eigen::bfloat16 behind one
// interface (cache_binding.hpp).
class KvCacheBase : public CacheInterface {
 public:
  virtual Index oldest_position() const = 0;
  virtual py::array keys() const = 0;
  virtual py::array values() const = 0;
  virtual plsh::PlshOptions options() const = 0;
};

template <class Scalar>
class KvCacheOf : public CacheOf<KvCacheBase, Scalar, plsh::KvCache<Scalar>> {
  using Base = CacheOf<KvCacheBase, Scalar, plsh::KvCache<Scalar>>;

 public:
  KvCacheOf(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
            const plsh::PlshOptions& options)
      : Base("KvCache", heads, kv_heads, dim, value_dim, std::move(slopes), options) {}

  Index oldest_position() const override {
    return this->locked([&] { return this->cache_.oldest_position(); });
  }
  py::array keys() const override {
    return this->locked([&] { return copy_of(this->cache_.keys()); });
  }
  py::array values() const override {
    return this->locked([&] { return copy_of(this->cache_.values()); });
  }
  plsh::PlshOptions options() const override { return this->cache_.options(); }

 private:
  // A new array [tokens, heads, dim] holding the rows of `view`.
  static py::array copy_of(const plsh::HeadsView<const Scalar>& view) {
    py::array array(numpy_dtype(storage_of<Scalar>()),
                    std::vector<py::ssize_t>{view.tokens, view.heads, view.dim});
    auto* data = static_cast<Scalar*>(array.mutable_data());
    for (Index t = 0; t < view.tokens; ++t) {
      for (Index h = 0; h < view.heads; ++h) {
        const Scalar* row = view.data + t * view.token_stride + h * view.head_stride;
        std::copy(row, row + view.dim, data + (t * view.heads + h) * view.dim);
      }
    }
    return array;
  }
};

// The KvCache of `dtype` (a NumPy float dtype or "bfloat16") with these shapes and options.
std::unique_ptr<KvCacheBase> make_kv_cache(
    const py::object& heads_arg, const py::object& kv_heads_arg, const py::object& dim_arg,
    const py::object& value_dim_arg, const Slopes& slopes, const DrawArguments& draws,
    const py::object& softmax_scale, const py::object& key_position, const std::string& kernel,
    const py::object& dtype) {
  const Index heads = index(heads_arg, "heads");
  const Index kv_heads = index(kv_heads_arg, "kv_heads");
  const Index dim = index(dim_arg, "dim");
  const Index value_dim = index(value_dim_arg, "value_dim");
  auto options =
      plsh_options_of(AttentionArguments{true, softmax_scale, py::int_(0), key_position}, draws);
  options.kernel = kernel_of(kernel);
  const std::vector<double> slope_list = slopes_or_default(slopes, heads);
  const auto make = [&](auto scalar) -> std::unique_ptr<KvCacheBase> {
    using Scalar = decltype(scalar);
    return std::make_unique<KvCacheOf<Scalar>>(heads, kv_heads, dim, value_dim, slope_list,
                                               options);
  };
  return dispatch(storage_of_dtype(dtype), [&](auto scalar) { return make(scalar); });
}

}  // namespace

void bind_kv_cache(py::module_& m) {
  using namespace pybind11::literals;
  const auto none = py::none();
  py::class_<KvCacheBase> kv_cache(
      m, "KvCache",
      "Key/value cache for incremental causal Positional LSH decoding that forgets the keys no "
      "later query can reach. append(k, v) with k [n, kv_heads, dim], v [n, kv_heads, "
      "value_dim]; attend(q) for the queries at the newest positions, q [n, heads, dim] -> [n, "
      "heads, value_dim]; decode(q, k, v) both in one step. samples, seed, sampling and "
      "near_field choose the estimator as in plsh_attention. alibi_slopes None means the standard "
      "slopes alibi_slopes(heads); softmax_scale None means 1/sqrt(dim). dtype numpy.float32, "
      "numpy.float64, numpy.float16, or \"bfloat16\" (arrays of uint16 bit patterns, the "
      "convention of the kernels' dtype=\"bfloat16\"): the 16-bit types store the cache in half "
      "the bytes and compute in float32.");
  std::apply(
      [&](const auto&... annotation) {
        kv_cache.def(py::init(flatten(&make_kv_cache)), annotation...);
      },
      annotations("heads"_a, "kv_heads"_a, "dim"_a, "value_dim"_a, "alibi_slopes"_a = none,
                  py::kw_only(), DrawArguments::arguments(), "softmax_scale"_a = none,
                  "key_position"_a = 0, "kernel"_a = "fused",
                  "dtype"_a = py::module_::import("numpy").attr("float32")));
  kv_cache
      .def("append", &KvCacheBase::append, "k"_a, "v"_a,
           "Appends the keys and values of positions position .. position + n - 1 (k [n, "
           "kv_heads, dim], v [n, kv_heads, value_dim]), after forgetting the keys no query at "
           "`position` or later can reach.")
      .def("attend", &KvCacheBase::attend, "q"_a, "out"_a = none,
           "Outputs [n, heads, value_dim] of the queries q [n, heads, dim] at positions "
           "position - n .. position - 1; n at most the tokens of the last append. Equal (to "
           "rounding) to those rows of plsh_attention over the whole sequence.")
      .def("decode", &KvCacheBase::decode, "q"_a, "k"_a, "v"_a, "out"_a = none,
           "One decoding step: append(k, v) then attend(q) for the same n tokens, with the same "
           "result; every argument is checked before the cache changes, so a call that raises "
           "leaves it as it was.")
      .def_property_readonly("bytes", &KvCacheBase::bytes,
                             "Bytes of the key and value buffers (resident rows and room for "
                             "later appends); half as many for float16 and bfloat16 as for "
                             "float32.")
      .def("keys", &KvCacheBase::keys,
           "A copy of the resident keys [resident, kv_heads, dim], positions oldest_position .. "
           "position - 1.")
      .def("values", &KvCacheBase::values,
           "A copy of the resident values [resident, kv_heads, value_dim].")
      .def_property_readonly("resident", &KvCacheBase::resident,
                             "The number of tokens whose keys and values the cache holds.")
      .def_property_readonly("oldest_position", &KvCacheBase::oldest_position,
                             "The position of the oldest resident token.")
      .def_property_readonly(
          "options",
          [](const KvCacheBase& cache) {
            const plsh::PlshOptions options = cache.options();
            return py::dict(
                "samples"_a = options.samples, "seed"_a = options.seed,
                "sampling"_a = sampling_name(options.sampling), "near_field"_a = options.near_field,
                "kernel"_a = options.kernel == plsh::Kernel::Passes ? "passes" : "fused",
                "softmax_scale"_a = options.scale, "key_position"_a = options.key_position);
          },
          "The options the cache was made with (softmax_scale 0 meaning 1/sqrt(dim)).");
  bind_cache_members(kv_cache);
}

}  // namespace plsh_python
