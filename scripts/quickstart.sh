#!/usr/bin/env bash
# Builds plsh in Release and runs the main example.
#
#   scripts/quickstart.sh [arguments for the example]
#
# Environment: PLSH_JOBS (parallel build jobs, default 2).
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh
plsh_ensure_deps

jobs="${PLSH_JOBS:-2}"
build_dir=build/release

if [[ -f examples/quickstart.cpp ]]; then
  example=quickstart
else
  example=error_decay
fi

cmake -S . -B "${build_dir}" -DCMAKE_BUILD_TYPE=Release -DPLSH_SMOKE_BUILD=OFF
cmake --build "${build_dir}" --target "${example}" -j "${jobs}"
echo "plsh: running ${build_dir}/examples/${example}"
"${build_dir}/examples/${example}" "$@"
