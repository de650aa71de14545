#!/usr/bin/env python3
"""Projects a whole fit (one model pair, every k) onto P GPUs from what one GPU measured (bench/gpu_check.sh).

  bench/project.py OUT [OUT2 ...] [--ranks 8] [--tokens 131072] [--nvlink-gbs 150] [--disk-gbs 2] [--read-gbs 10]

The folders (gpu_check.sh's outputs, e.g. of its two calls) hold bench_gpu.json (steady-state accumulation of one
kind, a round's end) and fit_gpu.log (a paper-shaped fit on one GPU: rounds, the k = all factor, the per-layer solve
rate). The model is the one of docs/PERFORMANCE.md
("Model of the distributed job"): one layer group, P token groups; each rank reads N/P tokens, folds in keys and
values (twice the benchmark's one kind) while the next block is read (the pass takes the longer of the two), ends
one round (reduce-scatter read from the resident sums, its 1/P share to the host and checkpointed, the sums zeroed
on the device; one reader: its checkpoint as the fit log measured it), probes, and solves Lt/P target layers
after factoring the k = all system. Measured figures are used as they are; what one GPU cannot measure (the
node's read rate for P readers, NVLink reduce-scatter, checkpoint disk) are assumptions, printed as such.
Standard library only.
"""
import argparse
import json
import re
import sys
from pathlib import Path


def seconds(text):
    """crosskv's human_seconds: '12.3 s', '4m05s', '1h02m'."""
    m = re.fullmatch(r"\s*([\d.]+) s\s*", text)
    if m:
        return float(m.group(1))
    m = re.fullmatch(r"\s*(\d+)m(\d+)s\s*", text)
    if m:
        return 60 * int(m.group(1)) + int(m.group(2))
    m = re.fullmatch(r"\s*(\d+)h(\d+)m\s*", text)
    if m:
        return 3600 * int(m.group(1)) + 60 * int(m.group(2))
    raise ValueError(f"not a duration: {text!r}")


def parse_log(path):
    """What fit_gpu.log measured: the pass, round ends, the pass's end, the k = all factor, the solve rate, memory."""
    got = {"rounds": []}
    for line in Path(path).read_text(errors="replace").splitlines():
        # (older logs: "sums to the host X, packed and reduced Y"; the flush is now part of the reduction)
        m = re.search(r"round (\d+)/(\d+) ended: (?:sums to the host (.+?), )?"
                      r"(?:reduced into the share|packed and reduced) (.+?), checkpoint (.+)$", line)
        if m:
            ck = m.group(5)
            got["rounds"].append({"reduce": seconds(m.group(4)) + (seconds(m.group(3)) if m.group(3) else 0.0),
                                  "checkpoint": None if "pass's end" in ck else seconds(ck)})
        # one reader: nothing to reduce; the checkpoint reads the sums where they are
        m = re.search(r"round (\d+)/(\d+) ended: checkpoint (.+?) \(one reader", line)
        if m:
            ck = m.group(3)
            got["rounds"].append({"reduce": 0.0, "checkpoint": None if "pass's end" in ck else seconds(ck)})
        m = re.search(r"factored the k = all system (once per kind|of one kind) .*?\((\d+) features\) in (.+)$", line)
        if m:
            got["factor_all"] = seconds(m.group(3))
            got["factor_kinds"] = 2 if m.group(1) == "once per kind" else 1
        m = re.search(r"solve[^:]*: (\d+) target layers in (.+?) \(", line)
        if m:
            got["solve_layers"], got["solve_s"] = int(m.group(1)), seconds(m.group(2))
        m = re.search(r"solve[^:]*: (\d+)/(\d+) target layers .*?, ([\d.]+) target layers/s", line)
        if m and "solve_s" not in got:
            got["solve_rate"] = float(m.group(3))
        m = re.search(r"memory: moments ([\d.]+) (GiB|MiB) \(keys\) \+ ([\d.]+) (GiB|MiB) \(values\)", line)
        if m:
            unit = {"GiB": 1.0, "MiB": 1 / 1024}
            got["moment_gib"] = float(m.group(1)) * unit[m.group(2)] + float(m.group(3)) * unit[m.group(4)]
        m = re.search(r"\]   ([a-z+-]+) +(\S.*?s)\s+[\d.]+%$", line)
        if m:
            got.setdefault("stages", {})[m.group(1)] = seconds(m.group(2))
        m = re.search(r"source .*?\[(\d+)x(\d+)x(\d+)\], target .*?\[(\d+)x(\d+)x(\d+)\]", line)
        if m:
            got["shape"] = [int(x) for x in m.groups()]
        m = re.search(r"pass 1/[12][^:]*: (\d+) tokens in (.+?) \(", line)
        if m:
            got["pass_tokens"], got["pass_s"] = int(m.group(1)), seconds(m.group(2))
        m = re.search(r"pass end: (?:sums to the host moments|shares gathered into the moments) (.+?), checkpoint (.+)$",
                      line)
        if m:
            got["pass_end_s"], got["pass_end_checkpoint_s"] = seconds(m.group(1)), seconds(m.group(2))
        if re.match(r"(\[[^]]*\] )*\s+all\s+\d+\s", line):  # the plan's table has a k = all row: a whole sweep
            got["sweep"] = True
    return got


