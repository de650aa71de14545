#!/usr/bin/env bash
set -euo pipefail
WORK=${1:?}
if [ -z "${PYTHON:-}" ]; then
  echo "SKIPPED: no Python with numpy and h5py (install python3-numpy python3-h5py)"
  exit 77
fi
rm -rf "$WORK"
cd "$(dirname "$0")"
exec "$PYTHON" consumer_check.py "$CROSSKV_FIT" "$CROSSKV_SYNTH" "$WORK"
