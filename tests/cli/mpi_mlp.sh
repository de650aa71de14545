#!/usr/bin/env bash
# Residual MLPs under mpiexec -np 2, as 1x2 (the layer group's two ranks train data-parallel) and 2x1 (one layer
# group per rank): the same job twice gives the same bytes, and a kill -9 of rank 1 during training resumes to them.
source "$(dirname "$0")/common.sh"
MPI=${MPIEXEC:?}
"$SYNTH" --out data --relation nonlinear --shards 2 --sequences 8 --seq-len 256 --source-layers 4 --target-layers 4 \
  --source-heads 2 --source-head-dim 16 --source-rotary-dim 16 --source-q-heads 4 \
  --target-heads 2 --target-head-dim 16 --target-rotary-dim 16 --target-q-heads 4 --seed 31 > /dev/null
cfg() {  # cfg NAME LAYER_GROUPS
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], lambda: 0.001, mapper: auto, mlp: {hidden: 32, epochs: 6, batch_tokens: 256, val_fraction: 0.25}}\noutput: {dir: %s}\nruntime: {block_tokens: 64, layer_groups: %s, checkpoint: {mlp_seconds: 0}}\n' "$1" "$2" > "$1.yaml"
}
same() { same_layers "$1" "$2" k1; }
for lg in 1 2; do
  for run in a b; do
    cfg "g$lg$run" $lg
    $MPI -np 2 "$FIT" "g$lg$run.yaml" > "g$lg$run.log" 2>&1 || { cat "g$lg$run.log"; die "mpiexec -np 2 (layer_groups $lg) failed"; }
  done
  grep -q "residual MLPs k1: kept for" "g${lg}a.log" || { cat "g${lg}a.log"; die "no MLP stage in the log"; }
  same "g${lg}a" "g${lg}b"
done
# kill -9 of rank 1 (a layer group of its own in 2x1) after its third epoch state; mpiexec ends the job.
cfg killed 2
set +e; $MPI -np 2 -x CROSSKV_FAULT=kill_in_mlp:3 -x CROSSKV_FAULT_RANK=1 "$FIT" killed.yaml > killed.log 2>&1; rc=$?; set -e
[ "$rc" != 0 ] || { cat killed.log; die "expected the job to fail after rank 1 was killed"; }
[ -e killed/k1 ] && die "a job killed in its MLP stage must not leave a complete-looking k1/"
$MPI -np 2 "$FIT" killed.yaml > killed.log 2>&1 || { cat killed.log; die "2-rank resume after a kill in MLP training failed"; }
grep -q "residual MLPs k1: .* taken over, 1 resumed from an epoch checkpoint" killed.log \
  || { cat killed.log; die "did not resume rank 1's training"; }
same g2a killed
echo "mpi_mlp: ok"
