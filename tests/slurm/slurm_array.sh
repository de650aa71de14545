#!/usr/bin/env bash
# A real single-node Slurm on localhost (munge, slurmctld, slurmd from Debian's packages): an array of two pairs,
# and a job that gets Slurm's USR1 mid-run, exits 75, is requeued and resumes. Success is decided by the
# artifacts. Where Slurm cannot be started, the test reports SKIPPED with the reason (exit 77).
set -uo pipefail
WORK=${1:?usage: $0 WORKDIR}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
FIT=${CROSSKV_FIT:?} SYNTH=${CROSSKV_SYNTH:?} PY=${PYTHON:-}
skip() { echo "SKIPPED: $*"; exit 77; }
die() { echo "FAIL: $*" >&2; exit 1; }
for b in munged slurmctld slurmd sbatch scontrol squeue; do command -v $b > /dev/null || skip "$b is not installed (apt-get install slurm-wlm munge)"; done
[ -n "$PY" ] && "$PY" -c "import yaml" 2> /dev/null || skip "no Python with yaml for slurm/check-pairs.py"
[ "$(id -u)" = 0 ] || skip "starting slurmctld/slurmd here needs root"
rm -rf "$WORK" && mkdir -p "$WORK"/{state,spool} && cd "$WORK"
H=$(hostname -s)
cat > slurm.conf <<CONF
ClusterName=crosskvtest
SlurmctldHost=$H
SlurmUser=root
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
NodeName=$H CPUs=$(nproc) State=UNKNOWN
PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
CONF
export SLURM_CONF=$WORK/slurm.conf
if [ ! -S /run/munge/munge.socket.2 ]; then
  mkdir -p /run/munge && chown munge:munge /run/munge 2> /dev/null
  [ -f /etc/munge/munge.key ] || skip "no /etc/munge/munge.key"
  munged --force > munged.log 2>&1 || skip "munged did not start: $(tail -1 munged.log)"
fi
cleanup() {
  for p in slurmctld slurmd; do [ -f "$WORK/$p.pid" ] && kill "$(cat "$WORK/$p.pid")" 2> /dev/null; done
}
trap cleanup EXIT
slurmctld -f "$SLURM_CONF" || skip "slurmctld did not start: $(tail -2 slurmctld.log 2> /dev/null)"
slurmd -f "$SLURM_CONF" || skip "slurmd did not start: $(tail -2 slurmd.log 2> /dev/null)"
for _ in $(seq 60); do sinfo -h -o %t 2> /dev/null | grep -q idle && break; sleep 0.5; done
sinfo -h -o %t | grep -q idle || skip "the Slurm node did not become idle: $(tail -2 slurmctld.log)"

export CROSSKV_FIT=$FIT
SB=(--nodes=1 --ntasks-per-node=1 --cpus-per-task=1 --time=10)
for p in a b c; do
  "$SYNTH" --out data-$p --shards 4 --sequences 2 --seq-len 128 --seed $((7 + ${#p})) > /dev/null
  printf 'source: {store: data-%s/source}\ntarget: {store: data-%s/target}\nfit: {k: [1, all]}\noutput: {dir: out-%s}\nruntime: {block_tokens: 32, checkpoint: {every_shards: 1}}\n' $p $p $p > "$WORK/pair-$p.yaml"
done
printf '%s\n' "$WORK/pair-a.yaml" "$WORK/pair-b.yaml" > pairs.txt

# 1. An array of two pairs.
jid=$("$ROOT/slurm/submit-pairs.sh" pairs.txt 2 "${SB[@]}" --parsable) || die "submit-pairs failed"
# 2. A job that gets USR1 (as from --signal=B:USR1@120) once it has a committed checkpoint: it must exit 75, be
#    requeued by the batch script, and resume.
rid=$(sbatch --parsable "${SB[@]}" --export=ALL "$ROOT/slurm/fit-pair.sbatch" "$WORK/pair-c.yaml") || die "sbatch failed"
for _ in $(seq 600); do [ -f out-c/checkpoint/domain-web/commit-1.json ] && break; sleep 0.05; done
[ -f out-c/checkpoint/domain-web/commit-1.json ] || die "job $rid wrote no checkpoint"
scancel --signal=USR1 --batch "$rid" || die "scancel --signal=USR1 failed"
# Slurm holds a requeued job back for a while (BeginTime); let it start now once it is requeued.
for _ in $(seq 200); do grep -q "requeueing" crosskv-${rid}*.out 2> /dev/null && break; sleep 0.1; done
for _ in $(seq 50); do squeue -h -j "$rid" -o %T 2> /dev/null | grep -q PENDING && break; sleep 0.1; done
scontrol update JobId="$rid" StartTime=now 2> /dev/null || true
# Wait for everything to leave the queue (requeued jobs come back pending first).
for _ in $(seq 240); do
  [ -z "$(squeue -h -j "$jid,$rid" 2> /dev/null)" ] && break
  sleep 0.5
  reason=$(squeue -h -j "$rid" -o %r 2> /dev/null)
done
[ -z "$(squeue -h -j "$jid,$rid" 2> /dev/null)" ] || die "jobs still queued (reason: ${reason:-?}): $(squeue -j "$jid,$rid")"
grep -q "exit 75: checkpoint committed; requeueing" crosskv-*.out || { cat crosskv-*.out; die "job $rid was not requeued on exit 75"; }
grep -q "restart 1" crosskv-*.out || { cat crosskv-*.out; die "job $rid did not run again"; }
printf '%s\n' "$WORK/pair-c.yaml" >> pairs.txt
"$PY" "$ROOT/slurm/check-pairs.py" pairs.txt || { cat crosskv-*.out; die "artifacts incomplete"; }
# The requeued job's artifacts equal an uninterrupted run's.
sed 's/out-c/out-c-ref/' pair-c.yaml > pair-c-ref.yaml
OPENBLAS_NUM_THREADS=1 "$FIT" pair-c-ref.yaml > ref.log 2>&1 || die "reference run failed"  # as in the job: 1 CPU
for f in out-c-ref/kall/layer-*.safetensors; do cmp -s "$f" "out-c/kall/$(basename "$f")" || die "$f differs after requeue"; done
echo "slurm array + requeue OK"
