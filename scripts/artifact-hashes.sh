#!/usr/bin/env bash
# Fits a fixed set of jobs (-np 1 and -np 2 grids, one and two passes, both probes, bf16, the benchmark's shapes) and
# prints the SHA-256 of every layer file and of every manifest's layer entries: two builds whose outputs are equal
# wrote byte-identical artifacts. Every job names its λ (0.01, the default before fit.lambda: auto), so builds from
# before and after auto compare. With `cuda` the same jobs run with runtime.device: cuda on the host emulation of CUDA
# (BUILD_DIR/emulation/, two emulated GPUs: the -np 2 jobs reduce through NCCL), and the residual-MLP jobs on it too.
# Usage: scripts/artifact-hashes.sh BUILD_DIR WORK_DIR [cuda] > hashes.txt
set -euo pipefail
BUILD=$(cd "$1" && pwd); mkdir -p "$2"; cd "$2"
DEVICE=${3:-cpu}
FIT=$BUILD/crosskv-fit
if [ "$DEVICE" = cuda ]; then
  FIT=$BUILD/emulation/crosskv-fit
  export CROSSKV_CUDA_EMULATION_DEVICES=2
  MPI+=(-x CROSSKV_CUDA_EMULATION_DEVICES)
fi
MPI=(mpiexec --oversubscribe); [ "$(id -u)" = 0 ] && MPI+=(--allow-run-as-root)
export OPENBLAS_NUM_THREADS=1 OMP_NUM_THREADS=1  # the summation order of OpenBLAS depends on its thread count
synth() { "$BUILD/crosskv-synth" --out "$@" > /dev/null; }
[ -d small ] || synth small --shards 3 --sequences 2 --seq-len 128
[ -d heads ] || synth heads --shards 2 --sequences 2 --seq-len 128 --target-heads 4
[ -d mlp ] || synth mlp --relation nonlinear --shards 2 --sequences 4 --seq-len 256 --source-layers 4 --target-layers 4 \
  --source-heads 2 --source-head-dim 16 --source-rotary-dim 16 --target-heads 2 --target-head-dim 16 --target-rotary-dim 16
[ -d bench ] || synth bench --dtype bfloat16 --shards 2 --sequences 2 --seq-len 1024 --source-layers 12 \
  --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64
job() {  # job NAME DATA NP FIT RUNTIME
  local runtime=$5
  [ "$DEVICE" = cpu ] || runtime="${5%\}}, device: $DEVICE}"
  printf 'source: {store: %s/source}\ntarget: {store: %s/target}\nfit: %s\noutput: {dir: out-%s}\nruntime: %s\n' \
    "$2" "$2" "$4" "$1" "$runtime" > "$1.yaml"
  rm -rf "out-$1"
  "${MPI[@]}" -np "$3" "$FIT" "$1.yaml" > "$1.log" 2>&1 || { cat "$1.log" >&2; exit 1; }
}
job np1 small 1 "{lambda: 0.01, k: [1, 2, all]}" "{block_tokens: 100, checkpoint: {every_shards: 1}}"
job np2 small 2 "{lambda: 0.01, k: [1, 2, all]}" "{block_tokens: 100}"
job np2lg small 2 "{lambda: 0.01, k: [1, all], dtype: bf16}" "{block_tokens: 100, layer_groups: 2}"
job twopass small 2 "{lambda: 0.01, k: [1, 2]}" "{block_tokens: 100, max_moment_gib: 0.0005}"
job heads heads 1 "{lambda: 0.01, k: [1, 2], probe: all_heads, dtype: fp16}" "{block_tokens: 64}"
job bench1 bench 1 "{lambda: 0.01, k: [1, 2, 4, 8, all]}" "{block_tokens: 1024}"
job bench2 bench 2 "{lambda: 0.01, k: [1, 4, all]}" "{block_tokens: 1024}"
MLP='{hidden: 32, epochs: 4, batch_tokens: 256, val_fraction: 0.25}'
job mlp1 mlp 1 "{k: [1, all], lambda: 0.001, mapper: auto, mlp: $MLP}" "{block_tokens: 256}"
job mlp2 mlp 2 "{k: [1], lambda: 0.001, mapper: mlp, mlp: $MLP}" "{block_tokens: 256, layer_groups: 2}"
for d in out-*/k*; do
  for f in "$d"/layer-*.safetensors; do echo "$(sha256sum < "$f" | cut -c1-64) $f"; done
  echo "$(python3 -c 'import json,sys; print(json.dumps(json.load(open(sys.argv[1]))["layers"], sort_keys=True))' \
    "$d/manifest.json" | sha256sum | cut -c1-64) $d/manifest.json:layers"
done
