#!/usr/bin/env bash
# The GPU check of issue 4, one prepared script for a bare GPU machine (nothing to install; ~5 minutes on an H200).
# Prepare here:   bench/gpu_bundle.sh                     (-> .gpu-bundle.tar.xz, programs built with nvcc here)
# Run there:      bash bench/gpu_check.sh "$OUT"          (carry .gpu-bundle.tar.xz)
# Writes to OUT:  summary.txt, nvidia-smi.txt, test_cuda.log + .xml (GPU vs CPU backend), bench_gpu.json
#                 (accumulation vs cuBLAS SGEMM, Qwen3 14B -> 32B shapes), fit_gpu.json + fit_gpu.log (a paper-shaped
#                 fit on one GPU, TOKENS tokens, k sweep 1,2,4,8,all), apply_gpu.json (apply throughput of one
#                 Qwen3-8B -> 32B-shaped layer).
# env: TOKENS (8192), BUNDLE (.gpu-bundle.tar.xz)
set -uo pipefail
OUT=${1:-${OUT:-gpu-check-out}}
TOKENS=${TOKENS:-8192}
BUNDLE=${BUNDLE:-.gpu-bundle.tar.xz}
mkdir -p "$OUT"
S=$OUT/summary.txt
note() { echo "$*" | tee -a "$S"; }
B=$(mktemp -d)
tar -C "$B" -xJf "$BUNDLE" || { note "cannot unpack $BUNDLE (run bench/gpu_bundle.sh where the project builds)"; exit 1; }
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:/usr/local/cuda/lib:${LD_LIBRARY_PATH:-}
note "gpu_check $(date -Is) on $(hostname)"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; note "gpu: $(nvidia-smi -L 2>&1 | head -1)"

t0=$SECONDS
timeout 240 "$B/bin/test_cuda" --gtest_output="xml:$OUT/test_cuda.xml" > "$OUT/test_cuda.log" 2>&1
note "test_cuda: exit $? in $((SECONDS - t0)) s; $(grep -E '^\[  (PASSED|FAILED|SKIPPED) ' "$OUT/test_cuda.log" | tr '\n' ' ')"

t0=$SECONDS
timeout 180 "$B/bin/crosskv-bench-gpu" > "$OUT/bench_gpu.json" 2> "$OUT/bench_gpu.err"
note "bench_gpu: exit $? in $((SECONDS - t0)) s: $(cat "$OUT/bench_gpu.json")"

t0=$SECONDS
timeout 120 "$B/bin/crosskv-bench-apply" cuda > "$OUT/apply_gpu.json" 2> "$OUT/apply_gpu.err"
note "apply on the GPU: exit $? in $((SECONDS - t0)) s: $(cat "$OUT/apply_gpu.json")"

W=$(mktemp -d)
SEQ=1024 SHARDS=$(( (TOKENS + 2047) / 2048 ))
t0=$SECONDS
"$B/bin/crosskv-synth" --out "$W/data" --dtype bfloat16 --shards "$SHARDS" --sequences 2 --seq-len $SEQ \
  --source-layers 40 --source-heads 8 --source-head-dim 128 --source-theta 1000000 \
  --target-layers 64 --target-heads 8 --target-head-dim 128 --target-theta 1000000 > "$OUT/synth.log" 2>&1
note "synth: $((SHARDS * 2 * SEQ)) tokens of 40x8x128 -> 64x8x128 in $((SECONDS - t0)) s ($(du -sh "$W/data" | cut -f1))"
cat > "$W/fit.yaml" <<YAML
source: {store: data/source}
target: {store: data/target}
fit: {k: [1, 2, 4, 8, all], lambda: 0.01, dtype: bf16}
output: {dir: out}
runtime: {device: cuda, block_tokens: 2048, max_moment_gib: 100, checkpoint: {every_shards: 64}}
YAML
t0=$SECONDS
timeout 420 "$B/bin/crosskv-bench-gpu" --fit "$W/fit.yaml" cuda > "$OUT/fit_gpu.log" 2>&1
note "fit on the GPU: exit $? in $((SECONDS - t0)) s: $(tail -1 "$OUT/fit_gpu.log")"
grep -E "summary|  (validate|plan|probe-pass|probe|select|solve\+export|total) " "$OUT/fit_gpu.log" | sed 's/.*\] //' >> "$S"
tail -1 "$OUT/fit_gpu.log" > "$OUT/fit_gpu.json"
rm -rf "$W" "$B"
