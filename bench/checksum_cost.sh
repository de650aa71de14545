#!/usr/bin/env bash
# What Fletcher-32 checksums cost: the same synthetic stores written with and without the filter
# (crosskv-synth, timed), then crosskv-bench-stream (read, convert, strip RoPE, check finiteness) over each, ROUNDS
# times alternating, in one run: the streaming rates and their ratio, the CPU and the BLAS kernels beside them.
# Usage: bench/checksum_cost.sh [OUT_DIR]    env: BUILD (build dir), ROUNDS (3), DTYPE (bfloat16)
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
BUILD=${BUILD:-$ROOT/build}
OUT=${1:-$ROOT/bench/results/checksum-$(date +%Y%m%d-%H%M%S)}
ROUNDS=${ROUNDS:-3}
mkdir -p "$OUT" && cd "$OUT"
SHAPE=(--dtype "${DTYPE:-bfloat16}" --shards 4 --sequences 8 --seq-len 1024 --source-layers 12 --source-heads 8
       --source-head-dim 64 --target-layers 16 --target-heads 8 --target-head-dim 64)
for kind in checked unchecked; do
  rm -rf "$kind"
  flag=(); [ "$kind" = unchecked ] && flag=(--no-checksum)
  s=$(date +%s.%N)
  "$BUILD/crosskv-synth" --out "$kind" "${SHAPE[@]}" "${flag[@]}" > /dev/null
  echo "write_s_$kind $(echo "$(date +%s.%N) - $s" | bc)"
  printf 'source: {store: %s/source}\ntarget: {store: %s/target}\nfit: {k: [1]}\noutput: {dir: %s/out}\n' \
    "$OUT/$kind" "$OUT/$kind" "$OUT/$kind" > "$kind.yaml"
done | tee write.txt
for r in $(seq "$ROUNDS"); do
  for kind in checked unchecked; do
    sync; echo 3 > /proc/sys/vm/drop_caches 2> /dev/null || true
    echo "$kind $("$BUILD/bench/crosskv-bench-stream" "$kind.yaml" 2> blas.txt)"
  done
done | tee rates.txt
python3 - "$OUT" <<'PY'
import json, statistics, sys
rates = {"checked": [], "unchecked": []}
for line in open(sys.argv[1] + "/rates.txt"):
    kind, js = line.split(" ", 1)
    rates[kind].append(json.loads(js)["tokens_per_s"])
w = dict(l.split() for l in open(sys.argv[1] + "/write.txt"))
c, u = statistics.median(rates["checked"]), statistics.median(rates["unchecked"])
print(f"streaming: checked {c:.0f} tokens/s, unchecked {u:.0f} tokens/s (medians of {len(rates['checked'])}): "
      f"checked/unchecked {c / u:.3f}")
print(f"writing (crosskv-synth): checked {float(w['write_s_checked']):.2f} s, unchecked "
      f"{float(w['write_s_unchecked']):.2f} s")
print(open(sys.argv[1] + "/blas.txt").read().strip())
PY
