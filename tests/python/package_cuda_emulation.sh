#!/usr/bin/env bash
# Runs the package's test on the emulated CUDA backend; SKIPPED (77) with the reason where it was not built.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
PKG=${CROSSKV_PACKAGE_EMULATED:?}
WORK=${1:?usage: $0 WORKDIR}
[ -x "$PY" ] || { echo "SKIPPED: no capture environment at $PY (scripts/setup-capture.sh installs it)"; exit 77; }
[ -f "$PKG/crosskv/__init__.py" ] || { echo "SKIPPED: the package on the emulated CUDA backend is not built at $PKG (scripts/setup-python-package.sh)"; exit 77; }
"$PY" -c "import torch" 2> /dev/null || { echo "SKIPPED: $PY lacks torch"; exit 77; }
rm -rf "$WORK"
CROSSKV_CUDA_EMULATION_DEVICES=1 PYTHONPATH="$PKG" exec "$PY" "$ROOT/tests/python/test_package_cuda_emulation.py" "$WORK" \
  "${CROSSKV_SYNTH:?}" "${CROSSKV_FIT:?}"
