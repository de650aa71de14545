# Sourced by the Python tests' ctest wrappers. pytest_in PY SETUP IMPORTS TEST WORK [PYTEST ARGS...]: SKIPPED (77)
# with the reason unless PY exists and imports IMPORTS (SETUP installs them); then TEST (under tests/python) runs
# under pytest with its temporary folders in WORK, made afresh.
pytest_in() {
  local py=$1 setup=$2 imports=$3 test=$4 work=$5
  shift 5
  local root
  root=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
  [ -x "$py" ] || { echo "SKIPPED: no Python environment at $py (set up by $setup)"; exit 77; }
  "$py" -c "import $imports" 2> /dev/null || { echo "SKIPPED: $py cannot import $imports ($setup)"; exit 77; }
  rm -rf "$work" && mkdir -p "$work"
  exec "$py" -m pytest -q -p no:cacheprovider --basetemp="$work/tmp" "$root/tests/python/$test" "$@"
}
