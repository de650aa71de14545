#!/usr/bin/env bash
# The crosskv Python package's tests (tests/python/test_package.py, pytest) in the capture virtualenv; SKIPPED (77)
# with the reason where it is missing. env: CROSSKV_SYNTH, CROSSKV_FIT, CROSSKV_APPLY. Extra arguments go to pytest.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
[ -x "$PY" ] || { echo "SKIPPED: no capture environment at $PY (scripts/setup-capture.sh installs it)"; exit 77; }
"$PY" -c "import torch, transformers, h5py, pytest" 2> /dev/null \
  || { echo "SKIPPED: $PY lacks torch/transformers/h5py/pytest (scripts/setup-capture.sh)"; exit 77; }
"$PY" -c "import crosskv" 2> /dev/null \
  || { echo "SKIPPED: the crosskv package is not installed in $PY (scripts/setup-python-package.sh)"; exit 77; }
: "${CROSSKV_SYNTH:?}" "${CROSSKV_FIT:?}" "${CROSSKV_APPLY:?}"
rm -rf "$WORK" && mkdir -p "$WORK"
exec "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/tmp" "$ROOT/tests/python/test_package.py" "$@"
