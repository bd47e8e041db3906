// AlibiKvCache: plsh::AlibiKvCache for decoding exact ALiBi with bounded memory and a certified
// bound per row, of float, double, Eigen::half or Eigen::bfloat16 behind one Python class; and
// plsh::CertificateError as plsh.CertificateError (a RuntimeError).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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

// The Python AlibiKvCache: a plsh::AlibiKvCache of float, double, Eigen::half or Eigen::bfloat16
// behind one interface. A mutex keeps calls from several Python threads (the GIL is released
// inside) from racing on the cache.
class AlibiKvCacheBase {
 public:
  virtual ~AlibiKvCacheBase() = default;
  virtual void append(const py::object& k, const py::object& v) = 0;
  virtual py::array attend(const py::object& q, const py::object& out) = 0;
  virtual py::array decode(const py::object& q, const py::object& k, const py::object& v,
                           const py::object& out) = 0;
  virtual plsh::DroppedWeight dropped() const = 0;
  virtual py::array bounds() const = 0;
  virtual Index position() const = 0;
  virtual Index resident() const = 0;
  virtual std::vector<Index> resident_per_head() const = 0;
  virtual std::vector<Index> windows() const = 0;
  virtual Index oldest_position(Index kv_head) const = 0;
  virtual std::vector<Index> pinned_positions(Index kv_head) const = 0;
  virtual std::size_t bytes() const = 0;
  virtual py::dtype dtype() const = 0;
  virtual Index heads() const = 0;
  virtual Index kv_heads() const = 0;
  virtual Index dim() const = 0;
  virtual Index value_dim() const = 0;
  virtual std::vector<double> slopes() const = 0;
  virtual plsh::AlibiCacheOptions options() const = 0;
};

template <class Scalar>
class AlibiKvCacheOf : public AlibiKvCacheBase {
 public:
  AlibiKvCacheOf(Index heads, Index kv_heads, Index dim, Index value_dim,
                 std::vector<double> slopes, const plsh::AlibiCacheOptions& options)
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
      try {
        dropped_ = cache_.attend(q_in.view[0], result.view[0]);
      } catch (const plsh::CertificateError& error) {
        dropped_ = error.dropped();  // the step was taken
        throw;
      }
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
      try {
        dropped_ = cache_.decode(q_in.view[0], k_in.view[0], v_in.view[0], result.view[0]);
      } catch (const plsh::CertificateError& error) {
        dropped_ = error.dropped();  // the step was taken
        throw;
      }
    }
    return result.array;
  }

  plsh::DroppedWeight dropped() const override {
    return locked([&] { return dropped_; });
  }
  py::array bounds() const override {
    return locked([&] {
      const std::vector<double>& bounds = cache_.bounds();
      const py::ssize_t rows = static_cast<py::ssize_t>(bounds.size()) / heads_;
      py::array_t<double> array(std::vector<py::ssize_t>{rows, static_cast<py::ssize_t>(heads_)});
      std::copy(bounds.begin(), bounds.end(), array.mutable_data());
      return py::array(std::move(array));
    });
  }
  Index position() const override {
    return locked([&] { return cache_.position(); });
  }
  Index resident() const override {
    return locked([&] { return cache_.resident(); });
  }
  std::vector<Index> resident_per_head() const override {
    return locked([&] {
      std::vector<Index> rows;
      for (Index g = 0; g < cache_.kv_heads(); ++g) rows.push_back(cache_.resident(g));
      return rows;
    });
  }
  std::vector<Index> windows() const override {
    std::vector<Index> windows;
    for (Index g = 0; g < cache_.kv_heads(); ++g) windows.push_back(cache_.window(g));
    return windows;
  }
  Index oldest_position(Index kv_head) const override {
    return locked([&] { return cache_.oldest_position(kv_head); });
  }
  std::vector<Index> pinned_positions(Index kv_head) const override {
    return locked([&] { return cache_.pinned_positions(kv_head); });
  }
  std::size_t bytes() const override {
    return locked([&] { return cache_.bytes(); });
  }
  py::dtype dtype() const override { return numpy_dtype(storage_of<Scalar>()); }
  Index heads() const override { return cache_.heads(); }
  Index kv_heads() const override { return cache_.kv_heads(); }
  Index dim() const override { return cache_.dim(); }
  Index value_dim() const override { return cache_.value_dim(); }
  std::vector<double> slopes() const override { return cache_.slopes(); }
  plsh::AlibiCacheOptions options() const override { return cache_.options(); }

 private:
  template <class F>
  auto locked(F&& f) const {
    const std::lock_guard<std::mutex> lock(mutex_);
    return f();
  }

  static Arrays arrays_of(std::initializer_list<std::pair<const char*, py::object>> named) {
    return cache_arrays<Scalar>("AlibiKvCache", named);
  }
  Output<Scalar> output_for(const Arrays& arrays, const py::object& out) const {
    return cache_output<Scalar>(arrays, out, heads_, value_dim_);
  }

  Index heads_;
  Index value_dim_;
  plsh::AlibiKvCache<Scalar> cache_;
  plsh::DroppedWeight dropped_;
  mutable std::mutex mutex_;
};

