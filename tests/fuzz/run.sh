#!/usr/bin/env bash
# Builds the libFuzzer target tests/fuzz/plsh_fuzz.cpp (clang++, ASan, UBSan) in build/fuzz, runs
# every input of tests/fuzz/regressions/ once, then fuzzes from a copy of the corpus
# tests/fuzz/corpus/ for a bounded time. Any finding (failed check, crash, sanitizer report, an
# exception other than std::invalid_argument, an input running longer than 10 s) makes the exit
# status non-zero; the input is kept in build/fuzz/findings/.
#
#   tests/fuzz/run.sh [build|run]    (no argument: both)
#
# `build` only configures and builds (scripts/test.sh starts it early, beside other phases);
# `run` builds what is out of date, then runs the inputs and fuzzes.
#
# Environment: PLSH_FUZZ_SECONDS (fuzzing time, default 60, shared by PLSH_JOBS fuzzing processes
# that run at once: 30 s each with the defaults), PLSH_FUZZ_SEED (libFuzzer seed of the first
# process, default 1, the next ones counting up, so that a run is repeatable up to its time
# limit), PLSH_FUZZ_CXX (default clang++), PLSH_JOBS (build jobs and fuzzing processes, default
# 2). Without clang++ and libFuzzer, installs them when running as root (or with password-less
# sudo); otherwise says so and exits 0.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

step="${1:-all}"
case "${step}" in
  all | build | run) ;;
  *)
    echo "usage: tests/fuzz/run.sh [build|run]" >&2
    exit 2
    ;;
esac
seconds="${PLSH_FUZZ_SECONDS:-60}"
cxx="${PLSH_FUZZ_CXX:-clang++}"
jobs="${PLSH_JOBS:-2}"
build=build/fuzz
skip_message="skipped: clang++ with libFuzzer not found (apt-get install clang libclang-rt-14-dev)"

have_libfuzzer() {
  plsh_have_command "${cxx}" || return 1
  local probe
  probe="$(mktemp -d)"
  printf '%s\n' 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) {' \
    '  return 0;' '}' >"${probe}/probe.cpp"
  local status=0
  "${cxx}" -fsanitize=fuzzer,address,undefined "${probe}/probe.cpp" -o "${probe}/probe" \
    >/dev/null 2>&1 || status=1
  rm -rf "${probe}"
  return "${status}"
}

if ! have_libfuzzer; then
  if [[ "$(id -u)" == 0 ]] || (plsh_have_command sudo && sudo -n true 2>/dev/null); then
    (plsh_ensure_deps clang libclang-rt-14-dev) || true
  fi
  if ! have_libfuzzer; then
    echo "plsh fuzz: ${skip_message}"
    exit 0
  fi
fi
plsh_ensure_deps

if [[ "${step}" != run || ! -f "${build}/CMakeCache.txt" ]]; then
  cmake -S tests/fuzz -B "${build}" -DCMAKE_CXX_COMPILER="${cxx}"
fi
cmake --build "${build}" -j "${jobs}"
if [[ "${step}" == build ]]; then
  exit 0
fi
fuzzer="${build}/plsh_fuzz"
findings="${build}/findings"
rm -rf "${findings}" "${build}/corpus"
mkdir -p "${findings}" "${build}/corpus"

export ASAN_OPTIONS="${ASAN_OPTIONS:-detect_leaks=1}"
export UBSAN_OPTIONS="${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}"

failed=()
regressions=0
for input in tests/fuzz/regressions/*; do
  [[ -f "${input}" ]] || continue
  regressions=$((regressions + 1))
  if ! "${fuzzer}" -timeout=10 "${input}" >"${findings}/regression.log" 2>&1; then
    cat "${findings}/regression.log"
    failed+=("${input}")
  fi
done
echo "plsh fuzz: ${regressions} regression inputs run, ${#failed[@]} failed"

cp tests/fuzz/corpus/* "${build}/corpus/"
# PLSH_JOBS processes fuzz at once from the shared corpus, each with its own seed and an equal
# share of the time.
workers=$((jobs > 1 ? jobs : 1))
share=$(((seconds + workers - 1) / workers))
seed="${PLSH_FUZZ_SEED:-1}"
start=${SECONDS}
pids=()
for ((worker = 0; worker < workers; ++worker)); do
  "${fuzzer}" -max_total_time="${share}" -seed="$((seed + worker))" -timeout=10 \
    -print_final_stats=1 -artifact_prefix="${findings}/" "${build}/corpus" \
    >"${build}/fuzz-${worker}.log" 2>&1 &
  pids+=($!)
done
status=0
executions=0
for ((worker = 0; worker < workers; ++worker)); do
  wait "${pids[worker]}" || status=$?
  cat "${build}/fuzz-${worker}.log"
  count="$(sed -n 's/^stat::number_of_executed_units: *//p' "${build}/fuzz-${worker}.log")"
  executions=$((executions + ${count:-0}))
done
echo "plsh fuzz: ${executions} executions by ${workers} processes of ${share} s in" \
  "$((SECONDS - start)) s (PLSH_FUZZ_SECONDS = ${seconds})"
if ((status != 0)); then
  echo "plsh fuzz: finding (status ${status}); inputs in ${findings}:" >&2
  ls -l "${findings}" >&2
  failed+=(fuzzing)
fi
if ((${#failed[@]} > 0)); then
  echo "plsh fuzz: FAILED: ${failed[*]}" >&2
  exit 1
fi
echo "plsh fuzz: no findings"
