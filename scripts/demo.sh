#!/usr/bin/env bash
# The demo: installs only what the programs need, builds only the programs it runs (build-demo/), synthesizes a
# small model pair, fits it (k sweep 1, 2, 4, all), diagnoses every k on a held-out shard (report.html), and maps
# that shard with crosskv-apply. Each step prints what it cost; run again, it goes straight to the fit.
# Usage: scripts/demo.sh [WORK_DIR]   (default: ./demo)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:-$ROOT/demo}
t0=$(date +%s)
"$ROOT/scripts/setup.sh" --demo
BIN=$ROOT/build-demo
mkdir -p "$WORK"
last=$(date +%s)
took() { local now; now=$(date +%s); echo "[demo] $1: $((now - last)) s"; last=$now; }
echo "[demo] synthesizing a source (8 layers) and a target (12 layers) store in $WORK/data (+ a held-out domain)"
rm -rf "$WORK/data" "$WORK/out" "$WORK/held"
"$BIN/crosskv-synth" --out "$WORK/data" --shards 2 --sequences 8 --seq-len 512 --with-queries > /dev/null
"$BIN/crosskv-synth" --out "$WORK/held" --shards 1 --sequences 2 --seq-len 512 --with-queries --domains heldout \
  --data-seed 2026 > /dev/null
for side in source target; do cp -r "$WORK/held/$side/heldout" "$WORK/data/$side/"; done
cp "$ROOT/configs/demo.yaml" "$WORK/fit.yaml"
took "synthesize"
echo "[demo] fitting: mpirun --bind-to none -np 1 crosskv-fit $WORK/fit.yaml"
MPIRUN_FLAGS=(); [ "$(id -u)" = 0 ] && MPIRUN_FLAGS+=(--allow-run-as-root)
mpirun "${MPIRUN_FLAGS[@]}" --bind-to none -np 1 "$BIN/crosskv-fit" "$WORK/fit.yaml"
took "fit and held-out eval"
echo "[demo] applying k4 to the held-out source shard: crosskv-apply"
"$BIN/crosskv-apply" --mapper "$WORK/out/k4" --source "$WORK/data/source/heldout/shard-000.h5" \
  --out "$WORK/out/heldout-mapped-k4.h5" | tail -1
took "apply"
echo
echo "[demo] done in $(( $(date +%s) - t0 )) s. Outputs in $WORK/out:"
echo "  mappers (one folder per k):  $(cd "$WORK/out" && ls -d k*/ | tr '\n' ' ')"
echo "  R² matrices:                 $WORK/out/r2.h5"
echo "  R² heatmaps:                 $WORK/out/r2_heatmap.svg"
echo "  a manifest:                  $WORK/out/k4/manifest.json"
echo "  held-out diagnostics:        $WORK/out/report.html (open in a browser), $WORK/out/eval-k*.json"
echo "  the held-out shard, mapped:  $WORK/out/heldout-mapped-k4.h5"
echo "  the programs:                $BIN/crosskv-{fit,eval,apply,synth} (scripts/setup.sh builds everything in build/)"
