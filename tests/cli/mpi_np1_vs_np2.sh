#!/usr/bin/env bash
# mpiexec -np 1 and -np 2 (token-sharded, moments reduced over MPI) give the same mapper.
source "$(dirname "$0")/common.sh"
[ -n "${PYTHON:-}" ] || { echo "SKIPPED: no Python with numpy and h5py to compare artifacts"; exit 77; }
MPI=${MPIEXEC:?}
"$SYNTH" --out data --shards 3 --sequences 2 --seq-len 128 > /dev/null
# A fixed λ: the weights compare within fp32 tolerance (an auto λ, smaller here, leaves the systems less damped and
# the weights more sensitive to the reduction's rounding; its choices are compared below).
for np in 1 2; do
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2], lambda: 0.01}\noutput: {dir: out%s}\nruntime: {block_tokens: 100}\n' $np > np$np.yaml
  $MPI -np $np "$FIT" np$np.yaml > np$np.log 2>&1 || { cat np$np.log; die "mpiexec -np $np failed"; }
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2]}\noutput: {dir: auto%s}\nruntime: {block_tokens: 100}\n' $np > auto$np.yaml
  $MPI -np $np "$FIT" auto$np.yaml > auto$np.log 2>&1 || { cat auto$np.log; die "mpiexec -np $np (auto lambda) failed"; }
done
# fit.lambda auto: every layer's choice is the same on one rank and two.
"$PYTHON" - <<'PY' || die "auto lambda chose differently on 1 and 2 ranks"
import json
a, b = (json.load(open(f"auto{n}/k2/manifest.json")) for n in (1, 2))
assert [l["lambda"]["rho"] for l in a["layers"]] == [l["lambda"]["rho"] for l in b["layers"]]
assert a["fit"]["lambda_choice"]["rho_all"] == b["fit"]["lambda_choice"]["rho_all"]
PY
# Log files hold no ANSI colour codes (mpiexec gives the ranks a pseudo-terminal even when its output is a file).
! grep -q $'\e\[' np1.log np2.log || die "log lines under mpiexec carry ANSI escape codes"
# The same job twice: byte-identical layer files (the reduction order is fixed, not MPI's).
sed 's/out2/out2b/' np2.yaml > np2b.yaml
$MPI -np 2 "$FIT" np2b.yaml > np2b.log 2>&1 || { cat np2b.log; die "second mpiexec -np 2 failed"; }
for f in out2/k2/layer-*.safetensors; do cmp -s "$f" "out2b/k2/$(basename "$f")" || die "$f differs between two identical runs"; done
# kill -9 of the 2-rank job between a checkpoint's rank files and its commit; the same command again.
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2]}\noutput: {dir: out2c}\nruntime: {block_tokens: 100, checkpoint: {every_shards: 1}}\n' > np2c.yaml
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2]}\noutput: {dir: out2d}\nruntime: {block_tokens: 100, checkpoint: {every_shards: 1}}\n' > np2d.yaml
$MPI -np 2 "$FIT" np2d.yaml > np2d.log 2>&1 || { cat np2d.log; die "reference 2-rank run failed"; }
set +e; $MPI -np 2 -x CROSSKV_FAULT=kill_before_commit:2 "$FIT" np2c.yaml > np2c.log 2>&1; set -e
[ -f out2c/checkpoint/domain-web/commit-1.json ] && [ ! -f out2c/checkpoint/domain-web/commit-2.json ] || { cat np2c.log; die "expected commit 1 only"; }
$MPI -np 2 "$FIT" np2c.yaml > np2c.log 2>&1 || { cat np2c.log; die "2-rank resume failed"; }
grep -q "resuming from committed checkpoint 1" np2c.log || { cat np2c.log; die "did not resume"; }
for f in out2d/k2/layer-*.safetensors; do cmp -s "$f" "out2c/k2/$(basename "$f")" || die "$f differs after kill and resume"; done
# A config mistake under mpiexec: every rank finds it, rank 0 alone reports it (one line), every rank exits 2.
printf 'source: {store: data/source}\ntarget: {store: data/target}\noutput: {dir: outbad}\nfit: {k: [1], lamda: 1}\n' > typo.yaml
set +e; $MPI -np 2 "$FIT" typo.yaml > typo.log 2> typo.err; rc=$?; set -e
[ "$rc" = 2 ] || { cat typo.log typo.err; die "a config error under mpiexec: exit $rc, expected 2"; }
[ "$(grep -c "crosskv-fit: error" typo.err)" = 1 ] && grep -q "typo.yaml:4: fit.lamda: unknown key" typo.err \
  || { cat typo.err; die "a config error under mpiexec must be reported once"; }
# SIGUSR1 to mpiexec (OpenMPI forwards it to the ranks): the job stops at its round's end, exit 75, one line.
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2]}\noutput: {dir: out2f}\nruntime: {block_tokens: 100, checkpoint: {every_shards: 1}}\n' > np2f.yaml
$MPI -np 2 -x CROSSKV_FAULT=pause_after_commit:1 "$FIT" np2f.yaml > np2f.log 2> np2f.err & pid=$!
for _ in $(seq 1200); do [ -f out2f/checkpoint/domain-web/commit-1.json ] && break; sleep 0.05; done
sleep 0.2; kill -USR1 $pid; set +e; wait $pid; rc=$?; set -e
[ "$rc" = 75 ] || { cat np2f.log np2f.err; die "SIGUSR1 to mpiexec: exit $rc, expected 75"; }
[ "$(grep -c "crosskv-fit: interrupted" np2f.err)" = 1 ] || { cat np2f.err; die "SIGUSR1: one rank must say so, once"; }
$MPI -np 2 "$FIT" np2f.yaml > np2f.log 2>&1 || { cat np2f.log; die "resume after SIGUSR1 failed"; }
for f in out2d/k2/layer-*.safetensors; do cmp -s "$f" "out2f/k2/$(basename "$f")" || die "$f differs after SIGUSR1 and resume"; done
# One dead rank never hangs the other: rank 1 is killed, the job ends within a bounded time naming the rank.
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1]}\noutput: {dir: out2e}\nruntime: {block_tokens: 100, checkpoint: {every_shards: 1}}\n' > np2e.yaml
set +e; timeout 120 $MPI -np 2 -x CROSSKV_FAULT=kill_before_commit:1 -x CROSSKV_FAULT_RANK=1 "$FIT" np2e.yaml > np2e.log 2>&1; rc=$?; set -e
[ "$rc" != 0 ] && [ "$rc" != 124 ] || { cat np2e.log; die "a dead rank must end the job (exit $rc; 124 = hung)"; }
grep -qi "rank 1" np2e.log || { cat np2e.log; die "the message must name the dead rank"; }
grep -q '"ranks": 2' out2/k2/manifest.json || die "manifest of the 2-rank run does not record 2 ranks"
"$PYTHON" "$(dirname "$0")/../python/compare_artifacts.py" out1/k2 out2/k2 1e-4  # fp32 moments summed in another order, amplified by cond(Cxx)
echo "np1 vs np2 OK"
