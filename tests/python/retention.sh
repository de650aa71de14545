#!/usr/bin/env bash
# crosskv.retention's tests (tests/python/test_retention.py) under pytest in the capture virtualenv; SKIPPED (77) with
# the reason where it is missing. CROSSKV_FIT: crosskv-fit, for the cases through fitted artifacts. Extra arguments go
# to pytest (-k NAME).
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
pytest_in "$PY" "scripts/setup-capture.sh, scripts/setup-python-package.sh" "torch, transformers, pytest, crosskv.retention" \
  test_retention.py "$WORK" "$@"
