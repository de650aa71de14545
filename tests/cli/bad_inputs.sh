#!/usr/bin/env bash
# A failing command exits non-zero with exactly one line on stderr naming the file and the problem.
source "$(dirname "$0")/common.sh"
"$SYNTH" --out data --shards 1 --sequences 2 --seq-len 64 > /dev/null
check() {  # check EXPECTED_CODE EXPECTED_TEXT ARGS...
  local code=$1 text=$2; shift 2
  set +e; "$FIT" "$@" > out.log 2> err.log; local rc=$?; set -e
  [ "$rc" = "$code" ] || { cat out.log err.log; die "exit code $rc, expected $code for: $*"; }
  [ "$(wc -l < err.log)" = 1 ] || { cat err.log; die "stderr must be one line for: $*"; }
  expect_in "$text" err.log
}
check 2 "missing CONFIG.yaml"
check 2 "nope.yaml: cannot open config file" nope.yaml
printf 'source: {store: data/source}\ntarget: {store: data/target}\noutput: {dir: out}\nfit: {k: [1], lamda: 1}\n' > typo.yaml
check 2 "typo.yaml:4: fit.lamda: unknown key" typo.yaml
printf 'source: {store: missing}\ntarget: {store: data/target}\noutput: {dir: out}\n' > nostore.yaml
check 2 "source.store: store folder" nostore.yaml
printf 'source: {store: data/source}\ntarget: {store: data/target}\noutput: {dir: out}\nfit: {k: [1], lambda: 0}\nruntime: {device: cuda}\n' > cuda.yaml
if "$FIT" --version | grep -q "cuda: no"; then
  check 2 "built without CUDA" cuda.yaml
elif ! command -v nvidia-smi > /dev/null || ! nvidia-smi -L > /dev/null 2>&1; then
  check 2 "runtime.device: cuda: no CUDA device 0 on host" cuda.yaml   # built with CUDA, no GPU here
fi
# The build without CUDA refuses by name; the emulation with no device, as a machine without a GPU does.
if [ -n "${CROSSKV_FIT_STUB:-}" ]; then
  FIT=$CROSSKV_FIT_STUB check 2 "runtime.device: cuda was requested but crosskv was built without CUDA" cuda.yaml
fi
if [ -n "${CROSSKV_FIT_EMULATED:-}" ]; then
  CROSSKV_CUDA_EMULATION_DEVICES=0 FIT=$CROSSKV_FIT_EMULATED check 2 "runtime.device: cuda: no CUDA device 0 on host" cuda.yaml
fi
# Usage errors: one line, exit 2 (not CLI11's 105/109).
check 2 "--log-level: bogus not in" typo.yaml --log-level bogus
check 2 "--nope" typo.yaml --nope
check 2 "--ranks" typo.yaml --plan --ranks 0
printf 'source: {store: data/source}\ntarget: {store: data/target}\noutput: {dir: inf-out}\nfit: {lambda: .inf}\n' > inf.yaml
check 2 "inf.yaml:4: fit.lambda: expected a finite number" inf.yaml
[ -e inf-out ] && die "a refused config must create nothing"
# Two jobs writing the same output folder: the second is refused.
printf 'source: {store: data/source}\ntarget: {store: data/target}\noutput: {dir: shared-out}\nfit: {k: [1]}\n' > lock.yaml
mkdir -p shared-out && exec 9> shared-out/.crosskv-fit.lock && flock -n 9 && echo "pid 4242 on otherhost" >&9
check 2 "is in use by another crosskv-fit (pid 4242 on otherhost)" lock.yaml
exec 9>&-
"$FIT" lock.yaml > /dev/null || die "the folder must be usable once the other job has ended"
echo "bad inputs OK"
