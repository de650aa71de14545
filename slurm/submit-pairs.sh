#!/usr/bin/env bash
# Submits one array job over a list of pair configs (one path per line), at most M tasks at once.
# Usage: slurm/submit-pairs.sh PAIRS.txt [M [SBATCH OPTIONS...]]   Then: python3 slurm/check-pairs.py PAIRS.txt
set -euo pipefail
PAIRS=$(readlink -f "${1:?usage: submit-pairs.sh PAIRS.txt [max parallel]}")
M=${2:-4}
shift $(( $# >= 2 ? 2 : 1 ))
N=$(grep -c . "$PAIRS")
[ "$N" -gt 0 ] || { echo "submit-pairs: $PAIRS lists no configs" >&2; exit 2; }
exec sbatch --array=0-$((N - 1))%"$M" --export=ALL,CROSSKV_PAIRS="$PAIRS" "$@" "$(dirname "$0")/fit-pair.sbatch"
