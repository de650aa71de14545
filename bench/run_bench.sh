#!/usr/bin/env bash
# The CPU fit benchmark (docs/PERFORMANCE.md, The fit benchmark), in one run: a paper-shaped fit scaled to this machine.
#   (a) moment accumulation GFLOP/s against OpenBLAS sgemm on the same shapes,
#   (b) crosskv-fit wall time for the k sweep against plain numpy done the paper's way,
#   (c) the streaming read rate.
# Usage: bench/run_bench.sh [OUT_DIR]     env: BUILD (build dir), TOKENS_PER_SHARD_SEQS (sequences per shard, 8),
#        SHARDS (4), SEQ_LEN (1024), PYTHON (python3 with numpy + h5py)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
OUT=${1:-$ROOT/bench/results/run-$(date +%Y%m%d-%H%M%S)}
PY=${PYTHON:-/usr/bin/python3}
SHARDS=${SHARDS:-4} SEQS=${SEQS:-8} SEQ_LEN=${SEQ_LEN:-1024}
DIMS="12,8,64,16,8,64"
mkdir -p "$OUT"
DATA=$OUT/data
echo "[bench] synthesizing $((SHARDS * SEQS * SEQ_LEN)) tokens (bf16): source 12x8x64, target 16x8x64"
rm -rf "$DATA"
"$BUILD/crosskv-synth" --out "$DATA" --dtype bfloat16 --shards "$SHARDS" --sequences "$SEQS" --seq-len "$SEQ_LEN" \
  --source-layers 12 --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64 \
  > "$OUT/synth.log"
cat > "$OUT/fit.yaml" <<YAML
source: {store: data/source}
target: {store: data/target}
fit: {k: [1, 2, 4, 8, all], lambda: 0.01}
output: {dir: out}
runtime: {block_tokens: 4096}
YAML
echo "[bench] (a) kernels"
CROSSKV_BENCH_DIMS=$DIMS CROSSKV_BENCH_BLOCK=4096 "$BUILD/bench/crosskv-bench-kernels" --benchmark_format=json \
  --benchmark_min_time=6 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true > "$OUT/kernels.json"
echo "[bench] (c) streaming read rate"
sync
"$BUILD/bench/crosskv-bench-stream" "$OUT/fit.yaml" > "$OUT/stream.json"
echo "[bench] (b) crosskv-fit, k sweep 1,2,4,8,all"
t0=$(date +%s.%N)
"$BUILD/crosskv-fit" "$OUT/fit.yaml" > "$OUT/fit.log"
t1=$(date +%s.%N)
echo "{\"wall_s\": $(echo "$t1 - $t0" | bc)}" > "$OUT/fit.json"
echo "[bench] (b) numpy baseline (the paper's way: per k, per layer ridge)"
"$PY" "$ROOT/bench/numpy_baseline.py" "$DATA/source" "$DATA/target" 1,2,4,8,all 0.01 > "$OUT/numpy.json"
"$PY" "$ROOT/bench/summarize.py" "$OUT"
rm -rf "$DATA"
