// AlibiKvCache: plsh::AlibiKvCache for decoding exact ALiBi with bounded memory and a certified
// bound per row, of float, double, Eigen::half or Eigen::bfloat16 behind one Python class; and
// plsh::CertificateError as plsh.CertificateError (a RuntimeError).

#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

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

// The Python AlibiKvCache: a plsh::AlibiKvCache of float, double, Eigen::half or Eigen::bfloat16
// behind one interface (cache_binding.hpp), with the dropped weight of its last step.
class AlibiKvCacheBase : public CacheInterface {
 public:
  virtual plsh::DroppedWeight dropped() const = 0;
  virtual py::array bounds() const = 0;
  virtual std::vector<Index> resident_per_head() const = 0;
  virtual std::vector<Index> windows() const = 0;
  virtual Index oldest_position(Index kv_head) const = 0;
  virtual std::vector<Index> pinned_positions(Index kv_head) const = 0;
  virtual plsh::AlibiCacheOptions options() const = 0;
};

template <class Scalar>
class AlibiKvCacheOf : public CacheOf<AlibiKvCacheBase, Scalar, plsh::AlibiKvCache<Scalar>> {
  using Base = CacheOf<AlibiKvCacheBase, Scalar, plsh::AlibiKvCache<Scalar>>;
  using typename Base::OutputRows;
  using typename Base::Rows;

 public:
  AlibiKvCacheOf(Index heads, Index kv_heads, Index dim, Index value_dim,
                 std::vector<double> slopes, const plsh::AlibiCacheOptions& options)
      : Base("AlibiKvCache", heads, kv_heads, dim, value_dim, std::move(slopes), options),
        heads_(heads) {}

  plsh::DroppedWeight dropped() const override {
    return this->locked([&] { return dropped_; });
  }
  py::array bounds() const override {
    return this->locked([&] {
      const std::vector<double>& bounds = this->cache_.bounds();
      const py::ssize_t rows = static_cast<py::ssize_t>(bounds.size()) / heads_;
      py::array_t<double> array(std::vector<py::ssize_t>{rows, static_cast<py::ssize_t>(heads_)});
      std::copy(bounds.begin(), bounds.end(), array.mutable_data());
      return py::array(std::move(array));
    });
  }
  std::vector<Index> resident_per_head() const override {
    return this->locked([&] {
      std::vector<Index> rows;
      for (Index g = 0; g < this->cache_.kv_heads(); ++g) rows.push_back(this->cache_.resident(g));
      return rows;
    });
  }
  std::vector<Index> windows() const override {
    std::vector<Index> windows;
    for (Index g = 0; g < this->cache_.kv_heads(); ++g) windows.push_back(this->cache_.window(g));
    return windows;
  }
  Index oldest_position(Index kv_head) const override {
    return this->locked([&] { return this->cache_.oldest_position(kv_head); });
  }
  std::vector<Index> pinned_positions(Index kv_head) const override {
    return this->locked([&] { return this->cache_.pinned_positions(kv_head); });
  }
  plsh::AlibiCacheOptions options() const override { return this->cache_.options(); }

 private:
  void attend_rows(const Rows& q, const OutputRows& out) override {
    try {
      dropped_ = this->cache_.attend(q, out);
    } catch (const plsh::CertificateError& error) {
      dropped_ = error.dropped();  // the step was taken
      throw;
    }
  }
  void decode_rows(const Rows& q, const Rows& k, const Rows& v, const OutputRows& out) override {
    try {
      dropped_ = this->cache_.decode(q, k, v, out);
    } catch (const plsh::CertificateError& error) {
      dropped_ = error.dropped();  // the step was taken
      throw;
    }
  }

  Index heads_;
  plsh::DroppedWeight dropped_;
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
      .def_property_readonly(
          "options",
          [](const AlibiKvCacheBase& self) {
            const plsh::AlibiCacheOptions options = self.options();
            return py::dict("tolerance"_a = options.tolerance, "max_score"_a = options.max_score,
                            "min_logit"_a = options.min_logit, "sinks"_a = options.sinks,
                            "strict"_a = options.strict, "softmax_scale"_a = options.scale,
                            "key_position"_a = options.key_position);
          },
          "The options the cache was made with (softmax_scale 0 meaning 1/sqrt(dim)).");
  bind_cache_members(cache);
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
