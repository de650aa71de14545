#!/usr/bin/env bash
# crosskv-capture's parts, device_map, dtype, kill and disk checks (test_capture_parts.py) in the capture virtualenv;
# SKIPPED (77) with the reason where it is missing.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR}
[ -x "$PY" ] || { echo "SKIPPED: no capture environment at $PY (scripts/setup-capture.sh installs it)"; exit 77; }
"$PY" -c "import torch, transformers, tokenizers, h5py, accelerate" 2> /dev/null \
  || { echo "SKIPPED: $PY lacks torch/transformers/tokenizers/h5py/accelerate (scripts/setup-capture.sh)"; exit 77; }
# A tmpfs the test mounted and could not unmount (a run that was killed) goes first.
[ -d "$WORK/tmpfs" ] && mountpoint -q "$WORK/tmpfs" && umount "$WORK/tmpfs"
"$PY" "$ROOT/tests/python/test_capture_parts.py" "$WORK"
rc=$?
mountpoint -q "$WORK/tmpfs" 2> /dev/null && umount "$WORK/tmpfs"
exit $rc
