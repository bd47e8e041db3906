/// \file plsh_frontier.cpp
/// The accuracy-time frontier of the ALiBi kernels (Google Benchmark): for each input set and
/// method, the time per call and two errors against exact ALiBi.
///
/// Benchmarks are named `frontier/<set>/<method>/<parameter>`:
/// - `exact/float`: plsh::exact_alibi_attention in float;
/// - `windowed/<tolerance>`: plsh::windowed_alibi_attention, the certified window, tolerance
///   1e-1 ... 1e-6 (every row drops keys of total exact-ALiBi weight at most the tolerance);
/// - `fused/<s>`, `fused_lhs/<s>`, `fused_near/<s>`: plsh_attention (Kernel::Fused) with s = 5,
///   10, 20, 50, 100 partitions per head, seed 0: drawn independently (Sampling::Independent) or
///   as a Latin hypercube (Sampling::LatinHypercube) with block masks only, or as a Latin
///   hypercube with the exact factor where it is at least 0.05 (near_field = 0.05: the defaults
///   of PlshOptions at s = 100);
/// - `fixed_blocks/<b>`: plsh::fixed_block_attention, block size b = 64, 256, 1024.
/// All causal, float, 8 heads with plsh::alibi_slopes(8), scale 1/sqrt(d).
///
/// Input sets (token-major [n][8][d], d = d_v):
/// - `normal`: n = 8192, d = 64, q, k, v ~ N(0, 1) (Box-Muller on plsh::detail::CounterRandom,
///   seeds 1, 2, 3).
/// - `peaked`: n = 8192, d = 64, q, k ~ N(0, 9) (the normal set's q and k times 3), v ~ N(0, 1),
///   with a far "sink" key in every head: coordinate 0 of every query is set to 3 and key 0 is
///   80 e_0 (zero but for coordinate 0), so every query scores it scale q_i.k_0 = 3 * 80 / 8 = 30,
///   where the other scores are about N(0, 9^2): the sink is 30 above the typical score, so it
///   takes much of the exact-ALiBi weight of the early rows of the gentle heads, at distances
///   where a window by the ALiBi factor alone would drop it.
/// - `trained`: n = 2048, d = 12, the q, k and v of the last layer of the miniature model of
///   docs/accuracy (examples/python/lm.py, ALiBi, seed 1) on the first 2048 bytes of its
///   validation text, dumped by examples/python/qk_dump.py --qkv-out into
///   docs/accuracy/qkv.bin (IEEE half precision; `--trained=FILE` reads another dump). The
///   model was trained with these slopes, alibi_slopes(8).
///
/// Errors (counters), against o* = plsh::exact_alibi_attention<double> on the same inputs
/// converted to double (computed once per set, outside the timed region), of the output o of the
/// last timed call:
/// - `relative_error`: ||o - o*||_F / ||o*||_F over all rows and heads;
/// - `largest_row_error`: max over rows i and heads h of ||o_ih - o*_ih||_2 / ||o*_ih||_2 (a row
///   whose exact output is zero counts its absolute error ||o_ih||_2).
/// Also `n` and `dim`. Times are wall time (`/real_time`); run with OMP_NUM_THREADS=1 for
/// single-thread figures (bench/regenerate.sh frontier does), and read the cpu_time on a shared
/// machine. About 5 minutes on one core with --benchmark_min_time=1 and 3 repetitions.

#include <benchmark/benchmark.h>

#include <Eigen/Core>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <fstream>
#include <functional>
#include <iostream>
#include <memory>
#include <stdexcept>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

#include <plsh/plsh.hpp>

namespace {

using plsh::Index;

constexpr Index kHeads = 8;
constexpr Index kRandomLength = 8192;
constexpr Index kRandomDim = 64;
/// The peaked set: q, k times 3; every query's coordinate 0 is 3 and k_0 = 80 e_0, so that
/// scale q_i.k_0 = 3 * 80 / sqrt(64) = 30.
constexpr double kPeakedScale = 3;
constexpr double kSinkQuery = 3;
constexpr double kSinkKey = 80;

#if defined(PLSH_FRONTIER_TRAINED)
const char* const kDefaultTrainedFile = PLSH_FRONTIER_TRAINED;
#else
const char* const kDefaultTrainedFile = "docs/accuracy/qkv.bin";
#endif

/// One input set: float inputs [n][heads][dim] and the exact-ALiBi output in double.
struct InputSet {
  std::string name;
  Index n = 0;
  Index dim = 0;
  std::vector<float> q, k, v, out;
  std::vector<double> truth;

