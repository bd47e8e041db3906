#!/usr/bin/env bash
# Regenerates the benchmark data of the documentation, then its tables and plots.
#
#   bench/regenerate.sh [part]...     (no part: kernels plots report)
#
#   kernels  plsh_bench, the kernel families (gemm, regular, exact, windowed, windowed_1e3,
#            truncated, truncated_1e3, passes, fused, fixed_blocks, fused_threads) ->
#            docs/bench/bench.json; plsh_accuracy --n=4096 -> docs/bench/accuracy.json and
#            accuracy.md. About 10 minutes on one core.
#   long     plsh_bench, the long families (n = 2^16, 2^18, 2^20) and exact/65536 ->
#            docs/bench/scaling.json. Several minutes; about 9 GiB of memory.
#   train    plsh_bench, the training families (train_forward/ and train/: the forward, and the
#            forward then the backward, of exact, windowed_1e3, truncated_1e3, truncated_5e2,
#            fused_defaults, fused_paper, fixed_blocks; n = 1024 ... 65536; 1 and 2 threads),
#            two repetitions -> docs/bench/train.json, then docs/bench/train_vs_n.png. About 10
#            minutes of processor time.
#   decode   plsh_bench, the decoding families (decode_plsh, decode_exact, team_step,
#            decode_estimator) -> docs/bench/decode.json. A few minutes.
#   alibi    plsh_bench, decode_alibi (AlibiKvCache, contexts to 65536, tolerances 1e-2, 1e-4,
#            1e-6) and decode_exact -> docs/bench/alibi_decode.json. About 10 minutes on one core.
#   alibi_model  examples/python/alibi_cache_study.py: AlibiKvCache on the miniature model
#            trained with exact ALiBi (build/lm-alibi.pt, trained first when missing), 10^5 tokens
#            per tolerance -> docs/bench/alibi_model.json. Under an hour on one core.
#   mpi      mpi_bench (build/mpi, PLSH_MPI=ON): the bytes each rank receives on 2 and 4 ranks ->
#            docs/bench/mpi-bytes-2.txt, mpi-bytes-4.txt. Seconds once built; needs mpirun.
#   frontier plsh_frontier, time and error of every method on the normal, peaked and trained
#            input sets, 3 repetitions -> docs/bench/frontier.json, then docs/bench/frontier.png.
#            About 5 minutes on one core. The trained set is docs/accuracy/qkv.bin (part qkv).
#   qkv      the trained set: examples/python/qk_dump.py --qkv-out -> docs/accuracy/qkv.bin and
#            qkv.json, from build/accuracy/alibi-s1.pt, which is trained first (as
#            docs/accuracy/regenerate.sh attention does, a few minutes) when it is missing.
#   plots    bench/plot.py over the JSON above -> docs/bench/time_vs_n.png, error_vs_time.png,
#            frontier.png and train_vs_n.png (processor time, train_vs_n.png's 2 threads wall
#            time; needs python3-matplotlib).
#   report   bench/report.py: the tables of README.md and docs/*.md, from the files above.
#
# Benchmarks run with OMP_NUM_THREADS=1 (fused_threads, team_step and the training families set
# their own). Environment: PLSH_JOBS (build jobs, default 2), PLSH_BUILD_DIR (default
# build/release), PLSH_BENCH_ARGS (extra plsh_bench arguments, e.g. --benchmark_repetitions=3),
# PLSH_FRONTIER_ARGS (extra plsh_frontier arguments), PLSH_PYTHON (default /usr/bin/python3, whose
# matplotlib Debian installs).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

