#!/usr/bin/env bash
# A real single-node Slurm on localhost (munge, slurmctld, slurmd from Debian's packages). MODE fit (the default):
# an array of two pairs, and a job that gets Slurm's USR1 mid-run, exits 75, is requeued and resumes. MODE capture:
# a pair captured from two tiny Hugging Face models as an array of 2 parts (capture-pair.sbatch) and fitted when
# both parts are done (submit-pairs.sh with CROSSKV_CAPTURE_PARTS). Success is decided by the files. Where Slurm
# (or, for capture, the capture environment) is missing, the test reports SKIPPED with the reason (exit 77).
set -uo pipefail
WORK=${1:?usage: $0 WORKDIR [fit|capture]}
MODE=${2:-fit}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIT=${CROSSKV_FIT:?} SYNTH=${CROSSKV_SYNTH:?} PY=${PYTHON:-}
skip() { echo "SKIPPED: $*"; exit 77; }
for b in munged slurmctld slurmd sbatch scontrol squeue; do command -v $b > /dev/null || skip "$b is not installed (apt-get install slurm-wlm munge)"; done
[ -n "$PY" ] && "$PY" -c "import yaml" 2> /dev/null || skip "no Python with yaml for slurm/check-pairs.py"
CAP_PY=${CROSSKV_CAPTURE_PYTHON:-$ROOT/.venv-capture/bin/python}
if [ "$MODE" = capture ]; then
  "$CAP_PY" -c "import torch, transformers, accelerate, h5py" 2> /dev/null \
    || skip "no capture environment at $CAP_PY (scripts/setup-capture.sh)"
fi
[ "$(id -u)" = 0 ] || skip "starting slurmctld/slurmd here needs root"
rm -rf "$WORK" && mkdir -p "$WORK"/{state,spool} && cd "$WORK"
H=$(hostname -s)
# Ports of our own, so that another Slurm on this machine (or a concurrent run of this test) cannot answer for ours.
free_port() {
  local p
  for _ in $(seq 50); do
    p=$((20000 + RANDOM % 30000))
    ss -ltn 2> /dev/null | awk '{print $4}' | grep -q ":$p\$" || { echo $p; return; }
  done
  echo 6817
}
CTLD_PORT=$(free_port) SLURMD_PORT=$(free_port)
# The node's every CPU: nproc alone counts OMP_NUM_THREADS (ctest sets 1), and an array's parts then run one by one.
cat > slurm.conf <<CONF
ClusterName=crosskvtest
SlurmctldHost=$H
SlurmUser=root
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
AuthType=auth/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MpiDefault=pmix
ReturnToService=2
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/slurmctld.log
SlurmdLogFile=$WORK/slurmd.log
NodeName=$H CPUs=$(nproc --all) State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$WORK/slurm.conf
# A working munged, not just its socket (a stale socket from a dead munged makes slurmd hang at start).
munge_ok() { timeout 5 bash -c 'munge -n | unmunge' > /dev/null 2>&1; }
if ! munge_ok; then
  mkdir -p /run/munge && chown munge:munge /run/munge 2> /dev/null
  [ -f /etc/munge/munge.key ] || skip "no /etc/munge/munge.key"
  timeout 30 munged --force > munged.log 2>&1 || skip "munged did not start: $(tail -1 munged.log)"
  munge_ok || skip "munge does not work after starting munged: $(tail -1 munged.log)"
fi
cleanup() {
  for p in slurmctld slurmd; do [ -f "$WORK/$p.pid" ] && kill "$(cat "$WORK/$p.pid")" 2> /dev/null; done
  sleep 1
  for p in slurmctld slurmd; do [ -f "$WORK/$p.pid" ] && kill -9 "$(cat "$WORK/$p.pid")" 2> /dev/null; done
}
trap cleanup EXIT
timeout 30 slurmctld -f "$SLURM_CONF" || skip "slurmctld did not start: $(tail -2 slurmctld.log 2> /dev/null)"
timeout 30 slurmd -f "$SLURM_CONF" || skip "slurmd did not start: $(tail -2 slurmd.log 2> /dev/null)"
sleep 0.5
for p in slurmctld slurmd; do
  kill -0 "$(cat "$WORK/$p.pid" 2> /dev/null)" 2> /dev/null || skip "$p exited after starting: $(tail -1 $p.log 2> /dev/null)"
