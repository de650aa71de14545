#!/usr/bin/env bash
# The crosskv Python package (python/crosskv: its extension is built on the serving layers alone, with CMake through
# scikit-build-core and nanobind) into the capture virtualenv: one wheel in build/python-wheel/ (rebuilt
# incrementally in build/python/ when the sources change), installed into each environment that asks.
# Failure is reported, not fatal: the package's tests then SKIP. Usage: scripts/setup-python-package.sh
# env: CROSSKV_CAPTURE_VENV (the environment), CROSSKV_NO_EMULATED_PACKAGE=1 (no emulated-CUDA build beside it)
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}
[ -x "$VENV/bin/python" ] || exit 0
source "$ROOT/scripts/pip-install.sh"
# The package is built from the sources git knows (tracked and untracked, not ignored): installed again only when
# their contents changed since the last install into this environment.
stamp="$VENV/.crosskv-sources.sha256"
sources=$(cd "$ROOT" && git ls-files -co --exclude-standard 2> /dev/null | grep -E '^(core|artifact|serve|backends|python|cmake)/|^(CMakeLists.txt|pyproject.toml)$' \
          | sort | xargs -r sha256sum 2> /dev/null | sha256sum | cut -c1-64)
if [ -n "$sources" ] && [ -f "$stamp" ] && [ "$(cat "$stamp")" = "$sources" ] && "$VENV/bin/python" -c "import crosskv" 2> /dev/null; then
  echo "[setup] crosskv Python package up to date in $VENV"
  exit 0
fi
rm -f "$stamp"
: > "$ROOT/.venv-crosskv.log"
# The build tools in the environment itself (no build isolation): pip's isolated environment has a new path each
# time, and the build folder made in one is discarded by the next, so nothing would be built incrementally.
BUILD_REQ=(scikit-build-core==1.1.2 nanobind==3.1.0)
build_tools() {
  "$VENV/bin/python" -c "import scikit_build_core, nanobind" 2> /dev/null \
    || pip_install "$VENV" -q "${BUILD_REQ[@]}" >> "$ROOT/.venv-crosskv.log" 2>&1
}
# The serving libraries of the build in build/, where scripts/setup.sh made one: the extension links them, brought up
# to date first, instead of compiling them again (CROSSKV_SERVING_PREBUILT); only when something is built (an
# environment that installs the current wheel skips it).
PREBUILT=()
prebuilt() {
  [ ${#PREBUILT[@]} -gt 0 ] && return 0
  [ -f "$ROOT/build/build.ninja" ] && cmake --build "$ROOT/build" --target crosskv_serving >> "$ROOT/.venv-crosskv.log" 2>&1 \
    && [ -f "$ROOT/build/crosskv-serving.cmake" ] \
    && PREBUILT=(--config-settings=cmake.define.CROSSKV_SERVING_PREBUILT="$ROOT/build")
  return 0
}
# The wheel, built once for these sources and this Python, and installed without dependencies (numpy, the only one,
# is in every environment the setup makes).
WHEELS=$ROOT/build/python-wheel/$("$VENV/bin/python" -c 'import sys; print("cp%d%d" % sys.version_info[:2])')
wheel() {
  [ -n "$sources" ] && [ "$(cat "$WHEELS/.sources.sha256" 2> /dev/null)" = "$sources" ] && ls "$WHEELS"/crosskv-*.whl > /dev/null 2>&1 \
    && return 0
  build_tools
  prebuilt
  rm -rf "$WHEELS"
  "$VENV/bin/pip" wheel -q --disable-pip-version-check --no-deps --no-build-isolation "${PREBUILT[@]}" -w "$WHEELS" "$ROOT" \
    >> "$ROOT/.venv-crosskv.log" 2>&1 \
    && echo "$sources" > "$WHEELS/.sources.sha256"
}
if wheel && "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps --force-reinstall "$WHEELS"/crosskv-*.whl \
     >> "$ROOT/.venv-crosskv.log" 2>&1; then
  echo "[setup] crosskv Python package installed in $VENV ($("$VENV/bin/python" -c 'import crosskv; print(crosskv.__version__)'))"
  # The same package on the host emulation of CUDA, for its CUDA tests (python.package_cuda_emulation), beside it
  # (once, for the capture environment: CROSSKV_NO_EMULATED_PACKAGE=1 skips it). It builds in the wheel's build
  # folder: the extension is linked again (and, without build/, the backends compiled).
  if [ "${CROSSKV_NO_EMULATED_PACKAGE:-0}" = 1 ]; then
    :
  elif build_tools && prebuilt && rm -rf "$ROOT/build/python-emulated" && "$VENV/bin/pip" install -q --disable-pip-version-check --no-deps \
       --no-build-isolation "${PREBUILT[@]}" --target "$ROOT/build/python-emulated" \
       --config-settings=cmake.define.CROSSKV_PYTHON_CUDA_EMULATION=ON "$ROOT" >> "$ROOT/.venv-crosskv.log" 2>&1; then
    echo "[setup] the package on the emulated CUDA backend: $ROOT/build/python-emulated"
  else
    echo "[setup] could not build the package on the emulated CUDA backend (see .venv-crosskv.log): its test will be SKIPPED"
  fi
  [ -n "$sources" ] && echo "$sources" > "$stamp"
else
  echo "[setup] could not build the crosskv Python package (see .venv-crosskv.log): its tests will be SKIPPED"
fi
exit 0
