#!/usr/bin/env bash
# Checkpoint and resume: whatever stops a run, running the same command again gives byte-identical artifacts.
source "$(dirname "$0")/common.sh"
"$SYNTH" --out data --shards 4 --sequences 2 --seq-len 128 --seed 3 > /dev/null
cfg() {  # cfg NAME [extra fit keys]
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, all]%s}\noutput: {dir: %s}\nruntime: {block_tokens: 64, checkpoint: {every_shards: 1}}\n' "${2:-}" "$1" > "$1.yaml"
}
same() { same_layers "$1" "$2" k1 kall; }  # same DIR_A DIR_B: identical layer files for every k

cfg ref && run ref.yaml || { cat run.log run.err; die "reference run failed"; }
ls ref/checkpoint/domain-web/commit-*.json > /dev/null || die "no committed checkpoint"

# kill -9 between a checkpoint's rank files and its commit record, then the same command again.
cfg killed
expect_fault 137 kill_before_commit:2 killed.yaml
[ -f killed/checkpoint/domain-web/state-2-rank0.bin ] && [ ! -f killed/checkpoint/domain-web/commit-2.json ] || die "expected state 2 without commit"
[ -e killed/k1 ] && die "an interrupted run must not leave a complete-looking artifact"
run killed.yaml || { cat run.log run.err; die "resume failed"; }
expect_in "resuming from committed checkpoint 1" run.log
same ref killed