done
for _ in $(seq 60); do timeout 10 sinfo -h -o %t 2> /dev/null | grep -q idle && break; sleep 0.5; done
timeout 10 sinfo -h -o %t | grep -q idle || skip "the Slurm node did not become idle: $(tail -2 slurmctld.log)"

export CROSSKV_FIT=$FIT
# Every wait has a deadline; on failure the queue, the job records and the daemons' logs are printed.
T0=$SECONDS
diag() {
  echo "--- after $((SECONDS - T0)) s; squeue:"; timeout 10 squeue 2>&1
  for j in ${rid:-} ${jid:-}; do timeout 10 scontrol show job "$j" 2>&1 | grep -E "JobId|JobState|Reason|BeginTime|Restarts"; done
  for f in crosskv-*.out; do [ -f "$f" ] && { echo "--- $f"; tail -20 "$f"; }; done
  echo "--- slurmctld.log"; tail -25 slurmctld.log 2> /dev/null
  echo "--- slurmd.log"; tail -25 slurmd.log 2> /dev/null
}
die() { echo "FAIL: $*" >&2; diag >&2; exit 1; }
# wait_for SECONDS DESCRIPTION COMMAND...: poll COMMAND every 0.2 s until it succeeds or the time is up.
wait_for() {
  local limit=$1 what=$2; shift 2
  local end=$((SECONDS + limit))
  until "$@"; do [ $SECONDS -ge $end ] && die "timed out after ${limit} s waiting for $what"; sleep 0.2; done
}
queue_empty() { [ -z "$(timeout 10 squeue -h -j "$jid,$rid" 2>&1)" ]; }
# Slurm holds a requeued job back (BeginTime); release it as soon as it is pending again.
requeued_and_started() {
  job_log_has "restart 1" && return 0
  timeout 10 squeue -h -j "$rid" -o %T 2> /dev/null | grep -q PENDING && timeout 10 scontrol update JobId="$rid" StartTime=now > /dev/null 2>&1
  return 1
}
SB=(--nodes=1 --ntasks-per-node=1 --cpus-per-task=1 --time=10)
if [ "$MODE" = capture ]; then
  # Two tiny models of one family (byte tokenizer), a pair config naming their stores, and one CAPTURES.txt line.
  "$CAP_PY" - "$ROOT" <<'PY' || die "making the models failed"
import sys, torch
sys.path.insert(0, sys.argv[1] + "/tests/python")
from tiny_hf import byte_tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM
for name, layers in (("source", 2), ("target", 3)):
    torch.manual_seed(layers)
    Qwen3ForCausalLM(Qwen3Config(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                                 num_attention_heads=4, num_key_value_heads=2, head_dim=16)).save_pretrained(f"model-{name}")
    byte_tokenizer().save_pretrained(f"model-{name}")
