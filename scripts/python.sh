#!/usr/bin/env bash
# The Python module plsh (pybind11 + NumPy, with plsh.torch for PyTorch), built for Debian's own
# interpreter /usr/bin/python3, the one python3-numpy and python3-torch install into (a `python3`
# found first on PATH may be another interpreter without them).
#
#   scripts/python.sh [build]   install missing Debian packages, build into build/python
#                               (then: PYTHONPATH=build/python /usr/bin/python3 -c "import plsh")
#   scripts/python.sh test      build, then run the pytest suite python/tests
#   scripts/python.sh install   build, then copy the package into the interpreter's site-packages
#
# Environment: PLSH_PYTHON (interpreter, default /usr/bin/python3), PLSH_JOBS (build jobs,
# default 2), PLSH_BUILD_TYPE (default Release), PLSH_PYTHON_SITE (install directory, default the
# interpreter's sysconfig platlib), PLSH_NATIVE=1 (compile for this machine's vector units,
# -march=native; the default build is portable). Extra arguments after `test` go to pytest.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
# shellcheck source=scripts/deps.sh
source scripts/deps.sh

command=${1:-build}
if (($# > 0)); then
  shift
fi
case "${command}" in
  build | test | install) ;;
  *)
    echo "usage: scripts/python.sh [build|test|install] [pytest arguments...]" >&2
    exit 2
    ;;
esac

python=${PLSH_PYTHON:-/usr/bin/python3}
jobs=${PLSH_JOBS:-2}
build_type=${PLSH_BUILD_TYPE:-Release}
output_dir=${PWD}/build/python
build_dir=${PWD}/build/python-build

# libopenblas0-pthread: Debian's torch runs on the reference BLAS without it (about 10x slower).
plsh_ensure_deps python3-dev pybind11-dev python3-numpy python3-pytest python3-torch \
  libopenblas0-pthread
if [[ ! -x "${python}" ]]; then
  echo "plsh: the Python interpreter ${python} does not exist (set PLSH_PYTHON)" >&2
  exit 1
fi

cmake -S python -B "${build_dir}" -DCMAKE_BUILD_TYPE="${build_type}" \
  -DPython_EXECUTABLE="${python}" -DPLSH_PYTHON_OUTPUT_DIR="${output_dir}" \
  -DPLSH_PYTHON_NATIVE="$([[ "${PLSH_NATIVE:-0}" == 1 ]] && echo ON || echo OFF)"
cmake --build "${build_dir}" -j "${jobs}"
PYTHONPATH="${output_dir}" "${python}" -c "import plsh, sys; assert 'torch' not in sys.modules"
echo "plsh: built ${output_dir}/plsh (use PYTHONPATH=${output_dir} ${python})"

case "${command}" in
  test)
    PYTHONPATH="${output_dir}" "${python}" -m pytest python/tests -q "$@"
    ;;
  install)
    site=${PLSH_PYTHON_SITE:-$("${python}" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')}
    mkdir -p "${site}"
    rm -rf "${site}/plsh"
    cp -r "${output_dir}/plsh" "${site}/plsh"
    find "${site}/plsh" -name __pycache__ -prune -exec rm -rf {} +
    echo "plsh: installed into ${site}/plsh"
    ;;
esac
