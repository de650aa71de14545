#!/usr/bin/env bash
# The package's tests on the emulated CUDA backend (tests/python/test_package_cuda_emulation.py) under pytest; SKIPPED
# (77) with the reason where it was not built. Further arguments go to pytest.
#   tests/python/package_cuda_emulation.sh WORKDIR [PYTEST ARGS...]
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
PKG=${CROSSKV_PACKAGE_EMULATED:?}
[ -f "$PKG/crosskv/__init__.py" ] || { echo "SKIPPED: the package on the emulated CUDA backend is not built at $PKG (scripts/setup-python-package.sh)"; exit 77; }
export CROSSKV_CUDA_EMULATION_DEVICES=1 PYTHONPATH="$PKG" CROSSKV_SYNTH="${CROSSKV_SYNTH:?}" CROSSKV_FIT="${CROSSKV_FIT:?}"
. "$ROOT/tests/python/pytest_in.sh"
pytest_in "$PY" scripts/setup-capture.sh "torch, pytest" test_package_cuda_emulation.py "$@"
