#!/usr/bin/env bash
# Runs the Python package's test in the capture virtualenv; SKIPPED (77) with the reason where it is missing.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR}
[ -x "$PY" ] || { echo "SKIPPED: no capture environment at $PY (scripts/setup-capture.sh installs it)"; exit 77; }
"$PY" -c "import torch, transformers, h5py" 2> /dev/null || { echo "SKIPPED: $PY lacks torch/transformers/h5py"; exit 77; }
"$PY" -c "import crosskv" 2> /dev/null \
  || { echo "SKIPPED: the crosskv package is not installed in $PY (scripts/setup-python-package.sh)"; exit 77; }
rm -rf "$WORK"
exec "$PY" "$ROOT/tests/python/test_package.py" "$WORK" "${CROSSKV_SYNTH:?}" "${CROSSKV_FIT:?}" "${CROSSKV_APPLY:?}"
