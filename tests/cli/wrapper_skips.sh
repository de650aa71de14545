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
. "$ROOT/tests/python/pytest_in.sh"
run() { (pytest_in "$PY" "the setup of $1" "json, $1" consumer_check.py "$WORK/$1" --collect-only -q) > "$WORK.$1.log" 2>&1; }
mkdir -p "$(dirname "$WORK")"
run crosskv_no_such_module; rc=$?
want="SKIPPED: $PY cannot import crosskv_no_such_module (the setup of crosskv_no_such_module): ModuleNotFoundError"
[ $rc = 77 ] && grep -qF "$want" "$WORK.crosskv_no_such_module.log" \
  || { cat "$WORK.crosskv_no_such_module.log"; echo "FAIL: exit $rc, and not the line: $want"; exit 1; }
# The planted case: every module imports, so the tests are collected (exit 0), not skipped.
run os; rc=$?
[ $rc = 0 ] || { cat "$WORK.os.log"; echo "FAIL: modules that import skipped the run (exit $rc)"; exit 1; }
# The engine tests' check (vllm.sh: CROSSKV_TEST_PRELOAD=1): the modules are imported in the preloaded engine process
# (tests/python/vllm_engine.py), not in pytest's; the same two outcomes.
preload() {
  (CROSSKV_TEST_PRELOAD=1 CROSSKV_TEST_PRELOAD_MODULES="json, $1" \
     pytest_in "$PY" "the setup of $1" json consumer_check.py "$WORK/preload-$1" --collect-only -q) \
    > "$WORK.preload-$1.log" 2>&1
}
preload crosskv_no_such_module; rc=$?
want="SKIPPED: $PY cannot import crosskv_no_such_module: ModuleNotFoundError: No module named 'crosskv_no_such_module' (the setup of crosskv_no_such_module)"
[ $rc = 77 ] && grep -qF "$want" "$WORK.preload-crosskv_no_such_module.log" \
  || { cat "$WORK.preload-crosskv_no_such_module.log"; echo "FAIL: preloaded: exit $rc, and not the line: $want"; exit 1; }
preload os; rc=$?
[ $rc = 0 ] || { cat "$WORK.preload-os.log"; echo "FAIL: preloaded: modules that import skipped the run (exit $rc)"; exit 1; }
echo "OK: a missing module skips with its name and setup (exit 77), in pytest's process and in the preloaded engine process; modules that import run the tests"
