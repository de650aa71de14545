#!/usr/bin/env bash
# crosskv.lm_eval's tests (tests/python/test_lm_eval.py) under pytest in .venv-lmeval, offline; SKIPPED (77) with the
# reason where the environment is missing. CROSSKV_FIT: crosskv-fit (the family's mapper). Extra arguments go to
# pytest (-k NAME).
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_LMEVAL_VENV:-$ROOT/.venv-lmeval}/bin/python
WORK=${1:?usage: $0 WORKDIR [PYTEST ARGS...]}
shift
[ -x "$PY" ] || { echo "SKIPPED: no lm-eval environment at $PY (scripts/setup-lmeval.sh installs it)"; exit 77; }
"$PY" -c "import lm_eval, crosskv.lm_eval, pytest" 2> /dev/null \
  || { echo "SKIPPED: lm_eval, crosskv.lm_eval or pytest does not import in $PY (scripts/setup-lmeval.sh)"; exit 77; }
rm -rf "$WORK" && mkdir -p "$WORK"
cd "$WORK" && HF_DATASETS_OFFLINE=1 HF_HUB_OFFLINE=1 HF_HOME="$WORK/hf" \
  exec "$PY" -m pytest -q -p no:cacheprovider --basetemp="$WORK/tmp" "$ROOT/tests/python/test_lm_eval.py" "$@"