parts=("$@")
if ((${#parts[@]} == 0)); then
  parts=(kernels plots report)
fi
for part in "${parts[@]}"; do
  case "${part}" in
    kernels | long | train | decode | alibi | alibi_model | mpi | frontier | qkv | plots | report) ;;
    *)
      echo "usage: bench/regenerate.sh" \
        "[kernels|long|train|decode|alibi|alibi_model|mpi|frontier|qkv|plots|report]..." >&2
      exit 2
      ;;
  esac
done

out=docs/bench
build_dir=${PLSH_BUILD_DIR:-build/release}
jobs=${PLSH_JOBS:-2}
python=${PLSH_PYTHON:-/usr/bin/python3}
mkdir -p "${out}"

build_bench() {
  plsh_ensure_deps
  cmake -S . -B "${build_dir}" -DCMAKE_BUILD_TYPE=Release -DPLSH_BUILD_BENCHMARKS=ON \
    -DPLSH_SMOKE_BUILD=OFF
  cmake --build "${build_dir}" --target "$@" -j "${jobs}"
}

# plsh_bench with a filter, single-threaded, JSON into the given file.
run_bench() {
  local filter=$1 file=$2
  # shellcheck disable=SC2086 # PLSH_BENCH_ARGS is a list of arguments
  OMP_NUM_THREADS=1 "${build_dir}/bench/plsh_bench" --benchmark_filter="${filter}" \
    --benchmark_out="${file}" --benchmark_out_format=json ${PLSH_BENCH_ARGS:-}
}

for part in "${parts[@]}"; do
  echo "== bench/regenerate.sh: ${part}"
  case "${part}" in
    kernels)
      build_bench plsh_bench plsh_accuracy
      run_bench '^(gemm|gemm_tile|regular|exact|windowed|windowed_1e3|truncated|truncated_1e3|passes|fused|fixed_blocks|fused_threads)/' \
        "${out}/bench.json"
      OMP_NUM_THREADS=1 "${build_dir}/bench/plsh_accuracy" --n=4096 --json="${out}/accuracy.json" |
        tee "${out}/accuracy.md"
      ;;
    long)
      build_bench plsh_bench
      run_bench '^(long_fused|long_windowed)/|^exact/65536/' "${out}/scaling.json"
      ;;
    train)
      build_bench plsh_bench
      # Two repetitions: the tables and the plot take the median (of two: their mean).
      PLSH_BENCH_ARGS="--benchmark_repetitions=2 ${PLSH_BENCH_ARGS:-}" \
        run_bench '^train(_forward)?/' "${out}/train.json"
      "${python}" bench/plot.py --train "${out}/train.json" --out-dir "${out}"
      ;;
    decode)
      build_bench plsh_bench
      run_bench '^(decode_plsh|decode_exact|team_step|decode_estimator)/' "${out}/decode.json"
      ;;
    alibi)
      build_bench plsh_bench
      run_bench '^decode_alibi/|^decode_exact/' "${out}/alibi_decode.json"
      ;;
    alibi_model)
      bash scripts/python.sh build
      OMP_NUM_THREADS=1 PYTHONPATH=build/python "${python}" examples/python/alibi_cache_study.py \
        --checkpoint build/lm-alibi.pt --data-cache build/kjv.txt --out "${out}/alibi_model.json"
      ;;
    mpi)
      plsh_ensure_deps libopenmpi-dev openmpi-bin
      mpi_build=build/mpi
      cmake -S . -B "${mpi_build}" -DCMAKE_BUILD_TYPE=Release -DPLSH_MPI=ON \
        -DPLSH_BUILD_BENCHMARKS=ON -DPLSH_SMOKE_BUILD=OFF
      cmake --build "${mpi_build}" --target mpi_bench -j "${jobs}"
      # Open MPI refuses to start as root without these two variables.
      for ranks in 2 4; do
        OMP_NUM_THREADS=1 OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
          mpirun --oversubscribe -np "${ranks}" "${mpi_build}/bench/mpi/mpi_bench" bytes 16 20 |
          tee "${out}/mpi-bytes-${ranks}.txt"
      done
      ;;
    frontier)
      build_bench plsh_frontier
      # shellcheck disable=SC2086 # PLSH_FRONTIER_ARGS is a list of arguments
      OMP_NUM_THREADS=1 "${build_dir}/bench/plsh_frontier" --benchmark_min_time=1 \
        --benchmark_repetitions=3 --benchmark_out="${out}/frontier.json" \
        --benchmark_out_format=json ${PLSH_FRONTIER_ARGS:-}
      "${python}" bench/plot.py --frontier "${out}/frontier.json" --clock cpu --out-dir "${out}"
      ;;
    qkv)
      work=build/accuracy
      mkdir -p "${work}"
      bash scripts/python.sh build
      if [[ ! -f "${work}/alibi-s1.pt" ]]; then
        PYTHONPATH=build/python "${python}" examples/python/lm.py --variant alibi --seed 1 \
          --eval-bytes 16384 --data-cache "${work}/bible.txt" --save "${work}/alibi-s1.pt" \
          --out "${work}/alibi-s1.json" | tee "${work}/train.log"
      fi
      PYTHONPATH=build/python "${python}" examples/python/qk_dump.py \
        --checkpoint "${work}/alibi-s1.pt" --length 2048 --data-cache "${work}/bible.txt" \
        --out "${work}/qk.bin" --qkv-out docs/accuracy/qkv.bin
      ;;
    plots)
      # bench.json last: where both files hold a benchmark, the kernels part's run is drawn.
      frontier=()
      if [[ -f "${out}/frontier.json" ]]; then
        frontier=(--frontier "${out}/frontier.json")
      fi
      train=()
      if [[ -f "${out}/train.json" ]]; then
        train=(--train "${out}/train.json")
      fi
      "${python}" bench/plot.py --bench "${out}/scaling.json" --bench "${out}/bench.json" \
        --accuracy "${out}/accuracy.json" "${frontier[@]}" "${train[@]}" --clock cpu \
        --out-dir "${out}"
      ;;
    report)
      "${python}" bench/report.py
      ;;
  esac
done
