#!/usr/bin/env bash
# crosskv-capture's parts, device_map, dtype, kill and disk checks (test_capture_parts.py) under pytest in the capture
# virtualenv; SKIPPED (77) with the reason where it is missing. Further arguments go to pytest.
#   tests/python/capture_parts.sh WORKDIR [PYTEST ARGS...]
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
PY=${CROSSKV_CAPTURE_PYTHON:-${CROSSKV_CAPTURE_VENV:-$ROOT/.venv-capture}/bin/python}
# A tmpfs a killed run left mounted goes first.
WORK=$(realpath -m "${1:?usage: $0 WORKDIR}")
for m in $(awk -v w="$WORK/" 'index($2, w) == 1 {print $2}' /proc/mounts 2> /dev/null); do umount "$m"; done
. "$ROOT/tests/python/pytest_in.sh"
pytest_in "$PY" scripts/setup-capture.sh "torch, transformers, tokenizers, h5py, accelerate, pytest" test_capture_parts.py "$@"
