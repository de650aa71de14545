#!/usr/bin/env bash
# The layers include only themselves and the layers below them (the build's layer checks catch calls; this catches
# headers). The programs (apps/) sit on top; the Python extension (python/src) on the serving layers alone.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SERVING="core backends backends/host backends/cuda artifact serve"
declare -A allowed=(
  [core]="core" [backends]="core backends" [backends/host]="core backends" [backends/cuda]="core backends"
  [backends/cuda/emulation]="core backends cuda_runtime.h cuda_fp16.h cublas_v2.h cusolverDn.h nccl.h" [artifact]="core artifact"
  [serve]="core artifact serve" [runtime]="core runtime" [io]="core runtime io"
  [eval]="core runtime io artifact serve eval" [fit]="core runtime io artifact serve eval fit"
  [tools]="core runtime io tools" [apps]="core backends runtime io artifact serve eval fit tools apps"
  [python/src]="$SERVING")
bad=0
for layer in "${!allowed[@]}"; do
  for f in "$ROOT/$layer"/*.{hpp,cpp,cu}; do
    [ -e "$f" ] || continue
    while IFS= read -r inc; do
      dir=${inc%%/*}
      [[ " ${allowed[$layer]} " == *" $dir "* ]] && continue
      echo "FAIL: $layer/$(basename "$f") includes \"$inc\" (layer $dir is not below $layer)"; bad=1
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
  done
done
# The serving layers include none of the fitting side's libraries (spdlog and CLI11 headers sit on the default
# include path, so the build alone would not notice).
for layer in $SERVING python/src; do
  for f in "$ROOT/$layer"/*.{hpp,cpp,cu}; do
    [ -e "$f" ] || continue
    if hit=$(grep -nE '^#include <(mpi\.h|hdf5|H5[A-Za-z]*\.h|yaml-cpp/|spdlog/|fmt/|CLI/)' "$f"); then
      echo "FAIL: $layer/$(basename "$f") is on the serving side but includes ${hit#*:}"; bad=1
    fi
  done
done
# Every folder of C++ sources is a layer above.
for d in "$ROOT"/*/; do
  d=$(basename "$d")
  case "$d" in build*|tests|bench|fuzz|cmake|docs|examples|scripts|configs|slurm|python|.*) continue ;; esac
  ls "$ROOT/$d"/*.{hpp,cpp,cu} > /dev/null 2>&1 || continue
  [ -n "${allowed[$d]+x}" ] || { echo "FAIL: $d/ holds C++ sources but is not a layer in tests/cli/layering.sh"; bad=1; }
done
[ $bad = 0 ] && echo "layering OK: ${!allowed[*]}"
exit $bad
