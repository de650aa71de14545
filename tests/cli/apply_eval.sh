#!/usr/bin/env bash
# crosskv-apply and crosskv-eval as a user runs them: held-out tokens, the numpy reference of apply, the report,
# the baselines, and bad inputs (one line on stderr, exit 2).
source "$(dirname "$0")/common.sh"
[ -n "${PYTHON:-}" ] || { echo "SKIPPED: no Python with numpy and h5py"; exit 77; }
APPLY=${CROSSKV_APPLY:?} EVAL=${CROSSKV_EVAL:?}
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
SYN=(--shards 2 --sequences 2 --seq-len 128 --with-queries --target-rope yarn --target-rope-convention interleaved)
"$SYNTH" --out cal "${SYN[@]}" > /dev/null
"$SYNTH" --out held "${SYN[@]:2}" --shards 1 --domains heldout --data-seed 77 > /dev/null
printf 'source: {store: cal/source}\ntarget: {store: cal/target}\nfit: {k: [2, all], dtype: %s, structure: [cross_head, per_head]}\noutput: {dir: out-%s}\n' fp32 fp32 > f32.yaml
printf 'source: {store: cal/source}\ntarget: {store: cal/target}\nfit: {k: [2], dtype: %s}\noutput: {dir: out-%s}\n' bf16 bf16 > b16.yaml
"$FIT" f32.yaml > fit.log 2>&1 || { cat fit.log; die "fit failed"; }
"$FIT" b16.yaml > fit.log 2>&1 || { cat fit.log; die "bf16 fit failed"; }
SRC=held/source/heldout/shard-000.h5 TGT=held/target/heldout/shard-000.h5

# Apply, and the numpy reference of apply on the same artifact: the same keys (post target-RoPE) and values.
for a in out-fp32/k2 out-fp32/k2-per_head out-bf16/k2; do
  "$APPLY" --mapper $a --source $SRC --out mapped.h5 > apply.log 2>&1 || { cat apply.log; die "crosskv-apply $a failed"; }
  "$PYTHON" "$ROOT/tools/crosskv_apply.py" --mapper $a --source $SRC --out ref.npz || die "the numpy reference failed"
  "$PYTHON" - <<'PY' || die "crosskv-apply and the numpy reference disagree on $a"
import h5py, json, numpy as np
f = h5py.File("mapped.h5")
r = np.load("ref.npz")
assert json.loads(f.attrs["kv_spec"])["n_layers"] == r["keys"].shape[1]
for name in ("keys", "values"):
    a = f[name][()].astype(np.float64)
    b = r[name].astype(np.float64)
    d = np.abs(a - b).max() / max(1.0, np.abs(b).max())
    print(f"{name}: max relative difference {d:.2e}")
    assert d < 1e-4, d
assert (f["positions"][()] == r["positions"]).all()
PY
done

# Eval: the documented keys (docs/FORMATS.md), the baselines catching the missing target RoPE, and a report.
"$EVAL" --mapper out-fp32/k2 --source $SRC --target $TGT --json eval.json --html report.html > eval.log 2>&1 \
  || { cat eval.log; die "crosskv-eval failed"; }
expect_in "verdict:" eval.log
"$PYTHON" - <<'PY' || die "eval.json is not as docs/FORMATS.md says"
import json
j = json.load(open("eval.json"))
for k in ("r2_k", "r2_v", "attention_cosine", "k_concentration", "v_concentration", "layers"):
    assert k in j, k
