#!/usr/bin/env bash
# Builds the libFuzzer targets with clang (ASan + UBSan) and runs each for a while, seeded with a real artifact.
#   fuzz/run_fuzz.sh WORKDIR [SECONDS per target, 20]    env: CROSSKV_FIT, CROSSKV_SYNTH (to make the seeds)
# Exit 77 (SKIPPED) where clang or libFuzzer is missing; 1 on a crash (the reproducer is left in WORKDIR).
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/.." && pwd)
WORK=${1:?usage: $0 WORKDIR [SECONDS]}
SECS=${2:-20}
CXX=$(command -v clang++ || command -v clang++-14 || true)
[ -n "$CXX" ] || { echo "SKIPPED: clang++ is not installed (apt-get install clang)"; exit 77; }
echo 'extern "C" int LLVMFuzzerTestOneInput(const unsigned char*, unsigned long) { return 0; }' > /tmp/crosskv-fz-probe.cpp
"$CXX" -fsanitize=fuzzer /tmp/crosskv-fz-probe.cpp -o /tmp/crosskv-fz-probe 2> /dev/null \
  || { echo "SKIPPED: $CXX cannot link libFuzzer (apt-get install libclang-rt-14-dev or clang)"; exit 77; }
rm -rf "$WORK" && mkdir -p "$WORK" && cd "$WORK"
# Line tables are what ASan's and UBSan's reports print; full debug info would double the compile.
FLAGS=(-std=c++20 -gline-tables-only -O1 -fsanitize=address,undefined -fno-sanitize-recover=undefined -I"$ROOT"
       -DCROSSKV_VERSION=\"fuzz\")
# The instrumented compiles are most of this test's time, and most of each is the shared headers (nlohmann/json,
# spdlog): the readers' sources are compiled as one translation unit (182 CPU-s one by one, 61 s at once), the
# targets beside it.
READERS=(artifact/safetensors.cpp artifact/layer_file.cpp artifact/manifest.cpp artifact/mapper.cpp core/error.cpp
         core/kv_spec.cpp core/sha256.cpp core/atomic_file.cpp)
printf '#include "%s"\n' "${READERS[@]}" > readers.cpp
pids=()
for src in readers.cpp "$ROOT"/fuzz/fuzz_{safetensors,manifest,layer}.cpp; do
  "$CXX" "${FLAGS[@]}" -fsanitize=fuzzer-no-link -c "$src" -o "$(basename "$src" .cpp).o" & pids+=($!)
done
for pid in "${pids[@]}"; do wait "$pid" || { echo "FAIL: a fuzz target's source did not compile"; exit 1; }; done
for t in safetensors manifest layer; do
  "$CXX" "${FLAGS[@]}" -fsanitize=fuzzer fuzz_$t.o readers.o -lcrypto -o fuzz_$t
done
mkdir -p seeds-st seeds-mf seeds-ly
if [ -n "${CROSSKV_FIT:-}" ] && [ -n "${CROSSKV_SYNTH:-}" ]; then
  "$CROSSKV_SYNTH" --out data --shards 1 --sequences 1 --seq-len 64 --source-layers 3 --target-layers 2 \
    --source-heads 2 --target-heads 2 --source-head-dim 8 --target-head-dim 8 > /dev/null
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1]}\noutput: {dir: out}\n' > f.yaml
  "$CROSSKV_FIT" f.yaml > /dev/null 2>&1
  # and with residual MLPs in every layer file (fit.mapper: mlp)
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], mapper: mlp, mlp: {hidden: 4, epochs: 1}}\noutput: {dir: mlp}\n' > m.yaml
  "$CROSSKV_FIT" m.yaml > /dev/null 2>&1
  # and head-matched (fit.structure: per_head: weights [Ht, k*Ds, Dt])
  printf 'source: {store: data/source}\ntarget: {store: data/target}\nfit: {k: [1], structure: per_head}\noutput: {dir: ph}\n' > p.yaml
  "$CROSSKV_FIT" p.yaml > /dev/null 2>&1
  cp ph/k1-per_head/layer-000.safetensors seeds-st/layer-000-per_head.safetensors
  cp ph/k1-per_head/manifest.json seeds-mf/manifest-per_head.json
  cp ph/k1-per_head/layer-000.safetensors seeds-ly/per_head.safetensors
  export CROSSKV_FUZZ_MANIFEST_PER_HEAD=$PWD/ph/k1-per_head/manifest.json
  cp out/k1/layer-000.safetensors seeds-st/
  cp mlp/k1/layer-000.safetensors seeds-st/layer-000-mlp.safetensors
  cp out/k1/manifest.json seeds-mf/
  cp mlp/k1/manifest.json seeds-mf/manifest-mlp.json
  cp out/k1/layer-000.safetensors seeds-ly/ridge.safetensors
  cp mlp/k1/layer-000.safetensors seeds-ly/mlp.safetensors
  export CROSSKV_FUZZ_MANIFEST=$PWD/mlp/k1/manifest.json
fi
printf '\x10\x00\x00\x00\x00\x00\x00\x00{"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}\x00\x00\x80\x3f' > seeds-st/tiny
export ASAN_OPTIONS=detect_leaks=1 UBSAN_OPTIONS=print_stacktrace=1
targets="safetensors manifest"
[ -n "${CROSSKV_FUZZ_MANIFEST:-}" ] && targets+=" layer" || echo "[fuzz] layer: not run (needs CROSSKV_FIT and CROSSKV_SYNTH for its seed artifact)"
for t in $targets; do
  seeds=seeds-st
  [ $t = manifest ] && seeds=seeds-mf
  [ $t = layer ] && seeds=seeds-ly
  echo "[fuzz] $t for ${SECS}s"
  ./fuzz_$t -max_total_time="$SECS" -max_len=65536 -print_final_stats=1 "$seeds" > fuzz_$t.log 2>&1 \
    || { tail -40 fuzz_$t.log; echo "FAIL: fuzz_$t crashed (reproducer in $WORK)"; exit 1; }
  grep -E "stat::number_of_executed_units" fuzz_$t.log || true
done
echo "fuzz OK"
