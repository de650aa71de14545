#!/usr/bin/env bash
# crosskv.retention's tests (tests/python/test_retention.py) under pytest in the capture virtualenv; SKIPPED (77) with
# the reason where it is missing. CROSSKV_FIT: crosskv-fit, for the cases through fitted artifacts. Extra arguments go
# to pytest (-k NAME).
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
[ -x "$PY" ] || { echo "SKIPPED: no capture environment at $PY (scripts/setup-capture.sh installs it)"; exit 77; }
"$PY" -c "import torch, transformers, pytest" 2> /dev/null \
  || { echo "SKIPPED: $PY lacks torch/transformers/pytest (scripts/setup-capture.sh)"; exit 77; }
"$PY" -c "import crosskv.retention" 2> /dev/null \
  || { echo "SKIPPED: the crosskv package is not installed in $PY (scripts/setup-python-package.sh)"; exit 77; }
rm -rf "$WORK" && mkdir -p "$WORK"
exec "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/tmp" "$ROOT/tests/python/test_retention.py" "$@"
