#!/usr/bin/env python3
"""The retention predictor behind crosskv's verdict: which held-out diagnostics predict the share of the
prefix's benefit a mapper keeps (the family studies' perplexity protocol, docs/RESULTS.md), and a small monotone
predictor of it, validated leaving one study out. Pure Python (no numpy): it runs in the tests.

    python3 tools/family/calibrate.py fit WORK/studies.json --out docs/retention-calibration.json
    python3 tools/family/calibrate.py check docs/retention-calibration.json [--binary build/crosskv-eval]
    python3 tools/family/calibrate.py self-test docs/retention-calibration.json --binary build/crosskv-eval

`fit` pairs every measured mapper's diagnostics with its recovered share, prints the correlations (with 95% Fisher
intervals) beside the paper's, fits each candidate predictor, validates each leaving one study out, and keeps the
one with the smallest held-out error (fewer features win within half a point of it). The programs read the file
at run time (CROSSKV_RETENTION_MODEL=FILE, else the one configured at build time: this repository's
docs/retention-calibration.json), so a refit reaches them without a rebuild. `check` refits from the rows stored in
the file and fails unless the stored model is that refit, and, given crosskv-eval, unless the program reads that
model from the file (`--print-retention-model`). `self-test` plants a changed coefficient and a changed row and
proves that `check` catches each, and that crosskv-eval reads a changed file without a rebuild.
"""
import argparse
import json
import math
import os
import subprocess
import sys
import tempfile

# Features: name -> (how to read it from a row, the sign its coefficient must have: the predictor is monotone).
FEATURES = {
    "attention_cosine": (lambda r: r["attention_cosine"], +1),
    "cosine_margin": (lambda r: (r["attention_cosine"] - r["mean_only_cosine"]) / (1.0 - r["mean_only_cosine"]), +1),
    "r2_mean": (lambda r: 0.5 * (r["r2_k"] + r["r2_v"]), +1),
    "k_concentration": (lambda r: r["k_concentration"], -1),
}
CANDIDATES = [["attention_cosine"], ["cosine_margin"], ["r2_mean"], ["attention_cosine", "r2_mean"],
              ["cosine_margin", "r2_mean"], ["attention_cosine", "k_concentration"]]
COVERAGE = 0.9  # the interval: this quantile of the held-out absolute errors
# The paper's correlations with accuracy retention: held-out attention cosine, and calibration (in-sample) R².
PAPER = {"attention_cosine": 0.57, "r2_in_sample": -0.20}


def rows_of(studies):
    """Every distinct mapper the studies measured: (study, label, figures, recovered). A mapper measured in two
    studies (the structure fit is also the λ = 0.01, 100% size and uniform-weighting row) is kept once, in the first."""
    groups = [("structure", {"": studies["structure"]})]
    groups.append(("lambda", {f"lambda {k}": v for k, v in studies["lambda"].items()}))
    groups.append(("direction", {"large->small": studies["direction"]["large->small"]}))
    groups.append(("size", {f"size {k}": v for k, v in studies["size"].items()}))
    groups.append(("domain", {k: v for k, v in studies["domain"].items()}))
    if "weighting" in studies:
        groups.append(("weighting", {f"weighting {k}": v for k, v in studies["weighting"].items()}))
    if "mlp" in studies:
        groups.append(("mlp", {"mapper auto": studies["mlp"]}))
    seen, out = set(), []
    for study, tables in groups:
        for name, table in tables.items():
            for r in table:
                if r.get("attention_cosine") is None:
                    continue
                key = (r["recovered"], r["r2_k"], r["r2_v"], r["attention_cosine"])
                if key in seen:
                    continue
                seen.add(key)
                out.append({"study": study, "label": f"{name} k={r['k']} {r['structure']}".strip(),
                            "recovered": r["recovered"],
                            **{t: r[t][0] for t in ("content_share", "choice_retention", "recall_retention")
                               if t in r},
                            **{x: r[x] for x in ("r2_k", "r2_v", "attention_cosine", "mean_only_cosine",
                                                 "k_concentration", "v_concentration", "r2_in_sample")
                               if x in r}})
    return out


