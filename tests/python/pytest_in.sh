# Sourced by the Python tests' ctest wrappers. pytest_in PY SETUP IMPORTS TEST WORK [PYTEST ARGS...]: TEST (under
# tests/python) under pytest with its temporary folders in WORK, made afresh; SKIPPED (77) with the reason unless PY
# exists, has pytest and imports IMPORTS (SETUP installs them). conftest.py imports them in pytest's own process
# (CROSSKV_TEST_IMPORTS): a second interpreter only to import torch or vLLM first cost up to 20 s a test.
pytest_in() {
  local py=$1 setup=$2 imports=$3 test=$4 work=$5
  shift 5
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  [ -x "$py" ] || { echo "SKIPPED: no Python environment at $py (set up by $setup)"; exit 77; }
  "$py" -c "import importlib.util as u, sys; sys.exit(u.find_spec('pytest') is None)" 2> /dev/null \
    || { echo "SKIPPED: $py has no pytest ($setup)"; exit 77; }
  rm -rf "$work" && mkdir -p "$work"
  CROSSKV_TEST_IMPORTS=$imports CROSSKV_TEST_SETUP=$setup exec "$py" -m pytest -q -p no:cacheprovider --basetemp="$work/tmp" "$root/tests/python/$test" "$@"
}
