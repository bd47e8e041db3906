// Matrix-free norms of the mask error E = K_hat - K (error_norms.hpp): the exact max norm and the
// Lanczos spectral norm (Spectra) with the accuracy figure's settings (tolerance 1e-6, basis 30),
// slope 1/16 (the middle of the 8 standard slopes), at n = 1024, s = 5 (the smoke test's size),
// n = 2*10^5, s = 20 (a spectrum whose top is clustered: thousands of products) and n = 10^6,
// s = 100. One iteration each beyond 10^5 (seconds to a minute). Counters: the norm and, for the
// spectral norm, the operator products (deterministic) and whether the solver converged.

#include <benchmark/benchmark.h>

#include <string>
#include <utility>
#include <vector>

#include <plsh/analysis.hpp>
#include <plsh/sampler.hpp>

namespace {

using plsh::Index;

constexpr double kSlope = 1.0 / 16;

/// The first draws of the stream head_seed(2024, 4): at n = 2*10^5, s = 20 the largest
/// |eigenvalues| of its error lie close together, the case where Lanczos needs many products.
std::vector<plsh::Grid> grids_of(Index samples) {
  return plsh::RandomBinning(kSlope, plsh::head_seed(2024, 4)).draw(samples);
}

void mask_max_norm(benchmark::State& state, Index n, Index samples) {
  const std::vector<plsh::Grid> grids = grids_of(samples);
  double norm = 0;
  for (auto _ : state) {
    norm = plsh::mask_max_error(n, kSlope, grids);
    benchmark::DoNotOptimize(norm);
  }
  state.counters["norm"] = norm;
}

#ifdef PLSH_HAS_SPECTRA
void mask_spectral_norm(benchmark::State& state, Index n, Index samples) {
  const std::vector<plsh::Grid> grids = grids_of(samples);
  plsh::LanczosOptions lanczos;
  lanczos.tolerance = 1e-6;
  lanczos.basis_size = 30;
  plsh::SpectralNorm norm;
  for (auto _ : state) {
    norm = plsh::mask_spectral_error(n, kSlope, grids, 0, lanczos);
    benchmark::DoNotOptimize(norm.value);
  }
  state.counters["norm"] = norm.value;
  state.counters["products"] = static_cast<double>(norm.products);
  state.counters["converged"] = norm.converged ? 1 : 0;
}
#endif

bool register_norm_benchmarks() {
  const std::pair<Index, Index> sizes[] = {{1024, 5}, {200000, 20}, {1000000, 100}};
  for (const auto& [n, samples] : sizes) {
    const std::string suffix = "/" + std::to_string(n) + "/" + std::to_string(samples);
    benchmark::RegisterBenchmark(
        ("mask_max_norm" + suffix).c_str(),
        [n = n, samples = samples](benchmark::State& state) { mask_max_norm(state, n, samples); })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(n > 100000 ? 1 : 10);
#ifdef PLSH_HAS_SPECTRA
    benchmark::RegisterBenchmark(("mask_spectral_norm" + suffix).c_str(),
                                 [n = n, samples = samples](benchmark::State& state) {
                                   mask_spectral_norm(state, n, samples);
                                 })
        ->Unit(benchmark::kMillisecond)
        ->UseRealTime()
        ->Iterations(n > 100000 ? 1 : 10);
#endif
  }
  return true;
}

[[maybe_unused]] const bool registered = register_norm_benchmarks();

}  // namespace
