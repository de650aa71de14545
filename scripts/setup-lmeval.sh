#!/usr/bin/env bash
# lm-evaluation-harness for crosskv.lm_eval, in .venv-lmeval: lm-eval from PyPI (exact versions in
# python/lmeval-lock.txt) over the capture environment's torch, transformers and crosskv package, which it reads
# through a .pth file (no second copy of torch). Failure is reported, not fatal: the lm-eval tests then SKIP with the
# reason. Usage: scripts/setup-lmeval.sh (after scripts/setup-capture.sh and setup-python-package.sh)
# env: CROSSKV_LMEVAL_VENV, CROSSKV_CAPTURE_VENV
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${CROSSKV_LMEVAL_VENV:-$ROOT/.venv-lmeval}
BASE=${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}
LOCK=$ROOT/python/lmeval-lock.txt
LOG=$ROOT/.venv-lmeval.log
source "$ROOT/scripts/pip-install.sh"
if ! "$BASE/bin/python" -c "import torch, transformers, crosskv" 2> /dev/null; then
  echo "[setup] no capture environment with the crosskv package at $BASE: not installing lm-eval; its tests will be SKIPPED"
  exit 0
fi
lock_sum=$( (sha256sum "$LOCK"; echo "$BASE") | sha256sum | cut -c1-64)
if [ -x "$VENV/bin/python" ] && [ "$(cat "$VENV/.lock.sha256" 2> /dev/null)" = "$lock_sum" ]; then
  exit 0
fi
echo "[setup] creating $VENV with lm-eval over $BASE"
rm -rf "$VENV"
site=$("$BASE/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if /usr/bin/python3 -m venv "$VENV" \
   && echo "$site" > "$("$VENV/bin/python" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")/crosskv-capture-env.pth" \
   && pip_install "$VENV" -q --no-deps -r "$LOCK" > "$LOG" 2>&1 \
   && "$VENV/bin/python" -c "import lm_eval, crosskv.lm_eval, pytest" >> "$LOG" 2>&1; then
  echo "$lock_sum" > "$VENV/.lock.sha256"
  echo "[setup] lm-eval ready: $VENV/bin/python -m crosskv.lm_eval --help"
else
  echo "[setup] could not install lm-eval (see .venv-lmeval.log): its tests will be SKIPPED"
  rm -rf "$VENV"
fi
exit 0
