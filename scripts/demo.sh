#!/usr/bin/env bash
# Sets up, builds, synthesizes a small model pair and fits it (k sweep 1, 2, 4, all).
# Usage: scripts/demo.sh [WORK_DIR]   (default: ./demo)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$ROOT/demo}
"$ROOT/scripts/setup.sh"
BIN=$ROOT/build
mkdir -p "$WORK"
echo "[demo] synthesizing a source (8 layers) and a target (12 layers) store in $WORK/data"
rm -rf "$WORK/data" "$WORK/out"
"$BIN/crosskv-synth" --out "$WORK/data" --shards 2 --sequences 8 --seq-len 512
cp "$ROOT/configs/demo.yaml" "$WORK/fit.yaml"
echo "[demo] fitting: mpirun --bind-to none -np 1 crosskv-fit $WORK/fit.yaml"
MPIRUN_FLAGS=(); [ "$(id -u)" = 0 ] && MPIRUN_FLAGS+=(--allow-run-as-root)
mpirun "${MPIRUN_FLAGS[@]}" --bind-to none -np 1 "$BIN/crosskv-fit" "$WORK/fit.yaml"
echo
echo "[demo] done. Outputs in $WORK/out:"
echo "  mappers (one folder per k):  $(cd "$WORK/out" && ls -d k*/ | tr '\n' ' ')"
echo "  R² matrices:                 $WORK/out/r2.h5"
echo "  R² heatmaps:                 $WORK/out/r2_heatmap.svg"
echo "  a manifest:                  $WORK/out/k4/manifest.json"
