#!/usr/bin/env bash
# crosskv.vllm against real vLLM engines (tests/python/test_vllm.py, or the test files named) under pytest in
# .venv-vllm, with the family made in the capture environment; SKIPPED (77) with the reason where either is missing.
# Further arguments go to pytest (-k NAME runs one case). Files named together share one pytest session and one
# preloaded vLLM (vllm_engine.Preloaded: about 30 s of a core per session); each runs in its own copy of the family.
#   tests/python/vllm.sh WORKDIR [TEST_FILE...] [PYTEST ARGS...]   (TEST_FILE: test_vllm.py unless named)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_VLLM_VENV:-$ROOT/.venv-vllm}/bin/python
CAP=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
WORK=${1:?usage: $0 WORKDIR [TEST_FILE...] [PYTEST ARGS...]}
shift
TESTS=()
while [ $# -gt 0 ] && [ "${1#-}" = "$1" ]; do TESTS+=("$1"); shift; done
[ ${#TESTS[@]} -gt 0 ] || TESTS=(test_vllm.py)
TEST=${TESTS[0]}  # the GPU and fp8 tests run alone
[ -x "$PY" ] || { echo "SKIPPED: no vLLM environment at $PY (scripts/setup-vllm.sh installs it)"; exit 77; }
# Before vLLM is imported (about 20 s): a GPU test without a GPU, and the fp8 test without AVX-512 or AMX, skip at once.
if [ "$TEST" = test_vllm_gpu.py ] && ! "$PY" -c "import torch, sys; sys.exit(not torch.cuda.is_available())"; then
  echo "SKIPPED: no CUDA GPU for vLLM here (test_vllm_gpu.py runs on a GPU node, or in bench/gpu_check.sh STEPS=vllm)"
  exit 77
fi
if [ "$TEST" = test_vllm_fp8.py ] && ! "$PY" -c "import torch, sys; sys.exit(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()))"; then
  echo "SKIPPED: vLLM's CPU build runs fp8 KV caches only with AVX-512 or AMX, and this CPU has neither"
  exit 77
fi
has() { "$1" -c "import importlib.util as u, sys; sys.exit(not all(u.find_spec(m) for m in sys.argv[1:]))" "${@:2}" 2> /dev/null; }
has "$PY" pytest || { echo "SKIPPED: $PY has no pytest (scripts/setup-vllm.sh)"; exit 77; }
[ -x "$CAP" ] && has "$CAP" torch transformers \
  || { echo "SKIPPED: no capture environment at $CAP to make the test's models (scripts/setup-capture.sh)"; exit 77; }
if [ "$TEST" != test_vllm_fp8.py ] && [ "$TEST" != test_vllm_gpu.py ] && ! command -v redis-server > /dev/null; then
  echo "SKIPPED: redis-server is not installed (Debian's redis-server): the test's engines meet through a Redis store"
  exit 77
fi
# pytest, its temporary folders and the family's (conftest.py) in WORK; the engines run in the family's folder.
mkdir -p "$WORK"
export CROSSKV_TEST_WORK="$WORK/family" CROSSKV_CAPTURE_PYTHON="$CAP" CROSSKV_FIT="${CROSSKV_FIT:?}"
# vLLM and the package's connector: SKIPPED (77) with the reason if they do not import. The engines and servers
# fork from a preloaded process (vllm_engine.Preloaded), which imports them; pytest's own process does without
# (about 20 s).
export CROSSKV_TEST_SETUP=scripts/setup-vllm.sh CROSSKV_TEST_IMPORTS=crosskv.vllm CROSSKV_TEST_PRELOAD=1
exec "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/tmp" "${TESTS[@]/#/$ROOT/tests/python/}" "$@"
