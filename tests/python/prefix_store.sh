#!/usr/bin/env bash
# crosskv.vllm's prefix store without an engine (tests/python/test_prefix_store.py, pytest) in .venv-vllm, on one kind
# of store: folder (a folder and shm:, and the settings) or redis (a redis-server of its own on a loopback port);
# SKIPPED (77) with the reason where the environment or redis-server is missing. Extra arguments go to pytest.
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python
WORK=${1:?usage: $0 WORKDIR folder|redis [PYTEST ARGS...]}
KIND=${2:?usage: $0 WORKDIR folder|redis [PYTEST ARGS...]}
shift 2
case $KIND in
  folder) SELECT="not redis" ;;
  redis) SELECT="redis"
         command -v redis-server > /dev/null \
           || { echo "SKIPPED: redis-server is not installed (Debian's redis-server)"; exit 77; } ;;
  *) echo "usage: $0 WORKDIR folder|redis" >&2; exit 2 ;;
esac
pytest_in "$PY" scripts/setup-vllm.sh "crosskv.vllm.store, pytest" test_prefix_store.py "$WORK" -k "$SELECT" "$@"
