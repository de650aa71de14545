#!/usr/bin/env python3
"""Transfer vs re-prefill: what a model switch costs the target with and without a mapper.

measured   --family WORK: the small real family of tools/family/run_family.py (its models and mappers in WORK).
           For contexts of 512..8K tokens: the target's own prefill (transformers, use_cache=True: the cache it
           would build) against crosskv.hf.transfer_cache of the source's cache (the source already has it in a
           handoff), each the median of --repeats runs in this process, same threads.
paper      --paper WORK: measured at the paper's pairs' real shapes without their weights: the target model with its
           real config and random weights (transformers), truncated to --depths decoder layers, against
           crosskv.hf.transfer_cache of a source cache of the real shape through a random mapper of the real
           source -> target shape (k = 4, k = all; bench/synthetic_mapper.py) with --mapper-depths target layers.
           Two or more depths give, per context and side, a fixed and a per-layer cost (least squares), hence the
           full depth's times: prefill(Lt) against transfer(Lt). --device cuda (bf16 model, mapper on the GPU, caches never leave it) or cpu (fp32).
model      the paper's pairs (Qwen3 14B -> 32B, Llama 3.1 8B -> 70B): flops and bytes of the target's prefill
           (bf16 weights) against a mapper's transfer (fp32 weights, k = 4 and k = all; + residual MLPs), and the
           roofline time of both on an H100 (989 TFLOP/s bf16 dense, 495 TFLOP/s TF32, 3.35 TB/s).

    .venv-capture/bin/python bench/transfer_vs_prefill.py --family /tmp/fam2 --json out.json
    python3 bench/transfer_vs_prefill.py --model-only
    .venv-capture/bin/python bench/transfer_vs_prefill.py --paper /tmp/paper --depths 1,2 --contexts 512,2048
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
# What transformers and crosskv need beyond PAIRS: the architecture and its rope (public config.json values).
HF = {
    "Qwen3 14B -> 32B": ("Qwen3", dict(rope_theta=1e6, max_position_embeddings=40960), dict(theta=1e6)),
    "Llama 3.1 8B -> 70B": ("Llama", dict(rope_theta=5e5, max_position_embeddings=131072, rope_scaling=dict(
        rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=8192)), dict(theta=5e5, rope_type="llama3", factor=8, low_freq_factor=1,
                                                        high_freq_factor=4, original_max_position_embeddings=8192)),
}


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


def median_time(f, repeats, warmup=0, sync=lambda: None):
    """(median seconds of `repeats` calls of f after `warmup` untimed ones, f's last result); `sync` waits for a
    device before and after each call."""
    times, out = [], None
    for _ in range(warmup + repeats):
        sync()
        t0 = time.perf_counter()
        out = f()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[warmup:]), out


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
        timed = lambda f: median_time(f, repeats)  # noqa: E731
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


def paper_measured(work, pairs, depths, mapper_depths, contexts, repeats, device, tf32):
    """Prefill of the real-config target (random weights, `depth` layers) against transfer_cache of a random
    real-shape mapper with as many target layers; per pair and context, both fitted as fixed + per-layer cost."""
    import numpy as np
    import torch
    import transformers
    from transformers import DynamicCache

    import crosskv
    import crosskv.hf

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from synthetic_mapper import kv_spec, write_mapper

    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)
    torch.set_num_threads(os.cpu_count() or 1)

    timed = lambda f: median_time(f, repeats, warmup=1, sync=sync)[0]  # noqa: E731

    points = []  # one per (pair, side, depth, tokens)
    for name in pairs:
        s, t = PAIRS[name]
        arch, hf_kw, rope = HF[name]
        src_spec = kv_spec(s["layers"], s["kv_heads"], s["head_dim"], s["q_heads"], **rope)
        for depth in depths:  # the target's prefill, `depth` decoder layers of the real width
            cfg = getattr(transformers, f"{arch}Config")(
                hidden_size=t["hidden"], intermediate_size=t["inter"], num_attention_heads=t["q_heads"],
                num_key_value_heads=t["kv_heads"], head_dim=t["head_dim"], vocab_size=t["vocab"],
                num_hidden_layers=depth, **hf_kw)
            torch.manual_seed(0)
            # Made in `dtype` where it runs (a 32B model in fp32 on the host first would not fit a GPU machine's RAM).
            default = torch.get_default_dtype()
            torch.set_default_dtype(dtype)
            try:
                with torch.device(device):
                    model = transformers.AutoModel.from_config(cfg).eval()
            finally:
                torch.set_default_dtype(default)
            for T in contexts:
                ids = torch.randint(0, t["vocab"], (1, T), device=device)
                with torch.no_grad():
                    points.append(dict(pair=name, side="prefill", depth=depth, tokens=T,
                                       s=timed(lambda: model(ids, use_cache=True))))
                print(json.dumps(points[-1]), file=sys.stderr, flush=True)
            del model
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        caches = {}
        for T in contexts:  # the source's cache, as the source model holds it
            cache = DynamicCache()
            for l in range(s["layers"]):
                kv = [torch.randn(1, s["kv_heads"], T, s["head_dim"], device=device, dtype=dtype) for _ in "kv"]
                cache.update(kv[0], kv[1], l)
            caches[T] = cache
        for depth in mapper_depths:  # the transfer into `depth` target layers
            tgt_spec = kv_spec(depth, t["kv_heads"], t["head_dim"], t["q_heads"], **rope)
            for label, k in (("k=4", 4), ("k=all", s["layers"])):
                d = os.path.join(work, f"{name.split()[0]}-{label}-{depth}".replace("=", ""))
                if not os.path.exists(os.path.join(d, "manifest.json")):
                    write_mapper(d, src_spec, tgt_spec, k)
                m = crosskv.Mapper(d, device=device, tf32=tf32)
                for T in contexts:
                    points.append(dict(pair=name, side=f"transfer {label}", depth=depth, tokens=T,
                                       s=timed(lambda: crosskv.hf.transfer_cache(m, caches[T]))))
                    print(json.dumps(points[-1]), file=sys.stderr, flush=True)
                del m
        del caches
    # Fixed + per-layer cost per (pair, side, tokens) by least squares, extrapolated to the target's full depth.
    rows = []
    for name in pairs:
        Lt = PAIRS[name][1]["layers"]
        for T in contexts:
            row = dict(pair=name, tokens=T, full_depth=Lt)
            for side in ("prefill", "transfer k=4", "transfer k=all"):
                pts = [p for p in points if p["pair"] == name and p["tokens"] == T and p["side"] == side]
                x = np.array([p["depth"] for p in pts], dtype=float)
                y = np.array([p["s"] for p in pts])
                per, fixed = np.polyfit(x, y, 1) if len(set(x)) > 1 else (y[0] / x[0], 0.0)
                row[side] = dict(depths=x.astype(int).tolist(), seconds=y.tolist(), per_layer_s=per,
                                 fixed_s=fixed, full_s=fixed + per * Lt)
            for label in ("k=4", "k=all"):
                row[f"speedup {label}"] = row["prefill"]["full_s"] / row[f"transfer {label}"]["full_s"]
            rows.append(row)
    return dict(points=points, full=rows, device=device, dtype=str(dtype), tf32=tf32)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--family", help="run_family.py's WORK folder (models and mappers)")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--model-only", action="store_true")
    ap.add_argument("--paper", metavar="WORK", help="measure at the paper's real shapes (random weights); mappers in WORK")
    ap.add_argument("--pairs", default=",".join(PAIRS), help="--paper: which pairs (comma-separated)")
    ap.add_argument("--depths", default="1,2", help="--paper: target decoder layers to time (two or more: a fit)")
    ap.add_argument("--mapper-depths", default="2,8", help="--paper: target layers of the timed mappers")
    ap.add_argument("--device", default="cpu", help="--paper: cpu (fp32) or cuda (bf16 model, mapper on the GPU)")
    ap.add_argument("--tf32", action="store_true", help="--paper: the mapper's GPU products on TF32 tensor cores")
    a = ap.parse_args()
    if a.paper:
        res = paper_measured(a.paper, a.pairs.split(","), [int(x) for x in a.depths.split(",")],
                             [int(x) for x in a.mapper_depths.split(",")],
                             [int(x) for x in a.contexts.split(",")], a.repeats, a.device, a.tf32)
        print("| pair | tokens | prefill per layer | transfer per target layer, k=4 / k=all | full depth: prefill | "
              "transfer k=4 | transfer k=all | speed-up k=4 | speed-up k=all |\n|---|---|---|---|---|---|---|---|---|")
        for r in res["full"]:
            p, t4, ta = r["prefill"], r["transfer k=4"], r["transfer k=all"]
            print(f"| {r['pair']} | {r['tokens']} | {p['per_layer_s'] * 1e3:.0f} ms | {t4['per_layer_s'] * 1e3:.2f} / "
                  f"{ta['per_layer_s'] * 1e3:.2f} ms | {p['full_s']:.2f} s ({r['full_depth']} layers) | "
                  f"{t4['full_s'] * 1e3:.0f} ms | {ta['full_s'] * 1e3:.0f} ms | {r['speedup k=4']:.1f}x | "
                  f"{r['speedup k=all']:.1f}x |")
        if a.json:
            with open(a.json, "w") as f:
                json.dump(res, f, indent=2)
        return
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
