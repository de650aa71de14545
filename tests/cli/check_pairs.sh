#!/usr/bin/env bash
# slurm/check-pairs.sh decides success from the artifacts: complete pairs pass, a missing or corrupt one fails.
source "$(dirname "$0")/common.sh"
[ -n "${PYTHON:-}" ] || { echo "SKIPPED: no Python with numpy/h5py/yaml"; exit 77; }
"$PYTHON" -c "import yaml" 2> /dev/null || { echo "SKIPPED: python3-yaml is not installed"; exit 77; }
CHECK=$(dirname "$0")/../../slurm/check-pairs.py
"$SYNTH" --out data --shards 1 --sequences 2 --seq-len 64 > /dev/null
for p in a b; do
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2]}\noutput: {dir: out-%s}\n' $p > $p.yaml
done
"$FIT" a.yaml > /dev/null
printf '%s\n' "$PWD/a.yaml" > pairs.txt
"$PYTHON" "$CHECK" pairs.txt > check.log || { cat check.log; die "a complete pair must pass"; }
printf '%s\n%s\n' "$PWD/a.yaml" "$PWD/b.yaml" > pairs.txt
set +e; "$PYTHON" "$CHECK" pairs.txt > check.log; rc=$?; set -e
[ "$rc" = 1 ] && grep -q "INCOMPLETE $PWD/b.yaml" check.log || { cat check.log; die "a pair without artifacts must fail"; }
"$FIT" b.yaml > /dev/null
printf 'x' | dd of=out-b/k2/layer-003.safetensors bs=1 seek=200 conv=notrunc 2> /dev/null
set +e; "$PYTHON" "$CHECK" pairs.txt > check.log; rc=$?; set -e
[ "$rc" = 1 ] && grep -q "does not verify" check.log || { cat check.log; die "a corrupt artifact must fail"; }
# --stores: the stores pair up (a CAPTURES.txt line: the config, then the capture's words); a shard missing from
# one store, and a pair whose token_ids differ, are named.
printf '%s model-s model-t text.txt --seq-len 64\n' "$PWD/a.yaml" > captures.txt
"$PYTHON" "$CHECK" --stores captures.txt > check.log || { cat check.log; die "paired stores must pass --stores"; }
mv data/target/web/shard-000.h5 shard-000.h5
set +e; "$PYTHON" "$CHECK" --stores captures.txt > check.log; rc=$?; set -e
[ "$rc" = 1 ] && grep -q "do not pair up: web/shard-000.h5 is in .*data/source only" check.log \
  || { cat check.log; die "an unpaired shard must fail --stores"; }
mv shard-000.h5 data/target/web/shard-000.h5
"$PYTHON" - data/target/web/shard-000.h5 <<'PY'
import sys, h5py
with h5py.File(sys.argv[1], "r+") as f:
    ids = f["token_ids"][()]
    ids[0] += 1
    del f["token_ids"]
    f["token_ids"] = ids
PY
set +e; "$PYTHON" "$CHECK" --stores captures.txt > check.log; rc=$?; set -e
[ "$rc" = 1 ] && grep -q "web/shard-000.h5: the source's and the target's token_ids differ" check.log \
  || { cat check.log; die "a pair of other tokens must fail --stores"; }
echo "check-pairs OK"
