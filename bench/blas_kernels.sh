#!/usr/bin/env bash
# BLAS kernels against each other in one run: crosskv-fit at the benchmark's shapes (12x8x64 -> 16x8x64,
# 16K bf16 tokens, k = 1, 2, 4, 8, all) and crosskv-eval (1,024 held-out tokens, k = 4), once per OpenBLAS core named
# in CORES ("default" = as this machine runs it, with crosskv's own choice), the CPU and the kernels beside each row.
# Usage: bench/blas_kernels.sh [OUT_DIR]    env: BUILD (build dir), CORES ("Prescott default")
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
OUT=${1:-$ROOT/bench/results/blas-$(date +%Y%m%d-%H%M%S)}
CORES=${CORES:-Prescott default}
mkdir -p "$OUT" && cd "$OUT"
rm -rf data held out-*
"$BUILD/crosskv-synth" --out data --dtype bfloat16 --shards 4 --sequences 4 --seq-len 1024 --source-layers 12 \
  --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64 > /dev/null
"$BUILD/crosskv-synth" --out held --dtype bfloat16 --shards 1 --sequences 1 --seq-len 1024 --source-layers 12 \
  --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64 --with-queries \
  --domains heldout --data-seed 99 > /dev/null
cpu=$(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2- | sed 's/^ //')
fam=$(grep -m1 "cpu family" /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
model=$(grep -m1 "^model\s" /proc/cpuinfo | cut -d: -f2 | tr -d ' ')
echo "| kernels | crosskv-fit (s) | crosskv-eval k=4 (s) | CPU |"
echo "|---|---|---|---|"
for core in $CORES; do
  envs=()
  [ "$core" = default ] || envs=(OPENBLAS_CORETYPE="$core")
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2, 4, 8, all], lambda: 0.01}\noutput: {dir: out-%s}\nruntime: {block_tokens: 4096}\n' \
    "$core" > "fit-$core.yaml"
  t0=$(date +%s.%N)
  env "${envs[@]}" "$BUILD/crosskv-fit" "fit-$core.yaml" > "fit-$core.log" 2>&1
  t1=$(date +%s.%N)
  env "${envs[@]}" "$BUILD/crosskv-eval" --mapper "out-$core/k4" --source held/source/heldout/shard-000.h5 \
    --target held/target/heldout/shard-000.h5 --json "eval-$core.json" > "eval-$core.log" 2>&1
  t2=$(date +%s.%N)
  used=$(grep -o "kernels [A-Za-z0-9_]*" "fit-$core.log" | head -1 | cut -d' ' -f2)
  printf '| %s%s | %.1f | %.2f | %s (family %s, model %s) |\n' "$used" "$([ "$core" = default ] && echo " (default)" || echo " (OPENBLAS_CORETYPE)")" \
    "$(echo "$t1 - $t0" | bc)" "$(echo "$t2 - $t1" | bc)" "$cpu" "$fam" "$model"
done
# The same mappers whatever the kernels, to the printed precision.
python3 - out-* <<'PY'
import json, sys
figs = {d: json.load(open(f"eval-{d[4:]}.json")) for d in sys.argv[1:]}
for d, j in figs.items():
    print(f"{d}: held-out R² k {j['r2_k']:.4f}, v {j['r2_v']:.4f}, cosine {j['attention_cosine']:.4f}")
PY
