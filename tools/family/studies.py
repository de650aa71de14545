#!/usr/bin/env python3
"""The calibration studies (docs/RESULTS.md) on the small family of run_family.py, with crosskv's refits: structure
(cross_head against per_head), direction (small to large and large to small), lambda over four orders of magnitude,
calibration size (25/50/100% of the tokens), domain (Shakespeare, then the Python standard library's own .py
files), token weighting (uniform against the attention weights of crosskv-capture --attention-weights) and
residual MLPs (fit.mapper: auto). Every mapper is measured with crosskv.retention (its controls, content share, task retention) and the held-out diagnostics; every fit
records how many tokens it read and in how many passes. Writes WORK/studies.md and WORK/studies.json.

    .venv-capture/bin/python tools/family/run_family.py WORK --build build      # the models and their captures
    .venv-capture/bin/python tools/family/studies.py WORK --build build         # ~11 min on 2 cores (5 of it the MLP)

Not a CI test (it needs the trained models).
"""
import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import time

import numpy as np
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import run_family as fam  # noqa: E402  (caches, continuation_nll, the capture module, crosskv)

cap, crosskv = fam.cap, fam.crosskv


def log(*a):
    print("[studies]", *a, file=sys.stderr, flush=True)


class Bench:
    """The two models and a held-out text's sequences of one direction; each mapper measured with crosskv.retention
    (its controls on the same sequences). own / none: the target's perplexity with its own prefill and with none."""

    def __init__(self, src, tgt, ids, S):
        self.src, self.tgt, self.ids, self.S = src, tgt, ids, S
        self.own = self.none = None

    def measure(self, mapper_dir):
        r = fam.retention_of(self.src, self.tgt, crosskv.Mapper(mapper_dir), self.ids, self.S)
        self.own, self.none = r.perplexity("own"), r.perplexity("none")
        return r


class Fits:
    """crosskv-fit runs of the study: each one's wall time and what it read (from its log)."""

    def __init__(self, build):
        self.fit = os.path.join(build, "crosskv-fit")
        self.eval = os.path.join(build, "crosskv-eval")
        self.runs = {}

    def run(self, name, source, target, fit, domains=("cal",), checkpoint=None, extra=""):
        out = f"st-{name}"
        ck = f"\nruntime: {{checkpoint: {{dir: {checkpoint}}}}}" if checkpoint else ""
        with open(f"{out}.yaml", "w") as f:
            f.write(f"source: {{store: {source}}}\ntarget: {{store: {target}}}\n"
                    f"calibration: {{domains: [{', '.join(domains)}]{extra}}}\nfit: {fit}\noutput: {{dir: {out}}}{ck}\n")
        t0 = time.time()
        r = subprocess.run([self.fit, f"{out}.yaml"], capture_output=True, text=True)
        secs = time.time() - t0
        open(f"{out}.log", "w").write(r.stdout + r.stderr)
        if r.returncode != 0:
            raise SystemExit(f"crosskv-fit {out}.yaml failed:\n{r.stdout[-3000:]}{r.stderr}")
        read = sum(int(m) for m in re.findall(r"read (\d+) tokens in pass", r.stdout))
        refit = "no calibration data was read" in r.stdout
        restored = re.findall(r"\[domain ([^]]+)\]: restored from the committed checkpoint", r.stdout)
        self.runs[name] = {"seconds": round(secs, 2), "tokens_read": read, "refit_without_reading": refit,
                           "domains_restored": sorted(set(restored)), "folder": out}
        log(f"{name}: {secs:.1f} s, read {read} tokens{' (a refit: nothing read)' if refit else ''}")
        return out

    def diagnose(self, mapper_dir, source_shard, target_shard):
        j = f"{mapper_dir}.eval-{source_shard.replace('/', '_')}.json"
        subprocess.run([self.eval, "--mapper", mapper_dir, "--source", source_shard, "--target", target_shard,
                        "--json", j], check=True, capture_output=True)
        e = json.load(open(j))
        d = {x: e.get(x) for x in ("r2_k", "r2_v", "attention_cosine", "k_concentration", "v_concentration",
                                   "verdict", "predicted_retention")}
        d["mean_only_cosine"] = e["baselines"]["mean_only"]["attention_cosine"]
        return d


