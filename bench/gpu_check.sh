#!/usr/bin/env bash
# The GPU check (docs/PERFORMANCE.md, GPU), one prepared script for a bare GPU machine (nothing to install). On an H200 (2026-11-30):
# tests, the accumulation benchmark and the k = all factor 42 s; the paper-shaped fit (40x8x128 -> 64x8x128,
# k = 1, 2, 4, 8, all, 2,048 tokens) 2m40s with its synthetic data; apply and tf32 about a minute more. Calls of the
# device tool are limited to 10 minutes: run the fit in a call of its own (STEPS=fit).
# Prepare here:   bench/gpu_bundle.sh                     (-> .gpu-bundle.tar.xz, programs built with nvcc here)
# Run there:      STEPS="test bench factor apply tf32" bash bench/gpu_check.sh "$OUT"   then, in a second call,
#                 STEPS=fit bash bench/gpu_check.sh "$OUT"  (carry .gpu-bundle.tar.xz; with no STEPS, all of them)
# Writes to OUT (9 files; the device tool returns what fits): summary.txt (everything below in short, with each
#                 step's stderr), test_cuda.log (GPU against the CPU backend), bench_gpu.json and bench_gpu_tf32.json
#                 (accumulation vs cuBLAS SGEMM at Qwen3 14B -> 32B shapes: host-shifted fp32, and the fit's own bf16
#                 path with the fused kernel), apply_gpu.json (apply throughput of one Qwen3-8B -> 32B layer, weights
#                 copied per call and kept on the GPU), factor_gpu.json (the k = all system of one kind, 40960
#                 features: assembled on the host and uploaded, against assembled on the device from fp32 blocks),
#                 eval_gpu.json (the held-out eval of one Qwen3-32B layer and the MLP's training rate, on the GPU),
#                 fit_gpu.log (a paper-shaped fit on one GPU, TOKENS tokens, k = 1, 2, 4, 8, all, bf16), nvidia-smi.txt.
# Every step has its own time limit, so one that hangs costs only its share.
# Issue 16 (serving): STEPS="test serving" in one call, then STEPS=python in another (about 4 + 6 minutes):
#                 serving_gpu.json (crosskv-bench-apply cuda serving: the resident apply of a 14B -> 32B-shaped
#                 mapper, 64 target layers, k = 4 fp32 and tf32, k = all tf32, against the per-layer loop and host
#                 arrays), package_gpu.log (tests/python/test_package.py with CUDA tensors on a GPU mapper),
#                 paper_gpu.json / .md (bench/transfer_vs_prefill.py --paper on the GPU: bf16 prefill of the real
#                 target configs against the transfer; PAPER_DEPTHS, PAPER_MAPPER_DEPTHS, PAPER_CONTEXTS).
# Issue 52 (serving through the engine's life): STEPS=vllm (about 5 minutes, where the machine has vLLM's CUDA build):
#                 vllm_gpu.log (tests/python/test_vllm_gpu.py: FULL_AND_PIECEWISE CUDA graphs, FlashInfer's HND cache).
# env: TOKENS (2048), BUNDLE (.gpu-bundle.tar.xz), STEPS (which steps, default "test bench factor apply eval fit tf32"),
#      FIT_K (the fit's k list, default "1, 2, 4, 8, all"; e.g. TOKENS=16384 FIT_K=1 times a pass at 8-GPU scale).
# Then, here: bench/project.py OUT [OUT2]   (8 GPUs x 128K tokens from the benchmark and the fit log; see its --help)
set -uo pipefail
OUT=${1:-${OUT:-gpu-check-out}}
TOKENS=${TOKENS:-2048}
STEPS=" ${STEPS:-test bench factor apply eval fit tf32} "
want() { [[ $STEPS == *" $1 "* ]]; }
BUNDLE=${BUNDLE:-.gpu-bundle.tar.xz}
mkdir -p "$OUT"
S=$OUT/summary.txt
exec 3>&1
note() { echo "$*" | tee -a "$S" >&3; }
B=$(mktemp -d)
tar -C "$B" -xJf "$BUNDLE" || { note "cannot unpack $BUNDLE (run bench/gpu_bundle.sh where the project builds)"; exit 1; }
# CUDA's own libraries (cuBLAS, cuSOLVER, runtime) from the machine: the toolkit's folder or Python's nvidia wheels.
CUDA_DIRS=$(find /usr/local /opt /usr/lib -xdev \( -name 'libcublas.so.13' -o -name 'libcusolver.so.12' -o \
  -name 'libcudart.so.13' -o -name 'libcusparse.so.12' -o -name 'libnvJitLink.so.13' -o -name 'libcublasLt.so.13' \) \
  -printf '%h\n' 2> /dev/null | sort -u | paste -sd:)
