#!/usr/bin/env bash
# crosskv.vllm's prefix store without an engine (tests/python/test_prefix_store.py) in .venv-vllm, on one kind of store:
# folder (a folder and shm:) or redis (a redis-server of its own on a loopback port); SKIPPED (77) with the reason
# where the environment or redis-server is missing.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python
WORK=${1:?usage: $0 WORKDIR folder|redis}
KIND=${2:?usage: $0 WORKDIR folder|redis}
[ -x "$PY" ] || { echo "SKIPPED: no vLLM environment at $PY (scripts/setup-vllm.sh installs it)"; exit 77; }
"$PY" -c "import crosskv.vllm.store" 2> /dev/null \
  || { echo "SKIPPED: crosskv.vllm does not import in $PY (scripts/setup-vllm.sh)"; exit 77; }
exec "$PY" "$ROOT/tests/python/test_prefix_store.py" "$WORK" "$KIND"
