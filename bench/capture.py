#!/usr/bin/env python3
"""crosskv-capture before and after the node-scale rework, in one run: the same models, corpus and flags through the
old capture (taken from git at OLD_COMMIT) and the new one, each in a process of its own. Per run: wall time, tokens
a second, the process's peak resident memory (ru_maxrss) and the store's bytes; across --n-seq, whether peak memory
grows with the corpus.

Models: the family's shapes (Qwen3-style; source 4 layers of width 128, target 8 of width 192, 2 KV heads of 32,
random weights, an fp32 checkpoint so that both run the model in fp32: the old default). Stored dtype bf16, with
queries, --shard-seqs 64.

    .venv-capture/bin/python bench/capture.py WORK --n-seq 64,256,1024 --seq-len 256 --json out.json
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OLD_COMMIT = "7f298c6"  # the last commit with the whole-shard, fp32-on-the-host capture
SHAPES = {"source": dict(layers=4, hidden=128, q=4, kv=2, dim=32, inter=512),
          "target": dict(layers=8, hidden=192, q=4, kv=2, dim=32, inter=768)}


def make(work):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, os.path.join(ROOT, "tests", "python"))
    from tiny_hf import byte_tokenizer

    for name, c in SHAPES.items():
        torch.manual_seed(len(name))
        cfg = Qwen3Config(vocab_size=257, hidden_size=c["hidden"], intermediate_size=c["inter"],
                          num_hidden_layers=c["layers"], num_attention_heads=c["q"], num_key_value_heads=c["kv"],
                          head_dim=c["dim"], max_position_embeddings=4096)
        Qwen3ForCausalLM(cfg).eval().save_pretrained(os.path.join(work, f"model-{name}"))
        byte_tokenizer().save_pretrained(os.path.join(work, f"model-{name}"))
    with open(os.path.join(work, "text.txt"), "w") as f:
        f.write(" ".join(f"paragraph {i}: the quick brown fox jumps over the lazy dog, again and again."
                         for i in range(40000)))


def run(script, args, out):
    """One capture in a process of its own: (seconds, peak RSS bytes, store bytes)."""
    shutil.rmtree(out, ignore_errors=True)
    t0 = time.perf_counter()
    p = subprocess.Popen([sys.executable, *([script] if isinstance(script, str) else script), *args, "--out", out], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True)
    _, status, usage = os.wait4(p.pid, 0)
    seconds = time.perf_counter() - t0
    err = p.stderr.read()
    if os.waitstatus_to_exitcode(status) != 0:
        sys.exit(f"{script} failed:\n{err[-2000:]}")
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    return seconds, usage.ru_maxrss * 1024, size


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--n-seq", default="64,256,1024")
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--json")
    a = ap.parse_args()
    work = os.path.abspath(a.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    make(work)
    old = os.path.join(work, "old_capture.py")
    with open(old, "w") as f:
        f.write(subprocess.run(["git", "-C", ROOT, "show", f"{OLD_COMMIT}:tools/capture/crosskv_capture.py"],
                               check=True, capture_output=True, text=True).stdout)
    new = ["-m", "crosskv.capture"]  # the package's, as the crosskv-capture console script runs it
    cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    import torch

    print(f"CPU: {cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)")
    rows = []
    for model in ("source", "target"):
        for n in [int(x) for x in a.n_seq.split(",")]:
            args = ["--model", os.path.join(work, f"model-{model}"), "--text", os.path.join(work, "text.txt"),
                    "--seq-len", str(a.seq_len), "--n-seq", str(n), "--dtype", "bf16", "--queries",
                    "--shard-seqs", "64", "--batch", "4"]
            row = {"model": model, "n_seq": n, "tokens": n * a.seq_len}
            for kind, script, extra in (("old", old, []), ("new", new, [])):
                s, rss, size = run(script, args + extra, os.path.join(work, f"{kind}-{model}-{n}", "web"))
                row[kind] = {"seconds": s, "tokens_per_s": n * a.seq_len / s, "peak_rss": rss, "store_bytes": size}
            rows.append(row)
            o, w = row["old"], row["new"]
            print(f"  {model:6s} n-seq {n:5d} ({n * a.seq_len:7d} tokens): old {o['tokens_per_s']:8.0f} tokens/s, "
                  f"peak {o['peak_rss'] / 2**20:6.0f} MiB | new {w['tokens_per_s']:8.0f} tokens/s, peak "
                  f"{w['peak_rss'] / 2**20:6.0f} MiB | new/old speed {w['tokens_per_s'] / o['tokens_per_s']:.2f}x, "
                  f"store {w['store_bytes'] / 2**20:.1f} MiB", flush=True)
    if a.json:
        json.dump({"cpu": cpu, "seq_len": a.seq_len, "rows": rows}, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
