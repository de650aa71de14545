#!/usr/bin/env bash
# The CPU benchmark of issue 2, in one run: a paper-shaped fit scaled to this machine.
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
  --benchmark_min_time=1 --benchmark_repetitions=3 --benchmark_report_aggregates_only=true > "$OUT/kernels.json"
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
"$PY" - "$OUT" <<'PYEOF'
import json, sys, os, re
out = sys.argv[1]
k = {b["run_name"]: b for b in json.load(open(f"{out}/kernels.json"))["benchmarks"] if b.get("aggregate_name") == "median"}
g = lambda name: k[name]["flops"] / 1e9
acc, blk, wide = g("BM_accumulate_full"), g("BM_sgemm_block"), g("BM_sgemm_wide")
st = json.load(open(f"{out}/stream.json"))
fit = json.load(open(f"{out}/fit.json"))
npy = json.load(open(f"{out}/numpy.json"))
log = open(f"{out}/fit.log").read()
stages = dict(re.findall(r"\]\s+(\S+)\s+([\d.]+) s\s+[\d.]+%", log))
lines = [
  f"tokens: {npy['tokens']}, source 12x8x64 -> target 16x8x64, bf16 shards, k sweep 1,2,4,8,all",
  f"(a) moment accumulation {acc:.1f} GFLOP/s; OpenBLAS sgemm on the same block shape {blk:.1f} GFLOP/s "
  f"-> {100*acc/blk:.0f}%; widest sgemm [{wide:.1f} GFLOP/s] -> {100*acc/wide:.0f}%",
  f"(b) crosskv-fit {fit['wall_s']:.1f} s (stages: {stages}); numpy {npy['total_s']:.1f} s "
  f"(load {npy['load_s']} s, probe {npy['probe_s']} s, fits {npy['fit_s']} s) -> {npy['total_s']/fit['wall_s']:.1f}x faster",
  f"(c) streaming read (read + bf16->fp32 + RoPE strip + checks): {st['tokens_per_s']:.0f} tokens/s, "
  f"{st['fp32_mb_per_s']:.0f} MB/s as fp32 ({st['fp32_mb_per_s']/2:.0f} MB/s of bf16 read)",
]
open(f"{out}/summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
PYEOF
rm -rf "$DATA"
