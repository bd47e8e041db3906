"""Builds the extension plsh._plsh (the six sources of python/src) and the package python/plsh.

The version is the plsh project's, read from `project(plsh VERSION ...)` in CMakeLists.txt (as
python/CMakeLists.txt reads it) and compiled into the extension as plsh.__version__. The sources
compile in parallel (pybind11's ParallelCompile, PLSH_JOBS jobs, default 2) at -O3 with OpenMP,
and with -march=native unless PLSH_NATIVE=0: the module is compiled where it runs, and the
portable build is several times slower where AVX2/AVX-512 exist. Every header of include/ and
python/src is a dependency, so a rebuild in the same tree recompiles after any of them changes.
See pyproject.toml for the commands.
"""

import glob
import os
import re

from pybind11.setup_helpers import ParallelCompile, Pybind11Extension, build_ext
from setuptools import setup

ROOT = os.path.dirname(os.path.abspath(__file__))


def project_version():
    with open(os.path.join(ROOT, "CMakeLists.txt"), encoding="utf-8") as f:
        match = re.search(r"project\(plsh\s+VERSION\s+([0-9.]+)", f.read())
    if not match:
        raise RuntimeError("setup.py: no `project(plsh VERSION ...)` in CMakeLists.txt")
    return match.group(1)


def eigen_include_dir():
    for candidate in (os.environ.get("EIGEN3_INCLUDE_DIR"), "/usr/include/eigen3",
                      "/usr/local/include/eigen3"):
        if candidate and os.path.exists(os.path.join(candidate, "Eigen", "Core")):
            return candidate
    raise RuntimeError("setup.py: Eigen 3.4 not found (Debian: libeigen3-dev); set "
                       "EIGEN3_INCLUDE_DIR")


VERSION = project_version()
os.chdir(ROOT)
os.makedirs("build/setuptools", exist_ok=True)
# The heavy sources (the kernels' instantiations) first, so that a parallel build starts them first.
SOURCES = ["python/src/" + name for name in ("attention.cpp", "kv_cache.cpp", "alibi_kv_cache.cpp",
                                              "partitions.cpp", "arrays.cpp", "options.cpp",
                                              "module.cpp")]
DEPENDS = sorted(glob.glob("include/**/*.hpp", recursive=True) + glob.glob("python/src/*.hpp"))

compile_args = ["-O3", "-fopenmp", "-Wall", "-Wextra", "-Wpedantic"]
if os.environ.get("PLSH_NATIVE", "1") == "1":
    compile_args.append("-march=native")
    # GCC 12's AVX-512 headers trip -Wmaybe-uninitialized inside Eigen (GCC bug 105593).
    compile_args.append("-Wno-maybe-uninitialized")

ParallelCompile("PLSH_JOBS", default=2).install()

extension = Pybind11Extension(
    "plsh._plsh",
    SOURCES,
    include_dirs=["include", eigen_include_dir()],
    depends=DEPENDS,
    define_macros=[("PLSH_VERSION", f'"{VERSION}"'), ("NDEBUG", None)],
    extra_compile_args=compile_args,
    extra_link_args=["-fopenmp"],
    cxx_std=17,
)

setup(
    version=VERSION,
    package_dir={"": "python"},
    packages=["plsh"],
    package_data={"plsh": ["py.typed"]},
    ext_modules=[extension],
    cmdclass={"build_ext": build_ext},
    # Build products under build/setuptools, beside the CMake builds of build/, not in the tree.
    options={"build": {"build_base": "build/setuptools"},
             "egg_info": {"egg_base": "build/setuptools"}},
    zip_safe=False,
)
