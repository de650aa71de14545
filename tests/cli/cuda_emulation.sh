#!/usr/bin/env bash
# runtime.device: cuda as a user runs it, on the host emulation of CUDA (build/emulation/: the CUDA backend's and the
# NCCL collectives' own code, against an emulated runtime, cuBLAS, cuSOLVER and NCCL). Whole fits match the CPU fit
# (one and two passes; fp32, bf16 and fp16 shards; residual MLPs; eval shards and the report); under mpiexec the
# ranks reduce through NCCL between emulated GPUs on 1x2, 2x1 and 2x2 grids, rerun to the same bytes, equal the MPI
# reduction bit for bit, and resume a kill -9 to the bytes of an uninterrupted run; crosskv-eval and crosskv-apply
# with --device cuda equal their CPU runs. Any misuse of the emulated device or a leak fails the program (exit 86).
source "$(dirname "$0")/common.sh"
[ -n "${PYTHON:-}" ] || { echo "SKIPPED: no Python with numpy and h5py to compare artifacts"; exit 77; }
EFIT=${CROSSKV_FIT_EMULATED:?} EEVAL=${CROSSKV_EVAL_EMULATED:?} EAPPLY=${CROSSKV_APPLY_EMULATED:?}
EVAL=${CROSSKV_EVAL:?} APPLY=${CROSSKV_APPLY:?} MPI=${MPIEXEC:?}
CMP="$PYTHON $(dirname "$0")/../python/compare_artifacts.py"
export CROSSKV_CUDA_EMULATION_DEVICES=4
SMALL=(--source-layers 4 --target-layers 6 --source-heads 2 --target-heads 2 --source-head-dim 16 --target-head-dim 16
       --source-rotary-dim 16 --target-rotary-dim 16 --source-q-heads 4 --target-q-heads 4)
for dt in float32 bfloat16 float16; do
  "$SYNTH" --out "d-$dt" --dtype $dt --shards 3 --sequences 2 --seq-len 128 --with-queries "${SMALL[@]}" > /dev/null
done
"$SYNTH" --out d-weighted --dtype bfloat16 --with-weights --shards 2 --sequences 2 --seq-len 128 --seed 37 \
  "${SMALL[@]}" > /dev/null
"$SYNTH" --out d-mlp --relation nonlinear --shards 2 --sequences 4 --seq-len 128 --seed 31 "${SMALL[@]}" > /dev/null
cfg() {  # NAME STORE DEVICE FIT_EXTRA RUNTIME_EXTRA [TOP_LEVEL_EXTRA]
  printf 'source: {store: %s/source}\ntarget: {store: %s/target}\nfit: {k: [1, 2, all]%s}\noutput: {dir: out-%s}\nruntime: {device: %s, block_tokens: 64%s}\n%s\n' \
    "$2" "$2" "$4" "$1" "$3" "$5" "${6:-}" > "$1.yaml"
}
fit() {  # BIN NAME
  "$1" "$2.yaml" > "$2.log" 2>&1 || { cat "$2.log"; die "$2 failed"; }
}
close() {  # NAME_A NAME_B: every k within fp32 tolerance
  for k in k1 k2 kall; do $CMP "out-$1/$k" "out-$2/$k" 1e-4 > /dev/null || die "out-$2/$k differs from out-$1/$k"; done
}
identical() {  # NAME_A NAME_B: the same bytes
  same_layers "out-$1" "out-$2" k1 k2 kall
}

# Per-token weights (fit.weighting: dataset): the device scales the rows as it prepares them, and weighs the column
# sums; the weighted fit equals the CPU's, and differs from the uniform one.
cfg cpu-weighted d-weighted cpu ", weighting: dataset" ""; fit "$FIT" cpu-weighted
cfg gpu-weighted d-weighted cuda ", weighting: dataset" ""; fit "$EFIT" gpu-weighted
cfg cpu-uniform d-weighted cpu "" ""; fit "$FIT" cpu-uniform
close cpu-weighted gpu-weighted
$CMP out-cpu-uniform/kall out-cpu-weighted/kall 1e-4 > /dev/null 2>&1 && die "the weighted fit equals the uniform one"

# One pass, every stored dtype: the emulated GPU's fit equals the CPU's within fp32 tolerance.
for dt in float32 bfloat16 float16; do
  cfg "cpu-$dt" "d-$dt" cpu "" ""; fit "$FIT" "cpu-$dt"
  cfg "gpu-$dt" "d-$dt" cuda "" ""; fit "$EFIT" "gpu-$dt"
  expect_in "backend cuda:0 (crosskv emulated GPU)" "gpu-$dt.log"
  close "cpu-$dt" "gpu-$dt"
