# shellcheck shell=bash
# Sourced by scripts/quickstart.sh and scripts/test.sh.
#
#   plsh_ensure_deps [extra Debian package]...
#
# Makes sure that a C++ compiler, CMake, make and the Debian packages plsh builds against
# are installed. Missing packages are installed with apt-get when running as root or
# when sudo needs no password; otherwise the command to run is printed and the calling
# script exits with status 1.

plsh_required_packages=(libeigen3-dev catch2 libbenchmark-dev)

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
    echo "plsh: dpkg not found, not checking for ${wanted[*]}; CMake will tell what it misses" >&2
    return 0
  fi

  for package in "${wanted[@]}"; do
    if ! dpkg -s "${package}" 2>/dev/null | grep -q '^Status: install ok installed'; then
      missing+=("${package}")
    fi
  done
  if ((${#missing[@]} == 0)); then
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
}