# kill -9 while a checkpoint's state file is half written: the temp file is never used; resume from the previous.
cfg halfw
expect_fault 137 kill_in_state_write:3 halfw.yaml
ls halfw/checkpoint/domain-web/state-3-rank0.bin.tmp-* > /dev/null 2>&1 || die "expected a half-written temp file"
[ ! -f halfw/checkpoint/domain-web/state-3-rank0.bin ] || die "a half-written state must not appear under its name"
run halfw.yaml || { cat run.log run.err; die "resume after a kill in a state write failed"; }
expect_in "resuming from committed checkpoint 2" run.log
expect_in "a temporary file of an interrupted checkpoint write" run.log
same ref halfw
ls halfw/checkpoint/domain-web/*.tmp-* > /dev/null 2>&1 && die "a stray temporary was left in the checkpoint folder"

# kill -9 while a layer file is half written: the resumed export removes the temporary, and every k<K>/ holds
# exactly its manifest's files.
cfg layerw
expect_fault 137 kill_in_layer_write:3 layerw.yaml
ls layerw/k*.partial/layer-*.safetensors.tmp-* > /dev/null 2>&1 || die "expected a half-written layer temp file"
run layerw.yaml || { cat run.log run.err; die "resume after a kill in a layer write failed"; }
expect_in "a temporary file of an interrupted export" run.log
same ref layerw
for k in k1 kall; do
  python3 -c 'import json,os,sys; d=sys.argv[1]; m=json.load(open(d+"/manifest.json"))
want={"manifest.json"}|{e["file"] for e in m["layers"]}; got=set(os.listdir(d))
sys.exit(0 if got==want else print(d, "holds", sorted(got-want), "beyond its manifest") or 1)' layerw/$k \
    || die "layerw/$k holds files its manifest does not name"
done

# kill -9 during export: after the first layer file, after two whole layers and a file of the third (two files per
# layer: k = 1 and all), and after the first k folder is complete. Whole layers are not solved again.
for n in 1 5 $(( $(ls ref/k1/layer-*.safetensors | wc -l) * 2 + 1 )); do
  cfg exp$n
  expect_fault 137 kill_in_export:$n exp$n.yaml
  [ -e exp$n/kall/manifest.json ] && die "kall must not look complete after a kill in export"
  run exp$n.yaml || { cat run.log run.err; die "rerun after a kill in export failed"; }
  expect_in "no calibration data was read" run.log
  if [ $n = 5 ]; then expect_in "2 target layer(s) already written by an interrupted run" run.log; fi
  if [ $n = 1 ]; then grep -q "already written" run.log && die "a partly written layer was taken as written"; fi
  same ref exp$n
  same_manifest_layers ref exp$n k1 kall  # taken over from the records for resumed layers
  [ -e exp$n/k1/.layers ] && die "resume records left in an artifact"
done

# kill -9 at an arbitrary moment.
cfg random
"$FIT" random.yaml > run.log 2>&1 & pid=$!
sleep 0.4; kill -9 $pid 2>/dev/null || true; wait $pid 2>/dev/null || true
run random.yaml || { cat run.log run.err; die "resume after kill -9 failed"; }
same ref random

# SIGTERM, and SIGINT (Ctrl-C) alike: exit 75 for the batch script to requeue, one line saying so; then resume.
for sig in TERM INT; do
  cfg stop$sig
  # The pause hook holds the run after its first commit until a signal comes, so the signal never races its end.
  CROSSKV_FAULT=pause_after_commit:1 "$FIT" stop$sig.yaml > run.log 2> run.err & pid=$!
  for _ in $(seq 1200); do [ -f stop$sig/checkpoint/domain-web/commit-1.json ] && break; sleep 0.05; done
  [ -f stop$sig/checkpoint/domain-web/commit-1.json ] || { kill -9 $pid; cat run.log run.err; die "no commit within 60 s"; }
  kill -$sig $pid; set +e; wait $pid; rc=$?; set -e
  [ "$rc" = 75 ] || { cat run.log run.err; die "SIG$sig: exit $rc, expected 75 (requeue)"; }
  [ "$(wc -l < run.err)" = 1 ] && expect_in "crosskv-fit: interrupted" run.err || { cat run.err; die "SIG$sig: one line"; }
  [ -e stop$sig/k1 ] && die "an interrupted run must not leave a complete-looking artifact"
  run stop$sig.yaml || { cat run.log run.err; die "resume after SIG$sig failed"; }
  same ref stop$sig
done

# A bit-flipped newest checkpoint (a byte of its sums): fall back to the previous one, say so, and still match.
cfg flip
set +e; CROSSKV_FAULT=kill_before_commit:4 "$FIT" flip.yaml > /dev/null 2>&1; set -e
printf '\xff' | dd of=flip/checkpoint/domain-web/state-3-rank0.bin bs=1 seek=200 conv=notrunc 2> /dev/null
run flip.yaml || { cat run.log run.err; die "resume with a corrupt checkpoint failed"; }
expect_in "checksum mismatch" run.log
expect_in "falling back to the previous one" run.log
same ref flip

# A truncated newest checkpoint likewise.
cfg trunc
set +e; CROSSKV_FAULT=kill_before_commit:4 "$FIT" trunc.yaml > /dev/null 2>&1; set -e
truncate -s 50 trunc/checkpoint/domain-web/state-3-rank0.bin
run trunc.yaml || { cat run.log run.err; die "resume with a truncated checkpoint failed"; }
expect_in "falling back to the previous one" run.log
same ref trunc

# A failed checkpoint write (a full disk): not committed, the run goes on, the result is the same.
cfg full
CROSSKV_FAULT=fail_state_write:2 "$FIT" full.yaml > run.log 2>&1 || { cat run.log; die "run with a failed write failed"; }
expect_in "not committed" run.log
same ref full

# Two passes (probe, then the selected blocks): killed in pass 1 and in pass 2, the same command resumes the pass it
# was in (pass 1 stays as committed: not read again, not added twice).
tcfg() { cfg "$1"; sed -i 's/every_shards: 1}/every_shards: 1}, max_moment_gib: 0.0005/' "$1.yaml"; }
tcfg two && run two.yaml || { cat run.log run.err; die "two-pass reference run failed"; }
expect_in "passes over the data: 2" run.log
commits=$(grep -c "ended:.*checkpoint [0-9]" run.log)
# Commits 1-3: pass 1's rounds, 4: its end, 5-7: pass 2's rounds. Killed before 2, 5 and the last round's commit.
for n in 2 5 $(( commits + 1 )); do
  tcfg two$n
  expect_fault 137 kill_before_commit:$n two$n.yaml
  run two$n.yaml || { cat run.log run.err; die "two passes: resume after a kill before commit $n failed"; }
  expect_in "resuming from committed checkpoint $(( n - 1 ))" run.log
  if [ $n -gt 4 ]; then expect_in "pass 1/2 (probe): restored from the committed checkpoint" run.log; fi
  if [ $n -gt 5 ]; then expect_in "pass 2/2 (selected blocks): resuming after round" run.log; fi
  same two two$n
done

# A changed config is refused with what differs; --fresh starts over.
sed -i 's/runtime: {block_tokens: 64/runtime: {block_tokens: 32/' killed.yaml
set +e; "$FIT" killed.yaml > run.log 2> run.err; rc=$?; set -e
[ "$rc" = 2 ] || die "a changed config must be refused (exit $rc)"
expect_in "differs in block_tokens" run.err
"$FIT" killed.yaml --fresh > run.log 2>&1 || die "--fresh failed"

# A change of lambda or k refits from the stored moments without reading the data.
cfg ref ", lambda: 0.5"
run ref.yaml || die "refit failed"
expect_in "no calibration data was read" run.log
# Calibration domains: a fit over [web, code] after one over [web] reads only code, and equals a fresh fit.
"$SYNTH" --out dom --domains web code --shards 2 --sequences 2 --seq-len 64 --seed 9 > /dev/null
dcfg() { printf 'source: {store: dom/source}\ntarget: {store: dom/target}\ncalibration: {domains: [%s]}\nfit: {k: [1, all]}\noutput: {dir: %s}\nruntime: {block_tokens: 64, checkpoint: {every_shards: 1}}\n' "$1" "$2" > "$2.yaml"; }
dcfg web incr && run incr.yaml || die "fit over web failed"
dcfg "web, code" incr && run incr.yaml || { cat run.log run.err; die "fit over web and code failed"; }
expect_in "pass 1/1 [domain web]: restored from the committed checkpoint" run.log
grep -q "pass 1/1 \[domain code\]: restored" run.log && die "the new domain must be read"
dcfg "web, code" both && run both.yaml || die "fresh fit over web and code failed"
same both incr
# A domain captured later whose name sorts first: the stored moments keep their shift, so only it is read.
"$SYNTH" --out dom2 --domains aaa --shards 1 --sequences 2 --seq-len 64 --seed 9 --data-seed 4 > /dev/null
for side in source target; do cp -r dom2/$side/aaa dom/$side/; done
dcfg "aaa, web, code" incr && run incr.yaml || { cat run.log run.err; die "fit over aaa, web and code failed"; }
expect_in "pass 1/1 [domain web]: restored from the committed checkpoint" run.log
expect_in "pass 1/1 [domain code]: restored from the committed checkpoint" run.log
grep -q "another provisional shift" run.log && die "a domain added later must not change the stored moments' shift"
echo "checkpoint/resume OK"
