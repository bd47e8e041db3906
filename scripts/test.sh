#!/usr/bin/env bash
# Everything CI checks, in order:
#   format   clang-format --dry-run --Werror over include/ tests/ examples/ bench/ python/, and
#            bench/report.py --check (every generated table in README.md and docs/ matches its data)
#   release  preset "release": build/release (tests, examples, benchmarks, -Werror), ctest. The
#            benchmarks and examples are compiled at -O1 and take the kernels' cores from the
#            unit tests' instance library (PLSH_SMOKE_BUILD=ON): here they only have to build and
#            run; bench/regenerate.sh, which measures, configures them at -O3 for this machine
#   asan     preset "asan": build/asan, the unit tests with ASan and UBSan at -O1 with line
#            tables only (the usual settings of a sanitizer build), compiled by clang++ (installed
#            here; the default compiler when it cannot be had), ctest (the examples and the
#            packaging tests, which build unsanitised consumer projects, run in the release phase
#            only). The release build compiles the unit tests for AVX-512 where the machine runs
#            it (tests/CMakeLists.txt, PLSH_TEST_AVX512), the sanitizer build for the portable
#            paths: each phase compiles every test once
#   mpi      build/release again, configured with PLSH_MPI=ON: only the MPI tests, example and
#            benchmark (target plsh_mpi_programs; they reuse the release phase's kernel instances
#            when it ran first), then ctest -L mpi (mpirun on 1, 2 and 4 ranks, the installed mpi
#            component, the bytes acceptance); installs libopenmpi-dev and openmpi-bin, skipped
#            with a message when they cannot be had. The release and asan phases build with
#            PLSH_MPI=OFF.
#   python   the Python package for Debian's /usr/bin/python3, installed by
#            `pip install --no-build-isolation .` into the virtual environment build/python-venv
#            (--system-site-packages), its pytest suite against the installed package
#            (scripts/python.sh test), and the training comparison's quick mode
#   fuzz     tests/fuzz/run.sh: the libFuzzer target (clang++, ASan, UBSan) on the regression
#            inputs, then PLSH_FUZZ_SECONDS (default 60, shared by PLSH_JOBS processes at once) of
#            fuzzing from tests/fuzz/corpus. Its build (one translation unit, one core) starts in
#            the background with the mpi or python phase, whichever comes first, and its log is
#            printed in the fuzz phase; the regression inputs and the fuzzing run on their own,
#            after the other phases
#
#   scripts/test.sh [format|release|asan|mpi|python|fuzz]...    (no argument: all six)
#
# Environment: PLSH_JOBS (parallel jobs for builds and ctest, default 2),
# PLSH_TEST_TIMEOUT (seconds per test, default 1500), CLANG_FORMAT (default clang-format).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

phases=("$@")
if ((${#phases[@]} == 0)); then
  phases=(format release asan mpi python fuzz)
fi
for phase in "${phases[@]}"; do
  case "${phase}" in
    format | release | asan | mpi | python | fuzz) ;;
    *)
      echo "usage: scripts/test.sh [format|release|asan|mpi|python|fuzz]..." >&2
      exit 2
      ;;
  esac
done

jobs="${PLSH_JOBS:-2}"
test_timeout="${PLSH_TEST_TIMEOUT:-1500}"
clang_format="${CLANG_FORMAT:-clang-format}"

extra_packages=()
for phase in "${phases[@]}"; do
  case "${phase}" in
    format) extra_packages+=(clang-format) ;;
    # The training comparison's text: the King James Bible of bible-kjv.
    python) extra_packages+=(bible-kjv) ;;
  esac
done
plsh_ensure_deps "${extra_packages[@]}"

timings=()
script_start=${SECONDS}
print_timings() {
  local status=$?
  echo
  echo "== plsh: elapsed time per phase"
  local line
  for line in "${timings[@]}"; do
    echo "  ${line}"
  done
  echo "  total: $((SECONDS - script_start)) s"
  if ((status != 0)); then
    echo "== plsh: FAILED (status ${status})"
  fi
}

# The fuzz target's build, started beside the mpi and python phases (start_fuzz_build) and waited
# for by the fuzz phase.
fuzz_build_pid=""
fuzz_build_log=build/fuzz-build.log
start_fuzz_build() {
  # Its packages are installed here, in the foreground, so that apt-get never runs twice at once.
  (plsh_ensure_deps clang libclang-rt-14-dev) || true
  mkdir -p build
  echo "plsh: building the fuzz target in the background (log: ${fuzz_build_log})"
  bash tests/fuzz/run.sh build >"${fuzz_build_log}" 2>&1 &
  fuzz_build_pid=$!
}
stop_fuzz_build() {
  if [[ -n "${fuzz_build_pid}" ]] && kill -0 "${fuzz_build_pid}" 2>/dev/null; then
    kill "${fuzz_build_pid}" 2>/dev/null || true
  fi
}
trap 'print_timings; stop_fuzz_build' EXIT

