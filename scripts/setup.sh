#!/usr/bin/env bash
# Installs the Debian packages crosskv needs (if missing) and builds it into build/.
# Usage: scripts/setup.sh [BUILD_DIR]
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${1:-$ROOT/build}
PKGS=(build-essential cmake ninja-build pkg-config
      libopenmpi-dev openmpi-bin libhdf5-dev hdf5-tools libspdlog-dev libcli11-dev libyaml-cpp-dev
      nlohmann-json3-dev libopenblas-dev liblapacke-dev libgtest-dev libgmock-dev libbenchmark-dev libssl-dev
      python3-numpy python3-h5py python3-yaml python3-venv)
missing=()
for p in "${PKGS[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if [ ${#missing[@]} -gt 0 ]; then
  echo "[setup] installing: ${missing[*]}"
  SUDO=""; [ "$(id -u)" = 0 ] || SUDO=sudo
  $SUDO apt-get update -q
  DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -q --no-install-recommends "${missing[@]}"
fi
mkdir -p "$BUILD"
# A configured build folder is only built: ninja re-runs CMake itself when a CMakeLists.txt changed.
if [ ! -f "$BUILD/build.ninja" ]; then
  echo "[setup] configuring in $BUILD"
  cmake -S "$ROOT" -B "$BUILD" -G Ninja -DCMAKE_BUILD_TYPE=Release > "$BUILD/configure.log" 2>&1 \
    || { cat "$BUILD/configure.log"; exit 1; }
fi
echo "[setup] building in $BUILD"
cmake --build "$BUILD" -j"$(nproc)"
# The capture tool's Python environment (torch, transformers), unless CROSSKV_NO_CAPTURE=1.
[ "${CROSSKV_NO_CAPTURE:-0}" = 1 ] || "$ROOT/scripts/setup-capture.sh"
# The crosskv Python package, into that environment (pip install . with scikit-build-core and nanobind).
[ "${CROSSKV_NO_CAPTURE:-0}" = 1 ] || "$ROOT/scripts/setup-python-package.sh"
# vLLM on the CPU with the crosskv package (crosskv.vllm's tests), unless CROSSKV_NO_VLLM=1 or CROSSKV_NO_CAPTURE=1.
[ "${CROSSKV_NO_CAPTURE:-0}" = 1 ] || [ "${CROSSKV_NO_VLLM:-0}" = 1 ] || "$ROOT/scripts/setup-vllm.sh"
