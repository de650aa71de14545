#!/usr/bin/env bash
# bench/project.py on what the GPU check writes, made here on the CPU: the benchmark's JSON (CROSSKV_BENCH_CPU=1)
# and a real fit log with several rounds. Every figure the projection reads from the log must be found (the log's
# wording and the script move together), and the projected total must be the sum of its rows.
source "$(dirname "$0")/common.sh"
BENCH=${CROSSKV_BENCH_GPU:?}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
command -v python3 > /dev/null || { echo "SKIPPED: no python3"; exit 77; }
CROSSKV_BENCH_CPU=1 "$BENCH" 3 2 16 4 2 16 256 1 > bench_gpu.json || die "crosskv-bench-gpu on the CPU failed"
CROSSKV_BENCH_CPU=1 "$BENCH" --factor 3 2 16 256 > factor_gpu.json || die "crosskv-bench-gpu --factor on the CPU failed"
"$SYNTH" --out data --shards 4 --sequences 2 --seq-len 64 --source-layers 3 --target-layers 4 > /dev/null
printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1, all]}\noutput: {dir: out}\nruntime: {block_tokens: 64, checkpoint: {every_shards: 1}}\n' > fit.yaml
"$FIT" fit.yaml > fit_gpu.log 2>&1 || { cat fit_gpu.log; die "fit failed"; }
project() {  # project OUT ARGS...: bench/project.py ARGS into OUT (and shown)
  local out=$1; shift
  python3 "$ROOT/bench/project.py" "$@" > "$out" 2>&1 || { cat "$out"; die "project.py $* failed"; }
  cat "$out"
}
expect_rows() {  # expect_rows FILE ROW...
  local f=$1; shift
  for row in "$@"; do expect_in "$row" "$f"; done
}
# Two ranks: the round's end reads the resident sums in place; one rank: the round's end is its checkpoint.
check_projection() {
  local ranks=$1; shift
  project projection.txt . --ranks "$ranks" --tokens 1000000000
  expect_rows projection.txt "pass: N/P tokens" "$@" "reduce-scatter" "probe (R², select)" "k = all factor" \
    "solve + export, $((4 / ranks)) target layers" "total per pair"
  grep -q "not in fit_gpu.log" projection.txt && die "a figure was not found in the fit log"
  python3 - <<'PY' || die "the total is not the sum of the rows"
import re
rows = [l for l in open("projection.txt") if re.match(r"  \S", l) and " s " in l]
vals = [float(re.search(r"\s([\d.]+) s\s", l).group(1)) for l in rows]
total = vals[-1]
assert total > 0 and abs(sum(vals[:-1]) - total) <= 0.05 * len(vals), (vals, total)
PY
}
check_projection 2 "round end: 1/P share to the host" "round end: sums zeroed on the device" "checkpoint of this rank" \
  "one kind's k = all system of 96 features: assembled on the host"
check_projection 1 "round end (one reader, measured)"
# The H200 runs of 2026-11-30 as stored (docs/gpu-runs): every measured row is read from the real logs, the pass
# from the 16K-token run and the solve from the whole k sweep.
R=$ROOT/docs/gpu-runs/2026-11-30
project h200.txt "$R/check" "$R/fit-2048" "$R/fit-16384-k1" --ranks 8
expect_rows h200.txt "16384 tokens at 2244 tokens/s" "26.4 GiB in 15.3 s on one GPU" "26.4 GiB in 37.0 s, / 8" \
  "10.4 s on one GPU, / 8" "1.3 s per kind" "0.98 s per layer" "total per pair                                 38.2 s"
python3 "$ROOT/bench/project.py" nowhere > err.txt 2>&1 && die "project.py without its inputs succeeded"
expect_in "no bench_gpu.json in nowhere" err.txt
echo "PASS"