def manifest(d):
    return json.load(open(os.path.join(d, "manifest.json")))


def in_sample_r2(m):
    """The calibration (in-sample) R² the manifest records: head mean, then layer mean, of keys and values."""
    mean = lambda v: sum(v) / len(v)  # noqa: E731
    return mean([mean([mean(l["r2_k"]), mean(l["r2_v"])]) for l in m["layers"]])


def folders(out, ks, structures):
    return [(k, s, os.path.join(out, f"k{k}" + ("-per_head" if s == "per_head" else ""))) for s in structures
            for k in ks]


def code_docs():
    """The Python standard library's own .py files on this machine (the second domain)."""
    paths = sorted(glob.glob(os.path.join(os.path.dirname(os.__file__), "*.py")))
    return [(os.path.basename(p), open(p, encoding="utf-8", errors="replace").read()) for p in paths]


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work")
    p.add_argument("--build", default=os.path.join(fam.ROOT, "build"))
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences of crosskv-eval's diagnostics")
    p.add_argument("--retention-seqs", type=int, default=128,
                   help="held-out sequences of the retention measurement (crosskv.retention)")
    a = p.parse_args()
    a.build = os.path.abspath(a.build)
    return a


def capture_code(a, code_train, code_held):
    """The second domain, captured once per model: calibration (domain "code") and held-out ("codeheld") sequences."""
    for name in ("source", "target"):
        if os.path.isdir(f"{name}/code"):
            continue
        fam.write_jsonl("code.jsonl", code_train)
        fam.write_jsonl("codeheld.jsonl", code_held)
        common = ["--model", f"model-{name}", "--seq-len", str(a.seq), "--dtype", "fp32", "--batch", "8",
                  "--shard-seqs", "64", "--name", f"stdlib-{name}"]
        if name == "target":
            common += ["--same-tokens-as", "model-source"]
        assert cap.main(common + ["--text", "code.jsonl", "--n-seq", "256", "--out", f"{name}/code"]) == 0
        assert cap.main(common + ["--text", "codeheld.jsonl", "--n-seq", str(a.eval_seqs), "--out",
                                  f"{name}/codeheld", "--queries"]) == 0


def measure(fits, out, ks, bench, shards, structures=("cross_head", "per_head")):
    """One study's rows: each mapper's size, retention with its controls and held-out diagnostics."""
    rows = []
    for k, s, d in folders(out, ks, structures):
        m = manifest(d)
        r = bench.measure(d)
        rows.append({"k": k, "structure": s, "mapper": d, "r2_in_sample": in_sample_r2(m),
                     "params": m["fit"]["params"] + m["fit"]["bias_params"],
                     "bytes_fp32": 4 * (m["fit"]["params"] + m["fit"]["bias_params"]),
                     "perplexity": r.perplexity("mapped"), "recovered": r.share.value,
                     "content_share": r.content_share.as_list(),
                     "choice_retention": r.task_retention["choice"].as_list(),
                     "recall_retention": r.task_retention["recall"].as_list(),
                     "retention": r.to_json(), **fits.diagnose(d, *shards)})
    return rows