// The AlibiKvCache of `dtype` (a NumPy float dtype or "bfloat16") with these shapes and options.
std::unique_ptr<AlibiKvCacheBase> make_alibi_kv_cache(
    const py::object& heads_arg, const py::object& kv_heads_arg, const py::object& dim_arg,
    const py::object& value_dim_arg, const Slopes& slopes, double tolerance, double max_score,
    double min_logit, const py::object& sinks, bool strict, const py::object& softmax_scale,
    const py::object& key_position, const py::object& dtype) {
  const Index heads = index(heads_arg, "heads");
  const Index kv_heads = index(kv_heads_arg, "kv_heads");
  const Index dim = index(dim_arg, "dim");
  const Index value_dim = index(value_dim_arg, "value_dim");
  plsh::AlibiCacheOptions options =
      options_of(AttentionArguments{true, softmax_scale, py::int_(0), key_position},
                 plsh::AlibiCacheOptions{});
  options.tolerance = tolerance;
  options.max_score = max_score;
  options.min_logit = min_logit;
  options.sinks = index(sinks, "sinks");
  options.strict = strict;
  const std::vector<double> slope_list = slopes_or_default(slopes, heads);
  return dispatch(storage_of_dtype(dtype), [&](auto scalar) -> std::unique_ptr<AlibiKvCacheBase> {
    using Scalar = decltype(scalar);
    return std::make_unique<AlibiKvCacheOf<Scalar>>(heads, kv_heads, dim, value_dim, slope_list,
                                                    options);
  });
}

}  // namespace

