// Error decay: how fast the mean of s random block masks approaches the ALiBi factor matrix.
//
// The ALiBi factor K_ij = exp(-m|i-j|) is the expectation of the 0/1 co-membership matrix M of a
// random block partition drawn by plsh::RandomBinning, so K_hat = (1/s) sum_t M_t is an unbiased
// estimate of K. Being a mean of s independent matrices, its error falls like s^(-1/2) in every
// norm. For a few (n, slope) pairs this program prints the spectral norm ||K_hat - K||_2 and the
// largest entry error max |K_hat - K|_ij for s = 1, 4, 16, 64, 256, each averaged over a few
// seeds, next to an s^(-1/2) reference scaled to the s = 4 value, and the least-squares slope of
// log(error) against log(s) over s >= 4 (s = 1 is left out of the fit: a single mask is far from
// the asymptotic regime, and its entry errors are capped at 1).
//
// plsh::mask_error is dense (an O(n^3) symmetric eigenvalue solve); it is meant for studies like
// this one, not for the attention kernels, which never form an n x n matrix.
//
// Build it against an installed plsh with
//   find_package(plsh CONFIG REQUIRED)
//   target_link_libraries(my_program PRIVATE plsh::plsh)
// and compile with optimisation (-O2 or -O3): it runs in a few seconds (`error_decay --quick`: the
// first setting only, with two seeds).

#include <plsh/plsh.hpp>

#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

namespace {

/// Least-squares slope of log(y) against log(x) over the points with x >= x_min.
double log_log_slope(const std::vector<double>& x, const std::vector<double>& y, double x_min) {
  double count = 0, sx = 0, sy = 0, sxx = 0, sxy = 0;
  for (std::size_t k = 0; k < x.size(); ++k) {
    if (x[k] < x_min) continue;
    const double lx = std::log(x[k]);
    const double ly = std::log(y[k]);
    count += 1;
    sx += lx;
    sy += ly;
    sxx += lx * lx;
    sxy += lx * ly;
  }
  return (count * sxy - sx * sy) / (count * sxx - sx * sx);
}

struct Setting {
  plsh::Index n;
  double slope;
  int seeds;
};

}  // namespace

int main(int argc, char** argv) {
  const bool quick = argc > 1 && std::strcmp(argv[1], "--quick") == 0;
  const std::vector<double> samples = {1, 4, 16, 64, 256};
  const double fit_from = 4;
  std::vector<Setting> settings{{256, 1.0 / 8, 8}, {512, 1.0 / 16, 4}, {1024, 1.0 / 32, 4}};
  if (quick) settings = {{256, 1.0 / 8, 2}};

  for (const Setting& setting : settings) {
    const auto start = std::chrono::steady_clock::now();
    std::vector<double> spectral(samples.size(), 0.0);
    std::vector<double> max(samples.size(), 0.0);
    for (int seed = 0; seed < setting.seeds; ++seed) {
      // One independent stream per seed, as plsh_attention seeds its heads; every s gets its own
      // draws, so the rows of the table are independent.
      const plsh::RandomBinning sampler(setting.slope, plsh::head_seed(2024, seed));
      std::uint64_t first = 0;
      for (std::size_t k = 0; k < samples.size(); ++k) {
        const auto count = static_cast<plsh::Index>(samples[k]);
        const plsh::MaskError error =
            plsh::mask_error(setting.n, setting.slope, sampler.draw(count, first));
        first += static_cast<std::uint64_t>(count);
        spectral[k] += error.spectral / setting.seeds;
        max[k] += error.max / setting.seeds;
      }
    }
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();

    std::printf("n = %ld, slope = 1/%g, mean over %d seeds (%.1f s)\n",
                static_cast<long>(setting.n), 1 / setting.slope, setting.seeds, seconds);
    std::printf("  %5s  %12s  %12s  %12s  %12s\n", "s", "spectral", "c s^-1/2", "max", "c s^-1/2");
    const std::size_t reference = 1;  // the s = 4 row
    for (std::size_t k = 0; k < samples.size(); ++k) {
      const double scale = std::sqrt(samples[reference] / samples[k]);
      std::printf("  %5g  %12.4f  %12.4f  %12.4f  %12.4f\n", samples[k], spectral[k],
                  spectral[reference] * scale, max[k], max[reference] * scale);
    }
    std::printf("  %5s  %12.3f  %12.3f  %12.3f  %12.3f\n\n", "fit",
                log_log_slope(samples, spectral, fit_from), -0.5,
                log_log_slope(samples, max, fit_from), -0.5);
  }
  std::printf("fit: least-squares slope of log(error) against log(s) for s >= %g (theory -0.5)\n",
              fit_from);
  return 0;
}
