#!/usr/bin/env bash
# What per-token weights cost the fit: one synthetic store with `weights` in the target's shards, fitted
# with fit.weighting: uniform and dataset, ROUNDS times alternating (--fresh: every fit reads the data), in one run:
# the first pass's rate and the whole fit's time of each, their ratio, the CPU and the BLAS kernels beside them.
# Usage: bench/weighting_cost.sh [OUT_DIR]    env: BUILD (build dir), ROUNDS (3)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
OUT=${1:-$ROOT/bench/results/weighting-$(date +%Y%m%d-%H%M%S)}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT" && cd "$OUT"
rm -rf data
"$BUILD/crosskv-synth" --out data --with-weights --dtype bfloat16 --shards 4 --sequences 8 --seq-len 1024 \
  --source-layers 12 --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64 \
  > /dev/null
for w in uniform dataset; do
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 4, all], weighting: %s}\noutput: {dir: out-%s}\n' \
    "$w" "$w" > "$w.yaml"
done
for r in $(seq "$ROUNDS"); do
  for w in uniform dataset; do
    s=$(date +%s.%N)
    "$BUILD/crosskv-fit" "$w.yaml" --fresh > "fit-$w-$r.log"
    echo "$w $(echo "$(date +%s.%N) - $s" | bc)"
  done
done | tee times.txt
python3 - "$OUT" "$ROUNDS" <<'PY'
import re, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
wall = {"uniform": [], "dataset": []}
for line in open(f"{out}/times.txt"):
    w, s = line.split()
    wall[w].append(float(s))
rate = {w: [] for w in wall}
for w in wall:
    for r in range(1, rounds + 1):
        log = open(f"{out}/fit-{w}-{r}.log").read()
        m = re.search(r"pass 1/1[^\n]*?\(([0-9.]+) ([KM]?) ?tokens/s", log)
        rate[w].append(float(m.group(1)) * {"": 1, "K": 1e3, "M": 1e6}[m.group(2)])
u, d = statistics.median(wall["uniform"]), statistics.median(wall["dataset"])
ru, rd = statistics.median(rate["uniform"]), statistics.median(rate["dataset"])
print(f"fit wall time: uniform {u:.2f} s, weighted {d:.2f} s (medians of {rounds}): weighted/uniform {d / u:.3f}")
print(f"first pass: uniform {ru:.0f} tokens/s, weighted {rd:.0f} tokens/s: weighted/uniform {rd / ru:.3f}")
log = open(f"{out}/fit-uniform-1.log").read()
print(next((l.split("] ", 2)[-1] for l in log.splitlines() if "kernels" in l and "CPU" in l), "BLAS kernels: ?"))
PY
grep -m1 "model name" /proc/cpuinfo