def pearson(x, y):
    n = len(x)
    mx, my = sum(x) / n, sum(y) / n
    sxy = sum((a - mx) * (b - my) for a, b in zip(x, y))
    sxx = sum((a - mx) ** 2 for a in x)
    syy = sum((b - my) ** 2 for b in y)
    r = sxy / math.sqrt(sxx * syy)
    z, se = math.atanh(max(min(r, 0.999999), -0.999999)), 1.0 / math.sqrt(n - 3)
    return r, math.tanh(z - 1.96 * se), math.tanh(z + 1.96 * se)


def ranks(v):
    order = sorted(range(len(v)), key=lambda i: v[i])
    r = [0.0] * len(v)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and v[order[j + 1]] == v[order[i]]:
            j += 1
        for t in range(i, j + 1):
            r[order[t]] = (i + j) / 2.0
        i = j + 1
    return r


def solve(A, b):
    """A x = b by Gauss-Jordan with partial pivoting (A small, square)."""
    n = len(A)
    M = [list(A[i]) + [b[i]] for i in range(n)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(M[r][c]))
        M[c], M[p] = M[p], M[c]
        if abs(M[c][c]) < 1e-300:
            raise ValueError("singular system")
        for r in range(n):
            if r != c:
                f = M[r][c] / M[c][c]
                M[r] = [a - f * d for a, d in zip(M[r], M[c])]
    return [M[i][n] / M[i][i] for i in range(n)]


TARGETS = ("recovered", "content_share", "choice_retention")  # what a predictor may predict (`fit --target`)


def least_squares(rows, features, target):
    """target ~ intercept + Σ coef·feature, each coefficient of its feature's sign (a feature whose coefficient
    would take the wrong sign is dropped: the predictor stays monotone). Returns (intercept, {feature: coef})."""
    feats = list(features)
    while True:
        X = [[1.0] + [FEATURES[f][0](r) for f in feats] for r in rows]
        y = [r[target] for r in rows]
        p = len(feats) + 1
        A = [[sum(x[i] * x[j] for x in X) for j in range(p)] for i in range(p)]
        b = [sum(x[i] * t for x, t in zip(X, y)) for i in range(p)]
        coef = solve(A, b)
        wrong = [f for f, c in zip(feats, coef[1:]) if c * FEATURES[f][1] < 0]
        if not wrong:
            return coef[0], dict(zip(feats, coef[1:]))
        feats.remove(wrong[0])


def predict(model, r):
    a, coefs = model
    return min(1.0, a + sum(c * FEATURES[f][0](r) for f, c in coefs.items()))


def quantile(v, q):
    s = sorted(v)
    i = q * (len(s) - 1)
    lo = int(math.floor(i))
    return s[lo] + (s[min(lo + 1, len(s) - 1)] - s[lo]) * (i - lo)


def leave_one_study_out(rows, features, target):
    """Each study held out in turn: fitted on the others, its mappers predicted. Per study MAE, and every residual."""
    per, residuals = {}, []
    for s in sorted({r["study"] for r in rows}):
        model = least_squares([r for r in rows if r["study"] != s], features, target)
        res = [r[target] - predict(model, r) for r in rows if r["study"] == s]
        per[s] = {"mappers": len(res), "mae": sum(abs(e) for e in res) / len(res),
                  "bias": sum(res) / len(res)}
        residuals += res
    return per, residuals


SIMPLER_WITHIN = 0.005  # a candidate with fewer features wins when its held-out MAE is within half a point


def chosen(cands):
    """The candidate kept: the fewest features among those within SIMPLER_WITHIN of the best held-out MAE (a second
    feature must earn its place held out), then the smallest held-out MAE."""
    best = min(c["loso_mae"] for c in cands)
    near = [c for c in cands if c["loso_mae"] <= best + SIMPLER_WITHIN]
    return min(near, key=lambda c: (len(c["kept"]), c["loso_mae"]))


