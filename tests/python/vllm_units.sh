#!/usr/bin/env bash
# crosskv.vllm's parts that need no engine (tests/python/test_vllm_units.py) under pytest in .venv-vllm; SKIPPED (77)
# with the reason where the environment is missing. Extra arguments go to pytest (-k NAME).
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
[ -x "$PY" ] || { echo "SKIPPED: no vLLM environment at $PY (scripts/setup-vllm.sh installs it)"; exit 77; }
"$PY" -c "import crosskv.vllm, pytest" 2> /dev/null \
  || { echo "SKIPPED: crosskv.vllm or pytest does not import in $PY (scripts/setup-vllm.sh)"; exit 77; }
mkdir -p "$WORK"
exec "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/tmp" "$ROOT/tests/python/test_vllm_units.py" "$@"
