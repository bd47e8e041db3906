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
// Two further modes write the data of docs/accuracy/ (docs/accuracy/regenerate.sh runs them):
//   error_decay --masks OUT.json [BUDGET [N]]   matrix-free spectral and max-norm mask errors
//                                     (error_norms.hpp) for n = 10^3 .. 10^6 (or N alone),
//                                     s = 1 .. 1000 and the 8 standard slopes, on the points with
//                                     n * s <= BUDGET (default 10^8), with their times;
//   error_decay --time OUT.json N S   both norms at one (N, S) for the slopes 1/16, 1/256, 1/2,
//                                     with the figure's Lanczos settings: the timings;
//   error_decay --attention QK OUT.json   attention-matrix errors (attention_error.hpp) of the
//                                     trained q, k that examples/python/qk_dump.py wrote to QK,
//                                     every layer and head, s = 1 .. 1000.
// They need Spectra (Debian: libspectra-dev) for the Lanczos solver.
//
// Build it against an installed plsh with
//   find_package(plsh CONFIG REQUIRED)
//   target_link_libraries(my_program PRIVATE plsh::plsh)
// and compile with optimisation (-O2 or -O3): it runs in a few seconds (`error_decay --quick`: the
// first setting only, with two seeds).

#include <plsh/analysis.hpp>
#include <plsh/plsh.hpp>

#include <Eigen/Core>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <ostream>
#include <string>
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

#ifdef PLSH_HAS_SPECTRA

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

/// The sample counts of the figures: 1, 3, 10, ... 1000.
const std::vector<plsh::Index> kFigureSamples = {1, 3, 10, 30, 100, 300, 1000};

/// Lanczos settings of the figures: the norm to six significant digits (tolerance 1e-6), plenty
/// for a log-log plot, convergence tested every 30 steps, at most 30,000 steps. A mean of few
/// masks has clusters of nearly equal top eigenvalues (blocks of equal size), which take
/// thousands of products; a point that still does not converge keeps the largest Ritz value (a
/// lower bound of the norm), flagged "converged": false.
plsh::LanczosOptions figure_lanczos() {
  plsh::LanczosOptions options;
  options.basis_size = 30;
  options.tolerance = 1e-6;
  options.max_restarts = 1000;
  return options;
}

/// One point of the mask figure: both norms of the first s draws of slope h's stream and their
/// times, printed and appended to `out` as a JSON object.
void mask_point(std::ostream& out, plsh::Index n, double slope, plsh::Index h, plsh::Index s,
                const plsh::LanczosOptions& lanczos) {
  const plsh::RandomBinning sampler(slope, plsh::head_seed(2024, h));
  const std::vector<plsh::Grid> grids = sampler.draw(s);
  auto start = std::chrono::steady_clock::now();
  const plsh::SpectralNorm spectral = plsh::mask_spectral_error(n, slope, grids, 0, lanczos);
  const double spectral_seconds = seconds_since(start);
  start = std::chrono::steady_clock::now();
  const double max = plsh::mask_max_error(n, slope, grids);
  const double max_seconds = seconds_since(start);
  std::printf(
      "n = %7ld  slope = 1/%-4g  s = %4ld  spectral %.4e (%s, %ld products, %.2f s)  "
      "max %.4e (%.2f s)\n",
      static_cast<long>(n), 1 / slope, static_cast<long>(s), spectral.value,
      spectral.converged ? "converged" : "NOT converged", static_cast<long>(spectral.products),
      spectral_seconds, max, max_seconds);
  std::fflush(stdout);
  out << "{\"n\": " << n << ", \"slope\": " << slope << ", \"s\": " << s
      << ", \"spectral\": " << spectral.value
      << ", \"converged\": " << (spectral.converged ? "true" : "false")
      << ", \"products\": " << spectral.products << ", \"spectral_seconds\": " << spectral_seconds
      << ", \"max\": " << max << ", \"max_seconds\": " << max_seconds << "}";
}

