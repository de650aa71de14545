#!/usr/bin/env bash
# What fit.lambda: auto costs against a fixed λ, in one run: one store fitted with each, ROUNDS times alternating
# (--fresh: every fit reads the data), k = 1, 2, 4, 8, all, both probes. Prints each setting's median wall time, the
# probe and solve stages (manifest timings), their ratio, the CPU and the BLAS kernels beside them.
# Usage: bench/lambda_cost.sh [OUT_DIR]    env: BUILD (build dir), ROUNDS (3), STORE (a store with source/ and target/;
#        default: a synthetic one of the benchmark's shape, 12x8x64 -> 16x8x64, 16,384 tokens)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
OUT=${1:-$ROOT/bench/results/lambda-$(date +%Y%m%d-%H%M%S)}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT" && cd "$OUT"
if [ -z "${STORE:-}" ]; then
  rm -rf data
  "$BUILD/crosskv-synth" --out data --dtype bfloat16 --shards 4 --sequences 4 --seq-len 1024 --source-layers 12 \
    --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64 > /dev/null
  STORE=$OUT/data
fi
for probe in same_head all_heads; do
  for l in 0.01 auto; do
    printf 'source: {store: %s/source}\ntarget: {store: %s/target}\nfit: {lambda: %s, probe: %s}\noutput: {dir: out-%s-%s}\n' \
      "$STORE" "$STORE" "$l" "$probe" "$probe" "$l" > "$probe-$l.yaml"
  done
done
for r in $(seq "$ROUNDS"); do
  for probe in same_head all_heads; do
    for l in 0.01 auto; do
      s=$(date +%s.%N)
      "$BUILD/crosskv-fit" "$probe-$l.yaml" --fresh > "fit-$probe-$l-$r.log" 2>&1
      echo "$probe $l $(echo "$(date +%s.%N) - $s" | bc)"
    done
  done
done | tee times.txt
python3 - "$OUT" <<'PY'
import json, statistics, sys
out = sys.argv[1]
wall = {}
for line in open(f"{out}/times.txt"):
    probe, l, s = line.split()
    wall.setdefault((probe, l), []).append(float(s))
for probe in ("same_head", "all_heads"):
    row = {}
    for l in ("0.01", "auto"):
        t = json.load(open(f"{out}/out-{probe}-{l}/k1/manifest.json"))["timings_s"]
        row[l] = (statistics.median(wall[(probe, l)]), t["probe"], t["solve+export"])
    (f, fp, fs), (a, ap, as_) = row["0.01"], row["auto"]
    print(f"probe {probe}: wall fixed {f:.2f} s, auto {a:.2f} s: auto/fixed {a / f:.3f} "
          f"(probe {fp:.2f} -> {ap:.2f} s, solve+export {fs:.2f} -> {as_:.2f} s)")
log = open(f"{out}/fit-same_head-auto-1.log").read()
print(next((l.split("] ", 2)[-1] for l in log.splitlines() if "kernels" in l and "CPU" in l), "BLAS kernels: ?"))
print(next((l.split("] ", 2)[-1] for l in log.splitlines() if "fit.lambda auto" in l), ""))
PY
grep -m1 "model name" /proc/cpuinfo
