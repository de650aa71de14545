#!/usr/bin/env bash
# The Python tests' wrapper (tests/python/pytest_in.sh) and conftest.py: a module the tests need that does not
# import ends the run as SKIPPED (77) with the module, the setup that installs it and the error named; modules that
# import run the tests; the same where the engine tests import them in their preloaded process. In Debian's python3
# with pytest.   tests/cli/wrapper_skips.sh WORKDIR
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
WORK=${1:?usage: $0 WORKDIR}
PY=/usr/bin/python3
"$PY" -c "import pytest" 2> /dev/null || { echo "SKIPPED: $PY has no pytest (apt-get install python3-pytest)"; exit 77; }
mkdir -p "$(dirname "$WORK")"
# check NAME WANT MODULE [ENV...]: pytest_in over consumer_check.py needing json and MODULE, with ENV; WANT: the
# SKIPPED line expected (exit 77), or "" for a run that collects the tests (exit 0).
check() {
  local name=$1 want=$2 module=$3
  shift 3
  (env "$@" bash -c '. "$0"; pytest_in "$1" "its setup" "json, $2" consumer_check.py "$3" --collect-only -q' \
     "$ROOT/tests/python/pytest_in.sh" "$PY" "$module" "$WORK/$name") > "$WORK.$name.log" 2>&1
  local rc=$?
  if [ -n "$want" ]; then
    [ $rc = 77 ] && grep -qF "$want" "$WORK.$name.log" \
      || { cat "$WORK.$name.log"; echo "FAIL: $name: exit $rc, and not the line: $want"; exit 1; }
  else  # the planted case: every module imports, so the tests are collected, not skipped
    [ $rc = 0 ] || { cat "$WORK.$name.log"; echo "FAIL: $name: modules that import skipped the run ($rc)"; exit 1; }
  fi
}
missing=crosskv_no_such_module
check missing "SKIPPED: $PY cannot import $missing (its setup): ModuleNotFoundError" $missing
check imports "" os
# The engine tests' check (vllm.sh: CROSSKV_TEST_PRELOAD=1): the modules are imported in the preloaded engine process
# (tests/python/vllm_engine.py), not in pytest's; the same two outcomes.
check preload-missing \
  "SKIPPED: $PY cannot import $missing: ModuleNotFoundError: No module named '$missing' (its setup)" os \
  CROSSKV_TEST_PRELOAD=1 CROSSKV_TEST_PRELOAD_MODULES="json, $missing"
check preload-imports "" os CROSSKV_TEST_PRELOAD=1 CROSSKV_TEST_PRELOAD_MODULES="json, os"
echo "OK: a missing module skips with its name and setup (exit 77), in pytest's process and in the preloaded" \
  "engine process; modules that import run the tests"
