#!/usr/bin/env bash
# --plan on the paper's shapes (docs/METHOD.md, Reference figures) shows the paper's mapper sizes: 1.07 B and 3.36 B parameters.
source "$(dirname "$0")/common.sh"
"$SYNTH" --out qwen --shards 1 --sequences 1 --seq-len 16 \
  --source-layers 40 --source-heads 8 --source-head-dim 128 --source-theta 1000000 \
  --target-layers 64 --target-heads 8 --target-head-dim 128 --target-rope default --target-theta 1000000 > /dev/null
cat > qwen.yaml <<'YAML'
source: {store: qwen/source}
target: {store: qwen/target}
fit: {k: 8}
output: {dir: out-qwen}
YAML
"$FIT" qwen.yaml --plan > qwen.log
expect_in "1.07 B" qwen.log
expect_in "(1073741824)" qwen.log
expect_in "4.00 GiB" qwen.log
# Head-matched from the same plan: 8x fewer parameters and bytes per artifact, one line each.
sed 's/fit: {k: 8}/fit: {k: 8, structure: [cross_head, per_head]}/' qwen.yaml > qwen-ph.yaml
"$FIT" qwen-ph.yaml --plan > qwen-ph.log
expect_in "k8                 8192  1.07 B" qwen-ph.log
expect_in "k8-per_head        1024  134.22 M     (134217728)" qwen-ph.log
expect_in "512.50 MiB" qwen-ph.log
expect_in "; per_head's share " qwen-ph.log
# Planning an 8-rank job from one process: the grid, and each rank's share of the moments.
"$FIT" qwen.yaml --plan --ranks 8 > qwen8.log
expect_in "grid: 8 rank(s) = 4 layer group(s) x 2 token group(s) (auto)" qwen8.log
printf 'runtime: {max_moment_gib: 40, layer_groups: 2}\n' >> qwen.yaml
"$FIT" qwen.yaml --plan --ranks 8 > qwen8b.log
expect_in "grid: 8 rank(s) = 2 layer group(s) x 4 token group(s);" qwen8b.log
expect_in "passes over the data: 1" qwen8b.log
# Host memory per rank for a batch job's request: 2 layer groups hold every Gram block and half the rest (17.04 GiB),
# a quarter of it checkpointed (4 readers), two blocks of 4096 fp32 tokens and reduction segments (16.75 GiB); in the
# solve, readers in pairs hold one kind's moments without the raw-key probe blocks, and a k = 8 factor.
expect_in "host memory per rank (estimate, CPU backend): pass 37.25 GiB (moments 17.04 GiB, checkpointed share 3.46 GiB, buffers 16.75 GiB); solve 8.89 GiB (moments 8.20 GiB, factors 512.00 MiB, workspace 192.00 MiB); peak 37.25 GiB" qwen8b.log
"$SYNTH" --out llama --shards 1 --sequences 1 --seq-len 16 \
  --source-layers 32 --source-heads 8 --source-head-dim 128 --source-rope llama3 --source-theta 500000 \
  --target-layers 80 --target-heads 8 --target-head-dim 128 --target-rope llama3 --target-theta 500000 > /dev/null
cat > llama.yaml <<'YAML'
source: {store: llama/source}
target: {store: llama/target}
fit: {k: [20]}
output: {dir: out-llama}
YAML
"$FIT" llama.yaml --plan > llama.log
expect_in "3.36 B" llama.log
expect_in "(3355443200)" llama.log
expect_in "12.50 GiB" llama.log
echo "paper shapes OK"
