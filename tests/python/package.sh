#!/usr/bin/env bash
# The crosskv Python package's tests (tests/python/test_package.py, pytest) in the capture virtualenv; SKIPPED (77)
# with the reason where it is missing. env: CROSSKV_SYNTH, CROSSKV_FIT, CROSSKV_APPLY. Extra arguments go to pytest.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
: "${CROSSKV_SYNTH:?}" "${CROSSKV_FIT:?}" "${CROSSKV_APPLY:?}"
pytest_in "$PY" "scripts/setup-capture.sh, scripts/setup-python-package.sh" "torch, transformers, h5py, pytest, crosskv" \
  test_package.py "$WORK" "$@"