def run_studies(a, fits, up, down, res):
    both = "[cross_head, per_head]"
    held_a = ("source/held/shard-000.h5", "target/held/shard-000.h5")
    held_b = ("source/codeheld/shard-000.h5", "target/codeheld/shard-000.h5")
    # Structure: one fit, both structures, one pass; k = 1, 2, all.
    out = fits.run("structure", "source", "target", f"{{k: [1, 2, all], lambda: 0.01, structure: {both}}}")
    res["structure"] = measure(fits, out, [1, 2, "all"], up["A"], held_a)
    # Structure's time: each structure alone, refitted from the moments just stored (nothing read).
    for s in ("cross_head", "per_head"):
        fits.run(f"structure-{s}-refit", "source", "target", f"{{k: [1, 2, all], lambda: 0.01, structure: {s}}}",
                 checkpoint="st-structure/checkpoint")
    # Lambda over four orders of magnitude (and one more), refits from the same moments.
    res["lambda"] = {}
    for lam in (1e-4, 1e-3, 1e-2, 1e-1, 1.0):
        out = fits.run(f"lambda-{lam:g}", "source", "target", f"{{k: [1, all], lambda: {lam:g}, structure: {both}}}",
                       checkpoint="st-structure/checkpoint")
        res["lambda"][f"{lam:g}"] = measure(fits, out, [1, "all"], up["A"], held_a)
    # Direction: large to small (the 8-layer model's cache into the 4-layer model), both structures.
    out = fits.run("down", "target", "source", f"{{k: [1, 2, 4, all], lambda: 0.01, structure: {both}}}")
    res["direction"] = {"small->large": res["structure"], "large->small": measure(fits, out, [1, 2, 4, "all"], down,
                                                                                    held_a[::-1])}
    # Calibration size: 25%, 50% of the calibration tokens (max_tokens: a new pass each), against 100%.
    total = manifest("st-structure/kall")["calibration"]["tokens_used"]
    res["size"] = {"100%": res["structure"]}
    for share in (25, 50):
        out = fits.run(f"size-{share}", "source", "target", f"{{k: [1, 2, all], lambda: 0.01, structure: {both}}}",
                       extra=f", max_tokens: {total * share // 100}")
        res["size"][f"{share}%"] = measure(fits, out, [1, 2, "all"], up["A"], held_a)
    # Domain: fitted on A (text) alone, evaluated on A and B (code); then A + B as a refit that reads only B, against
    # a fit of A + B from scratch.
    res["domain"] = {"A only, on A": res["structure"],
                     "A only, on B": measure(fits, "st-structure", [1, 2, "all"], up["B"], held_b)}
    out = fits.run("domain-AB-refit", "source", "target", f"{{k: [1, 2, all], lambda: 0.01, structure: {both}}}",
                   domains=("cal", "code"), checkpoint="st-structure/checkpoint")
    res["domain"]["A+B, on A"] = measure(fits, out, [1, 2, "all"], up["A"], held_a)
    res["domain"]["A+B, on B"] = measure(fits, out, [1, 2, "all"], up["B"], held_b)
    fits.run("domain-AB-scratch", "source", "target", f"{{k: [1, 2, all], lambda: 0.01, structure: {both}}}",
             domains=("cal", "code"))
    # Token weighting: the target's calibration captured again with --attention-weights (the same keys and
    # values, plus `weights`), fitted with fit.weighting: dataset; uniform is the structure study's fit.
    if not os.path.isdir("target-aw/cal"):
        assert cap.main(["--model", "model-target", "--seq-len", str(a.seq), "--dtype", "fp32", "--batch", "8",
                         "--shard-seqs", "64", "--name", "shakespeare-target", "--same-tokens-as", "model-source",
                         "--text", "train.jsonl", "--n-seq", "256", "--out", "target-aw/cal",
                         "--attention-weights"]) == 0
    out = fits.run("weighting-attention", "source", "target-aw",
                   f"{{k: [1, 2, all], lambda: 0.01, structure: {both}, weighting: dataset}}")
    res["weighting"] = {"uniform": res["structure"], "attention": measure(fits, out, [1, 2, "all"], up["A"], held_a)}
    # Residual MLPs (fit.mapper: auto, the issue-15 settings), cross_head.
    out = fits.run("mlp", "source", "target", "{k: [1, 2, all], lambda: 0.01, mapper: auto, "
                   "mlp: {hidden: 256, epochs: 20}}")
    res["mlp"] = measure(fits, out, [1, 2, "all"], up["A"], held_a, structures=("cross_head",))