  plsh::HeadsView<const float> view(const std::vector<float>& data) const {
    return plsh::HeadsView<const float>{data.data(), n, kHeads, dim};
  }
  plsh::HeadsView<float> output() { return plsh::HeadsView<float>{out.data(), n, kHeads, dim}; }
};

/// Element i is a standard normal number: Box-Muller on the uniforms (i, 0) and (i, 1) of
/// CounterRandom(seed), the same numbers on every platform.
std::vector<float> normal_values(std::size_t count, std::uint64_t seed, double scale) {
  const plsh::detail::CounterRandom random(seed);
  const double two_pi = 2 * std::acos(-1.0);
  std::vector<float> values(count);
  for (std::size_t i = 0; i < count; ++i) {
    const double radius = std::sqrt(-2 * std::log(random.unit(i, 0)));
    values[i] = static_cast<float>(scale * radius * std::cos(two_pi * random.unit(i, 1)));
  }
  return values;
}

void random_set(InputSet& set, bool peaked) {
  set.n = kRandomLength;
  set.dim = kRandomDim;
  const auto size = static_cast<std::size_t>(set.n * kHeads * set.dim);
  const double scale = peaked ? kPeakedScale : 1.0;
  set.q = normal_values(size, 1, scale);
  set.k = normal_values(size, 2, scale);
  set.v = normal_values(size, 3, 1.0);
  if (peaked) {
    for (Index row = 0; row < set.n * kHeads; ++row) {
      set.q[static_cast<std::size_t>(row * set.dim)] = static_cast<float>(kSinkQuery);
    }
    for (Index h = 0; h < kHeads; ++h) {
      const auto first = set.k.begin() + h * set.dim;
      std::fill(first, first + set.dim, 0.0f);
      *first = static_cast<float>(kSinkKey);
    }
  }
}

/// The dump of examples/python/qk_dump.py --qkv-out: int64 layer, heads, tokens, dim, then q, k
/// and v in IEEE half precision, [tokens][heads][dim] each.
void trained_set(InputSet& set, const std::string& file) {
  std::ifstream in(file, std::ios::binary);
  if (!in) throw std::runtime_error("cannot open " + file);
  std::int64_t header[4];
  in.read(reinterpret_cast<char*>(header), sizeof(header));
  if (!in || header[1] != kHeads || header[2] < 1 || header[3] < 1) {
    throw std::runtime_error(file + " is not a dump of " + std::to_string(kHeads) + " heads");
  }
  set.n = header[2];
  set.dim = header[3];
  const auto size = static_cast<std::size_t>(set.n * kHeads * set.dim);
  std::vector<std::uint16_t> bits(size);
  for (std::vector<float>* tensor : {&set.q, &set.k, &set.v}) {
    in.read(reinterpret_cast<char*>(bits.data()),
            static_cast<std::streamsize>(size * sizeof(std::uint16_t)));
    if (!in) throw std::runtime_error(file + " is shorter than its header says");
    tensor->resize(size);
    std::transform(bits.begin(), bits.end(), tensor->begin(), [](std::uint16_t b) {
      return static_cast<float>(Eigen::half(Eigen::half_impl::raw_uint16_to_half(b)));
    });
  }
}

std::vector<double> to_double(const std::vector<float>& values) {
  return std::vector<double>(values.begin(), values.end());
}

/// The inputs of `name` with their exact output; only the latest set is kept.
InputSet& input_set(const std::string& name, const std::string& trained_file) {
  static std::unique_ptr<InputSet> cached;
  if (cached && cached->name == name) return *cached;
  cached.reset();
  auto set = std::make_unique<InputSet>();
  set->name = name;
  if (name == "trained") {
    trained_set(*set, trained_file);
  } else {
    random_set(*set, name == "peaked");
  }
  set->out.assign(set->v.size(), 0.0f);
  const std::vector<double> q = to_double(set->q);
  const std::vector<double> k = to_double(set->k);
  const std::vector<double> v = to_double(set->v);
  set->truth.assign(v.size(), 0.0);
  const auto view = [&](const std::vector<double>& data) {
    return plsh::HeadsView<const double>{data.data(), set->n, kHeads, set->dim};
  };
  plsh::exact_alibi_attention<double>(
      view(q), view(k), view(v),
      plsh::HeadsView<double>{set->truth.data(), set->n, kHeads, set->dim},
      plsh::alibi_slopes(kHeads));
  cached = std::move(set);
  return *cached;
}

struct Errors {
  double relative;     // ||o - o*||_F / ||o*||_F
  double largest_row;  // max over rows and heads of ||o_ih - o*_ih|| / ||o*_ih||
};

Errors errors(const InputSet& set) {
  double difference = 0;
  double norm = 0;
  double largest_row = 0;
  const auto dim = static_cast<std::size_t>(set.dim);
  for (std::size_t row = 0; row < set.truth.size(); row += dim) {
    double row_difference = 0;
    double row_norm = 0;
    for (std::size_t e = row; e < row + dim; ++e) {
      const double delta = static_cast<double>(set.out[e]) - set.truth[e];
      row_difference += delta * delta;
      row_norm += set.truth[e] * set.truth[e];
    }
    difference += row_difference;
    norm += row_norm;
    const double row_error =
        row_norm > 0 ? std::sqrt(row_difference / row_norm) : std::sqrt(row_difference);
    largest_row = std::max(largest_row, row_error);
  }
  return Errors{std::sqrt(difference / norm), largest_row};
}

/// One method: a name, its parameter as written in the benchmark's name, and the call.
struct Method {
  std::string name;
  std::string parameter;
  std::function<void(InputSet&)> run;
};

std::vector<Method> methods() {
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  std::vector<Method> list;
  list.push_back({"exact", "float", [slopes](InputSet& x) {
                    plsh::exact_alibi_attention<float>(x.view(x.q), x.view(x.k), x.view(x.v),
                                                       x.output(), slopes);
                  }});
  const std::pair<const char*, double> tolerances[] = {{"1e-1", 1e-1}, {"1e-2", 1e-2},
                                                       {"1e-3", 1e-3}, {"1e-4", 1e-4},
                                                       {"1e-5", 1e-5}, {"1e-6", 1e-6}};
  for (const auto& [label, tolerance] : tolerances) {
    list.push_back({"windowed", label, [slopes, tolerance = tolerance](InputSet& x) {
                      plsh::windowed_alibi_attention<float>(x.view(x.q), x.view(x.k), x.view(x.v),
                                                            x.output(), slopes, tolerance);
                    }});
  }
  const std::tuple<const char*, plsh::Sampling, double> estimators[] = {
      {"fused", plsh::Sampling::Independent, 0.0},
      {"fused_lhs", plsh::Sampling::LatinHypercube, 0.0},
      {"fused_near", plsh::Sampling::LatinHypercube, 0.05}};
  for (const auto& [family, sampling, near_field] : estimators) {
    for (const Index samples : {5, 10, 20, 50, 100}) {
      plsh::PlshOptions options;
      options.samples = samples;
      options.sampling = sampling;
      options.near_field = near_field;
      list.push_back({family, std::to_string(samples), [slopes, options](InputSet& x) {
                        plsh::plsh_attention<float>(x.view(x.q), x.view(x.k), x.view(x.v),
                                                    x.output(), slopes, options);
                      }});
    }
  }
  for (const Index block_size : {64, 256, 1024}) {
    list.push_back({"fixed_blocks", std::to_string(block_size), [block_size](InputSet& x) {
                      plsh::fixed_block_attention<float>(x.view(x.q), x.view(x.k), x.view(x.v),
                                                         x.output(), block_size);
                    }});
  }
  return list;
}

void frontier_benchmark(benchmark::State& state, const std::string& set_name,
                        const std::string& trained_file, const Method& method) {
  InputSet* set = nullptr;
  try {
    set = &input_set(set_name, trained_file);
  } catch (const std::exception& error) {
    state.SkipWithError(error.what());
    for (auto _ : state) {
    }
    return;
  }
  for (auto _ : state) {
    method.run(*set);
    benchmark::DoNotOptimize(set->out.data());
    benchmark::ClobberMemory();
  }
  const Errors error = errors(*set);
  state.counters["relative_error"] = error.relative;
  state.counters["largest_row_error"] = error.largest_row;
  state.counters["n"] = static_cast<double>(set->n);
  state.counters["dim"] = static_cast<double>(set->dim);
}

void register_benchmarks(const std::string& trained_file) {
  for (const char* set : {"normal", "peaked", "trained"}) {
    for (const Method& method : methods()) {
      const std::string name =
          std::string("frontier/") + set + "/" + method.name + "/" + method.parameter;
      benchmark::RegisterBenchmark(
          name.c_str(),
          [set = std::string(set), trained_file, method](benchmark::State& state) {
            frontier_benchmark(state, set, trained_file, method);
          })
          ->Unit(benchmark::kMillisecond)
          ->UseRealTime();
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  benchmark::Initialize(&argc, argv);
  std::string trained_file = kDefaultTrainedFile;
  const std::string trained_flag = "--trained=";
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument.rfind(trained_flag, 0) == 0) {
      trained_file = argument.substr(trained_flag.size());
    } else {
      std::cerr << "plsh_frontier: unknown argument " << argument
                << " (besides Google Benchmark's flags: --trained=FILE)\n";
      return 2;
    }
  }
  benchmark::AddCustomContext("trained_file", trained_file);
  register_benchmarks(trained_file);
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
