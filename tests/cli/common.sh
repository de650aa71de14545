# Shared by the command-line tests: fail loudly, with the command's output.
set -euo pipefail
WORK=${1:?usage: $0 WORKDIR}
rm -rf "$WORK" && mkdir -p "$WORK"
cd "$WORK"
FIT=${CROSSKV_FIT:?} SYNTH=${CROSSKV_SYNTH:?}
die() { echo "FAIL: $*" >&2; exit 1; }
expect_in() { grep -qF -- "$1" "$2" || { cat "$2"; die "expected '$1' in $2"; }; }
run() { "$FIT" "$@" > run.log 2> run.err; }  # crosskv-fit ARGS: its log in run.log, its errors in run.err
# expect_fault RC FAULT CONFIG: crosskv-fit CONFIG with CROSSKV_FAULT=FAULT ends with exit status RC.
expect_fault() {
  local rc
  set +e; CROSSKV_FAULT=$2 "$FIT" "$3" > run.log 2> run.err; rc=$?; set -e
  [ "$rc" = "$1" ] || { cat run.log run.err; die "$3 with CROSSKV_FAULT=$2: exit $rc, expected $1"; }
}
# same_layers DIR_A DIR_B K...: every layer file of DIR_A/K is in DIR_B/K, byte for byte.
same_layers() {
  local a=$1 b=$2 k f
  shift 2
  for k in "$@"; do
    for f in "$a/$k"/layer-*.safetensors; do
      cmp -s "$f" "$b/$k/$(basename "$f")" || die "$b/$k/$(basename "$f") differs from $a/$k/$(basename "$f")"
    done
  done
}
# same_manifest_layers DIR_A DIR_B K...: the manifests of DIR_A/K and DIR_B/K have equal layer entries.
same_manifest_layers() {
  local a=$1 b=$2 k
  shift 2
  for k in "$@"; do
    python3 -c 'import json,sys; a,b=(json.load(open(p))["layers"] for p in sys.argv[1:]); sys.exit(a!=b)' \
      "$a/$k/manifest.json" "$b/$k/manifest.json" || die "$b/$k/manifest.json: layer entries differ from $a's"
  done
}
