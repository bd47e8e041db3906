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
/// The fused kernel runs with independent draws ("fused") and with Latin hypercube draws
/// ("fused_lhs", PlshOptions::sampling = Sampling::LatinHypercube).
///
/// Sampler study (after the table; `--seeds=S`, default 64, 0 skips it): the seed-to-seed mean
/// and standard deviation, over seeds 0 .. S-1, of
///   - the mask error of one head, mask_error(n_mask, m, grids) (spectral and max norm, dense;
///     n_mask = `--mask-n`, default 1024) for m = 1/2, 1/16, 1/256, and
///   - the relative Frobenius error of plsh_attention (fused, float) against the truth above,
/// at s = 5, 20, 100, for three ways of drawing a head's s partitions: independent draws, the
/// Latin hypercube of latin_hypercube_grids, and a randomly shifted Kronecker sequence (draw t
/// takes the uniforms frac(Delta_c + t alpha_c) with alpha = (phi^-1, phi^-2, phi^-3), phi^4 =
/// phi + 1, the R3 sequence; computed here only, as the second construction compared). The
/// relative change of the mean against independent draws is printed with its standard error,
/// sqrt(sd_a^2 + sd_b^2) / sqrt(S) over the independent mean.
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

#include <plsh/analysis.hpp>
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
  const auto add_plsh = [&](const char* name, plsh::Kernel kernel, plsh::Sampling sampling) {
    for (const Index samples : {5, 20, 100}) {
      plsh::PlshOptions options;
      options.samples = samples;
      options.kernel = kernel;
      options.sampling = sampling;
      options.near_field = 0;  // the block estimator
      list.push_back({name, "s=" + std::to_string(samples),
                      [=](const Tensors<float>& in, std::vector<float>& out) {
                        const auto x = views(in, out);
                        plsh::plsh_attention<float>(x.q, x.k, x.v, x.out, slopes, options);
                      }});
    }
  };
  add_plsh("passes", plsh::Kernel::Passes, plsh::Sampling::Independent);
  add_plsh("fused", plsh::Kernel::Fused, plsh::Sampling::Independent);
  add_plsh("fused_lhs", plsh::Kernel::Fused, plsh::Sampling::LatinHypercube);
  for (const Index block_size : {64, 256}) {
    list.push_back({"fixed_blocks", "b=" + std::to_string(block_size),
                    [=](const Tensors<float>& in, std::vector<float>& out) {
                      const auto x = views(in, out);
                      plsh::fixed_block_attention<float>(x.q, x.k, x.v, x.out, block_size);
                    }});
  }
  return list;
}

// ---------------------------------------------------------------------------------------------
// Sampler study: independent, Latin hypercube and shifted Kronecker draws over many seeds.
// ---------------------------------------------------------------------------------------------

enum class Draws { Independent, LatinHypercube, Kronecker };
constexpr Draws kDraws[] = {Draws::Independent, Draws::LatinHypercube, Draws::Kronecker};
constexpr std::size_t kDrawKinds = 3;

const char* draws_name(Draws draws) {
  switch (draws) {
    case Draws::Independent:
      return "independent";
    case Draws::LatinHypercube:
      return "latin_hypercube";
    case Draws::Kronecker:
      return "shifted_kronecker";
  }
  return "";
}

/// 2^64 frac(phi^-c), c = 1, 2, 3, with phi = 1.2207440846... the positive root of x^4 = x + 1.
constexpr std::uint64_t kKroneckerStep[3] = {0xd1b54a32d192ed03ULL, 0xabc98388fb8fac02ULL,
                                             0x8cb92ba72f3d8dd7ULL};

/// Draw t takes uniform c from the 64-bit fixed-point number Delta_c + t alpha_c (mod 2^64),
/// Delta_c = word (0, c) of CounterRandom(seed): a uniformly random shift of the whole sequence,
/// so every uniform has exactly the law of detail::open_unit of a random word, as in
/// RandomBinning.
std::vector<plsh::Grid> kronecker_grids(double slope, std::uint64_t seed, Index count) {
  const plsh::detail::CounterRandom random(seed);
  std::uint64_t offset[3];
  for (std::uint64_t c = 0; c < 3; ++c) offset[c] = random.word(0, c);
  std::vector<plsh::Grid> grids;
  for (Index t = 0; t < count; ++t) {
    double u[3];
    for (std::size_t c = 0; c < 3; ++c) {
      u[c] = plsh::detail::open_unit(offset[c] + static_cast<std::uint64_t>(t) * kKroneckerStep[c]);
    }
    grids.push_back(plsh::detail::binning_grid(slope, u[0], u[1], u[2]));
  }
  return grids;
}

