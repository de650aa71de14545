# Shared by the command-line tests: fail loudly, with the command's output.
set -euo pipefail
WORK=${1:?usage: $0 WORKDIR}
rm -rf "$WORK" && mkdir -p "$WORK"
cd "$WORK"
FIT=${CROSSKV_FIT:?} SYNTH=${CROSSKV_SYNTH:?}
die() { echo "FAIL: $*" >&2; exit 1; }
expect_in() { grep -qF -- "$1" "$2" || { cat "$2"; die "expected '$1' in $2"; }; }
