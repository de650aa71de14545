#!/usr/bin/env bash
# The verdict from the retention predictor as a user meets it: eval-k*.json's predicted share and its
# interval, eval.min_retention / --min-retention deciding the verdict, and (with `chromium`) the report's new line
# as headless Chromium renders it, with a screenshot.
#   retention_report.sh WORKDIR json      the JSON and the threshold (needs python3)
#   retention_report.sh WORKDIR chromium  the report in headless Chromium (skips without chromium)
source "$(dirname "$0")/common.sh"
MODE=${2:?json or chromium}
EVAL=${CROSSKV_EVAL:?}
if [ "$MODE" = chromium ]; then
  CHROMIUM=$(command -v chromium || command -v chromium-browser || true)
  [ -n "$CHROMIUM" ] || { echo "SKIPPED: no chromium (Debian's chromium; scripts/setup.sh installs it)"; exit 77; }
fi
SYN=(--shards 2 --sequences 2 --seq-len 128 --with-queries)
"$SYNTH" --out cal "${SYN[@]}" > /dev/null
"$SYNTH" --out held "${SYN[@]:2}" --shards 1 --domains heldout --data-seed 77 > /dev/null
mkdir -p cal/source/heldout cal/target/heldout
cp held/source/heldout/shard-000.h5 cal/source/heldout/ && cp held/target/heldout/shard-000.h5 cal/target/heldout/
cat > fit.yaml <<'YAML'
source: {store: cal/source}
target: {store: cal/target}
fit: {k: [1, all]}
output: {dir: out}
eval: {shards: [heldout/shard-000.h5], min_retention: 0.8}
YAML
"$FIT" fit.yaml > fit.log 2>&1 || { cat fit.log; die "crosskv-fit failed"; }
# The predictor's target names the figure: "recovered share" or "content share" (crosskv-eval --print-retention-model).
NAME=$("$EVAL" --print-retention-model | python3 -c "import json, sys
print({'content_share': 'content share'}.get(json.load(sys.stdin).get('target'), 'recovered share'))")
expect_in "predicted $NAME" fit.log
[ -f out/report.html ] || die "no out/report.html"

if [ "$MODE" = json ]; then
  SRC=held/source/heldout/shard-000.h5 TGT=held/target/heldout/shard-000.h5
  NAME="$NAME" python3 - <<'PY' || die "eval-k*.json's predicted_retention is not as docs/FORMATS.md says"
import json, os
for k in ("k1", "kall"):
    e = json.load(open(f"out/eval-{k}.json"))
    p = e["predicted_retention"]
    assert p["low"] <= p["share"] <= p["high"] <= 1.0, p
    assert p["min_retention"] == 0.8 and 0 < p["coverage"] < 1 and p["loso_mae"] > 0, p
    assert "a real pair may differ" in p["calibrated_on"], p
    assert e["verdict"].startswith("LIKELY TO TRANSFER" if p["share"] >= 0.8 else "NOT READY"), e["verdict"]
    assert f"predicted {os.environ['NAME']}" in e["verdict"] and "needs >= 80%" in e["verdict"], e["verdict"]
    assert p["target"] in ("recovered", "content_share"), p
    assert e["ok"] == e["verdict"].startswith("LIKELY TO TRANSFER") == (e["verdict_class"] == "likely"), e
    assert e["verdict_class"] in ("likely", "not_ready"), e  # with queries: never uncertain
    open(f"share-{k}", "w").write(str(p["share"]))
PY
  # The threshold is the setting: just below the predicted share passes, just above it does not.
  share=$(cat share-kall)
  below=$(python3 -c "print(max(0.01, $share - 0.01))") above=$(python3 -c "print(min(1.0, $share + 0.01))")
  "$EVAL" --mapper out/kall --source $SRC --target $TGT --json lo.json --min-retention "$below" --require-ok \
    > lo.log 2>&1 || { cat lo.log; die "--min-retention $below (below the predicted $share) should pass"; }
  if python3 -c "import sys; sys.exit(0 if $share < 1.0 else 1)"; then
    set +e; "$EVAL" --mapper out/kall --source $SRC --target $TGT --json hi.json --min-retention "$above" --require-ok \
      > hi.log 2>&1; rc=$?; set -e
    [ "$rc" = 4 ] || { cat hi.log; die "--min-retention $above (above the predicted $share): exit $rc, expected 4"; }
    expect_in "NOT READY: predicted $NAME" hi.log
  fi
  # A share outside (0, 1] is refused by key.
  printf 'source: {store: cal/source}\ntarget: {store: cal/target}\nfit: {k: [1]}\noutput: {dir: bad}\neval: {min_retention: 1.5}\n' > bad.yaml
  set +e; "$FIT" bad.yaml > bad.log 2>&1; rc=$?; set -e
  [ "$rc" = 2 ] || { cat bad.log; die "eval.min_retention: 1.5 should be refused (exit 2), got $rc"; }
  expect_in "eval.min_retention" bad.log
  "$EVAL" --print-retention-model > model.json
  python3 -c "import json; m = json.load(open('model.json')); assert m['coefficients'] and m['half_width'] > 0, m"
  # A refit reaches the program without a rebuild: the same mapper, a predictor file with its intercept raised by
  # 0.05, predicts 0.05 more (CROSSKV_RETENTION_MODEL; capped at 1).
  python3 -c "import json
d = json.load(open(json.load(open('model.json'))['file'])); d['model']['intercept'] += 0.05
json.dump(d, open('refit.json', 'w'))"
  CROSSKV_RETENTION_MODEL=$PWD/refit.json "$EVAL" --mapper out/kall --source $SRC --target $TGT --json refit-eval.json \
    > refit.log 2>&1 || { cat refit.log; die "crosskv-eval with CROSSKV_RETENTION_MODEL=refit.json failed"; }
  python3 -c "import json
a = json.load(open('lo.json'))['predicted_retention']['share']; b = json.load(open('refit-eval.json'))['predicted_retention']['share']
assert abs(b - min(a + 0.05, 1.0)) < 1e-9, (a, b)" || die "the refit predictor file did not change crosskv-eval's prediction"
  # A broken predictor file stops the fit before it starts, naming the file.
  echo '{"format": "crosskv-retention-calibration", "version": 1}' > broken.json
  set +e; CROSSKV_RETENTION_MODEL=$PWD/broken.json "$FIT" fit.yaml > broken.log 2>&1; rc=$?; set -e
  [ "$rc" = 2 ] || { cat broken.log; die "a broken CROSSKV_RETENTION_MODEL should stop crosskv-fit (exit 2), got $rc"; }
  expect_in "broken.json: model: expected an object" broken.log
  grep -q "moments" broken.log && { cat broken.log; die "crosskv-fit started fitting before it read the predictor"; }
  echo "retention verdict OK"
  exit 0
fi

# Headless Chromium: the rendered page (the DOM after layout) has the new line, and a screenshot of it is made.
REPORT="file://$PWD/out/report.html"
CHROME=(--headless --no-sandbox --disable-gpu --hide-scrollbars --no-first-run --user-data-dir="$PWD/chrome-profile")
timeout 120 "$CHROMIUM" "${CHROME[@]}" --dump-dom "$REPORT" > dom.html 2> chrome.err || { cat chrome.err; die "chromium --dump-dom failed"; }
expect_in "Predicted $NAME:" dom.html
expect_in "<th>predicted $NAME</th>" dom.html
expect_in "eval.min_retention" dom.html
timeout 120 "$CHROMIUM" "${CHROME[@]}" --window-size=1280,2000 --screenshot="$PWD/report.png" "$REPORT" \
  > /dev/null 2>> chrome.err || { cat chrome.err; die "chromium --screenshot failed"; }
[ "$(stat -c %s report.png)" -gt 20000 ] || die "report.png is too small to show the report"
echo "report in headless Chromium OK: $PWD/report.png"
