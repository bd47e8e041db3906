#!/usr/bin/env bash
# The Python package plsh (pybind11 + NumPy, with plsh.torch for PyTorch), built and installed by
# pip from pyproject.toml/setup.py for Debian's own interpreter /usr/bin/python3, the one
# python3-numpy and python3-torch install into (a `python3` found first on PATH may be another
# interpreter without them). No index, no download: the build backend (setuptools, pybind11's
# setup helpers) comes from Debian.
#
#   scripts/python.sh [build]   install missing Debian packages, create the virtual environment
#                               build/python-venv (--system-site-packages, so it sees Debian's
#                               numpy and torch) and `pip install --no-build-isolation .` into it;
#                               the installed package is also copied to build/python/plsh for
#                               PYTHONPATH=build/python /usr/bin/python3
#   scripts/python.sh test      build, then run the pytest suite python/tests against the
#                               installed package (not the source tree or a build folder)
#   scripts/python.sh install   build, then copy the installed package into the interpreter's
#                               site-packages (or PLSH_PYTHON_SITE)
#
# Environment: PLSH_PYTHON (interpreter, default /usr/bin/python3), PLSH_VENV (default
# build/python-venv), PLSH_JOBS (parallel compile jobs, default 2), PLSH_PYTHON_SITE (install
# directory, default the interpreter's sysconfig platlib), PLSH_NATIVE (default 1: compile for the
# vector units of the machine that builds it, -march=native, as the module is built where it runs;
# 0: a portable build, several times slower). Extra arguments after `test` go to pytest.
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
venv=${PLSH_VENV:-${PWD}/build/python-venv}
output_dir=${PWD}/build/python
export PLSH_JOBS=${PLSH_JOBS:-2} PLSH_NATIVE=${PLSH_NATIVE:-1}

# libopenblas0-pthread: Debian's torch runs on the reference BLAS without it (about 10x slower).
plsh_ensure_deps python3-dev pybind11-dev python3-pybind11 python3-setuptools python3-wheel \
  python3-pip python3-venv python3-numpy python3-pytest python3-torch libopenblas0-pthread
if [[ ! -x "${python}" ]]; then
  echo "plsh: the Python interpreter ${python} does not exist (set PLSH_PYTHON)" >&2
  exit 1
fi

if [[ ! -x "${venv}/bin/python" ]]; then
  "${python}" -m venv --system-site-packages "${venv}"
fi
# --no-build-isolation: the build backend is Debian's, seen through --system-site-packages.
"${venv}/bin/pip" install --no-build-isolation --no-deps --no-index --disable-pip-version-check \
  .
site_dir=$("${venv}/bin/python" -c 'import os, plsh; print(os.path.dirname(plsh.__file__))')
(cd /tmp && "${venv}/bin/python" -c "import plsh, sys; assert 'torch' not in sys.modules")
mkdir -p "${output_dir}"
rm -rf "${output_dir}/plsh"
cp -r "${site_dir}" "${output_dir}/plsh"
find "${output_dir}/plsh" -name __pycache__ -prune -exec rm -rf {} +
echo "plsh: installed into ${site_dir} (use ${venv}/bin/python, or" \
  "PYTHONPATH=${output_dir} ${python})"

case "${command}" in
  test)
    PLSH_EXPECT_INSTALLED=1 "${venv}/bin/python" -m pytest python/tests -q -p no:cacheprovider "$@"
    ;;
  install)
    site=${PLSH_PYTHON_SITE:-$("${python}" -c 'import sysconfig; print(sysconfig.get_paths()["platlib"])')}
    mkdir -p "${site}"
    rm -rf "${site}/plsh"
    cp -r "${output_dir}/plsh" "${site}/plsh"
    echo "plsh: installed into ${site}/plsh"
    ;;
esac
