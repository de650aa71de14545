#!/usr/bin/env bash
# The crosskv Python package (python/crosskv: pip install . builds its extension with CMake through scikit-build-core
# and nanobind) into the capture virtualenv, rebuilt incrementally in build/python/. Failure is reported, not fatal:
# the package's tests then SKIP. Usage: scripts/setup-python-package.sh    env: CROSSKV_CAPTURE_VENV
set -uo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
VENV=${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}
[ -x "$VENV/bin/python" ] || exit 0
if "$VENV/bin/pip" install -q --disable-pip-version-check "$ROOT" > "$ROOT/.venv-crosskv.log" 2>&1; then
  echo "[setup] crosskv Python package installed in $VENV ($("$VENV/bin/python" -c 'import crosskv; print(crosskv.__version__)'))"
else
  echo "[setup] could not build the crosskv Python package (see .venv-crosskv.log): its tests will be SKIPPED"
fi
exit 0
