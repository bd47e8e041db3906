// A million tokens: causal ALiBi attention through Positional LSH (fused kernel, s = 20) over
// n = 2^20 tokens in one call, in float and in bfloat16 storage.
//
// 8 heads with the standard ALiBi slopes, head dim 64, q, k, v uniform in [-1, 1). For each
// storage type it prints the time of the call, the bytes of q, k, v and out, and the peak
// resident memory of the process during the call (Linux: VmHWM of /proc/self/status, reset
// before the call through /proc/self/clear_refs; elsewhere "n/a"). Then the relative error of the
// bfloat16 output against the float output (inputs rounded to bfloat16 included).
//
//   million_tokens            n = 1048576: q, k, v, out take 8 GiB in float and 4 GiB in
//                             bfloat16, and the program keeps the float inputs and output
//                             beside each run (about 14 GiB at its peak); about 20 s per call
//                             on one core (set OMP_NUM_THREADS to use more)
//   million_tokens 4096       a quick run (the ctest example)
//
// Exit status 1 when an output is not finite or the bfloat16 error exceeds 1e-2.

#include <plsh/plsh.hpp>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <string>
#include <vector>

namespace {

constexpr plsh::Index kHeads = 8;
constexpr plsh::Index kDim = 64;

/// Uniform values in [-1, 1).
std::vector<float> uniform_tensor(std::size_t size, std::uint64_t seed) {
  std::mt19937_64 engine(seed);
  std::uniform_real_distribution<float> uniform(-1.0f, 1.0f);
  std::vector<float> values(size);
  for (float& x : values) x = uniform(engine);
  return values;
}

/// A field of /proc/self/status in MiB ("VmHWM:"), negative where there is none.
double status_mib(const std::string& field) {
  std::ifstream status("/proc/self/status");
  std::string line;
  while (std::getline(status, line)) {
    if (line.compare(0, field.size(), field) == 0)
      return std::stod(line.substr(field.size())) / 1024;
  }
  return -1;
}

/// Resets the peak resident memory to the current one; false where the system does not allow it.
bool reset_peak_memory() {
  std::ofstream clear("/proc/self/clear_refs");
  clear << "5";
  clear.flush();
  return static_cast<bool>(clear);
}

template <class To, class From>
std::vector<To> converted(const std::vector<From>& values) {
  std::vector<To> result(values.size());
  for (std::size_t i = 0; i < values.size(); ++i) result[i] = static_cast<To>(values[i]);
  return result;
}

/// Runs the fused kernel once on inputs stored as `Storage`; prints time and memory; returns the
/// output as float.
template <class Storage>
std::vector<float> run(const char* name, plsh::Index n, const std::vector<float>& q,
                       const std::vector<float>& k, const std::vector<float>& v) {
  std::vector<float> result;
  {
    const std::vector<Storage> q_stored = converted<Storage>(q);
    const std::vector<Storage> k_stored = converted<Storage>(k);
    const std::vector<Storage> v_stored = converted<Storage>(v);
    std::vector<Storage> out(v.size());
    const double tensor_mib =
        static_cast<double>(4 * q.size() * sizeof(Storage)) / (1024.0 * 1024.0);
    const bool reset = reset_peak_memory();
    const auto start = std::chrono::steady_clock::now();
    plsh::plsh_attention<Storage>({q_stored.data(), n, kHeads, kDim},
                                  {k_stored.data(), n, kHeads, kDim},
                                  {v_stored.data(), n, kHeads, kDim}, {out.data(), n, kHeads, kDim},
                                  plsh::alibi_slopes(kHeads), plsh::PlshOptions{});
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double peak = status_mib("VmHWM:");
    std::printf("%-9s n = %8ld: %8.3f s, q+k+v+out %7.1f MiB, ", name, static_cast<long>(n),
                seconds, tensor_mib);
    if (reset && peak >= 0) {
      std::printf("peak resident memory during the call %7.1f MiB\n", peak);
    } else {
      std::printf("peak resident memory n/a\n");
    }
    result = converted<float>(out);
  }
  return result;
}

}  // namespace

int main(int argc, char** argv) {
  const plsh::Index n = argc > 1 ? std::atol(argv[1]) : plsh::Index{1} << 20;
  if (n < 1) {
    std::fprintf(stderr, "usage: million_tokens [n >= 1]\n");
    return 2;
  }
  const auto size = static_cast<std::size_t>(n * kHeads * kDim);
  const std::vector<float> q = uniform_tensor(size, 1);
  const std::vector<float> k = uniform_tensor(size, 2);
  const std::vector<float> v = uniform_tensor(size, 3);

  const std::vector<float> out_float = run<float>("float", n, q, k, v);
  const std::vector<float> out_bf16 = run<Eigen::bfloat16>("bfloat16", n, q, k, v);

  double error = 0;
  double norm = 0;
  bool finite = true;
  for (std::size_t i = 0; i < out_float.size(); ++i) {
    finite = finite && std::isfinite(out_float[i]) && std::isfinite(out_bf16[i]);
    error += std::pow(static_cast<double>(out_bf16[i]) - out_float[i], 2);
    norm += std::pow(static_cast<double>(out_float[i]), 2);
  }
  const double relative = std::sqrt(error / norm);
  std::printf("relative error of the bfloat16 output against the float output: %.2e\n", relative);
  if (!finite || !(relative <= 1e-2)) {
    std::printf("FAILED: %s\n", finite ? "bfloat16 error above 1e-2" : "non-finite output");
    return 1;
  }
  return 0;
}