void bind_alibi_kv_cache(py::module_& m) {
  using namespace pybind11::literals;
  const auto none = py::none();
  py::register_exception<plsh::CertificateError>(m, "CertificateError", PyExc_RuntimeError);
  const plsh::AlibiCacheOptions defaults;
  py::class_<AlibiKvCacheBase> cache(
      m, "AlibiKvCache",
      "Key/value cache for decoding exact ALiBi with bounded memory and, for every row, a "
      "certified upper bound on the exact-ALiBi weight of the keys it dropped "
      "(plsh/alibi_kv_cache.hpp). Key/value head g keeps the newest W_g = ceil(ln(1 + "
      "exp(max_score - min_logit) / tolerance) / m_g) positions (m_g the smallest slope of its "
      "query heads) and pins the `sinks` keys of largest norm that left that window. Declared: "
      "|softmax_scale| |q| |k| <= max_score for the keys a row drops, softmax_scale q.k >= "
      "min_logit within its window; when that holds every bound is at most the tolerance, and a "
      "step whose bound is larger says so (certified False; with strict=True, CertificateError "
      "after the step). append(k, v) with k [n, kv_heads, dim], v [n, kv_heads, value_dim]; "
      "attend(q) for the queries at the newest positions, q [n, heads, dim] -> [n, heads, "
      "value_dim]; decode(q, k, v) both in one step. alibi_slopes None means alibi_slopes(heads); "
      "softmax_scale None means 1/sqrt(dim). dtype numpy.float32, numpy.float64, numpy.float16 or "
      "\"bfloat16\" (uint16 bit patterns).");
  std::apply(
      [&](const auto&... annotation) {
        cache.def(py::init(flatten(&make_alibi_kv_cache)), annotation...);
      },
      annotations("heads"_a, "kv_heads"_a, "dim"_a, "value_dim"_a, "alibi_slopes"_a = none,
                  py::kw_only(), "tolerance"_a = defaults.tolerance,
                  "max_score"_a = defaults.max_score, "min_logit"_a = defaults.min_logit,
                  "sinks"_a = defaults.sinks, "strict"_a = false, "softmax_scale"_a = none,
                  "key_position"_a = 0, "dtype"_a = py::module_::import("numpy").attr("float32")));
  cache
      .def("append", &AlibiKvCacheBase::append, "k"_a, "v"_a,
           "Appends the keys and values of positions position .. position + n - 1, after each "
           "key/value head has let go of the positions before position - W_g + 1.")
      .def("attend", &AlibiKvCacheBase::attend, "q"_a, "out"_a = none,
           "Outputs [n, heads, value_dim] of the queries at positions position - n .. position - "
           "1 (n at most the tokens of the last append): exact ALiBi over the keys each head "
           "holds. Sets bound, certified and bounds.")
      .def("decode", &AlibiKvCacheBase::decode, "q"_a, "k"_a, "v"_a, "out"_a = none,
           "One decoding step: append(k, v) then attend(q) for the same n tokens, with the same "
           "result; a ValueError leaves the cache as it was.")
      .def_property_readonly(
          "bound", [](const AlibiKvCacheBase& self) { return self.dropped().bound; },
          "The largest bound of the last step over its rows and heads: an upper bound on the "
          "exact-ALiBi weight (over the whole prefix) of the keys a row did not attend.")
      .def_property_readonly(
          "certified", [](const AlibiKvCacheBase& self) { return self.dropped().certified; },
          "Whether the last step's bound is at most the tolerance.")
      .def_property_readonly("bounds", &AlibiKvCacheBase::bounds,
                             "The bound of every row and head of the last step, [n, heads].")
      .def_property_readonly("position", &AlibiKvCacheBase::position,
                             "The position of the next appended token.")
      .def_property_readonly("resident", &AlibiKvCacheBase::resident,
                             "The most rows (window and pinned keys) a key/value head holds.")
      .def_property_readonly("resident_per_head", &AlibiKvCacheBase::resident_per_head,
                             "The rows each key/value head holds.")
      .def_property_readonly("windows", &AlibiKvCacheBase::windows,
                             "W_g of each key/value head (2**63 - 1: every key kept).")
      .def("oldest_position", &AlibiKvCacheBase::oldest_position, "kv_head"_a,
           "The first position of the window of a key/value head.")
      .def("pinned_positions", &AlibiKvCacheBase::pinned_positions, "kv_head"_a,
           "The positions of the pinned keys of a key/value head, oldest first.")
      .def_property_readonly("bytes", &AlibiKvCacheBase::bytes,
                             "Bytes of the rows held and of the blocks of dropped positions.")
      .def_property_readonly("heads", &AlibiKvCacheBase::heads)
      .def_property_readonly("kv_heads", &AlibiKvCacheBase::kv_heads)
      .def_property_readonly("dim", &AlibiKvCacheBase::dim)
      .def_property_readonly("value_dim", &AlibiKvCacheBase::value_dim)
      .def_property_readonly("alibi_slopes", &AlibiKvCacheBase::slopes, "The slopes, one per head.")
      .def_property_readonly(
          "options",
          [](const AlibiKvCacheBase& self) {
            const plsh::AlibiCacheOptions options = self.options();
            return py::dict("tolerance"_a = options.tolerance, "max_score"_a = options.max_score,
                            "min_logit"_a = options.min_logit, "sinks"_a = options.sinks,
                            "strict"_a = options.strict, "softmax_scale"_a = options.scale,
                            "key_position"_a = options.key_position);
          },
          "The options the cache was made with (softmax_scale 0 meaning 1/sqrt(dim)).")
      .def_property_readonly("dtype", &AlibiKvCacheBase::dtype,
                             "The NumPy dtype of the cache's arrays (uint16 for bfloat16).");
  m.def(
      "alibi_cache_window",
      [](double slope, double tolerance, double max_score, double min_logit) {
        plsh::AlibiCacheOptions options;
        options.tolerance = tolerance;
        options.max_score = max_score;
        options.min_logit = min_logit;
        return plsh::alibi_cache_window(slope, options);
      },
      "slope"_a, py::kw_only(), "tolerance"_a = defaults.tolerance,
      "max_score"_a = defaults.max_score, "min_logit"_a = defaults.min_logit,
      "The window of AlibiKvCache for one slope: ceil(ln(1 + exp(max_score - min_logit) / "
      "tolerance) / slope), at least 1; 2**63 - 1 when every key is kept (slope or tolerance 0).");
}

}  // namespace plsh_python
