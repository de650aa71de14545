#!/usr/bin/env python3
"""Time to the first token in vLLM: the target engine with crosskv.vllm mapping a stored source prefix, against the
same engine prefilling a context of the same length itself (prefix caching off, so each request is what it says).

shapes   family: the small family of docs/RESULTS.md (Qwen3-style, 4 layers of width 128 -> 8 of width 192, 2 KV
         heads of 32), random weights, mapper k = all. qwen3-32b: Qwen3 14B -> 32B at their real widths (5120, 8
         KV heads of 128, vocab 151936), random weights, the target cut to --depth decoder layers and the source to
         --source-depth, mapper k = --k: each target layer costs what it costs in the full models on both sides
         (its prefill; its mapping from k source layers), so the ratio at a depth is near the full model's.
Mapper: random weights of the real shape (bench/synthetic_mapper.py); the weights do not change its cost.
The source engine saves each context's KV first; then, per context, the median of --repeats requests each way,
the kinds in turn. A request is the stored context plus --suffix new tokens (the next turn, which the target
computes either way). --layerwise both also times the connector with every layer mapped before the forward
(layerwise: false) beside its default, layer l mapped on a thread while the model computes the layers before it.
--tp N runs both engines with tensor parallelism N (each worker maps its own KV heads). Map time per layer: from the
target engine's log, each worker's read, check and map of a prefix over the target's layers (median per context;
the slowest worker's).
--scenario system-prompt: the source answers --questions requests that share a system prompt of the first
--contexts length (its chunks stored once); the target then gets as many other questions after the same system
prompt. Each maps the system prompt's stored chunks and computes its own question (--suffix tokens): the hit rate,
and each request's time to the first token against the same engine prefilling a fresh request as long.

    .venv-vllm/bin/python bench/vllm_ttft.py WORK --shape family --contexts 512,1024,2048,4096,8192
    .venv-vllm/bin/python bench/vllm_ttft.py WORK --shape qwen3-32b --depth 1 --source-depth 4 --k 4 \
        --contexts 512,1024,2048
    .venv-vllm/bin/python bench/vllm_ttft.py WORK --shape family --contexts 1024,4096 --suffix 256 --layerwise both
    .venv-vllm/bin/python bench/vllm_ttft.py WORK --shape family --contexts 512,1024,2048 --tp 2
    .venv-vllm/bin/python bench/vllm_ttft.py WORK --shape family --scenario system-prompt --contexts 1024 \
        --suffix 64 --questions 8
"""
import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {  # source, target: layers, hidden, q heads, kv heads, head dim, intermediate, vocab
    "family": (dict(layers=4, hidden=128, q=4, kv=2, dim=32, inter=512, vocab=257),
               dict(layers=8, hidden=192, q=4, kv=2, dim=32, inter=768, vocab=257)),
    "qwen3-32b": (dict(layers=40, hidden=5120, q=40, kv=8, dim=128, inter=17408, vocab=151936),
                  dict(layers=64, hidden=5120, q=64, kv=8, dim=128, inter=25600, vocab=151936)),
}
ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine(model, connector, role, max_len, tp=1):
    from vllm import LLM

    kv = {"kv_connector": "CrossKVConnector", "kv_connector_module_path": "crosskv.vllm", "kv_role": role,
          "kv_load_failure_policy": "recompute", "kv_connector_extra_config": connector}
    return LLM(model=model, enforce_eager=True, dtype="float32", block_size=32, max_model_len=max_len + 64,
               kv_cache_memory_bytes=int(os.environ.get("TTFT_KV_BYTES", 2 << 30)), enable_prefix_caching=False,
               kv_transfer_config=kv, seed=0, skip_tokenizer_init=True,
               **({"tensor_parallel_size": tp, "distributed_executor_backend": "mp"} if tp > 1 else {}))


def serve(job_path, out_path):
    from vllm import SamplingParams

    job = json.load(open(job_path))
    llm = engine(job["model"], job["connector"], job["role"], max(len(p) for p in job["prompts"]), job.get("tp", 1))
    one = SamplingParams(max_tokens=1, temperature=0, detokenize=False)
    res = []
    llm.generate([{"prompt_token_ids": job["prompts"][0][:64]}], one, use_tqdm=False)  # warm-up
    for p in job["prompts"]:
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": p}], one, use_tqdm=False)[0]
        res.append({"s": time.perf_counter() - t0, "kv": out.kv_transfer_params})
    for _ in range(2):  # a source engine saves finished requests' KV on the next steps
        llm.llm_engine.step()
    json.dump(res, open(out_path, "w"))


