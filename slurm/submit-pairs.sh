#!/usr/bin/env bash
# Fits only: one array job over a list of pair configs (one path per line), at most M tasks at once.
#   slurm/submit-pairs.sh PAIRS.txt [M [SBATCH OPTIONS...]]          Then: python3 slurm/check-pairs.py PAIRS.txt
# Capture, then fit: with CROSSKV_CAPTURE_PARTS=N, each line is CONFIG.yaml SOURCE_MODEL TARGET_MODEL TEXT [capture
# args]; each pair's capture is an array of N parts (capture-pair.sbatch, at most M at once), and its fit
# (fit-pair.sbatch) starts when every part of its capture has succeeded (--dependency=afterok).
#   CROSSKV_CAPTURE_PARTS=8 slurm/submit-pairs.sh CAPTURES.txt [M [SBATCH OPTIONS...]]
#   Then: python3 slurm/check-pairs.py --stores CAPTURES.txt (the stores pair up), python3 slurm/check-pairs.py CAPTURES.txt
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
PAIRS=$(readlink -f "${1:?usage: submit-pairs.sh PAIRS.txt [max parallel]}")
M=${2:-4}
shift $(( $# >= 2 ? 2 : 1 ))
N=$(grep -c . "$PAIRS" || true)
[ "$N" -gt 0 ] || { echo "submit-pairs: $PAIRS lists no configs" >&2; exit 2; }
if [ -z "${CROSSKV_CAPTURE_PARTS:-}" ]; then
  exec sbatch --array=0-$((N - 1))%"$M" --export=ALL,CROSSKV_PAIRS="$PAIRS" "$@" "$HERE/fit-pair.sbatch"
fi
PARTS=$CROSSKV_CAPTURE_PARTS
[[ "$PARTS" =~ ^[1-9][0-9]*$ ]] || { echo "submit-pairs: CROSSKV_CAPTURE_PARTS=$PARTS: expected a count of parts >= 1" >&2; exit 2; }
export CROSSKV_CAPTURE=${CROSSKV_CAPTURE:-$(cd "$HERE/.." && pwd)/tools/capture/crosskv-capture}
while read -r config source target text args; do
  [ -n "${config:-}" ] || continue
  [ -n "${text:-}" ] || { echo "submit-pairs: $PAIRS: '$config $source $target': expected CONFIG SOURCE TARGET TEXT [args]" >&2; exit 2; }
  # shellcheck disable=SC2086  # the capture arguments are words
  cap=$(sbatch --parsable --array=0-$((PARTS - 1))%"$M" --export=ALL "$@" "$HERE/capture-pair.sbatch" \
        "$config" "$source" "$target" "$text" ${args:-})
  fit=$(sbatch --parsable --dependency=afterok:"${cap%%;*}" --export=ALL "$@" "$HERE/fit-pair.sbatch" "$config")
  echo "$config: capture ${cap%%;*} (${PARTS} parts), fit $fit after it"
done < "$PAIRS"