run_phase() {
  local name=$1
  shift
  echo
  echo "== plsh: ${name}"
  local start=${SECONDS}
  timings+=("${name}: running or failed")
  "$@"
  timings[${#timings[@]} - 1]="${name}: $((SECONDS - start)) s"
}

check_format() {
  local -a dirs=()
  local dir
  for dir in include tests examples bench python; do
    if [[ -d "${dir}" ]]; then
      dirs+=("${dir}")
    fi
  done
  local -a files=()
  if ((${#dirs[@]} > 0)); then
    mapfile -d '' files < <(find "${dirs[@]}" -type f \( -name '*.hpp' -o -name '*.cpp' \) -print0 |
      sort -z)
  fi
  if ((${#files[@]} == 0)); then
    echo "no C++ files to check"
    return 0
  fi
  "${clang_format}" --version
  echo "checking ${#files[@]} files"
  if ! "${clang_format}" --dry-run --Werror "${files[@]}"; then
    echo "plsh: clang-format violations above; fix with: ${clang_format} -i <file>" >&2
    return 1
  fi
  if ! /usr/bin/python3 bench/report.py --check; then
    echo "plsh: tables out of date; regenerate with: /usr/bin/python3 bench/report.py" >&2
    return 1
  fi
}

# The build directories, cache variables and test environments are those of CMakePresets.json
# (presets "release" and "asan"): this script adds only -Werror, the job count and the timeout.
build_and_test() {
  local preset=$1
  shift
  cmake --preset "${preset}" "$@"
  cmake --build --preset "${preset}" -j "${jobs}"
  ctest --preset "${preset}" -j "${jobs}" --timeout "${test_timeout}"
}

# PLSH_MPI=OFF: the MPI parts are built and run once, by the mpi phase, whether or not MPI was
# installed when these phases run.
release() {
  build_and_test release -DPLSH_WERROR=ON -DPLSH_MPI=OFF -DPLSH_SMOKE_BUILD=ON
}

# The sanitizer build compiles with clang++ when it and its ASan runtime and OpenMP can be had
# (Debian: clang libclang-rt-14-dev libomp-14-dev): it compiles these tests in about 30% less time
# than g++ at -O1. Otherwise with the default compiler, said here.
asan() {
  local -a compiler=()
  if (plsh_ensure_deps clang libclang-rt-14-dev libomp-14-dev) && plsh_have_command clang++; then
    compiler=(-DCMAKE_CXX_COMPILER=clang++)
  else
    echo "plsh: asan builds with the default compiler: clang++ with its ASan runtime and OpenMP" \
      "(Debian: clang libclang-rt-14-dev libomp-14-dev) could not be installed" >&2
  fi
  build_and_test asan -DPLSH_MPI=OFF "${compiler[@]}"
}

# The MPI layer: Open MPI from Debian (installed here, not at the start, so that the other phases
# never depend on it), the release build reconfigured with PLSH_MPI=ON (which adds targets and
# changes no other target's flags, so nothing the release phase built is compiled again), the MPI
# targets only, and the tests labelled mpi.
mpi_phase() {
  if ! (plsh_ensure_deps libopenmpi-dev openmpi-bin); then
    echo "plsh: SKIP mpi: Open MPI (Debian: libopenmpi-dev openmpi-bin) could not be installed;" \
      "see the messages above" >&2
    return 0
  fi
  cmake --preset release -DPLSH_WERROR=ON -DPLSH_MPI=ON -DPLSH_SMOKE_BUILD=ON
  cmake --build --preset release -j "${jobs}" --target plsh_mpi_programs
  ctest --preset release -L mpi -j "${jobs}" --timeout "${test_timeout}"
}

python_phase() {
  bash scripts/python.sh test
  build/python-venv/bin/python examples/python/compare.py --quick
}

fuzz_phase() {
  if [[ -z "${fuzz_build_pid}" ]]; then
    bash tests/fuzz/run.sh
    return
  fi
  local status=0
  wait "${fuzz_build_pid}" || status=$?
  fuzz_build_pid=""
  echo "plsh: the fuzz target's build (beside the earlier phases):"
  cat "${fuzz_build_log}"
  if ((status != 0)); then
    echo "plsh: the fuzz target's build failed (status ${status})" >&2
    return "${status}"
  fi
  bash tests/fuzz/run.sh run
}

wants_fuzz=0
for phase in "${phases[@]}"; do
  if [[ "${phase}" == fuzz ]]; then
    wants_fuzz=1
  fi
done

for phase in "${phases[@]}"; do
  case "${phase}" in
    format) run_phase format check_format ;;
    release) run_phase release release ;;
    asan) run_phase asan asan ;;
    mpi | python)
      if ((wants_fuzz)); then
        start_fuzz_build
        wants_fuzz=0
      fi
      ;;&
    mpi) run_phase mpi mpi_phase ;;
    python) run_phase python python_phase ;;
    fuzz)
      wants_fuzz=0
      run_phase fuzz fuzz_phase
      ;;
  esac
done
