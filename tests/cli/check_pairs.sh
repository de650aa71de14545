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
echo "check-pairs OK"
