#!/usr/bin/env bash
# The layers include only themselves and the layers below them (the build's layer checks catch calls; this catches
# headers). Programs (main_*.cpp) sit on top and may include any layer.
set -euo pipefail
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
declare -A allowed=(
  [core]="core" [backends]="core backends" [cuda]="core backends cuda" [io]="core io" [apply]="core io apply"
  [stages]="core io apply stages" [pipeline]="core io apply stages pipeline" [tools]="core io tools")
bad=0
for layer in "${!allowed[@]}"; do
  for f in "$ROOT/$layer"/*.{hpp,cpp,cu}; do
    [ -e "$f" ] || continue
    case "$(basename "$f")" in main_*) continue ;; esac
    while IFS= read -r inc; do
      dir=${inc%%/*}
      [[ " ${allowed[$layer]} " == *" $dir "* ]] && continue
      echo "FAIL: $layer/$(basename "$f") includes \"$inc\" (layer $dir is not below $layer)"; bad=1
    done < <(sed -n 's/^#include "\([^"]*\)".*/\1/p' "$f")
  done
done
[ $bad = 0 ] && echo "layering OK: ${!allowed[*]}"
exit $bad
