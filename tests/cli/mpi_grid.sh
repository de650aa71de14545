#!/usr/bin/env bash
# mpiexec -np 4 as a grid of layer groups x token groups (1x4, 2x2, 4x1), one and two passes, both probe modes:
# the same selections and weights as one rank within fp32 tolerance (a fixed λ: mpi_np1_vs_np2.sh compares auto's
# choices); the same grid twice gives byte-identical
# files; more layer groups means less memory per rank; the manifest records the grid.
source "$(dirname "$0")/common.sh"
[ -n "${PYTHON:-}" ] || { echo "SKIPPED: no Python with numpy and h5py to compare artifacts"; exit 77; }
MPI=${MPIEXEC:?}
CMP="$PYTHON $(dirname "$0")/../python/compare_artifacts.py"
"$SYNTH" --out data --shards 5 --sequences 2 --seq-len 96 > /dev/null
cfg() {  # NAME PROBE LAYER_GROUPS MAX_MOMENT_GIB
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 3, all], probe: %s, lambda: 0.01}\noutput: {dir: out-%s}\nruntime: {block_tokens: 64, layer_groups: %s, max_moment_gib: %s}\n' \
    "$2" "$1" "$3" "$4" > "$1.yaml"
}
run() {  # NP NAME
  $MPI -np "$1" "$FIT" "$2.yaml" > "$2.log" 2>&1 || { cat "$2.log"; die "mpiexec -np $1 $2 failed"; }
}
r2_close() {  # two r2.h5 files agree
  "$PYTHON" - "$1" "$2" <<'PY'
import sys, h5py, numpy as np
a, b = h5py.File(sys.argv[1]), h5py.File(sys.argv[2])
for k in a:
    if isinstance(a[k], h5py.Dataset):
        d = float(np.nanmax(np.abs(a[k][()] - b[k][()])))
        assert d < 1e-4, f"{k}: R² differs by {d}"
PY
}
# One pass, same-head probe.
cfg ref same_head 1 8; run 1 ref
for g in 1 2 4; do cfg g$g same_head $g 8; run 4 g$g; $CMP out-ref/kall out-g$g/kall 1e-4; $CMP out-ref/k3 out-g$g/k3 1e-4; r2_close out-ref/r2.h5 out-g$g/r2.h5; done
grep -q '"layer_groups": 2' out-g2/kall/manifest.json || die "manifest does not record the grid"
grep -q '"token_groups": 2' out-g2/kall/manifest.json || die "manifest does not record the grid"
# The same grid twice: byte-identical.
sed 's/out-g2/out-g2b/' g2.yaml > g2b.yaml; run 4 g2b
for f in out-g2/kall/layer-*.safetensors out-g2/k1/layer-*.safetensors; do
  cmp -s "$f" "${f/out-g2/out-g2b}" || die "$f differs between two identical 2x2 runs"
done
# More layer groups, less memory per rank (largest share after the Gram exchange vs 1 layer group).
peak() { grep -E "holds" "$1" | grep -v "checkpointed" | sed -E 's/.* holds ([0-9.]+) (KiB|MiB)$/\1 \2/' |
         awk '{v = $2 == "MiB" ? $1 * 1024 : $1; if (v > m) m = v} END {print m + 0}'; }
p1=$(grep -E "rank 0 holds" g1.log | grep checkpointed | sed -E 's/.* holds ([0-9.]+) (KiB|MiB)$/\1 \2/' | awk '{print $2 == "MiB" ? $1 * 1024 : $1}' | head -1)
p4=$(peak g4.log)
awk -v a="$p4" -v b="$p1" 'BEGIN {exit !(a > 0 && a < b)}' || { grep holds g1.log g4.log; die "4 layer groups hold $p4 KiB per rank, 1 holds $p1 KiB"; }
# The plan's host memory estimate counts what a rank then holds: moments plus checkpointed share (1x4, one pass).
"$PYTHON" - g1.log <<'PY' || die "the plan's estimate of moments + share does not match what rank 0 held"
import re, sys
unit = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}
size = lambda v, u: float(v) * unit[u]
log = open(sys.argv[1]).read()
est = re.search(r"host memory per rank \(estimate, \w+ backend\): pass \S+ \S+ \(moments ([\d.]+) (\w+), "
                r"checkpointed share ([\d.]+) (\w+)", log)