def run(job, name, work):
    path = os.path.join(work, name + ".job.json")
    json.dump(job, open(path, "w"))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--serve", path, os.path.join(work, name + ".json")],
                       env={**os.environ, **ENV}, capture_output=True, text=True)
    open(os.path.join(work, name + ".log"), "w").write(r.stdout + r.stderr)
    if r.returncode != 0:
        sys.exit(f"the {name} engine failed (see {work}/{name}.log):\n{r.stderr[-2000:]}")
    return json.load(open(os.path.join(work, name + ".json")))


def make_models(work, shape, depth, source_depth, k):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    sys.path.insert(0, HERE)
    from synthetic_mapper import kv_spec, write_mapper

    specs = []
    for name, c in zip(("source", "target"), SHAPES[shape]):
        layers = (source_depth if name == "source" else depth) or c["layers"]
        torch.manual_seed(len(name))
        cfg = Qwen3Config(vocab_size=c["vocab"], hidden_size=c["hidden"], intermediate_size=c["inter"],
                          num_hidden_layers=layers, num_attention_heads=c["q"], num_key_value_heads=c["kv"],
                          head_dim=c["dim"], max_position_embeddings=40960, rope_theta=1e6, tie_word_embeddings=False)
        Qwen3ForCausalLM(cfg).eval().save_pretrained(os.path.join(work, f"model-{name}"))
        specs.append(kv_spec(layers, c["kv"], c["dim"], c["q"], 1e6))
    write_mapper(os.path.join(work, "mapper", "kall"), specs[0], specs[1], k=min(k or specs[0]["n_layers"],
                                                                                 specs[0]["n_layers"]))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work", nargs="?")
    ap.add_argument("--shape", choices=SHAPES, default="family")
    ap.add_argument("--depth", type=int, default=0, help="the target's decoder layers (0: its own)")
    ap.add_argument("--source-depth", type=int, default=0, help="the source's decoder layers (0: its own)")
    ap.add_argument("--k", type=int, default=0, help="source layers per target layer (0: all)")
    ap.add_argument("--contexts", default="512,1024,2048,4096,8192")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--suffix", type=int, default=1, help="new tokens after the stored context")
    ap.add_argument("--layerwise", choices=["on", "off", "both"], default="on",
                    help="the connector's layerwise setting (both: time each)")
    ap.add_argument("--tp", type=int, default=1, help="tensor parallelism of both engines")
    ap.add_argument("--scenario", choices=["context", "system-prompt"], default="context")
    ap.add_argument("--questions", type=int, default=8, help="system-prompt: requests each side")
    ap.add_argument("--json")
    ap.add_argument("--serve", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve(*a.serve)
    import numpy as np

    import crosskv

    work = os.path.abspath(a.work)
    os.makedirs(work, exist_ok=True)
    make_models(work, a.shape, a.depth, a.source_depth, a.k)
    contexts = [int(c) for c in a.contexts.split(",")]
    rng = np.random.default_rng(0)
    vocab = SHAPES[a.shape][0]["vocab"]
    prefixes = [rng.integers(1, vocab, n).tolist() for n in contexts]
    store = {"store": os.path.join(work, "store")}
    if a.scenario == "system-prompt":
        return system_prompt(a, work, store, rng, vocab)
    run({"model": os.path.join(work, "model-source"), "connector": store, "role": "kv_producer",
         "prompts": prefixes, "tp": a.tp}, "source", work)
    modes = {"on": [True], "off": [False], "both": [True, False]}[a.layerwise]
    prompts = []  # per context and repeat, in turn: the stored context + the suffix; a fresh context as long
    for n, p in zip(contexts, prefixes):
        for _ in range(a.repeats):
            prompts += [p + rng.integers(1, vocab, a.suffix).tolist(), rng.integers(1, vocab, n + a.suffix).tolist()]
    mapper = os.path.join(work, "mapper", "kall")
    res = {lw: run({"model": os.path.join(work, "model-target"), "role": "kv_consumer", "prompts": prompts,
                    "connector": {**store, "mapper": mapper, "layerwise": lw}, "tp": a.tp}, f"target-layerwise-{lw}",
                   work)
           for lw in modes}  # one engine per setting, each timing its own prefill too (the same engine, in turn)
    kinds = [("layer by layer" if lw else "all layers first") for lw in modes]
    rows = []
    print(f"CPU: {crosskv.blas}")
    cut = f", target {a.depth} / source {a.source_depth} layers, k = {a.k or 'all'}" if a.depth else ""
    cut += f", tensor parallel {a.tp}" if a.tp > 1 else ""
    maps = {}  # (worker, tokens) -> ms per layer, from the connector's log lines
    for line in open(os.path.join(work, f"target-layerwise-{modes[0]}.log")):
        if m := re.search(r"crosskv: worker (\d+) mapped request \S+: (\d+) tokens, [\d.]+ ms \(([\d.]+) ms per layer", line):
            maps.setdefault((int(m.group(1)), int(m.group(2))), []).append(float(m.group(3)))
    print(f"{a.shape}{cut}, {a.suffix} new token(s) after the context: time to the first token, median of "
          f"{a.repeats} (ms)\n  context" + "".join(f"  {k:>16}" for k in kinds) + "   own prefill   speed-up"
          "   map/layer")
    for i, n in enumerate(contexts):
        t, own = {}, []
        for lw, k in zip(modes, kinds):
            mine = res[lw][2 * i * a.repeats:2 * (i + 1) * a.repeats]
            m, o = mine[0::2], mine[1::2]
            assert all(x["kv"]["crosskv"]["status"] == "applied" for x in m), m[0]["kv"]
            t[k] = statistics.median(x["s"] for x in m)
            own += [x["s"] for x in o]
        to = statistics.median(own)
        map_ms = max((statistics.median(v) for (w, tokens), v in maps.items() if tokens == n), default=float("nan"))
        row = {"context": n, "suffix": a.suffix, "own_prefill_s": to, "speedup": to / t[kinds[0]], "tp": a.tp,
               "map_ms_per_layer": map_ms}
        row.update({("crosskv_s" if lw else "crosskv_all_layers_first_s"): t[k] for lw, k in zip(modes, kinds)})
        rows.append(row)
        print(f"  {n:7d}" + "".join(f"  {t[k] * 1e3:16.1f}" for k in kinds) + f"   {to * 1e3:11.1f}"
              f"   {row['speedup']:7.2f}x   {row['map_ms_per_layer']:6.2f} ms")
    if a.json:
        json.dump({"shape": a.shape, "depth": a.depth, "source_depth": a.source_depth, "k": a.k, "suffix": a.suffix,
                   "blas": crosskv.blas, "rows": rows}, open(a.json, "w"), indent=2)


def system_prompt(a, work, store, rng, vocab):
    import crosskv

    system = rng.integers(1, vocab, int(a.contexts.split(",")[0])).tolist()
    ask = lambda: [system + rng.integers(1, vocab, a.suffix).tolist() for _ in range(a.questions)]  # noqa: E731
    run({"model": os.path.join(work, "model-source"), "connector": store, "role": "kv_producer", "prompts": ask(),
         "tp": a.tp}, "source", work)
    prompts = []
    for p in ask():  # each request, then a fresh one as long (the same engine's own prefill)
        prompts += [p, rng.integers(1, vocab, len(p)).tolist()]
    res = run({"model": os.path.join(work, "model-target"), "role": "kv_consumer", "prompts": prompts, "tp": a.tp,
               "connector": {**store, "mapper": os.path.join(work, "mapper", "kall")}}, "target", work)
    mine, own = res[0::2], res[1::2]
    hits = [x["kv"]["crosskv"] for x in mine if x["kv"]["crosskv"]["status"] == "applied"]
    t, to = statistics.median(x["s"] for x in mine), statistics.median(x["s"] for x in own)
    row = {"system_tokens": len(system), "question_tokens": a.suffix, "requests": a.questions, "hits": len(hits),
           "mapped_tokens": sorted({h["tokens"] for h in hits}), "crosskv_s": t, "own_prefill_s": to,
           "speedup": to / t}
    print(f"CPU: {crosskv.blas}")
    print(f"{a.shape}: a {len(system)}-token system prompt, {a.questions} new questions of {a.suffix} tokens: "
          f"{len(hits)}/{a.questions} mapped ({row['mapped_tokens']} tokens each); time to the first token, median: "
          f"{t * 1e3:.1f} ms against {to * 1e3:.1f} ms of own prefill ({row['speedup']:.2f}x)")
    if a.json:
        json.dump({"shape": a.shape, "scenario": a.scenario, "blas": crosskv.blas, "rows": [row]}, open(a.json, "w"),
                  indent=2)


if __name__ == "__main__":
    main()
