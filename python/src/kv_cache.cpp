// KvCache: plsh::KvCache for incremental causal decoding, of float, double, Eigen::half or
// Eigen::bfloat16 behind one Python class.

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cstddef>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include <plsh/plsh.hpp>

#include "arguments.hpp"
#include "arrays.hpp"
#include "bindings.hpp"
#include "options.hpp"

namespace plsh_python {

namespace {

// The Python KvCache: a plsh::KvCache of float, double, Eigen::half or Eigen::bfloat16 behind one
// interface. A mutex keeps calls from several Python threads (the GIL is released inside) from
// racing on the cache.
class KvCacheBase {
 public:
  virtual ~KvCacheBase() = default;
  virtual void append(const py::object& k, const py::object& v) = 0;
  virtual py::array attend(const py::object& q, const py::object& out) = 0;
  virtual py::array decode(const py::object& q, const py::object& k, const py::object& v,
                           const py::object& out) = 0;
  virtual Index position() const = 0;
  virtual Index resident() const = 0;
  virtual Index oldest_position() const = 0;
  virtual std::size_t bytes() const = 0;
  virtual py::dtype dtype() const = 0;
  virtual py::array keys() const = 0;
  virtual py::array values() const = 0;
  virtual Index heads() const = 0;
  virtual Index kv_heads() const = 0;
  virtual Index dim() const = 0;
  virtual Index value_dim() const = 0;
  virtual std::vector<double> slopes() const = 0;
  virtual plsh::PlshOptions options() const = 0;
};

template <class Scalar>
class KvCacheOf : public KvCacheBase {
 public:
  KvCacheOf(Index heads, Index kv_heads, Index dim, Index value_dim, std::vector<double> slopes,
            const plsh::PlshOptions& options)
      : heads_(heads),
        value_dim_(value_dim),
        cache_(heads, kv_heads, dim, value_dim, std::move(slopes), options) {}

  void append(const py::object& k, const py::object& v) override {
    const Arrays arrays = arrays_of({{"k", k}, {"v", v}});
    const Input<Scalar> k_in = arrays.input<Scalar>(0);
    const Input<Scalar> v_in = arrays.input<Scalar>(1);
    py::gil_scoped_release release;
    const std::lock_guard<std::mutex> lock(mutex_);
    cache_.append(k_in.view[0], v_in.view[0]);
  }

  py::array attend(const py::object& q, const py::object& out) override {
    const Arrays arrays = arrays_of({{"q", q}});
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Output<Scalar> result = output_for(arrays, out);
    {
      py::gil_scoped_release release;
      const std::lock_guard<std::mutex> lock(mutex_);
      cache_.attend(q_in.view[0], result.view[0]);
    }
    return result.array;
  }

  py::array decode(const py::object& q, const py::object& k, const py::object& v,
                   const py::object& out) override {
    const Arrays arrays = arrays_of({{"q", q}, {"k", k}, {"v", v}});
    const Input<Scalar> q_in = arrays.input<Scalar>(0);
    const Input<Scalar> k_in = arrays.input<Scalar>(1);
    const Input<Scalar> v_in = arrays.input<Scalar>(2);
    const Output<Scalar> result = output_for(arrays, out);
    {
      py::gil_scoped_release release;
      const std::lock_guard<std::mutex> lock(mutex_);
      cache_.decode(q_in.view[0], k_in.view[0], v_in.view[0], result.view[0]);
    }
    return result.array;
  }

  Index position() const override {
    return locked([&] { return cache_.position(); });
  }
  Index resident() const override {
    return locked([&] { return cache_.resident(); });
  }
  Index oldest_position() const override {
    return locked([&] { return cache_.oldest_position(); });
  }
  std::size_t bytes() const override {
    return locked([&] { return cache_.bytes(); });
  }
  py::dtype dtype() const override { return numpy_dtype(storage_of<Scalar>()); }
  py::array keys() const override {
    return locked([&] { return copy_of(cache_.keys()); });
  }
  py::array values() const override {
    return locked([&] { return copy_of(cache_.values()); });
  }
  Index heads() const override { return cache_.heads(); }
  Index kv_heads() const override { return cache_.kv_heads(); }
  Index dim() const override { return cache_.dim(); }
  Index value_dim() const override { return cache_.value_dim(); }
  std::vector<double> slopes() const override { return cache_.slopes(); }
  plsh::PlshOptions options() const override { return cache_.options(); }

 private:
  template <class F>
  auto locked(F&& f) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return f();
  }

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

  static Arrays arrays_of(std::initializer_list<std::pair<const char*, py::object>> named) {
    return cache_arrays<Scalar>("KvCache", named);
  }
  Output<Scalar> output_for(const Arrays& arrays, const py::object& out) const {
    return cache_output<Scalar>(arrays, out, heads_, value_dim_);
  }

  Index heads_;
  Index value_dim_;
  plsh::KvCache<Scalar> cache_;
  mutable std::mutex mutex_;
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
      .def_property_readonly("position", &KvCacheBase::position,
                             "The position of the next appended token (tokens appended so far).")
      .def_property_readonly("resident", &KvCacheBase::resident,
                             "The number of tokens whose keys and values the cache holds.")
      .def_property_readonly("oldest_position", &KvCacheBase::oldest_position,
                             "The position of the oldest resident token.")
      .def_property_readonly("heads", &KvCacheBase::heads)
      .def_property_readonly("kv_heads", &KvCacheBase::kv_heads)
      .def_property_readonly("dim", &KvCacheBase::dim)
      .def_property_readonly("value_dim", &KvCacheBase::value_dim)
      .def_property_readonly("alibi_slopes", &KvCacheBase::slopes, "The slopes, one per head.")
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
          "The options the cache was made with (softmax_scale 0 meaning 1/sqrt(dim)).")
      .def_property_readonly("dtype", &KvCacheBase::dtype,
                             "The NumPy dtype of the cache's arrays (uint16 for bfloat16).");
}

}  // namespace plsh_python