held = re.search(r"\(moments \+ checkpointed share\): rank 0 holds ([\d.]+) (\w+)", log)
assert est and held, "estimate or holdings not in the log"
e = size(*est.group(1, 2)) + size(*est.group(3, 4))
h = size(*held.group(1, 2))
print(f"estimated {e / 2**20:.2f} MiB, held {h / 2**20:.2f} MiB")
assert abs(e - h) <= 0.02 * h, (e, h)
PY
# Two passes (probe, then the selected blocks): 2x2 agrees with one rank.
cfg ref2 same_head 1 0.0001; run 1 ref2
grep -q "pass 2/2" ref2.log || die "expected a two-pass fit"
cfg g2p same_head 2 0.0001; run 4 g2p
$CMP out-ref2/kall out-g2p/kall 1e-4; $CMP out-ref2/k1 out-g2p/k1 1e-4
# All-heads probe: 2x2 and 4x1 agree with one rank.
cfg refa all_heads 1 8; run 1 refa
for g in 2 4; do cfg a$g all_heads $g 8; run 4 a$g; $CMP out-refa/k3 out-a$g/k3 1e-4; r2_close out-refa/r2.h5 out-a$g/r2.h5; done
# A grid that does not divide the ranks is refused, naming the key.
cfg bad same_head 3 8
set +e; $MPI -np 4 "$FIT" bad.yaml > bad.log 2>&1; rc=$?; set -e
[ "$rc" = 2 ] || { cat bad.log; die "expected exit 2 for layer_groups 3 on 4 ranks, got $rc"; }
expect_in "runtime.layer_groups: 3 does not divide the job's 4 ranks" bad.log
# Readers pair up for the solve (one solves the keys, the other the values, and they take turns writing): 1x3 is a
# pair and a reader alone; it agrees with one rank.
cfg g13 same_head 1 8; run 3 g13
$CMP out-ref/kall out-g13/kall 1e-4; $CMP out-ref/k1 out-g13/k1 1e-4
expect_in "keys and values solved by a pair of ranks" g13.log
# A pair killed in export (rank 1, at its third file) resumes: the layers both wrote are kept, the rest solved
# again, and the files equal an uninterrupted run's.
cfg e2a same_head 1 8; run 2 e2a
cfg e2b same_head 1 8
set +e; CROSSKV_FAULT=kill_in_export:3 CROSSKV_FAULT_RANK=1 $MPI -np 2 "$FIT" e2b.yaml > e2b.log 2>&1; set -e
[ -e out-e2b/kall/manifest.json ] && die "kall must not look complete after a kill in export"
run 2 e2b
expect_in "already written by an interrupted run" e2b.log
for f in out-e2a/k*/layer-*.safetensors; do
  cmp -s "$f" "${f/out-e2a/out-e2b}" || die "$f: the resumed pair's export differs"
done
# One reader per layer group (4x1): its checkpoints are read from its moments; killed before its third commit, the
# same command resumes (each rank reads its state straight into its moments) to byte-identical files.
for n in k4a k4b; do
  cfg $n same_head 4 8; sed -i '/^runtime/ s/}$/, checkpoint: {every_shards: 1}}/' $n.yaml
done
run 4 k4a
set +e; CROSSKV_FAULT=kill_before_commit:3 $MPI -np 4 "$FIT" k4b.yaml > k4b.log 2>&1; set -e
[ -f out-k4b/checkpoint/domain-web/commit-2.json ] && [ ! -f out-k4b/checkpoint/domain-web/commit-3.json ] \
  || { cat k4b.log; die "4x1: expected a kill before commit 3"; }
run 4 k4b
expect_in "resuming from committed checkpoint 2" k4b.log
expect_in "checkpoint at the pass's end (one reader" k4b.log
for f in out-k4a/kall/layer-*.safetensors out-k4a/k1/layer-*.safetensors; do
  cmp -s "$f" "${f/out-k4a/out-k4b}" || die "$f: the resumed 4x1 run differs"
done
echo "grid OK"