open("text.txt", "w").write(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))
PY
  printf 'source: {store: kv-source}\ntarget: {store: kv-target}\nfit: {k: [1, all]}\noutput: {dir: out-cap}\n' > pair-cap.yaml
  echo "$WORK/pair-cap.yaml $WORK/model-source $WORK/model-target $WORK/text.txt --seq-len 64 --n-seq 16 --shard-seqs 4 --dtype fp32" > captures.txt
  export CROSSKV_CAPTURE_PYTHON=$CAP_PY
  out=$(CROSSKV_CAPTURE_PARTS=2 timeout 30 "$ROOT/slurm/submit-pairs.sh" captures.txt 2 "${SB[@]}") || die "submit-pairs failed: $out"
  echo "$out"
  jid=$(echo "$out" | sed -n 's/.*capture \([0-9]*\) .*fit \([0-9]*\).*/\1,\2/p')
  rid=""
  [ -n "$jid" ] || die "submit-pairs printed no job ids"
  queue_done() { [ -z "$(timeout 10 squeue -h -j "$jid" 2>&1)" ]; }
  wait_for 600 "the capture array and its fit to leave the queue" queue_done
  for f in crosskv-capture-*.out; do grep -q "part [01]/2 (SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT)" "$f" || die "$f: no part of 2 from Slurm's array"; done
  [ "$(ls kv-source/web kv-target/web | grep -c 'shard-00[0-3].h5')" = 8 ] || die "the two parts did not write 4 shards a model: $(ls kv-*/web)"
  "$PY" "$ROOT/slurm/check-pairs.py" --stores captures.txt || die "the stores do not pair up"
  "$PY" "$ROOT/slurm/check-pairs.py" captures.txt || die "the fit after the capture is incomplete"
  echo "slurm capture array + dependent fit OK in $((SECONDS - T0)) s"
  exit 0
fi
for p in a b c; do
  "$SYNTH" --out data-$p --shards 4 --sequences 2 --seq-len 128 --seed $((7 + ${#p})) > /dev/null
  printf 'source: {store: data-%s/source}\ntarget: {store: data-%s/target}\nfit: {k: [1, all]}\noutput: {dir: out-%s}\nruntime: {block_tokens: 32, checkpoint: {every_shards: 1}}\n' $p $p $p > "$WORK/pair-$p.yaml"
done
printf '%s\n' "$WORK/pair-a.yaml" "$WORK/pair-b.yaml" > pairs.txt

# 1. A job that gets USR1 (as from --signal=B:USR1@120) once it has committed a checkpoint: it must exit 75, be
#    requeued by the batch script, and resume. The fault hook holds it after its first commit until a signal comes,
#    so the signal cannot race the end of this small fit. It is submitted first, so it starts at once.
rid=$(CROSSKV_FAULT=pause_after_commit:1 timeout 30 sbatch --parsable "${SB[@]}" --export=ALL \
      "$ROOT/slurm/fit-pair.sbatch" "$WORK/pair-c.yaml") || die "sbatch failed"
# 2. An array of two pairs.
jid=$(timeout 30 "$ROOT/slurm/submit-pairs.sh" pairs.txt 2 "${SB[@]}" --parsable) || die "submit-pairs failed"
wait_for 120 "job $rid to commit a checkpoint" test -f out-c/checkpoint/domain-web/commit-1.json
timeout 30 scancel --signal=USR1 --batch "$rid" || die "scancel --signal=USR1 failed"
job_log_has() { cat crosskv-"$rid"_*.out 2> /dev/null | grep -q "$1"; }
wait_for 60 "job $rid to exit 75 and requeue itself" job_log_has "exit 75: checkpoint committed; requeueing"
wait_for 180 "job $rid to run again" requeued_and_started
wait_for 240 "all jobs to leave the queue" queue_empty
printf '%s\n' "$WORK/pair-c.yaml" >> pairs.txt
"$PY" "$ROOT/slurm/check-pairs.py" pairs.txt || die "artifacts incomplete"
# The requeued job's artifacts equal an uninterrupted run's.
sed 's/out-c/out-c-ref/' pair-c.yaml > pair-c-ref.yaml
OPENBLAS_NUM_THREADS=1 "$FIT" pair-c-ref.yaml > ref.log 2>&1 || die "reference run failed"  # as in the job: 1 CPU
for f in out-c-ref/kall/layer-*.safetensors; do cmp -s "$f" "out-c/kall/$(basename "$f")" || die "$f differs after requeue"; done
echo "slurm array + requeue OK in $((SECONDS - T0)) s"
