#!/usr/bin/env bash
# Regenerates the benchmark figures of README.md: builds plsh_bench and plsh_accuracy in Release
# (-O3 -march=native), runs them single-threaded and writes into docs/bench/ (or the folder given
# as the first argument):
#   bench.json      plsh_bench, every family (Google Benchmark JSON)
#   accuracy.json   plsh_accuracy --n=4096, and accuracy.md, its table
#   time_vs_n.png, error_vs_time.png   bench/plot.py (needs matplotlib: python3-matplotlib)
# The whole suite takes about 8 minutes on one core (the long-sequence families, up to n = 2^20,
# about 2 of them; they need about 9 GiB of memory). Environment: PLSH_JOBS (build jobs, default
# 2), PLSH_BENCH_ARGS (extra plsh_bench arguments, e.g. --benchmark_repetitions=3).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh
plsh_ensure_deps

out="${1:-docs/bench}"
build_dir=build/release
cmake -S . -B "${build_dir}" -DCMAKE_BUILD_TYPE=Release -DPLSH_BUILD_BENCHMARKS=ON
cmake --build "${build_dir}" --target plsh_bench plsh_accuracy -j "${PLSH_JOBS:-2}"
mkdir -p "${out}"

# shellcheck disable=SC2086 # PLSH_BENCH_ARGS is a list of arguments
OMP_NUM_THREADS=1 "${build_dir}/bench/plsh_bench" --benchmark_out="${out}/bench.json" \
  --benchmark_out_format=json ${PLSH_BENCH_ARGS:-}
OMP_NUM_THREADS=1 "${build_dir}/bench/plsh_accuracy" --n=4096 --json="${out}/accuracy.json" |
  tee "${out}/accuracy.md"

# Debian's matplotlib belongs to the system interpreter, which may not be the first python3.
python=python3
if ! "${python}" -c 'import matplotlib' 2>/dev/null && [[ -x /usr/bin/python3 ]]; then
  python=/usr/bin/python3
fi
"${python}" bench/plot.py --bench "${out}/bench.json" --accuracy "${out}/accuracy.json" \
  --out-dir "${out}"
