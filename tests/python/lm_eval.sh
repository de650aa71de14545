#!/usr/bin/env bash
# crosskv.lm_eval's tests (tests/python/test_lm_eval.py) under pytest in .venv-lmeval, offline; SKIPPED (77) with the
# reason where the environment is missing. CROSSKV_FIT: crosskv-fit (the family's mapper). Extra arguments go to
# pytest (-k NAME).
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
source "$ROOT/tests/python/pytest_in.sh"
PY=${CROSSKV_LMEVAL_VENV:-$ROOT/.venv-lmeval}/bin/python
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
export HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HOME="$WORK/hf"
pytest_in "$PY" scripts/setup-lmeval.sh "lm_eval, crosskv.lm_eval, pytest" test_lm_eval.py "$WORK" "$@"
