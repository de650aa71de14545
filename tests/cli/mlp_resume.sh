#!/usr/bin/env bash
# Residual MLPs (fit.mapper: auto) survive kill -9 and SIGTERM during training: running the same command again takes
# the trained (layer, kind) pairs and the last epoch over, and ends with the bytes of an uninterrupted run. Until
# the stage is done no k<K>/ appears (the mappers wait in k<K>.partial).
source "$(dirname "$0")/common.sh"
"$SYNTH" --out data --relation nonlinear --shards 2 --sequences 8 --seq-len 256 --source-layers 4 --target-layers 4 \
  --source-heads 2 --source-head-dim 16 --source-rotary-dim 16 --source-q-heads 4 \
  --target-heads 2 --target-head-dim 16 --target-rotary-dim 16 --target-q-heads 4 --seed 31 > /dev/null
cfg() {  # cfg NAME
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], lambda: 0.001, mapper: auto, mlp: {hidden: 64, epochs: 8, batch_tokens: 256, val_fraction: 0.25}}\noutput: {dir: %s}\nruntime: {block_tokens: 64, checkpoint: {mlp_seconds: 0}}\n' "$1" > "$1.yaml"
}
same() { same_layers "$1" "$2" k1 && same_manifest_layers "$1" "$2" k1; }  # identical layer files and entries

cfg ref && run ref.yaml || { cat run.log run.err; die "reference run failed"; }
expect_in "residual MLPs k1: kept for" run.log
python3 -c 'import json,sys; m=json.load(open("ref/k1/manifest.json"))
kept=sum(l["mlp"][k]["kept"] for l in m["layers"] for k in "kv"); sys.exit(0 if kept>0 else print("no MLP kept") or 1)' \
  || die "auto kept no MLP on the planted nonlinearity"

# kill -9 right after the third epoch's state was written.
cfg killed
expect_fault 137 kill_in_mlp:3 killed.yaml
[ -e killed/k1 ] && die "a fit killed in its MLP stage must not leave a complete-looking k<K>/"
ls killed/checkpoint/mlp/k1-layer-000-k.state > /dev/null || die "expected the epoch state of the first unit"
run killed.yaml || { cat run.log run.err; die "resume after a kill in MLP training failed"; }
expect_in "resuming from epoch 3 of 8" run.log
same ref killed
ls killed/checkpoint/mlp/*.state > /dev/null 2>&1 && die "epoch states must go once their unit is done"

# kill -9 after several units: those are taken over, not trained again.
cfg later
expect_fault 137 kill_in_mlp:12 later.yaml
run later.yaml || { cat run.log run.err; die "resume after a later kill failed"; }
expect_in "trained (layer, kind) pair(s) taken over" run.log
same ref later

# SIGTERM during training: one line, exit 75 (requeue), the epoch checkpointed; the same command resumes.
cfg termed
expect_fault 75 term_in_mlp:4 termed.yaml
expect_in "stopped by a signal while training residual MLPs" run.err
[ "$(wc -l < run.err)" = 1 ] || { cat run.err; die "expected one line on stderr"; }
run termed.yaml || { cat run.log run.err; die "resume after SIGTERM in MLP training failed"; }
expect_in "resuming from epoch 4 of 8" run.log
same ref termed

# Killed in the MLP stage after some layer files were rewritten with MLPs, then run with fit.mapper: ridge: the
# partial layers are not taken over (another job), and the artifact is a plain ridge fit's, byte for byte.
cfg switched
expect_fault 137 kill_in_mlp_rewrite:2 switched.yaml
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], lambda: 0.001}\noutput: {dir: %s}\nruntime: {block_tokens: 64}\n' switched > switched.yaml
run switched.yaml || { cat run.log run.err; die "the ridge rerun failed"; }
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], lambda: 0.001}\noutput: {dir: %s}\nruntime: {block_tokens: 64}\n' ridge > ridge.yaml
run ridge.yaml || { cat run.log run.err; die "the plain ridge run failed"; }
same_layers ridge switched k1
grep -q '"mlp"' switched/k1/manifest.json && die "a ridge artifact must not carry MLP decisions"

# The same job again refits from the stored moments and takes every trained pair over, to the same bytes.
cp -r ref before
run ref.yaml || { cat run.log run.err; die "rerun failed"; }
expect_in "refit from the stored moments" run.log
expect_in "residual MLPs k1: 8 trained (layer, kind) pair(s) taken over" run.log
same before ref
echo "mlp_resume: ok"
