#!/usr/bin/env bash
# The demo as a user runs it: synthesize a pair, fit a k sweep, find every output.
source "$(dirname "$0")/common.sh"
"$SYNTH" --out data --shards 2 --sequences 4 --seq-len 256 --seed 5 > synth.log
cat > fit.yaml <<'YAML'
source: {store: data/source}
target: {store: data/target}
fit: {k: [1, 2, all], lambda: 0.01, dtype: bf16}
output: {dir: out}
runtime: {block_tokens: 256}
YAML
"$FIT" fit.yaml > fit.log 2> fit.err || { cat fit.log fit.err; die "crosskv-fit failed"; }
[ -s fit.err ] && { cat fit.err; die "stderr should be empty on success"; }
for k in k1 k2 kall; do
  [ -f out/$k/manifest.json ] || die "missing out/$k/manifest.json"
  n=$(ls out/$k/layer-*.safetensors | wc -l); [ "$n" = 12 ] || die "out/$k has $n layer files, expected 12"
done
[ -f out/r2.h5 ] && [ -f out/r2_heatmap.svg ] || die "missing r2.h5 or the heatmap"
ls out | grep -q partial && die "a .partial folder was left behind"
expect_in "tokens/s" fit.log
expect_in "summary: stage times" fit.log
expect_in "artifact: " fit.log
# --plan stops before any heavy work and writes nothing.
rm -rf out && "$FIT" fit.yaml --plan > plan.log
expect_in "mapper params" plan.log
[ -e out ] && die "--plan must not write outputs"
echo "demo fit OK"
