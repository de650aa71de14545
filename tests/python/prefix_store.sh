#!/usr/bin/env bash
# crosskv.vllm's prefix store without an engine (tests/python/test_prefix_store.py, pytest) in .venv-vllm, on one kind
# of store: folder (a folder and shm:, and the settings) or redis (a redis-server of its own on a loopback port);
# SKIPPED (77) with the reason where the environment or redis-server is missing. Extra arguments go to pytest.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python
WORK=${1:?usage: $0 WORKDIR folder|redis [PYTEST ARGS...]}
KIND=${2:?usage: $0 WORKDIR folder|redis [PYTEST ARGS...]}
shift 2
[ -x "$PY" ] || { echo "SKIPPED: no vLLM environment at $PY (scripts/setup-vllm.sh installs it)"; exit 77; }
"$PY" -c "import crosskv.vllm.store, pytest" 2> /dev/null \
  || { echo "SKIPPED: crosskv.vllm or pytest does not import in $PY (scripts/setup-vllm.sh)"; exit 77; }
case $KIND in
  folder) SELECT="not redis" ;;
  redis) SELECT="redis"
         command -v redis-server > /dev/null \
           || { echo "SKIPPED: redis-server is not installed (Debian's redis-server)"; exit 77; } ;;
  *) echo "usage: $0 WORKDIR folder|redis" >&2; exit 2 ;;
esac
rm -rf "$WORK" && mkdir -p "$WORK"
exec "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/tmp" -k "$SELECT" "$ROOT/tests/python/test_prefix_store.py" "$@"