done
# Two passes (probe, then the selected blocks).
cfg cpu-2p d-float32 cpu "" ", max_moment_gib: 0.00002"; fit "$FIT" cpu-2p
cfg gpu-2p d-float32 cuda "" ", max_moment_gib: 0.00002"; fit "$EFIT" gpu-2p
expect_in "pass 2/2" gpu-2p.log
close cpu-2p gpu-2p
# The device's memory shapes the plan: a small emulated GPU caps the moments (the same fit), a smaller one is
# refused by name before anything runs.
cfg gpu-small d-float32 cuda "" ""
CROSSKV_CUDA_EMULATION_MEMORY=1500K fit "$EFIT" gpu-small
expect_in "moments per rank capped at" gpu-small.log
close cpu-float32 gpu-small
set +e; CROSSKV_CUDA_EMULATION_MEMORY=700K "$EFIT" gpu-small.yaml > tiny.log 2> tiny.err; rc=$?; set -e
[ "$rc" = 2 ] || { cat tiny.log tiny.err; die "a device too small for the inputs: exit $rc, expected 2"; }
expect_in "runtime.block_tokens: 64 tokens per block need" tiny.err
# Held-out diagnostics of every k and the report, on the device.
EV='eval: {shards: [web/shard-002.h5]}'
cfg cpu-ev d-float32 cpu "" "" "$EV"; fit "$FIT" cpu-ev
cfg gpu-ev d-float32 cuda "" "" "$EV"; fit "$EFIT" gpu-ev
[ -s out-gpu-ev/report.html ] || die "no report.html from the emulated GPU's fit"
close cpu-ev gpu-ev
"$PYTHON" - out-cpu-ev out-gpu-ev <<'PY' || die "the emulated GPU's held-out figures differ from the CPU's"
import json, sys
for k in ("k1", "k2", "kall"):
    a, b = (json.load(open(f"{d}/eval-{k}.json")) for d in sys.argv[1:])
    for f in ("r2_k", "r2_v", "attention_cosine", "k_concentration", "v_concentration"):
        assert abs(a[f] - b[f]) < 1e-4, (k, f, a[f], b[f])
PY
# Residual MLPs (mapper: auto): trained on the device; ridge equal to the CPU's, and the same bytes twice.
MLP=', lambda: 0.001, mapper: auto, mlp: {hidden: 32, epochs: 4, batch_tokens: 256, val_fraction: 0.25}'
cfg cpu-mlp d-mlp cpu "$MLP" ", checkpoint: {mlp_seconds: 0}"; fit "$FIT" cpu-mlp
for r in a b; do cfg "gpu-mlp$r" d-mlp cuda "$MLP" ", checkpoint: {mlp_seconds: 0}"; fit "$EFIT" "gpu-mlp$r"; done
expect_in "residual MLPs k1: kept for" gpu-mlpa.log
close cpu-mlp gpu-mlpa
identical gpu-mlpa gpu-mlpb

# crosskv-eval and crosskv-apply with --device cuda equal their CPU runs.
SRC=d-float32/source/web/shard-002.h5 TGT=d-float32/target/web/shard-002.h5
"$EVAL" --mapper out-cpu-float32/k2 --source $SRC --target $TGT --json e-cpu.json > e.log 2>&1 || { cat e.log; die "eval"; }
"$EEVAL" --mapper out-cpu-float32/k2 --source $SRC --target $TGT --json e-gpu.json --device cuda > e.log 2>&1 \
  || { cat e.log; die "crosskv-eval --device cuda on the emulation failed"; }
"$APPLY" --mapper out-cpu-float32/k2 --source $SRC --out a-cpu.h5 > a.log 2>&1 || { cat a.log; die "apply"; }
"$EAPPLY" --mapper out-cpu-float32/k2 --source $SRC --out a-gpu.h5 --device cuda --resident > a.log 2>&1 \
  || { cat a.log; die "crosskv-apply --device cuda on the emulation failed"; }
"$PYTHON" - <<'PY' || die "--device cuda on the emulation differs from the CPU"
import h5py, json, numpy as np
a, b = json.load(open("e-cpu.json")), json.load(open("e-gpu.json"))
for f in ("r2_k", "r2_v", "attention_cosine", "k_concentration", "v_concentration"):
    assert abs(a[f] - b[f]) < 1e-4, (f, a[f], b[f])
x, y = h5py.File("a-cpu.h5"), h5py.File("a-gpu.h5")
for name in ("keys", "values"):
    d = np.abs(x[name][()].astype(np.float64) - y[name][()]).max() / max(1.0, np.abs(x[name][()]).max())
    assert d < 1e-5, (name, d)
PY

# mpiexec with one emulated GPU per rank: NCCL between them.
mpi_cfg() {  # NAME LAYER_GROUPS
  cfg "$1" d-float32 cuda "" ", layer_groups: $2"
}
mpi_fit() {  # NP NAME [mpiexec args]
  local np=$1 name=$2
  shift 2
  $MPI -np "$np" -x CROSSKV_CUDA_EMULATION_DEVICES "$@" "$EFIT" "$name.yaml" > "$name.log" 2>&1 \
    || { cat "$name.log"; die "mpiexec -np $np $name failed"; }
}
for grid in "2 1 g12" "2 2 g21" "4 2 g22"; do
  set -- $grid
  mpi_cfg "$3" "$2"; mpi_fit "$1" "$3"
  expect_in "collectives nccl" "$3.log"
  close cpu-float32 "$3"
done
mpi_cfg g22b 2; mpi_fit 4 g22b
identical g22 g22b
# The same grid reduced through MPI (one emulated GPU per process: more ranks than GPUs): the same bytes as NCCL.
for g in "2 1 m12" "4 2 m22"; do
  set -- $g
  mpi_cfg "$3" "$2"
  CROSSKV_CUDA_EMULATION_DEVICES=1 mpi_fit "$1" "$3"
  expect_in "the collectives go through MPI" "$3.log"
done
identical g12 m12
identical g22 m22
# kill -9 of rank 1 in the export, then the same command: the files of an uninterrupted run.
mpi_cfg kill12 1
set +e
$MPI -np 2 -x CROSSKV_CUDA_EMULATION_DEVICES -x CROSSKV_FAULT=kill_in_export:3 -x CROSSKV_FAULT_RANK=1 "$EFIT" kill12.yaml \
  > kill12.log 2>&1
rc=$?
set -e
[ "$rc" != 0 ] || { cat kill12.log; die "expected the job to fail after rank 1 was killed"; }
[ -e out-kill12/kall/manifest.json ] && die "kall must not look complete after a kill in export"
mpi_fit 2 kill12
expect_in "already written by an interrupted run" kill12.log
identical g12 kill12
echo "cuda_emulation: ok"