export LD_LIBRARY_PATH=$B/lib:/usr/local/cuda/lib64:${CUDA_DIRS}:${LD_LIBRARY_PATH:-}
export OPENBLAS_NUM_THREADS=${OPENBLAS_NUM_THREADS:-16}
note "gpu_check $(date -Is) on $(hostname), $(nproc) cores"
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1; note "gpu: $(nvidia-smi -L 2>&1 | head -1)"
for b in "$B"/bin/*; do
  missing=$(ldd "$b" | grep 'not found' | tr -s ' \t' ' ')
  [ -z "$missing" ] || note "$(basename "$b") is missing libraries: $missing"
done

step() {  # step NAME SECONDS COMMAND...: runs with a limit, notes exit status and time
  local name=$1 limit=$2 t0=$SECONDS rc
  shift 2
  timeout "$limit" "$@"
  rc=$?
  note "$name: exit $rc in $((SECONDS - t0)) s$([ $rc = 124 ] && echo " (time limit $limit s)")"
  return $rc
}

if want test; then
  step test_cuda 80 "$B/bin/test_cuda" > "$OUT/test_cuda.log" 2>&1
  grep -E '^\[  (PASSED|FAILED|SKIPPED) |^\[       OK \]|^\[  FAILED  \]' "$OUT/test_cuda.log" | sed 's/^/  /' >> "$S"
  grep -B2 -A8 'Failure' "$OUT/test_cuda.log" | head -60 >> "$S"
fi

E=$(mktemp)
if want bench; then
  step bench_gpu 75 "$B/bin/crosskv-bench-gpu" > "$OUT/bench_gpu.json" 2> "$E"
  note "  $(cat "$OUT/bench_gpu.json") $(tail -3 "$E")"
fi

if want factor; then
  step factor_gpu 90 "$B/bin/crosskv-bench-gpu" --factor > "$OUT/factor_gpu.json" 2> "$E"
  note "  $(cat "$OUT/factor_gpu.json") $(tail -3 "$E")"
fi

if want apply; then
  step apply_gpu 40 "$B/bin/crosskv-bench-apply" cuda > "$OUT/apply_gpu.json" 2> "$E"
  step apply_gpu_resident 40 "$B/bin/crosskv-bench-apply" cuda 8 resident >> "$OUT/apply_gpu.json" 2>> "$E"
  note "  $(cat "$OUT/apply_gpu.json") $(tail -3 "$E")"
fi

if want eval; then  # one Qwen3-32B-shaped layer's held-out diagnostics, and the MLP's training rate
  step eval_gpu 60 "$B/bin/crosskv-bench-eval" paper cuda 4096 > "$OUT/eval_gpu.json" 2> "$E"
  step mlp_gpu 30 "$B/bin/crosskv-bench-eval" mlp cuda 4 >> "$OUT/eval_gpu.json" 2>> "$E"
  note "  $(cat "$OUT/eval_gpu.json") $(tail -3 "$E")"
fi

W=$(mktemp -d)
if want fit; then
SEQ=1024 SHARDS=$(( (TOKENS + 2047) / 2048 ))
step synth $(( 45 + TOKENS / 128 )) "$B/bin/crosskv-synth" --out "$W/data" --dtype bfloat16 --shards "$SHARDS" --sequences 2 --seq-len $SEQ \
  --source-layers 40 --source-heads 8 --source-head-dim 128 --source-theta 1000000 \
  --target-layers 64 --target-heads 8 --target-head-dim 128 --target-theta 1000000 > "$E" 2>&1 || tail -5 "$E" >> "$S"
note "  $((SHARDS * 2 * SEQ)) tokens of 40x8x128 -> 64x8x128, $(du -sh "$W/data" | cut -f1)"
cat > "$W/fit.yaml" <<YAML
source: {store: data/source}
target: {store: data/target}
fit: {k: [${FIT_K:-1, 2, 4, 8, all}], lambda: 0.01, dtype: bf16}
output: {dir: out}
runtime: {device: cuda, block_tokens: 2048, max_moment_gib: 100, checkpoint: {every_shards: 64}}
YAML
(cd "$W" && step fit_gpu 540 "$B/bin/crosskv-bench-gpu" --fit fit.yaml cuda > "$OUT/fit_gpu.log" 2>&1)
grep -E "flops:|memory:|== |pass [0-9]|factored|solve:|summary|\]   [a-z+-]+ +[0-9.]+ s|error|warn" "$OUT/fit_gpu.log" |
  sed 's/^\[[^]]*\] //' | tail -40 >> "$S"
tail -1 "$OUT/fit_gpu.log" >> "$S"
fi

if want serving; then  # the serving apply (all 64 target layers of a 14B -> 32B-shaped mapper, caches on the GPU)
  step serving_gpu 150 "$B/bin/crosskv-bench-apply" cuda serving 64 4 > "$OUT/serving_gpu.json" 2> "$E"
  step serving_gpu_tf32 100 "$B/bin/crosskv-bench-apply" cuda serving 64 4 tf32 >> "$OUT/serving_gpu.json" 2>> "$E"
  step serving_gpu_kall 150 "$B/bin/crosskv-bench-apply" cuda serving 64 40 tf32 >> "$OUT/serving_gpu.json" 2>> "$E"
  note "  $(cat "$OUT/serving_gpu.json") $(tail -3 "$E")"
fi

if want python; then  # the package on the GPU (CUDA tensors in place), and transfer vs prefill at real shapes
  if [ -d "$B/python/crosskv" ]; then
    export PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH}
    R=$(cd "$(dirname "$0")/.." && pwd)
    if python3 -c "import pytest" 2> /dev/null; then  # the package's tests are pytest; the GPU cases run here
      CROSSKV_SYNTH=$B/bin/crosskv-synth CROSSKV_FIT=$B/bin/crosskv-fit CROSSKV_APPLY=$B/bin/crosskv-apply \
        step package_gpu 200 python3 -m pytest -rA -p no:cacheprovider --basetemp="$W/pkg" \
        "$R/tests/python/test_package.py" > "$OUT/package_gpu.log" 2>&1
      grep -E "^(PASSED|FAILED|SKIPPED|ERROR).*(cuda|CUDA)|[0-9]+ (passed|failed)" "$OUT/package_gpu.log" \
        | sed 's/^/  /' >> "$S"
    else
      note "  package_gpu: skipped, this machine's python3 has no pytest (tests/python/test_package.py needs it)"
    fi
    PYTHONUNBUFFERED=1 step paper_gpu 330 python3 "$R/bench/transfer_vs_prefill.py" --paper "$W/paper" --device cuda \
      --tf32 --depths ${PAPER_DEPTHS:-8,16} --mapper-depths ${PAPER_MAPPER_DEPTHS:-2,8} \
      --contexts ${PAPER_CONTEXTS:-512,2048,8192} --repeats 3 --json "$OUT/paper_gpu.json" > "$OUT/paper_gpu.md" 2> "$E"
    cat "$OUT/paper_gpu.md" >> "$S"
    tail -3 "$E" >> "$S"
  else
    note "python: the bundle has no Python package (bench/gpu_bundle.sh needs a Python 3.12 where it runs)"
  fi
fi

if want vllm; then  # crosskv.vllm on a GPU engine: FULL_AND_PIECEWISE CUDA graphs, FlashInfer's HND cache
  R=$(cd "$(dirname "$0")/.." && pwd)
  if ! python3 -c "import vllm, torch, transformers, pytest; assert torch.cuda.is_available()" 2> /dev/null; then
    note "vllm: skipped, this machine's python3 lacks vLLM's CUDA build, transformers or pytest (nothing to install here)"
  elif [ ! -d "$B/python/crosskv" ]; then
    note "vllm: skipped, the bundle has no Python package (bench/gpu_bundle.sh needs a Python 3.12 where it runs)"
  else
    W2=$(mktemp -d)
    PYTHONPATH=$B/python${PYTHONPATH:+:$PYTHONPATH} CROSSKV_TEST_WORK=$W2/family CROSSKV_CAPTURE_PYTHON=$(command -v python3) \
      CROSSKV_FIT=$B/bin/crosskv-fit step vllm_gpu 420 python3 -m pytest -rA -p no:cacheprovider --basetemp="$W2/tmp" \
      "$R/tests/python/test_vllm_gpu.py" > "$OUT/vllm_gpu.log" 2>&1
    grep -E "^(PASSED|FAILED|SKIPPED|ERROR)|[0-9]+ (passed|failed)" "$OUT/vllm_gpu.log" | sed 's/^/  /' >> "$S"
    rm -rf "$W2"
  fi
fi

if want tf32; then
  CROSSKV_TF32=1 step bench_gpu_tf32 45 "$B/bin/crosskv-bench-gpu" > "$OUT/bench_gpu_tf32.json" 2> "$E"
  note "  $(cat "$OUT/bench_gpu_tf32.json") $(tail -3 "$E")"
fi
if command -v python3 > /dev/null && [ -s "$OUT/bench_gpu.json" ]; then
  python3 "$(dirname "$0")/project.py" "$OUT" >> "$S" 2>&1
fi
rm -rf "$W" "$B" "$E"
