#!/usr/bin/env bash
# Everything CI checks, in order:
#   format   clang-format --dry-run --Werror over include/ tests/ examples/ bench/
#   release  preset "release": build/release (tests, examples, benchmarks, -Werror), ctest
#   asan     preset "asan": build/asan, RelWithDebInfo with ASan and UBSan, ctest
#
#   scripts/test.sh [format|release|asan]...    (no argument: all three)
#
# Environment: PLSH_JOBS (parallel jobs for builds and ctest, default 2),
# PLSH_TEST_TIMEOUT (seconds per test, default 1500), CLANG_FORMAT (default clang-format).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

phases=("$@")
if ((${#phases[@]} == 0)); then
  phases=(format release asan)
fi
for phase in "${phases[@]}"; do
  case "${phase}" in
    format | release | asan) ;;
    *)
      echo "usage: scripts/test.sh [format|release|asan]..." >&2
      exit 2
      ;;
  esac
done

jobs="${PLSH_JOBS:-2}"
test_timeout="${PLSH_TEST_TIMEOUT:-1500}"
clang_format="${CLANG_FORMAT:-clang-format}"

extra_packages=()
for phase in "${phases[@]}"; do
  if [[ "${phase}" == format ]]; then
    extra_packages+=(clang-format)
  fi
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
trap print_timings EXIT

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
  for dir in include tests examples bench; do
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

release() {
  build_and_test release -DPLSH_WERROR=ON
}

asan() {
  build_and_test asan
}

for phase in "${phases[@]}"; do
  case "${phase}" in
    format) run_phase format check_format ;;
    release) run_phase release release ;;
    asan) run_phase asan asan ;;
  esac
done