def calibrate(rows, target="recovered"):
    y = [r[target] for r in rows]
    corr = {}
    for f in list(FEATURES) + ["r2_k", "r2_v", "v_concentration", "r2_in_sample"]:
        if any(f not in FEATURES and f not in r for r in rows):
            continue
        x = [FEATURES[f][0](r) if f in FEATURES else r[f] for r in rows]
        r, lo, hi = pearson(x, y)
        rho = pearson(ranks(x), ranks(y))[0]
        corr[f] = {"pearson": r, "low": lo, "high": hi, "spearman": rho}
    cands = []
    for feats in CANDIDATES:
        a, coefs = least_squares(rows, feats, target)
        per, res = leave_one_study_out(rows, feats, target)
        cands.append({"features": feats, "kept": list(coefs), "intercept": a, "coefficients": coefs,
                      "loso_mae": sum(abs(e) for e in res) / len(res), "loso_by_study": per,
                      "half_width": quantile([abs(e) for e in res], COVERAGE),
                      "in_sample_mae": sum(abs(r[target] - predict((a, coefs), r)) for r in rows) / len(rows)})
    best = chosen(cands)
    # Where the calibration has data: a mapper outside these ranges is an extrapolation (the verdict says so).
    ranges = {f: [min(r[f] for r in rows), max(r[f] for r in rows)] for f in ("attention_cosine", "mean_only_cosine")}
    model = {"intercept": best["intercept"], "coefficients": best["coefficients"], "half_width": best["half_width"],
             "coverage": COVERAGE, "loso_mae": best["loso_mae"], "mappers": len(rows), "ranges": ranges,
             "studies": sorted({r["study"] for r in rows}), "target": target}
    return {"correlations": corr, "paper": PAPER, "candidates": cands, "model": model}


def rounded(x, digits=6):
    if isinstance(x, float):
        return round(x, digits)
    if isinstance(x, dict):
        return {k: rounded(v, digits) for k, v in x.items()}
    if isinstance(x, list):
        return [rounded(v, digits) for v in x]
    return x


def markdown(cal, rows):
    f = lambda x: f"{x:+.2f}"  # noqa: E731
    lines = [f"{len(rows)} mappers, {len(cal['model']['studies'])} studies ({', '.join(cal['model']['studies'])})", "",
             "| diagnostic | Pearson r (95% interval) | Spearman | the paper |", "|---|---|---|---|"]
    for name, c in cal["correlations"].items():
        paper = f"{PAPER[name]:+.2f}" if name in PAPER else ""
        lines.append(f"| {name} | {f(c['pearson'])} ({f(c['low'])} .. {f(c['high'])}) | {f(c['spearman'])} | {paper} |")
    lines += ["", "| predictor | kept | held-out MAE (leave one study out) | in-sample MAE | 90% half-width |",
              "|---|---|---|---|---|"]
    for c in cal["candidates"]:
        lines.append(f"| {' + '.join(c['features'])} | {' + '.join(c['kept'])} | {100 * c['loso_mae']:.1f} points | "
                     f"{100 * c['in_sample_mae']:.1f} | {100 * c['half_width']:.1f} |")
    best = chosen(cal["candidates"])
    lines += ["", "held out, per study (the chosen predictor):", "", "| study | mappers | MAE | bias (measured - predicted) |",
              "|---|---|---|---|"]
    for s, v in best["loso_by_study"].items():
        lines.append(f"| {s} | {v['mappers']} | {100 * v['mae']:.1f} points | {100 * v['bias']:+.1f} |")
    m = cal["model"]
    terms = " ".join(f"{c:+.4f}·{name}" for name, c in m["coefficients"].items())
    lines += ["", f"model: {m['target']} = {m['intercept']:+.4f} {terms} (at most 1), ± {m['half_width']:.3f} "
                  f"({100 * m['coverage']:.0f}% of held-out errors)"]
    return "\n".join(lines)


def program_model(binary, path):
    """The model crosskv-eval reads from the calibration file at `path`, and the file it names."""
    env = dict(os.environ, CROSSKV_RETENTION_MODEL=os.path.abspath(path))
    out = subprocess.run([binary, "--print-retention-model"], capture_output=True, text=True, check=True, env=env)
    return json.loads(out.stdout)


def same_model(a, b, tol=5e-6):
    """Whether two models agree (the stored file keeps 6 decimals)."""
    if set(a["coefficients"]) != set(b["coefficients"]):
        return False
    if a.get("target", "recovered") != b.get("target", "recovered"):
        return False
    if set(a.get("ranges", {})) != set(b.get("ranges", {})):
        return False
    pairs = [(a["intercept"], b["intercept"]), (a["half_width"], b["half_width"])]
    pairs += [(a["coefficients"][k], b["coefficients"][k]) for k in a["coefficients"]]
    pairs += [(x, y) for k in a["ranges"] for x, y in zip(a["ranges"][k], b["ranges"][k])]
    return all(abs(x - y) <= tol for x, y in pairs)