std::vector<std::vector<plsh::Grid>> study_grids(Draws draws, const std::vector<double>& slopes,
                                                 Index samples, std::uint64_t seed) {
  if (draws == Draws::Kronecker) {
    std::vector<std::vector<plsh::Grid>> grids;
    for (std::size_t h = 0; h < slopes.size(); ++h) {
      grids.push_back(
          kronecker_grids(slopes[h], plsh::head_seed(seed, static_cast<Index>(h)), samples));
    }
    return grids;
  }
  plsh::PlshOptions options;
  options.samples = samples;
  options.seed = seed;
  options.sampling =
      draws == Draws::LatinHypercube ? plsh::Sampling::LatinHypercube : plsh::Sampling::Independent;
  return plsh::kernel_grids(slopes, options);
}

struct Statistic {
  double mean;
  double sd;  // standard deviation over seeds
};

Statistic statistic(const std::vector<double>& values) {
  const double count = static_cast<double>(values.size());
  double mean = 0;
  for (const double value : values) mean += value / count;
  double sum = 0;
  for (const double value : values) sum += (value - mean) * (value - mean);
  return Statistic{mean, values.size() > 1 ? std::sqrt(sum / (count - 1)) : 0.0};
}

struct StudyRow {
  std::string error;  // mask_spectral, mask_max, attention
  double slope;       // of the mask; 0 for the attention output (all heads)
  Index samples;
  Statistic by_draws[kDrawKinds];
};

struct Study {
  int seeds;
  Index mask_n;
  std::vector<StudyRow> rows;
};

const Index kStudySamples[] = {5, 20, 100};

Study sampler_study(int seeds, Index mask_n, const Tensors<float>& inputs,
                    const std::vector<double>& truth, Index n) {
  Study study{seeds, mask_n, {}};
  const std::vector<double> slopes = plsh::alibi_slopes(kHeads);
  for (const double slope : {1.0 / 2, 1.0 / 16, 1.0 / 256}) {
    for (const Index samples : kStudySamples) {
      StudyRow spectral{"mask_spectral", slope, samples, {}};
      StudyRow max{"mask_max", slope, samples, {}};
      for (std::size_t d = 0; d < kDrawKinds; ++d) {
        std::vector<double> spectral_errors, max_errors;
        for (int seed = 0; seed < seeds; ++seed) {
          const auto grids =
              study_grids(kDraws[d], {slope}, samples, static_cast<std::uint64_t>(seed));
          const plsh::MaskError error = plsh::mask_error(mask_n, slope, grids[0]);
          spectral_errors.push_back(error.spectral);
          max_errors.push_back(error.max);
        }
        spectral.by_draws[d] = statistic(spectral_errors);
        max.by_draws[d] = statistic(max_errors);
      }
      study.rows.push_back(spectral);
      study.rows.push_back(max);
    }
  }
  std::vector<float> out(truth.size());
  const plsh::HeadsView<const float> q{inputs.q.data(), n, kHeads, kDim};
  const plsh::HeadsView<const float> k{inputs.k.data(), n, kHeads, kDim};
  const plsh::HeadsView<const float> v{inputs.v.data(), n, kHeads, kValueDim};
  const plsh::HeadsView<float> out_view{out.data(), n, kHeads, kValueDim};
  for (const Index samples : kStudySamples) {
    StudyRow attention{"attention", 0.0, samples, {}};
    for (std::size_t d = 0; d < kDrawKinds; ++d) {
      std::vector<double> errors;
      for (int seed = 0; seed < seeds; ++seed) {
        const auto grids =
            study_grids(kDraws[d], slopes, samples, static_cast<std::uint64_t>(seed));
        plsh::detail::fused_attention<float>(q, k, v, out_view, grids, slopes, {});
        errors.push_back(relative_frobenius_error(out, truth));
      }
      attention.by_draws[d] = statistic(errors);
    }
    study.rows.push_back(attention);
  }
  return study;
}

std::string slope_name(double slope) {
  return slope == 0 ? std::string("all") : "1/" + std::to_string(std::lround(1 / slope));
}

