/// \file plsh_accuracy.cpp
/// Error and speed of each ALiBi method against exact ALiBi attention.
///
/// Problem: n tokens (default 4096, `--n=N`), 8 heads with plsh::alibi_slopes(8), d = d_v = 64,
/// causal, float. q and k are uniform in [-2, 2] (2 (2U - 1) from plsh::detail::CounterRandom):
/// with scale 1/sqrt(64) a logit q.k/8 has standard deviation sqrt(64 (4/3)^2)/8 = 4/3, so the
/// attention weights of one row spread over about e^(+-2.7) and are far from uniform; v is
/// uniform in [-1, 1].
///
/// Truth: plsh::exact_alibi_attention in double on the same (float-rounded) inputs. For each
/// method the float output's relative Frobenius error over all heads, ||out - truth||_F /
/// ||truth||_F, the median wall time of 3 runs and the speed-up against the float exact kernel
/// are printed as a markdown table; `--json=FILE` also writes them as JSON (read by plot.py).
/// Threads: omp_get_max_threads(); run with OMP_NUM_THREADS=1 for single-thread times.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <fstream>
#include <functional>
#include <iostream>
#include <string>
#include <vector>

#include <plsh/plsh.hpp>

#include "../tests/fill.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using plsh::Index;

constexpr Index kHeads = 8;
constexpr Index kDim = 64;
constexpr Index kValueDim = 64;
constexpr double kQueryKeyRange = 2;  // q, k uniform in [-2, 2]
constexpr double kWindowTolerance = 1e-6;
constexpr int kTimedRuns = 3;

template <class Scalar>
struct Tensors {
  std::vector<Scalar> q, k, v;
};

/// Element i of a tensor seeded `seed` is range (2 U(i) - 1) (the tests' fill, tests/fill.hpp).
std::vector<float> uniform(std::size_t size, std::uint64_t seed, double range) {
  return plsh_test::uniform_values<float>(size, seed, range);
}

struct Method {
  std::string name;       // family, as in plsh_bench
  std::string parameter;  // "s=20", "b=64", "tolerance=1e-06" or ""
  std::function<void(const Tensors<float>&, std::vector<float>&)> run;
};

struct Result {
  std::string name;
  std::string parameter;
  double relative_error;
  double median_seconds;
  double median_cpu_seconds;
  double speedup;
};

double relative_frobenius_error(const std::vector<float>& out, const std::vector<double>& truth) {
  double difference = 0;
  double norm = 0;
  for (std::size_t i = 0; i < truth.size(); ++i) {
    const double delta = static_cast<double>(out[i]) - truth[i];
    difference += delta * delta;
    norm += truth[i] * truth[i];
  }
  return std::sqrt(difference / norm);
}

double median(std::vector<double> values) {
  std::sort(values.begin(), values.end());
  return values[values.size() / 2];
}

struct Timing {
  double wall_seconds;  // median wall time
  double cpu_seconds;   // median processor time of the process (all threads)
};

/// On a shared machine the wall time includes the time other processes held the core; the
/// processor time does not, so both are reported.
Timing median_time(const std::function<void()>& run) {
  std::vector<double> wall;
  std::vector<double> cpu;
  for (int i = 0; i < kTimedRuns; ++i) {
    const auto start = std::chrono::steady_clock::now();
    const std::clock_t cpu_start = std::clock();
    run();
    const std::clock_t cpu_stop = std::clock();
    const auto stop = std::chrono::steady_clock::now();
    wall.push_back(std::chrono::duration<double>(stop - start).count());
    cpu.push_back(static_cast<double>(cpu_stop - cpu_start) / CLOCKS_PER_SEC);
  }
  return Timing{median(wall), median(cpu)};
}

std::vector<Method> methods(Index n) {
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  const auto views = [n](const Tensors<float>& in, std::vector<float>& out) {
    struct Views {
      plsh::HeadsView<const float> q, k, v;
      plsh::HeadsView<float> out;
    };
    return Views{{in.q.data(), n, kHeads, kDim},
                 {in.k.data(), n, kHeads, kDim},
                 {in.v.data(), n, kHeads, kValueDim},
                 {out.data(), n, kHeads, kValueDim}};
  };
  std::vector<Method> list;
  list.push_back({"exact", "", [=](const Tensors<float>& in, std::vector<float>& out) {
                    const auto x = views(in, out);
                    plsh::exact_alibi_attention<float>(x.q, x.k, x.v, x.out, slopes);
                  }});
  list.push_back(
      {"windowed", "tolerance=1e-06", [=](const Tensors<float>& in, std::vector<float>& out) {
         const auto x = views(in, out);
         plsh::windowed_alibi_attention<float>(x.q, x.k, x.v, x.out, slopes, kWindowTolerance);
       }});
  for (const plsh::Kernel kernel : {plsh::Kernel::Passes, plsh::Kernel::Fused}) {
    for (const Index samples : {5, 20, 100}) {
      plsh::PlshOptions options;
      options.samples = samples;
      options.kernel = kernel;
      list.push_back({kernel == plsh::Kernel::Passes ? "passes" : "fused",
                      "s=" + std::to_string(samples),
                      [=](const Tensors<float>& in, std::vector<float>& out) {
                        const auto x = views(in, out);
                        plsh::plsh_attention<float>(x.q, x.k, x.v, x.out, slopes, options);
                      }});
    }
  }
  for (const Index block_size : {64, 256}) {
    list.push_back({"fixed_blocks", "b=" + std::to_string(block_size),
                    [=](const Tensors<float>& in, std::vector<float>& out) {
                      const auto x = views(in, out);
                      plsh::fixed_block_attention<float>(x.q, x.k, x.v, x.out, block_size);
                    }});
  }
  return list;
}