assert len(j["layers"]) == 12 and all("attention_cosine" in l for l in j["layers"])
b = j["baselines"]
assert b["no_target_rope"]["r2_k"] < j["r2_k"] - 0.3, (b["no_target_rope"]["r2_k"], j["r2_k"])
assert b["no_target_rope"]["attention_cosine"] < j["attention_cosine"], "the missing RoPE must show"
assert abs(b["mean_only"]["r2_k"]) < 0.05 and b["mean_only"]["attention_cosine"] < j["attention_cosine"]
print("eval:", {k: round(j[k], 3) for k in ("r2_k", "r2_v", "attention_cosine", "k_concentration", "v_concentration")})
PY
# Under mpirun the target layers are shared out over the ranks: the same figures, one verdict line, no colours.
if [ -n "${MPIEXEC:-}" ]; then
  $MPIEXEC -np 3 "$EVAL" --mapper out-fp32/k2 --source $SRC --target $TGT --json eval3.json > eval3.log 2>&1 \
    || { cat eval3.log; die "crosskv-eval under mpiexec -np 3 failed"; }
  [ "$(grep -c "verdict:" eval3.log)" = 1 ] || { cat eval3.log; die "one verdict line under mpiexec"; }
  ! grep -q $'\e\[' eval3.log || die "crosskv-eval's log under mpiexec carries ANSI escape codes"
  "$PYTHON" - <<'PY' || die "crosskv-eval -np 3 differs from -np 1"
import json
a, b = json.load(open("eval.json")), json.load(open("eval3.json"))
for k in ("r2_k", "r2_v", "attention_cosine", "k_concentration", "v_concentration"):
    assert abs(a[k] - b[k]) <= 1e-6 * max(1, abs(a[k])), (k, a[k], b[k])
assert [l["layer"] for l in b["layers"]] == list(range(12))
assert a["verdict"] == b["verdict"]
PY
fi
grep -q "Verdict:" report.html && grep -q "<svg" report.html && grep -q "Probe R" report.html \
  || die "report.html lacks the verdict, the charts or the R² heatmaps"

# A mapper applied without the target RoPE, evaluated as if it were right: --require-ok fails it.
"$APPLY" --mapper out-fp32/k2 --source $SRC --out norope.h5 --no-target-rope > /dev/null 2>&1 || die "--no-target-rope failed"

# Bad inputs: one line on stderr naming the file and the problem, exit 2.
bad() {  # bad EXPECTED-TEXT COMMAND...
  local want=$1; shift
  set +e; "$@" > out.log 2> err.log; local rc=$?; set -e
  [ "$rc" = 2 ] || { cat out.log err.log; die "expected exit 2 from $*, got $rc"; }
  [ "$(wc -l < err.log)" = 1 ] || { cat err.log; die "expected one line on stderr from $*"; }
  grep -qF -- "$want" err.log || { cat err.log; die "expected '$want' from $*"; }
}
bad "kv_spec does not match the mapper's source" "$APPLY" --mapper out-fp32/k2 --source $TGT --out x.h5
bad "manifest.json: missing" "$APPLY" --mapper nowhere --source $SRC --out x.h5
cp -r out-fp32/k2 broken && truncate -s -4 broken/layer-005.safetensors
bad "layer-005.safetensors: SHA-256 does not match" "$APPLY" --mapper broken --source $SRC --out x.h5
bad "$SRC: kv_spec does not match the mapper's target" "$EVAL" --mapper out-fp32/k2 --source $SRC --target $SRC --json x.json
# --out must not be an input: the source shard is left as it was.
cp $SRC src-copy.h5
bad "--out: $SRC is the --source shard" "$APPLY" --mapper out-fp32/k2 --source $SRC --out $SRC
bad "is the --source shard" "$APPLY" --mapper out-fp32/k2 --source $SRC --out ./held/source/../source/heldout/shard-000.h5
cmp -s $SRC src-copy.h5 || die "crosskv-apply overwrote its --source"
# A manifest edited by hand is validated like a shard; mapped values that are not finite are refused by layer and token.
cp -r out-fp32/k2 edited
"$PYTHON" -c 'import json,sys; p=sys.argv[1]; m=json.load(open(p)); m["target"]["kv_spec"]["rope"]["theta"]=0; json.dump(m,open(p,"w"))' edited/manifest.json
bad "kv_spec.rope.theta must be a finite number > 1" "$APPLY" --mapper edited --source $SRC --out x.h5
cp $SRC nan.h5
"$PYTHON" -c 'import h5py,sys; f=h5py.File(sys.argv[1],"r+"); v=f["values"]; x=v[5]; x[...]=float("inf"); v[5]=x' nan.h5
bad "are not finite at token 5" "$APPLY" --mapper out-fp32/k2 --source nan.h5 --out x.h5
# Usage errors: one line, exit 2, whichever tool.
bad "--nope" "$APPLY" --mapper out-fp32/k2 --source $SRC --out x.h5 --nope
bad "--device" "$APPLY" --mapper out-fp32/k2 --source $SRC --out x.h5 --device tpu
bad "--json" "$EVAL" --mapper out-fp32/k2 --source $SRC --target $TGT
bad "--out" "$SYNTH"
bad "--relation: expected family, linear, per_head or nonlinear, got \"quadratic\"" "$SYNTH" --out x-synth --relation quadratic
bad "--bogus" "$(dirname "$APPLY")/crosskv-strip" --shard $SRC --out y.h5 --bogus
[ -z "$(ls x.h5* x.json* 2> /dev/null)" ] || die "a failed command must not leave an output behind: $(ls x.h5* x.json*)"
# A fit that names held-out shards leaves them out and diagnoses every k on them: eval-k<K>.json, report.html.
for side in source target; do mkdir -p cal/$side/heldout && cp held/$side/heldout/shard-000.h5 cal/$side/heldout/; done
printf 'source: {store: cal/source}\ntarget: {store: cal/target}\nfit: {k: [1, all]}\noutput: {dir: out-eval}\neval: {shards: [heldout/shard-000.h5]}\n' > ev.yaml
"$FIT" --plan ev.yaml > plan.log 2>&1 || { cat plan.log; die "--plan with eval.shards failed"; }
grep -Eq "held-out eval \(every k\): [0-9]+ held-out tokens, 12 target layer\(s\) per rank, at most .* in memory, .* GFLOP" plan.log \
  || { cat plan.log; die "--plan must print the eval's memory and flops"; }
