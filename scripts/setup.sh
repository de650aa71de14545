#!/usr/bin/env bash
# Installs what is missing and builds crosskv. What is installed and built depends on who asks:
#   scripts/setup.sh            everything the test suite needs (scripts/test.sh): the Debian packages of the build,
#                               the tests and benchmarks, Slurm, munge, clang (libFuzzer) and redis-server; the whole
#                               build in build/ (tests, benchmarks, the emulated CUDA build); the Python environments
#                               (.venv-capture with the crosskv package, .venv-lmeval, .venv-vllm)
#   scripts/setup.sh --build    the Debian packages and the whole build, without the Python environments
#                               (scripts/test.sh: ctest's first tests, setup.*_environment, make them while
#                               the C++ tests run)
#   scripts/setup.sh --python   the Python environments alone (capture, the package, lm-eval, vLLM)
#   scripts/setup.sh --demo     only what the programs need to build and run, and only the programs the demo runs
#                               (crosskv-synth, -fit, -eval, -apply), in build-demo/ (the CPU backend; CUDA's too
#                               when a GPU is present)
#   scripts/setup.sh --capture  the capture environment (.venv-capture: torch, transformers) and the crosskv package
#   scripts/setup.sh --vllm     vLLM for the CPU with the crosskv package (.venv-vllm)
#   scripts/setup.sh --lmeval   lm-evaluation-harness over the capture environment (.venv-lmeval; after --capture)
# Each step prints what it cost. env: CROSSKV_NO_CAPTURE=1 / CROSSKV_NO_VLLM=1 / CROSSKV_NO_LMEVAL=1 skip those environments in the full
# setup (their tests then report SKIPPED).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
MODE=full
case "${1:-}" in
  --build) MODE=build ;;
  --python) MODE=python ;;
  --demo) MODE=demo ;;
  --capture) MODE=capture ;;
  --vllm) MODE=vllm ;;
  --lmeval) MODE=lmeval ;;
  "") ;;
  *) echo "usage: scripts/setup.sh [--build | --python | --demo | --capture | --vllm | --lmeval]" >&2; exit 2 ;;
esac
step_start=$(date +%s)
step() {  # step NAME: the previous step's cost, then this one's name
  local now; now=$(date +%s)
  [ -z "${STEP:-}" ] || echo "[setup] $STEP: $((now - step_start)) s"
  STEP=$1 step_start=$now
}

# The programs' build and run: compilers, MPI, HDF5, the header libraries, BLAS/LAPACK, OpenSSL.
RUN_PKGS=(build-essential cmake ninja-build pkg-config libopenmpi-dev openmpi-bin libhdf5-dev libspdlog-dev
          libcli11-dev libyaml-cpp-dev nlohmann-json3-dev libopenblas-dev liblapacke-dev libssl-dev)
# The tests and benchmarks: GoogleTest, Google Benchmark, the numpy/h5py consumer checks, Python venvs; and, where
# they can be installed (their tests report SKIPPED with the reason otherwise), the single-node Slurm of the array
# tests, libFuzzer, the Redis prefix store, headless Chromium (the report as a browser renders it).
TEST_PKGS=(hdf5-tools libgtest-dev libgmock-dev libbenchmark-dev python3-numpy python3-h5py python3-pytest python3-yaml python3-venv)
TEST_SERVICES=(slurm-wlm munge clang redis-server)
TEST_BROWSER=(chromium)  # its own step: a failure to install it must not take the services' tests with it

install_missing() {
  local missing=()
  for p in "$@"; do
    dpkg-query -W -f='${Status}' "$p" 2> /dev/null | grep -q "install ok installed" || missing+=("$p")
  done
  [ ${#missing[@]} -gt 0 ] || return 0
  echo "[setup] installing ${#missing[@]} Debian package(s): ${missing[*]}"
  local sudo=""; [ "$(id -u)" = 0 ] || sudo=sudo
  $sudo apt-get update -q > /dev/null
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -q --no-install-recommends "${missing[@]}" > /dev/null
}

configure() {  # configure BUILD_DIR CMAKE_ARGS...: once; ninja re-runs CMake itself when a CMakeLists.txt changed
  local build=$1; shift
  mkdir -p "$build"
  [ -f "$build/build.ninja" ] && return 0
  echo "[setup] configuring in $build"
  cmake -S "$ROOT" -B "$build" -G Ninja -DCMAKE_BUILD_TYPE=Release "$@" > "$build/configure.log" 2>&1 \
    || { cat "$build/configure.log"; exit 1; }
}

case $MODE in
  demo)
    step "Debian packages"
    install_missing "${RUN_PKGS[@]}"
    step "configure"
    cuda=OFF; command -v nvidia-smi > /dev/null && nvidia-smi -L > /dev/null 2>&1 && cuda=ON
    configure "$ROOT/build-demo" -DCROSSKV_BUILD_TESTS=OFF -DCROSSKV_BUILD_BENCH=OFF -DCROSSKV_CUDA_EMULATION=OFF \
      -DCROSSKV_CHECK_LAYERS=OFF -DCROSSKV_CUDA=$cuda
    step "build (crosskv-synth, crosskv-fit, crosskv-eval, crosskv-apply)"
    cmake --build "$ROOT/build-demo" -j"$(nproc)" --target crosskv-synth crosskv-fit crosskv-eval crosskv-apply \
      | grep -vE '^\[[0-9]+/[0-9]+\] (Building|Linking)' || true
    step ""
    ;;
  full | build)
    step "Debian packages"
    install_missing "${RUN_PKGS[@]}" "${TEST_PKGS[@]}"
    install_missing "${TEST_SERVICES[@]}" \
      || echo "[setup] could not install ${TEST_SERVICES[*]}: the Slurm, fuzz and Redis tests will be SKIPPED"
    install_missing "${TEST_BROWSER[@]}" \
      || echo "[setup] could not install ${TEST_BROWSER[*]}: the report-in-Chromium test will be SKIPPED"
    step "configure"
    configure "$ROOT/build"
    # One after the other: installing the Python environments while the build compiles was measured slower on 2
    # cores (docs/PERFORMANCE.md, The test suite).
    step "build (everything: programs, tests, benchmarks, the emulated CUDA build)"
    cmake --build "$ROOT/build" -j"$(nproc)"
    step ""
    ;;
esac
# The Python environments: the capture environment with the package first (lm-eval reads it, and vLLM's installs
# its wheel). CROSSKV_NO_CAPTURE=1 / CROSSKV_NO_LMEVAL=1 / CROSSKV_NO_VLLM=1 leave one out (its tests then SKIP).
wants() { case $MODE in full | python | "$1") [ "${2:-0}" != 1 ] ;; *) false ;; esac; }
if wants capture "${CROSSKV_NO_CAPTURE:-0}"; then
  step "capture environment (.venv-capture)"
  "$ROOT/scripts/setup-capture.sh"
  step "crosskv Python package"
  "$ROOT/scripts/setup-python-package.sh"
fi
if wants lmeval "${CROSSKV_NO_LMEVAL:-0}" && [ "${CROSSKV_NO_CAPTURE:-0}" != 1 ]; then
  step "lm-eval environment (.venv-lmeval)"
  "$ROOT/scripts/setup-lmeval.sh"
fi
if wants vllm "${CROSSKV_NO_VLLM:-0}" && [ "${CROSSKV_NO_CAPTURE:-0}" != 1 ]; then
  step "vLLM environment (.venv-vllm) with the crosskv package"
  "$ROOT/scripts/setup-vllm.sh"
fi
step ""