def main():
    a = parse_args()
    os.chdir(a.work)
    torch.set_num_threads(os.cpu_count() or 1)
    small = AutoModelForCausalLM.from_pretrained("model-source").eval()
    large = AutoModelForCausalLM.from_pretrained("model-target").eval()
    tok = AutoTokenizer.from_pretrained("model-source")
    S = a.seq // 2
    held = [json.loads(l)["text"] for l in open("held.jsonl")]
    docs = code_docs()
    code_train, code_held = [d for i, d in enumerate(docs) if i % 8 != 7], [d for i, d in enumerate(docs) if i % 8 == 7]
    fits = Fits(a.build)
    res = {"runs": fits.runs}
    capture_code(a, code_train, code_held)
    text_ids = cap.pack(tok, held, 2 * S, a.retention_seqs)
    code_ids = cap.pack(tok, [t for _, t in code_held], 2 * S, a.retention_seqs)
    up = {"A": Bench(small, large, text_ids, S), "B": Bench(small, large, code_ids, S)}
    down = Bench(large, small, text_ids, S)
    run_studies(a, fits, up, down, res)
    res["reference"] = {"small->large, text": {"own": up["A"].own, "none": up["A"].none},
                        "small->large, code": {"own": up["B"].own, "none": up["B"].none},
                        "large->small, text": {"own": down.own, "none": down.none}}
    with open("studies.json", "w") as f:
        json.dump(res, f, indent=2)
    write_markdown(res)


def write_markdown(res):
    f3 = lambda x: "n/a" if x is None else f"{x:.3f}"

    def table(rows, first="k"):
        fig = lambda x: f"{x[0]:.2f} [{x[1]:.2f}, {x[2]:.2f}]"  # noqa: E731
        out = [f"| {first} | structure | params | fp32 | content share | recovered (ppl) | choice retention | "
               "recall retention | held-out R² k / v | attention cosine | verdict |",
               "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in rows:
            out.append(f"| {r['k']} | {r['structure']} | {r['params']:,} | {r['bytes_fp32'] / 1024:.0f} KiB | "
                       f"{fig(r['content_share'])} | {100 * r['recovered']:.0f}% ({r['perplexity']:.2f}) | "
                       f"{fig(r['choice_retention'])} | {fig(r['recall_retention'])} | "
                       f"{f3(r['r2_k'])} / {f3(r['r2_v'])} | "
                       f"{f3(r['attention_cosine'])} | {r['verdict'].split(':')[0]} |")
        return out

    lines = ["## Fits", "", "| fit | seconds | tokens read | refit (nothing read) | domains restored |",
             "|---|---|---|---|---|"]
    for n, r in res["runs"].items():
        lines.append(f"| {n} | {r['seconds']} | {r['tokens_read']} | {'yes' if r['refit_without_reading'] else 'no'} "
                     f"| {', '.join(r['domains_restored'])} |")
    lines += ["", "## References", ""] + [f"- {k}: own prefill {v['own']:.2f}, no prefix {v['none']:.2f}"
                                          for k, v in res["reference"].items()]
    lines += ["", "## Structure (small -> large, text)", ""] + table(res["structure"])
    lines += ["", "## Direction: large -> small (text)", ""] + table(res["direction"]["large->small"])
    for lam, rows in res["lambda"].items():
        lines += ["", f"## lambda = {lam}", ""] + table(rows)
    for share, rows in res["size"].items():
        lines += ["", f"## Calibration size {share}", ""] + table(rows)
    for name, rows in res["domain"].items():
        lines += ["", f"## Domain: {name}", ""] + table(rows)
    for name, rows in res.get("weighting", {}).items():
        lines += ["", f"## Token weighting: {name}", ""] + table(rows)
    if "mlp" in res:
        lines += ["", "## Residual MLPs (mapper: auto)", ""] + table(res["mlp"])
    open("studies.md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
