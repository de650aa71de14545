#!/usr/bin/env python3
"""Transfer vs re-prefill: what a model switch costs the target with and without a mapper.

measured   --family WORK: the small real family of tools/family/run_family.py (its models and mappers in WORK).
           For contexts of 512..8K tokens: the target's own prefill (transformers, use_cache=True: the cache it
           would build) against crosskv.hf.transfer_cache of the source's cache (the source already has it in a
           handoff), each the median of --repeats runs in this process, same threads.
model      the paper's pairs (Qwen3 14B -> 32B, Llama 3.1 8B -> 70B): flops and bytes of the target's prefill
           (bf16 weights) against a mapper's transfer (fp32 weights, k = 4 and k = all; + residual MLPs), and the
           roofline time of both on an H100 (989 TFLOP/s bf16 dense, 495 TFLOP/s TF32, 3.35 TB/s).

    .venv-capture/bin/python bench/transfer_vs_prefill.py --family /tmp/fam2 --json out.json
    python3 bench/transfer_vs_prefill.py --model-only
"""
import argparse
import json
import os
import statistics
import sys
import time

# Model configs (public config.json values).
PAIRS = {
    "Qwen3 14B -> 32B": (
        dict(layers=40, hidden=5120, q_heads=40, kv_heads=8, head_dim=128, inter=17408, vocab=151936),
        dict(layers=64, hidden=5120, q_heads=64, kv_heads=8, head_dim=128, inter=25600, vocab=151936)),
    "Llama 3.1 8B -> 70B": (
        dict(layers=32, hidden=4096, q_heads=32, kv_heads=8, head_dim=128, inter=14336, vocab=128256),
        dict(layers=80, hidden=8192, q_heads=64, kv_heads=8, head_dim=128, inter=28672, vocab=128256)),
}
H100 = dict(bf16=989e12, tf32=495e12, hbm=3.35e12)


def prefill_cost(c, T):
    """Flops and bytes of a causal prefill of T tokens that builds the cache (no logits but the last token's)."""
    q, kv, h = c["q_heads"] * c["head_dim"], c["kv_heads"] * c["head_dim"], c["hidden"]
    per_layer_params = h * (2 * q + 2 * kv) + 3 * h * c["inter"]
    params = c["layers"] * per_layer_params + c["vocab"] * h
    flops = 2 * T * c["layers"] * per_layer_params + 2 * c["layers"] * 2 * q * T * (T + 1) / 2 + 2 * h * c["vocab"]
    bytes_ = 2 * params + T * c["layers"] * 2 * kv * 2  # bf16 weights read once, the cache written
    return flops, bytes_


def transfer_cost(s, t, T, k, mlp_hidden=0):
    """Flops and bytes of applying a mapper with k source layers per target layer (fp32 weights) to T tokens."""
    F, G = s["kv_heads"] * s["head_dim"], t["kv_heads"] * t["head_dim"]
    K = k * F
    per_kind = K * G + (K * mlp_hidden + mlp_hidden ** 2 + mlp_hidden * G if mlp_hidden else 0)
    flops = 2 * T * t["layers"] * 2 * per_kind
    bytes_ = 4 * t["layers"] * 2 * per_kind + T * (s["layers"] * 2 * F + t["layers"] * 2 * G) * 2
    return flops, bytes_


def roofline(flops, bytes_, peak):
    return max(flops / peak, bytes_ / H100["hbm"])


def model_table():
    rows = []
    for name, (s, t) in PAIRS.items():
        for T in (512, 2048, 8192, 32768):
            pf, pb = prefill_cost(t, T)
            p_s = roofline(pf, pb, H100["bf16"])
            for label, k, mlp in (("k=4", 4, 0), ("k=all", s["layers"], 0), ("k=4 + MLP 1024", 4, 1024)):
                tf, tb = transfer_cost(s, t, T, k, mlp)
                t_s = roofline(tf, tb, H100["tf32"])
                rows.append(dict(pair=name, tokens=T, mapper=label, prefill_tflop=pf / 1e12, transfer_tflop=tf / 1e12,
                                 prefill_gb=pb / 1e9, transfer_gb=tb / 1e9, prefill_ms=1e3 * p_s,
                                 transfer_ms=1e3 * t_s, speedup=p_s / t_s))
    return rows


def measured(work, contexts, repeats, ks):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    import crosskv
    import crosskv.hf

    torch.set_num_threads(os.cpu_count() or 1)
    src = AutoModelForCausalLM.from_pretrained(os.path.join(work, "model-source")).eval()
    tgt = AutoModelForCausalLM.from_pretrained(os.path.join(work, "model-target")).eval()
    mappers = {k: crosskv.Mapper(os.path.join(work, d)) for k, d in ks}
    rng = np.random.default_rng(0)
    rows = []
    for T in contexts:
        ids = torch.as_tensor(rng.integers(0, src.config.vocab_size, size=(1, T)))

        def timed(f):
            times = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                out = f()
                times.append(time.perf_counter() - t0)
            return statistics.median(times), out

        with torch.no_grad():
            p_s, _ = timed(lambda: tgt(ids, use_cache=True).past_key_values)
            s_s, src_cache = timed(lambda: src(ids, use_cache=True).past_key_values)
        row = dict(tokens=T, target_prefill_s=p_s, source_prefill_s=s_s)
        for name, m in mappers.items():
            t_s, _ = timed(lambda: crosskv.hf.transfer_cache(m, src_cache))
            row[f"transfer_{name}_s"] = t_s
            row[f"speedup_{name}"] = p_s / t_s
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", help="run_family.py's WORK folder (models and mappers)")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--model-only", action="store_true")
    a = ap.parse_args()
    out = {"model": model_table()}
    print("| pair | tokens | mapper | prefill TFLOP | transfer TFLOP | prefill GB | transfer GB | prefill ms | "
          "transfer ms | speed-up |\n|---|---|---|---|---|---|---|---|---|---|")
    for r in out["model"]:
        print(f"| {r['pair']} | {r['tokens']} | {r['mapper']} | {r['prefill_tflop']:.1f} | {r['transfer_tflop']:.2f} | "
              f"{r['prefill_gb']:.1f} | {r['transfer_gb']:.2f} | {r['prefill_ms']:.1f} | {r['transfer_ms']:.2f} | "
              f"{r['speedup']:.1f}x |")
    if not a.model_only:
        if not a.family:
            ap.error("--family WORK (or --model-only)")
        ks = [(f"k{k}", f"out/k{k}") for k in ("1", "all")] + [("kall_ridge", "out-ridge/kall")]
        ks = [(n, d) for n, d in ks if os.path.isdir(os.path.join(a.family, d))]
        out["measured"] = measured(a.family, [int(x) for x in a.contexts.split(",")], a.repeats, ks)
        names = [n for n, _ in ks]
        print("\n| tokens | target prefill | source prefill | " + " | ".join(f"transfer {n}" for n in names) + " |")
        print("|---" * (3 + len(names)) + "|")
        for r in out["measured"]:
            print(f"| {r['tokens']} | {r['target_prefill_s'] * 1e3:.1f} ms | {r['source_prefill_s'] * 1e3:.1f} ms | " +
                  " | ".join(f"{r[f'transfer_{n}_s'] * 1e3:.1f} ms ({r[f'speedup_{n}']:.1f}x)" for n in names) + " |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
