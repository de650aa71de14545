#!/usr/bin/env bash
# The consumer check (consumer_check.py) under pytest in a plain Python with numpy and h5py ($PYTHON: Debian's
# python3 with python3-numpy, python3-h5py and python3-pytest); SKIPPED (77) with the reason where it lacks them.
#   tests/python/consumer_check.sh WORKDIR [PYTEST ARGS...]
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ -n "${PYTHON:-}" ] || { echo "SKIPPED: no Python with numpy and h5py (install python3-numpy python3-h5py)"; exit 77; }
export CROSSKV_FIT="${CROSSKV_FIT:?}" CROSSKV_SYNTH="${CROSSKV_SYNTH:?}"
. "$ROOT/tests/python/pytest_in.sh"
pytest_in "$PYTHON" "apt-get install python3-numpy python3-h5py python3-pytest" "numpy, h5py, pytest" consumer_check.py "$@"
