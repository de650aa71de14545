#!/usr/bin/env bash
# Two builds of crosskv on the CPU benchmark's data (bench/run_bench.sh's shapes), alternating A, B, A, B in one
# session so that machine drift falls on both: the accumulation kernel (BM_accumulate_full), the streaming read rate,
# crosskv-fit's wall time for the sweep k = 1, 2, 4, 8, all, and the serving apply (crosskv-bench-apply serving: a
# 40x8x128 -> 8x8x128 mapper, k = 4, on 512 tokens, resident on the backend). Prints the medians and B/A. For refactors: "no
# regression" is B/A within the noise of the two A runs.
# Usage: bench/compare_builds.sh BUILD_A BUILD_B [OUT]     env: SHARDS (4), SEQS (8), SEQ_LEN (1024), ROUNDS (2)
set -euo pipefail
A=$(cd "$1" && pwd) B=$(cd "$2" && pwd)
OUT=${3:-/tmp/crosskv-compare}
SHARDS=${SHARDS:-4} SEQS=${SEQS:-8} SEQ_LEN=${SEQ_LEN:-1024} ROUNDS=${ROUNDS:-2}
mkdir -p "$OUT" && cd "$OUT"
rm -rf data
"$A/crosskv-synth" --out data --dtype bfloat16 --shards "$SHARDS" --sequences "$SEQS" --seq-len "$SEQ_LEN" \
  --source-layers 12 --source-heads 8 --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64 \
  > synth.log
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, 2, 4, 8, all], lambda: 0.01}\noutput: {dir: out}\nruntime: {block_tokens: 4096}\n' > fit.yaml
: > results.tsv
for round in $(seq "$ROUNDS"); do
  for side in A B; do
    build=$A; [ $side = B ] && build=$B
    gflops=$(CROSSKV_BENCH_DIMS=12,8,64,16,8,64 CROSSKV_BENCH_BLOCK=4096 "$build/bench/crosskv-bench-kernels" \
      --benchmark_filter=BM_accumulate_full --benchmark_min_time=6 --benchmark_format=json 2> /dev/null |
      python3 -c 'import json,sys; b=json.load(sys.stdin)["benchmarks"][0]; print(b["flops"] / 1e9)')
    sync
    tps=$("$build/bench/crosskv-bench-stream" fit.yaml | python3 -c 'import json,sys; j=json.load(sys.stdin); print(j["tokens_per_s"])')
    rm -rf out
    t0=$(date +%s.%N); "$build/crosskv-fit" fit.yaml > "fit-$side-$round.log"; t1=$(date +%s.%N)
    wall=$(python3 -c "print(round($t1 - $t0, 2))")
    apply=$("$build/bench/crosskv-bench-apply" cpu serving 2> /dev/null | head -1 |
      python3 -c 'import json,sys; j=json.loads(sys.stdin.readline()); print([b["resident_ms"] for b in j["batches"] if b["tokens"] == 512][0])')
    printf '%s\t%s\t%s\t%s\t%s\t%s\n' "$side" "$round" "$gflops" "$tps" "$wall" "$apply" | tee -a results.tsv
  done
done
python3 - <<'PY'
import statistics as st
rows=[l.split('\t') for l in open('results.tsv').read().split('\n') if l]
def med(side,col): return st.median(float(r[col]) for r in rows if r[0]==side)
print("measure                      A          B        B/A")
for name,col in (("accumulation GFLOP/s",2),("streaming tokens/s",3),("crosskv-fit wall s",4),("apply ms, 512 tokens",5)):
    a,b=med("A",col),med("B",col)
    print(f"{name:<24} {a:>10.1f} {b:>10.1f} {b/a:>9.3f}")
PY