int threads() {
#if defined(_OPENMP)
  return omp_get_max_threads();
#else
  return 1;
#endif
}

void print_table(Index n, const std::vector<Result>& results) {
  std::printf(
      "ALiBi attention, n = %ld, %ld heads, d = %ld, causal, float, q and k uniform in "
      "[-%g, %g], %d thread(s)\n"
      "Error: relative Frobenius norm against exact ALiBi in double. Times: median of %d runs "
      "(wall; processor time of all threads); speed-up: exact wall time / method wall time.\n\n",
      static_cast<long>(n), static_cast<long>(kHeads), static_cast<long>(kDim), kQueryKeyRange,
      kQueryKeyRange, threads(), kTimedRuns);
  std::printf(
      "| method | parameter | relative error | time (ms) | cpu time (ms) | speed-up vs exact |\n");
  std::printf("|---|---|---:|---:|---:|---:|\n");
  for (const Result& result : results) {
    std::printf("| %s | %s | %.3e | %.2f | %.2f | %.2f |\n", result.name.c_str(),
                result.parameter.c_str(), result.relative_error, 1e3 * result.median_seconds,
                1e3 * result.median_cpu_seconds, result.speedup);
  }
}

void write_json(const std::string& path, Index n, const std::vector<Result>& results) {
  std::ofstream file(path);
  if (!file) {
    std::fprintf(stderr, "plsh_accuracy: cannot write %s\n", path.c_str());
    std::exit(1);
  }
  file.precision(9);
  file << "{\n  \"n\": " << n << ",\n  \"heads\": " << kHeads << ",\n  \"dim\": " << kDim
       << ",\n  \"value_dim\": " << kValueDim << ",\n  \"causal\": true,\n  \"scalar\": \"float\""
       << ",\n  \"query_key_range\": " << kQueryKeyRange << ",\n  \"threads\": " << threads()
       << ",\n  \"timed_runs\": " << kTimedRuns << ",\n  \"methods\": [\n";
  for (std::size_t i = 0; i < results.size(); ++i) {
    const Result& result = results[i];
    file << "    {\"method\": \"" << result.name << "\", \"parameter\": \"" << result.parameter
         << "\", \"relative_error\": " << result.relative_error
         << ", \"median_seconds\": " << result.median_seconds
         << ", \"median_cpu_seconds\": " << result.median_cpu_seconds
         << ", \"speedup\": " << result.speedup << "}" << (i + 1 < results.size() ? "," : "")
         << "\n";
  }
  file << "  ]\n}\n";
}

[[noreturn]] void usage(const char* program) {
  std::fprintf(stderr, "usage: %s [--n=N] [--json=FILE]\n  N: tokens, at least 1 (default 4096)\n",
               program);
  std::exit(2);
}

}  // namespace

int main(int argc, char** argv) {
  Index n = 4096;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    if (argument.rfind("--n=", 0) == 0) {
      char* end = nullptr;
      const long long value = std::strtoll(argument.c_str() + 4, &end, 10);
      if (end == argument.c_str() + 4 || *end != '\0' || value < 1) usage(argv[0]);
      n = static_cast<Index>(value);
    } else if (argument.rfind("--json=", 0) == 0 && argument.size() > 7) {
      json_path = argument.substr(7);
    } else {
      usage(argv[0]);
    }
  }

  const auto size = static_cast<std::size_t>(n * kHeads * kDim);
  Tensors<float> inputs{uniform(size, 1, kQueryKeyRange), uniform(size, 2, kQueryKeyRange),
                        uniform(static_cast<std::size_t>(n * kHeads * kValueDim), 3, 1)};
  const auto widen = [](const std::vector<float>& values) {
    return std::vector<double>(values.begin(), values.end());
  };
  const Tensors<double> wide{widen(inputs.q), widen(inputs.k), widen(inputs.v)};
  std::vector<double> truth(static_cast<std::size_t>(n * kHeads * kValueDim));
  plsh::exact_alibi_attention<double>(
      {wide.q.data(), n, kHeads, kDim}, {wide.k.data(), n, kHeads, kDim},
      {wide.v.data(), n, kHeads, kValueDim}, {truth.data(), n, kHeads, kValueDim},
      plsh::alibi_slopes(kHeads));

  std::vector<Result> results;
  std::vector<float> out(truth.size());
  double exact_seconds = 0;
  for (const Method& method : methods(n)) {
    std::fill(out.begin(), out.end(), 0.0f);
    const Timing timing = median_time([&] { method.run(inputs, out); });
    if (method.name == "exact") exact_seconds = timing.wall_seconds;
    results.push_back(Result{method.name, method.parameter, relative_frobenius_error(out, truth),
                             timing.wall_seconds, timing.cpu_seconds,
                             exact_seconds / timing.wall_seconds});
  }
  print_table(n, results);
  if (!json_path.empty()) write_json(json_path, n, results);
  return 0;
}
