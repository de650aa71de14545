#!/usr/bin/env bash
# crosskv.vllm's parts that need no engine (tests/python/test_vllm_units.py) under pytest in .venv-vllm; SKIPPED (77)
# with the reason where the environment is missing. Extra arguments go to pytest (-k NAME).
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
pytest_in "$PY" scripts/setup-vllm.sh "crosskv.vllm, pytest" test_vllm_units.py "$WORK" "$@"
