#!/usr/bin/env bash
# The Hugging Face conformity tests (tests/python/test_capture_conformity.py, pytest) in the capture virtualenv;
# SKIPPED (77) with the reason where it is missing. env: CROSSKV_STRIP, CROSSKV_FIT. Extra arguments go to pytest.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
: "${CROSSKV_STRIP:?}" "${CROSSKV_FIT:?}"
pytest_in "$PY" scripts/setup-capture.sh "torch, transformers, tokenizers, h5py, pytest" test_capture_conformity.py \
  "$WORK" "$@"