def check(doc, path, binary=None):
    """Problems (empty when none): the stored model is not the refit of the stored rows, or crosskv-eval does not
    read it from the file at `path`."""
    problems = []
    refit = rounded(calibrate(doc["rows"], doc.get("target", "recovered"))["model"])
    if not same_model(refit, doc["model"]):
        problems.append(f"the stored model is not the refit of the stored rows: stored {doc['model']}, refit {refit}")
    if binary:
        got = program_model(binary, path)
        if not same_model(doc["model"], got) or got.get("file") != os.path.abspath(path):
            problems.append(f"{binary} does not read {path}'s model: it reads {got}, the file holds {doc['model']}")
    return problems


def with_file(doc, fn):
    """fn(path) with `doc` written to a temporary calibration file."""
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "retention-calibration.json")
        with open(path, "w") as fh:
            json.dump(doc, fh)
        return fn(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fit")
    f.add_argument("studies", nargs="+", help="studies.json of tools/family/studies.py")
    f.add_argument("--out", required=True)
    f.add_argument("--target", default="recovered", choices=TARGETS,
                   help="what the predictor predicts: the share of the prefix's gain (recovered), the content share "
                        "(crosskv.retention: beyond the wrong-sequence control), or the choice task's retention")
    f.add_argument("--calibrated-on", default="the small family of docs/RESULTS.md (two Qwen3-style models trained on "
                                              "Shakespeare, 4 and 8 layers); a real pair may differ")
    for name in ("check", "self-test"):
        c = sub.add_parser(name)
        c.add_argument("calibration")
        c.add_argument("--binary")
    a = p.parse_args()
    if a.cmd == "fit":
        rows = []
        for path in a.studies:
            rows += rows_of(json.load(open(path)))
        rows = rounded(rows)  # as stored: the stored model is the fit of exactly these
        cal = calibrate(rows, a.target)
        doc = {"format": "crosskv-retention-calibration", "version": 1, "calibrated_on": a.calibrated_on,
               "target": a.target,
               "model": rounded(cal["model"]), "correlations": rounded(cal["correlations"], 4),
               "candidates": rounded(cal["candidates"], 4), "paper": PAPER, "rows": rows}
        with open(a.out, "w") as fh:
            json.dump(doc, fh, indent=1)
            fh.write("\n")
        print(markdown(cal, rows))
        return 0
    doc = json.load(open(a.calibration))
    if a.cmd == "check":
        problems = check(doc, a.calibration, a.binary)
        for pr in problems:
            print("calibrate.py check:", pr, file=sys.stderr)
        if not problems:
            print(f"calibrate.py check: {a.calibration}: the model is the refit of its {len(doc['rows'])} rows"
                  + (f", and {a.binary} reads it" if a.binary else ""))
        return 1 if problems else 0
    return self_test(doc, a.calibration, a.binary)


def self_test(doc, path, binary):
    """The check passes on the file as it is and fails on a planted change of each kind; crosskv-eval reads a
    changed file as it is, without a rebuild."""
    assert not check(doc, path, binary), "the calibration does not pass its own check"
    planted = json.loads(json.dumps(doc))
    name = next(iter(planted["model"]["coefficients"]))
    planted["model"]["coefficients"][name] += 0.01
    assert with_file(planted, lambda p: check(planted, p)), "a changed coefficient was not caught"
    if binary:
        got = with_file(planted, lambda p: program_model(binary, p))
        assert abs(got["coefficients"][name] - planted["model"]["coefficients"][name]) < 1e-9, \
            f"{binary} did not read the changed file: {got}"
        assert with_file(planted, lambda p: check(doc, p, binary)), "a program reading another model was not caught"
    planted = json.loads(json.dumps(doc))
    planted["rows"][0][doc.get("target", "recovered")] += 0.2
    assert with_file(planted, lambda p: check(planted, p)), "a changed row was not caught"
    print("calibrate.py self-test: a changed coefficient and a changed row are both caught"
          + (f"; {binary} reads a changed file without a rebuild" if binary else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
