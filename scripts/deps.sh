# shellcheck shell=bash
# Sourced by scripts/quickstart.sh and scripts/test.sh.
#
#   plsh_ensure_deps [extra Debian package]...
#
# Makes sure that a C++ compiler, CMake, make and the Debian packages plsh builds against
# are installed. Missing packages are installed with apt-get when running as root or
# when sudo needs no password; otherwise the command to run is printed and the calling
# script exits with status 1. Optional packages (plsh_optional_packages) are installed the same
# way when possible; when they cannot be, a message says what is skipped and the script goes on.

plsh_required_packages=(libeigen3-dev catch2 libbenchmark-dev)
# libspectra-dev: the Lanczos solver of the matrix-free spectral norms (error_norms.hpp,
# attention_error.hpp); without it those norms and their tests are skipped.
plsh_optional_packages=(libspectra-dev)

plsh_package_installed() {
  dpkg -s "$1" 2>/dev/null | grep -q '^Status: install ok installed'
}

# Installs the optional packages that are missing, if it can; never fails.
plsh_ensure_optional_deps() {
  local -a missing=()
  local package
  for package in "${plsh_optional_packages[@]}"; do
    if ! plsh_package_installed "${package}"; then
      missing+=("${package}")
    fi
  done
  if ((${#missing[@]} == 0)); then
    return 0
  fi
  local -a apt_env=(env DEBIAN_FRONTEND=noninteractive)
  local -a runner=()
  if [[ "$(id -u)" != 0 ]]; then
    if plsh_have_command sudo && sudo -n true 2>/dev/null; then
      runner=(sudo -n)
    else
      echo "plsh: optional packages missing: ${missing[*]} (the matrix-free spectral norms are" \
        "skipped); install them with: sudo apt-get install -y ${missing[*]}" >&2
      return 0
    fi
  fi
  echo "plsh: installing optional packages: ${missing[*]}" >&2
  if ! { "${runner[@]}" "${apt_env[@]}" apt-get install -y --no-install-recommends \
    "${missing[@]}" ||
    { "${runner[@]}" "${apt_env[@]}" apt-get update &&
      "${runner[@]}" "${apt_env[@]}" apt-get install -y --no-install-recommends "${missing[@]}"; }; }; then
    echo "plsh: could not install the optional packages ${missing[*]}; the matrix-free spectral" \
      "norms and their tests are skipped" >&2
  fi
  return 0
}

plsh_have_command() {
  command -v "$1" >/dev/null 2>&1
}

plsh_ensure_deps() {
  local -a wanted=("${plsh_required_packages[@]}" "$@")
  local -a missing=()
  local package

  if ! plsh_have_command cmake; then
    echo "plsh: cmake (3.21 or newer) is not installed" >&2
    missing+=(cmake)
  fi
  if [[ -n "${CXX:-}" ]]; then
    if ! plsh_have_command "${CXX%% *}"; then
      echo "plsh: the C++ compiler CXX='${CXX}' was not found" >&2
      exit 1
    fi
  elif ! plsh_have_command c++ && ! plsh_have_command g++ && ! plsh_have_command clang++; then
    echo "plsh: no C++ compiler found (c++, g++ or clang++); set CXX or install g++" >&2
    missing+=(g++)
  fi
  if ! plsh_have_command make && ! plsh_have_command ninja; then
    echo "plsh: neither make nor ninja is installed" >&2
    missing+=(make)
  fi

  if ! plsh_have_command dpkg; then
    if ((${#missing[@]} > 0)); then
      echo "plsh: install ${missing[*]} and try again" >&2
      exit 1
    fi
    echo "plsh: dpkg not found, not checking for ${wanted[*]} ${plsh_optional_packages[*]};" \
      "CMake will tell what it misses" >&2
    return 0
  fi

  for package in "${wanted[@]}"; do
    if ! plsh_package_installed "${package}"; then
      missing+=("${package}")
    fi
  done
  if ((${#missing[@]} == 0)); then
    plsh_ensure_optional_deps
    return 0
  fi

  echo "plsh: installing missing packages: ${missing[*]}" >&2
  local -a apt_env=(env DEBIAN_FRONTEND=noninteractive)
  if [[ "$(id -u)" == 0 ]]; then
    "${apt_env[@]}" apt-get update
    "${apt_env[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  elif plsh_have_command sudo && sudo -n true 2>/dev/null; then
    sudo -n "${apt_env[@]}" apt-get update
    sudo -n "${apt_env[@]}" apt-get install -y --no-install-recommends "${missing[@]}"
  else
    echo "plsh: missing packages: ${missing[*]}. Install them with:" >&2
    echo "  sudo apt-get install -y ${missing[*]}" >&2
    exit 1
  fi
  plsh_ensure_optional_deps
}