"$FIT" ev.yaml > ev.log 2>&1 || { cat ev.log; die "fit with eval.shards failed"; }
expect_in "held-out kall" ev.log
[ -f out-eval/eval-k1.json ] && [ -f out-eval/eval-kall.json ] && grep -q "Probe R" out-eval/report.html \
  || die "the fit did not write eval-k*.json and report.html"
grep -q heldout out-eval/kall/manifest.json && die "a held-out shard was used for the fit"
# With ranks, the eval's target layers are shared out; every k's figures are the same as with one.
if [ -n "${MPIEXEC:-}" ]; then
  sed 's/out-eval/out-eval2/' ev.yaml > ev2r.yaml
  $MPIEXEC -np 2 "$FIT" ev2r.yaml > ev2r.log 2>&1 || { cat ev2r.log; die "fit with eval.shards under mpiexec -np 2 failed"; }
  "$PYTHON" - <<'PY' || die "the eval under -np 2 differs from -np 1"
import json
for k in ("k1", "kall"):
    a, b = json.load(open(f"out-eval/eval-{k}.json")), json.load(open(f"out-eval2/eval-{k}.json"))
    for f in ("r2_k", "r2_v", "attention_cosine"):
        assert abs(a[f] - b[f]) <= 1e-4, (k, f, a[f], b[f])  # -np 2 fits its mappers from moments summed in another order
PY
fi
printf 'source: {store: cal/source}\ntarget: {store: cal/target}\noutput: {dir: o}\neval: {shards: [heldout/nope.h5]}\n' > ev2.yaml
set +e; "$FIT" ev2.yaml > /dev/null 2> err.log; rc=$?; set -e
[ "$rc" = 2 ] && grep -q 'eval.shards: "heldout/nope.h5" is not a shard of both' err.log || { cat err.log; die "a missing eval shard must be refused"; }
echo "apply + eval OK"