/// Mask errors for every (n, slope, s) with n * s <= budget: the first s draws of one stream per
/// slope (the same draws at every n), spectral norm by Lanczos (figure_lanczos), max norm exactly.
/// n is 10^3, 10^4, 10^5 and 10^6, or `length` alone when it is > 0.
/// With `only_n` > 0: that n and that s only, for the slopes 1/16, 1/256 and 1/2: the timing of
/// the matrix-free norms.
int write_mask_figure(const char* path, double budget, plsh::Index only_n, plsh::Index only_s,
                      plsh::Index length = 0) {
  std::ofstream out(path);
  if (!out) return std::fprintf(stderr, "error_decay: cannot write %s\n", path), 1;
  // The timing runs three slopes of the 8, the middle one first: 1/16, 1/256, 1/2.
  const std::vector<double> all_slopes = plsh::alibi_slopes(8);
  const std::vector<double> slopes =
      only_n > 0 ? std::vector<double>{all_slopes[3], all_slopes[7], all_slopes[0]} : all_slopes;
  out << "{\"budget_n_times_s\": " << budget << ", \"points\": [\n";
  bool first = true;
  const std::vector<plsh::Index> lengths =
      only_n > 0   ? std::vector<plsh::Index>{only_n}
      : length > 0 ? std::vector<plsh::Index>{length}
                   : std::vector<plsh::Index>{1000, 10000, 100000, 1000000};
  const std::vector<plsh::Index> samples =
      only_n > 0 ? std::vector<plsh::Index>{only_s} : kFigureSamples;
  for (const plsh::Index n : lengths) {
    for (std::size_t h = 0; h < slopes.size(); ++h) {
      for (const plsh::Index s : samples) {
        if (only_n == 0 && static_cast<double>(n) * static_cast<double>(s) > budget) continue;
        out << (first ? "" : ",\n");
        const auto stream = static_cast<plsh::Index>(
            std::find(all_slopes.begin(), all_slopes.end(), slopes[h]) - all_slopes.begin());
        mask_point(out, n, slopes[h], stream, s, figure_lanczos());
        first = false;
        out.flush();
      }
    }
  }
  out << "\n]}\n";
  return 0;
}

/// E = A_plsh - A_alibi as a dense matrix, with the products largest_singular_value needs.
struct DenseOperator {
  const Eigen::MatrixXd& matrix;
  plsh::Index rows() const { return matrix.rows(); }
  plsh::Index cols() const { return matrix.cols(); }
  void product(const double* x, double* y) const {
    Eigen::Map<Eigen::VectorXd>(y, rows()).noalias() =
        matrix * Eigen::Map<const Eigen::VectorXd>(x, cols());
  }
  void transpose_product(const double* u, double* y) const {
    Eigen::Map<Eigen::VectorXd>(y, cols()).noalias() =
        matrix.transpose() * Eigen::Map<const Eigen::VectorXd>(u, rows());
  }
};