void print_study(Index n, const Study& study) {
  std::printf(
      "\nSampler study: mean +- standard deviation over seeds 0..%d of the mask error of one head "
      "(mask_error, n = %ld, dense) and of the attention output's relative Frobenius error "
      "(fused, float, n = %ld, all %ld heads); change: relative difference of the means against "
      "independent draws +- its standard error.\n\n",
      study.seeds - 1, static_cast<long>(study.mask_n), static_cast<long>(n),
      static_cast<long>(kHeads));
  std::printf(
      "| error | slope | s | independent | Latin hypercube | change | shifted Kronecker | change "
      "|\n|---|---|---:|---:|---:|---:|---:|---:|\n");
  const double root_seeds = std::sqrt(static_cast<double>(study.seeds));
  for (const StudyRow& row : study.rows) {
    const Statistic& base = row.by_draws[0];
    std::printf("| %s | %s | %ld | %.4g ± %.2g", row.error.c_str(), slope_name(row.slope).c_str(),
                static_cast<long>(row.samples), base.mean, base.sd);
    for (std::size_t d = 1; d < kDrawKinds; ++d) {
      const Statistic& other = row.by_draws[d];
      const double change = (other.mean - base.mean) / base.mean;
      const double error =
          std::sqrt(base.sd * base.sd + other.sd * other.sd) / root_seeds / base.mean;
      std::printf(" | %.4g ± %.2g | %+.1f%% ± %.1f%%", other.mean, other.sd, 100 * change,
                  100 * error);
    }
    std::printf(" |\n");
  }
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

void write_json(const std::string& path, Index n, const std::vector<Result>& results,
                const Study& study) {
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
  file << "  ],\n  \"sampler_study\": {\"seeds\": " << study.seeds
       << ", \"mask_n\": " << study.mask_n << ", \"rows\": [\n";
  for (std::size_t i = 0; i < study.rows.size(); ++i) {
    const StudyRow& row = study.rows[i];
    file << "    {\"error\": \"" << row.error << "\", \"slope\": " << row.slope
         << ", \"samples\": " << row.samples;
    for (std::size_t d = 0; d < kDrawKinds; ++d) {
      file << ", \"" << draws_name(kDraws[d]) << "\": {\"mean\": " << row.by_draws[d].mean
           << ", \"sd\": " << row.by_draws[d].sd << "}";
    }
    file << "}" << (i + 1 < study.rows.size() ? "," : "") << "\n";
  }
  file << "  ]}\n}\n";
}

[[noreturn]] void usage(const char* program) {
  std::fprintf(stderr,
               "usage: %s [--n=N] [--seeds=S] [--mask-n=M] [--json=FILE]\n"
               "  N: tokens, at least 1 (default 4096)\n"
               "  S: seeds of the sampler study, 0 skips it (default 64)\n"
               "  M: positions of the study's mask errors, at least 1 (default 1024)\n",
               program);
  std::exit(2);
}

/// The value of `--name=value` when `argument` starts with `--name=`: an integer of at least
/// `minimum`, or the usage message.
bool integer_option(const std::string& argument, const std::string& name, long long minimum,
                    const char* program, long long& value) {
  const std::string prefix = "--" + name + "=";
  if (argument.rfind(prefix, 0) != 0) return false;
  const char* begin = argument.c_str() + prefix.size();
  char* end = nullptr;
  value = std::strtoll(begin, &end, 10);
  if (end == begin || *end != '\0' || value < minimum) usage(program);
  return true;
}

}  // namespace

int main(int argc, char** argv) {
  Index n = 4096;
  int seeds = 64;
  Index mask_n = 1024;
  std::string json_path;
  for (int i = 1; i < argc; ++i) {
    const std::string argument = argv[i];
    long long value = 0;
    if (integer_option(argument, "n", 1, argv[0], value)) {
      n = static_cast<Index>(value);
    } else if (integer_option(argument, "seeds", 0, argv[0], value)) {
      seeds = static_cast<int>(std::min(value, 1LL << 20));
    } else if (integer_option(argument, "mask-n", 1, argv[0], value)) {
      mask_n = static_cast<Index>(value);
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
  Study study{seeds, mask_n, {}};
  if (seeds > 0) {
    study = sampler_study(seeds, mask_n, inputs, truth, n);
    print_study(n, study);
  }
  if (!json_path.empty()) write_json(json_path, n, results, study);
  return 0;
}