def merge_logs(paths):
    """Figures from several fit logs: the pass from the one that read the most tokens, the solve from a whole sweep."""
    logs = [parse_log(p) for p in paths]
    got = {"rounds": []}
    for log in logs:
        for key in ("rounds", "moment_gib", "stages", "shape", "pass_end_s", "pass_end_checkpoint_s"):
            if key in log and log[key]:
                got[key] = log[key]
    passes = [g for g in logs if "pass_tokens" in g]
    if passes:
        best = max(passes, key=lambda g: g["pass_tokens"])
        got["pass_tokens"], got["pass_s"] = best["pass_tokens"], best["pass_s"]
    sweeps = [g for g in logs if g.get("sweep")] or logs
    for key in ("factor_all", "factor_kinds", "solve_layers", "solve_s", "solve_rate"):
        for g in sweeps:
            if key in g:
                got[key] = g[key]
    return got


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="+", help="gpu_check.sh's output folders (bench_gpu.json, fit_gpu.log)")
    ap.add_argument("--ranks", type=int, default=8)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--nvlink-gbs", type=float, default=150.0, help="assumed NCCL reduce-scatter bus rate, GB/s")
    ap.add_argument("--disk-gbs", type=float, default=2.0, help="assumed checkpoint write rate per rank, GB/s")
    ap.add_argument("--read-gbs", type=float, default=10.0, help="assumed shard read rate of a node (P readers), GB/s")
    a = ap.parse_args()
    def find(name):
        hits = [Path(d) / name for d in a.out if (Path(d) / name).is_file()]
        return hits[-1] if hits else None

    bench_path = find("bench_gpu.json")
    log_paths = [Path(d) / "fit_gpu.log" for d in a.out if (Path(d) / "fit_gpu.log").is_file()]
    if not bench_path:
        sys.exit(f"project.py: no bench_gpu.json in {', '.join(a.out)}")
    try:
        bench = json.loads(bench_path.read_text())
    except ValueError as e:
        sys.exit(f"project.py: {bench_path}: not the benchmark's JSON ({e})")
    if "sums_gib" not in bench:
        sys.exit(f"project.py: {bench_path}: written by an older crosskv-bench-gpu (no steady-state fields)")
    log = merge_logs(log_paths)
    Ls, Hs, Ds, Lt, Ht, Dt = log.get("shape", bench["shape"])
    P, N = a.ranks, a.tokens
    rows = []  # (what, seconds, where the figure comes from)

    read_bytes = N / P * 2 * (Ls * Hs * Ds + Lt * Ht * Dt) * 2  # bf16 keys and values of both models
    read = read_bytes / (a.read_gbs * 1e9 / P)
    if "pass_s" in log:  # measured: one GPU reading, converting and folding in its shards (keys, raw keys, values)
        rate = log["pass_tokens"] / max(log["pass_s"], 1e-9)
        acc, src = N / P / rate, f"fit_gpu.log: {log['pass_tokens']} tokens at {rate:.0f} tokens/s -> {N / P / rate:.1f} s"
    else:
        tok_s = bench["prepared_tokens_per_s"] / 2  # keys and values; the benchmark folds in one kind
        acc, src = N / P / tok_s, f"bench_gpu: {bench['prepared_tokens_per_s']:.0f} tokens/s per kind -> {N / P / tok_s:.1f} s"
    rows.append((f"pass: N/P tokens ({'one GPU' if acc >= read else 'reading'} binds)", max(acc, read),
                 f"{src}; reading {read_bytes / 1e9:.1f} GB at an assumed {a.read_gbs:g} GB/s per node -> {read:.1f} s"))
    sums_gib = 2 * bench["sums_gib"]
    gib = log.get("moment_gib", sums_gib)
    if "share_to_host_s" in bench and P > 1:
        # Several readers: the reduce-scatter reads the resident sums in place; only the 1/P share comes to the host.
        share = bench["share_to_host_s"] / max(bench["share_gib"], 1e-9)
        zero = bench["zero_resident_s"] / max(bench["sums_gib"], 1e-9)
        rows.append(("round end: 1/P share to the host", share * gib / P,
                     f"bench_gpu: {share:.2f} s/GiB x {gib / P:.2f} GiB"))
        rows.append(("round end: sums zeroed on the device", zero * gib,
                     f"bench_gpu: {zero:.3f} s/GiB x {gib:.1f} GiB"))
    elif log["rounds"]:
        # One reader (P = 1): its round ends are its checkpoints, measured with the sums read where they are.
        ck = [r["checkpoint"] for r in log["rounds"] if r["checkpoint"] is not None]
        rows.append(("round end (one reader, measured)", log["rounds"][-1]["reduce"] + (ck[-1] if ck else 0.0),
                     "fit_gpu.log, the last round checkpointed"))
    else:
        per_gib = (bench["flush_s"] + bench["zero_live_s"]) / max(bench["sums_gib"], 1e-9)
        rows.append(("round end: sums to the host and zeroed", per_gib * gib,
                     f"bench_gpu: {per_gib:.2f} s/GiB x {gib:.1f} GiB"))
    rs = gib * (P - 1) / P * 1.0737 / a.nvlink_gbs
    rows.append(("reduce-scatter of the sums (in place)", rs,
                 f"assumed {a.nvlink_gbs:g} GB/s (NCCL, NVLink)"))
    if "pass_end_s" in log:
        # Every rank writes all of its moments into host memory at the pass's end (one GPU: from the device; P: the
        # gathered shares), the same bytes either way; its checkpoint is 1/P of the one GPU's.
        rows.append(("pass end: the moments written on the host", log["pass_end_s"],
                     f"fit_gpu.log: {gib:.1f} GiB in {log['pass_end_s']:.1f} s on one GPU"))
        rows.append(("checkpoint of this rank's 1/P share", log["pass_end_checkpoint_s"] / P,
                     f"fit_gpu.log: {gib:.1f} GiB in {log['pass_end_checkpoint_s']:.1f} s, / {P}"))
    elif not rows[-1][0].startswith("round end (one reader"):
        rows.append(("checkpoint of this rank's 1/P share", gib / P * 1.0737 / a.disk_gbs,
                     f"assumed {a.disk_gbs:g} GB/s per rank"))
    if "probe" in log.get("stages", {}):
        rows.append(("probe (R², select), shared out over the ranks", log["stages"]["probe"] / P,
                     f"fit_gpu.log: {log['stages']['probe']:.1f} s on one GPU, / {P}"))
    if "factor_all" in log:
        # With several readers they pair up for the solve: each rank factors one kind's system.
        per_kind = log["factor_all"] / log.get("factor_kinds", 2)
        if P > 1:
            rows.append(("k = all factor, one kind per rank (readers in pairs)", per_kind,
                         f"fit_gpu.log: {per_kind:.1f} s per kind"))
        else:
            rows.append(("k = all factor, keys and values", 2 * per_kind, "fit_gpu.log"))
    per_layer = None
    if "solve_s" in log:
        per_layer = log["solve_s"] / max(log["solve_layers"], 1)
    elif "solve_rate" in log:
        per_layer = 1 / log["solve_rate"]
    if per_layer is not None:
        rows.append((f"solve + export, {Lt / P:g} target layers", per_layer * Lt / P,
                     f"fit_gpu.log: {per_layer:.2f} s per layer"))
    total = sum(s for _, s, _ in rows)
    print(f"Projection: {N} tokens, {P} GPUs (one layer group), {Lt} target layers, every k")
    for what, s, src in rows:
        print(f"  {what:<42} {s:8.1f} s   {src}")
    print(f"  {'total per pair':<42} {total:8.1f} s   ({total / 60:.1f} min)")
    factor_path = find("factor_gpu.json")
    if factor_path:
        try:
            fj = json.loads(factor_path.read_text())
            print(f"  (factor_gpu.json, one kind's k = all system of {fj['features']} features: assembled on the host "
                  f"and uploaded {fj['host_assemble_s'] + fj['upload_and_factor_s']:.1f} s, assembled on the device "
                  f"{fj['assemble_cov_s'] + fj['factor_assembled_s']:.1f} s; the fit uses the latter)")
        except (ValueError, KeyError) as e:
            print(f"  (factor_gpu.json unreadable: {e})")
    missing = [w for w, key in (("probe", "probe"), ("k = all factor", "factor_all"), ("solve", "solve"))
               if not any(w in r for r, _, _ in rows)]
    if missing:
        print(f"  (not in fit_gpu.log, so not counted: {', '.join(missing)})")


if __name__ == "__main__":
    main()
