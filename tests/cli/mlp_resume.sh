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
same() {  # same DIR_A DIR_B: identical layer files and manifest layer entries for every k
  for k in k1; do
    for f in "$1"/$k/layer-*.safetensors; do
      cmp -s "$f" "$2/$k/$(basename "$f")" || die "$2/$k/$(basename "$f") differs from the uninterrupted run"
    done
    python3 -c 'import json,sys; a,b=(json.load(open(p))["layers"] for p in sys.argv[1:]); sys.exit(a!=b)' \
      "$1/$k/manifest.json" "$2/$k/manifest.json" || die "$2/$k/manifest.json: layers differ from the uninterrupted run"
  done
}
run() { "$FIT" "$@" > run.log 2> run.err; }

cfg ref && run ref.yaml || { cat run.log run.err; die "reference run failed"; }
expect_in "residual MLPs k1: kept for" run.log
python3 -c 'import json,sys; m=json.load(open("ref/k1/manifest.json"))
kept=sum(l["mlp"][k]["kept"] for l in m["layers"] for k in "kv"); sys.exit(0 if kept>0 else print("no MLP kept") or 1)' \
  || die "auto kept no MLP on the planted nonlinearity"

# kill -9 right after the third epoch's state was written.
cfg killed
set +e; CROSSKV_FAULT=kill_in_mlp:3 "$FIT" killed.yaml > run.log 2>&1; rc=$?; set -e
[ "$rc" = 137 ] || { cat run.log; die "expected the injected SIGKILL (137) in MLP training, got $rc"; }
[ -e killed/k1 ] && die "a fit killed in its MLP stage must not leave a complete-looking k<K>/"
ls killed/checkpoint/mlp/k1-layer-000-k.state > /dev/null || die "expected the epoch state of the first unit"
run killed.yaml || { cat run.log run.err; die "resume after a kill in MLP training failed"; }
expect_in "resuming from epoch 3 of 8" run.log
same ref killed
ls killed/checkpoint/mlp/*.state > /dev/null 2>&1 && die "epoch states must go once their unit is done"

# kill -9 after several units: those are taken over, not trained again.
cfg later
set +e; CROSSKV_FAULT=kill_in_mlp:12 "$FIT" later.yaml > run.log 2>&1; rc=$?; set -e
[ "$rc" = 137 ] || { cat run.log; die "expected the injected SIGKILL (137), got $rc"; }
run later.yaml || { cat run.log run.err; die "resume after a later kill failed"; }
expect_in "trained (layer, kind) pair(s) taken over" run.log
same ref later

# SIGTERM during training: one line, exit 75 (requeue), the epoch checkpointed; the same command resumes.
cfg termed
set +e; CROSSKV_FAULT=term_in_mlp:4 "$FIT" termed.yaml > run.log 2> run.err; rc=$?; set -e
[ "$rc" = 75 ] || { cat run.log run.err; die "expected exit 75 after SIGTERM in MLP training, got $rc"; }
expect_in "stopped by a signal while training residual MLPs" run.err
[ "$(wc -l < run.err)" = 1 ] || { cat run.err; die "expected one line on stderr"; }
run termed.yaml || { cat run.log run.err; die "resume after SIGTERM in MLP training failed"; }
expect_in "resuming from epoch 4 of 8" run.log
same ref termed

# Killed in the MLP stage after some layer files were rewritten with MLPs, then run with fit.mapper: ridge: the
# partial layers are not taken over (another job), and the artifact is a plain ridge fit's, byte for byte.
cfg switched
set +e; CROSSKV_FAULT=kill_in_mlp_rewrite:2 "$FIT" switched.yaml > run.log 2>&1; rc=$?; set -e
[ "$rc" = 137 ] || { cat run.log; die "expected the injected SIGKILL (137) while rewriting layer files, got $rc"; }
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], lambda: 0.001}\noutput: {dir: %s}\nruntime: {block_tokens: 64}\n' switched > switched.yaml
run switched.yaml || { cat run.log run.err; die "the ridge rerun failed"; }
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], lambda: 0.001}\noutput: {dir: %s}\nruntime: {block_tokens: 64}\n' ridge > ridge.yaml
run ridge.yaml || { cat run.log run.err; die "the plain ridge run failed"; }
for f in ridge/k1/layer-*.safetensors; do
  cmp -s "$f" "switched/k1/$(basename "$f")" || die "switched/k1/$(basename "$f") is not the ridge fit's"
done
grep -q '"mlp"' switched/k1/manifest.json && die "a ridge artifact must not carry MLP decisions"

# The same job again refits from the stored moments and takes every trained pair over, to the same bytes.
cp -r ref before
run ref.yaml || { cat run.log run.err; die "rerun failed"; }
expect_in "refit from the stored moments" run.log
expect_in "residual MLPs k1: 8 trained (layer, kind) pair(s) taken over" run.log
same before ref
echo "mlp_resume: ok"