/// Attention errors of every layer and head of the q, k that qk_dump.py wrote, causal, for
/// s = 1 .. 1000, with the grids plsh_attention draws for seed 0: the dense matrices of
/// attention_error.hpp, the spectral norm by Lanczos over dense products. One point per layer is
/// checked against the matrix-free attention_error (kernel products).
int write_attention_figure(const char* qk_path, const char* path) {
  std::ifstream in(qk_path, std::ios::binary);
  std::int64_t header[4];
  if (!in.read(reinterpret_cast<char*>(header), sizeof header)) {
    return std::fprintf(stderr, "error_decay: cannot read %s\n", qk_path), 1;
  }
  const plsh::Index layers = header[0], heads = header[1], tokens = header[2], dim = header[3];
  std::ofstream out(path);
  if (!out) return std::fprintf(stderr, "error_decay: cannot write %s\n", path), 1;
  const std::vector<double> slopes = plsh::alibi_slopes(heads);
  out << "{\"layers\": " << layers << ", \"heads\": " << heads << ", \"tokens\": " << tokens
      << ", \"dim\": " << dim << ", \"points\": [\n";
  bool first = true;
  std::vector<double> q(static_cast<std::size_t>(tokens * dim)), k(q.size());
  for (plsh::Index layer = 0; layer < layers; ++layer) {
    for (plsh::Index h = 0; h < heads; ++h) {
      const auto bytes = static_cast<std::streamsize>(q.size() * sizeof(double));
      if (!in.read(reinterpret_cast<char*>(q.data()), bytes) ||
          !in.read(reinterpret_cast<char*>(k.data()), bytes)) {
        return std::fprintf(stderr, "error_decay: %s is too short\n", qk_path), 1;
      }
      const plsh::HeadsView<const double> q_view{q.data(), tokens, 1, dim};
      const plsh::HeadsView<const double> k_view{k.data(), tokens, 1, dim};
      const double slope = slopes[static_cast<std::size_t>(h)];
      const Eigen::MatrixXd alibi = plsh::alibi_attention_matrix<double>(q_view, k_view, slope);
      for (const plsh::Index s : kFigureSamples) {
        const auto start = std::chrono::steady_clock::now();
        const std::vector<plsh::Grid> grids =
            plsh::draw_head_grids(slopes, s)[static_cast<std::size_t>(h)];
        const Eigen::MatrixXd error =
            plsh::plsh_attention_matrix<double>(q_view, k_view, grids) - alibi;
        const plsh::SpectralNorm spectral =
            plsh::largest_singular_value(DenseOperator{error}, figure_lanczos());
        const double max = error.cwiseAbs().maxCoeff();
        const double frobenius = error.norm();
        const double seconds = seconds_since(start);
        std::printf(
            "layer %ld head %ld slope 1/%-4g s = %4ld  spectral %.4e (%s)  max %.4e  "
            "frobenius %.4e (%.2f s)\n",
            static_cast<long>(layer), static_cast<long>(h), 1 / slope, static_cast<long>(s),
            spectral.value, spectral.converged ? "converged" : "NOT converged", max, frobenius,
            seconds);
        std::fflush(stdout);
        out << (first ? "" : ",\n") << "{\"layer\": " << layer << ", \"head\": " << h
            << ", \"slope\": " << slope << ", \"s\": " << s << ", \"spectral\": " << spectral.value
            << ", \"converged\": " << (spectral.converged ? "true" : "false")
            << ", \"max\": " << max << ", \"frobenius\": " << frobenius;
        first = false;
        if (h == 0 && s == 10) {
          // The matrix-free norms (forward and backward kernels) at one point per layer.
          const auto check_start = std::chrono::steady_clock::now();
          const plsh::AttentionErrorNorms matrix_free =
              plsh::attention_error<double>(q_view, k_view, slope, grids, {}, figure_lanczos());
          out << ", \"matrix_free\": {\"spectral\": " << matrix_free.spectral.value
              << ", \"converged\": " << (matrix_free.spectral.converged ? "true" : "false")
              << ", \"max\": " << matrix_free.max << ", \"frobenius\": " << matrix_free.frobenius
              << ", \"seconds\": " << seconds_since(check_start) << "}";
          std::printf("  matrix-free: spectral %.10e (%s; dense %.10e), max %.4e\n",
                      matrix_free.spectral.value,
                      matrix_free.spectral.converged ? "converged" : "NOT converged",
                      spectral.value, matrix_free.max);
        }
        out << "}";
      }
    }
  }
  out << "\n]}\n";
  return 0;
}

#endif  // PLSH_HAS_SPECTRA

/// The figure modes: 0 or 1 when `argv` asked for one, -1 otherwise.
int figure_mode(int argc, char** argv) {
  const bool masks = argc >= 3 && argc <= 5 && std::strcmp(argv[1], "--masks") == 0;
  const bool attention = argc == 4 && std::strcmp(argv[1], "--attention") == 0;
  const bool timing = argc == 5 && std::strcmp(argv[1], "--time") == 0;
  if (!masks && !attention && !timing) return -1;
#ifdef PLSH_HAS_SPECTRA
  if (masks) {
    return write_mask_figure(argv[2], argc >= 4 ? std::atof(argv[3]) : 1e8, 0, 0,
                             argc == 5 ? std::atol(argv[4]) : 0);
  }
  if (timing) {
    return write_mask_figure(argv[2], 0, std::atol(argv[3]), std::atol(argv[4]));
  }
  return write_attention_figure(argv[2], argv[3]);
#else
  std::fprintf(stderr, "error_decay: %s needs Spectra (Debian: libspectra-dev)\n", argv[1]);
  return 1;
#endif
}

}  // namespace

int main(int argc, char** argv) {
  const int figure = figure_mode(argc, argv);
  if (figure >= 0) return figure;
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
