// Quickstart: ALiBi attention through Positional LSH next to exact ALiBi.
//
// 8 heads with the standard ALiBi slopes, causal, n = 4096 tokens (or the first argument:
// `quickstart 512` runs in a moment), head dim 64, float. For s = 1, 5, 20, 100 random partitions
// per head it prints the relative error of plsh_attention (fused and pass kernels) against exact
// ALiBi, and the wall time of every method.
//
// Build it against an installed plsh with
//   find_package(plsh CONFIG REQUIRED)
//   target_link_libraries(my_program PRIVATE plsh::plsh)
// and compile with -O3 -march=native (and -fopenmp for threads).

#include <plsh/plsh.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

namespace {

using Tensor = std::vector<float>;

// Token-major [n][heads][dim] data, uniform in [-amplitude, amplitude). q is scaled up so that
// attention is sharp enough for the bias to matter.
Tensor random_tensor(plsh::Index size, std::uint64_t seed, float amplitude) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<float> uniform(-amplitude, amplitude);
  Tensor tensor(static_cast<std::size_t>(size));
  for (float& x : tensor) x = uniform(engine);
  return tensor;
}

double relative_error(const Tensor& approx, const Tensor& truth) {
  double error = 0, norm = 0;
  for (std::size_t i = 0; i < truth.size(); ++i) {
    error += std::pow(double(approx[i]) - truth[i], 2);
    norm += std::pow(double(truth[i]), 2);
  }
  return std::sqrt(error / norm);
}

template <class Run>
double milliseconds(Run&& run) {
  const auto start = std::chrono::steady_clock::now();
  run();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - start)
      .count();
}

}  // namespace

int main(int argc, char** argv) {
  const plsh::Index n = argc > 1 ? std::atol(argv[1]) : 4096;
  const plsh::Index heads = 8, dim = 64;
  if (n < 1) {
    std::fprintf(stderr, "usage: quickstart [tokens >= 1]\n");
    return 2;
  }
  const Tensor q = random_tensor(n * heads * dim, 1, 4.0f);
  const Tensor k = random_tensor(n * heads * dim, 2, 1.0f);
  const Tensor v = random_tensor(n * heads * dim, 3, 1.0f);
  const std::vector<double> slopes = plsh::alibi_slopes(heads);

  const plsh::HeadsView<const float> q_view{q.data(), n, heads, dim};
  const plsh::HeadsView<const float> k_view{k.data(), n, heads, dim};
  const plsh::HeadsView<const float> v_view{v.data(), n, heads, dim};
  const auto out_view = [&](Tensor& out) {
    return plsh::HeadsView<float>{out.data(), n, heads, dim};
  };

  Tensor exact(q.size()), windowed(q.size()), out(q.size());
  plsh::AttentionOptions options;  // causal, scale 1/sqrt(dim)
  const double exact_ms = milliseconds([&] {
    plsh::exact_alibi_attention<float>(q_view, k_view, v_view, out_view(exact), slopes, options);
  });
  const double windowed_ms = milliseconds([&] {
    plsh::windowed_alibi_attention<float>(q_view, k_view, v_view, out_view(windowed), slopes, 1e-6,
                                          options);
  });

  std::printf(
      "plsh quickstart: n = %ld, %ld heads (standard ALiBi slopes), d = %ld, causal, float\n\n",
      static_cast<long>(n), static_cast<long>(heads), static_cast<long>(dim));
  std::printf("| method             |   s | rel. error vs exact | time (ms) |\n");
  std::printf("|--------------------|-----|---------------------|-----------|\n");
  std::printf("| exact ALiBi        |   - | %19.2e | %9.1f |\n", 0.0, exact_ms);
  std::printf("| windowed (1e-6)    |   - | %19.2e | %9.1f |\n", relative_error(windowed, exact),
              windowed_ms);
  bool all_finite = std::isfinite(relative_error(windowed, exact));
  for (const plsh::Index samples : {1, 5, 20, 100}) {
    for (const plsh::Kernel kernel : {plsh::Kernel::Fused, plsh::Kernel::Passes}) {
      plsh::PlshOptions plsh_options;
      plsh_options.samples = samples;
      plsh_options.near_field = 0;  // block masks only: the error falls like s^(-1/2)
      plsh_options.seed = 2026;
      plsh_options.kernel = kernel;
      const double ms = milliseconds([&] {
        plsh::plsh_attention<float>(q_view, k_view, v_view, out_view(out), slopes, plsh_options);
      });
      std::printf("| plsh %-13s | %3ld | %19.2e | %9.1f |\n",
                  kernel == plsh::Kernel::Fused ? "(fused)" : "(passes)",
                  static_cast<long>(samples), relative_error(out, exact), ms);
      all_finite = all_finite && std::isfinite(relative_error(out, exact));
    }
  }
  std::printf(
      "\nThe error of Positional LSH falls like s^(-1/2); the fused kernel computes each score\n"
      "once, so its time grows only like log(s).\n");
  return all_finite ? 0 : 1;
}
