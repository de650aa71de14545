#!/usr/bin/env bash
# Runs the Hugging Face conformity test in the capture virtualenv; SKIPPED (77) with the reason where it is missing.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR}
[ -x "$PY" ] || { echo "SKIPPED: no capture environment at $PY (scripts/setup-capture.sh installs it)"; exit 77; }
"$PY" -c "import torch, transformers, tokenizers, h5py" 2> /dev/null \
  || { echo "SKIPPED: $PY lacks torch/transformers/tokenizers/h5py"; exit 77; }
rm -rf "$WORK"
exec "$PY" "$ROOT/tests/python/test_capture_conformity.py" "$WORK" "${CROSSKV_STRIP:?}" "${CROSSKV_FIT:?}"
