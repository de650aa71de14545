"""crosskv.vllm's parts that need no engine, under pytest in the vLLM environment: the connector against the installed
vLLM's interface, its CUDA-graph declaration, the models it refuses, the one KV-spec reader, the store guard's
deadlines and breaker, the background saver under faults, chunks in the cache's own dtype, and LayerByLayer's
failures at any layer.

    .venv-vllm/bin/python -m pytest tests/python/test_vllm_units.py [-k NAME]
"""
import json
import re
import threading
import time
from types import SimpleNamespace

import numpy as np

import pytest
import torch

from crosskv import MapperError, kvspec
from crosskv.vllm import config as cfg
from crosskv.vllm import store as st
from crosskv.vllm.api import api_mismatches
from crosskv.vllm.connector import CrossKVConnector
from crosskv.vllm.guard import HEALTHY, PROBING, UNHEALTHY, StoreGuard
from crosskv.vllm.layout import PagedLayout, slots_of
from crosskv.vllm.metadata import LoadPlan
from crosskv.vllm.saver import ABANDONED, DROPPED, FAILED, SHARED, STORED, Saver, SaveJob
from crosskv.vllm.worker import LayerByLayer, SourcePrefix
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1


# ---------------------------------------------------------------------------------------------- the vLLM API
def test_connector_fits_the_installed_base_class():
    assert api_mismatches(CrossKVConnector, KVConnectorBase_V1) == []


def test_api_check_catches_planted_bugs():
    class MissingMethod(CrossKVConnector):
        pass

    MissingMethod.__abstractmethods__ = frozenset({"wait_for_save"})
    MissingMethod.wait_for_save = KVConnectorBase_V1.wait_for_save

    class WrongSignature(CrossKVConnector):
        def get_finished(self, finished):  # the base names it finished_req_ids
            return None, None

    class TwoArgumentConstructor(CrossKVConnector):
        def __init__(self, vllm_config, role):
            pass

    class DroppedParameter(CrossKVConnector):
        def get_num_new_matched_tokens(self, request):  # num_computed_tokens dropped
            return 0, False

    assert any("wait_for_save" in m for m in api_mismatches(MissingMethod, KVConnectorBase_V1))
    assert any(m.startswith("get_finished: takes (self, finished)") for m in
               api_mismatches(WrongSignature, KVConnectorBase_V1))
    assert any(m.startswith("__init__:") for m in api_mismatches(TwoArgumentConstructor, KVConnectorBase_V1))
    assert [m.split(":")[0] for m in api_mismatches(DroppedParameter, KVConnectorBase_V1)] == \
        ["get_num_new_matched_tokens"]


@pytest.mark.parametrize("extra, want", [({"store": "s", "mapper": "m"}, True),
                                         ({"store": "s", "mapper": "m", "layerwise": False}, True),
                                         ({"store": "s", "mapper": "m", "layerwise": True}, True),
                                         ({"store": "s"}, False), ({}, False), (None, False)])
def test_piecewise_cudagraphs_whenever_the_connector_writes_in_the_forward(extra, want):
    assert CrossKVConnector.requires_piecewise_for_cudagraph(extra) is want


def test_best_effort_delivery():
    assert CrossKVConnector.requires_kv_delivery.fget(None) is False


# ----------------------------------------------------------------------------------- models it cannot map
def _qwen3(**kw):
    from transformers import Qwen3Config

    return Qwen3Config(vocab_size=257, hidden_size=64, intermediate_size=128, head_dim=32, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, **kw)


def test_full_attention_models_are_mappable():
    assert cfg.unmappable(_qwen3()) is None
    full = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=_spec("FullAttentionSpec"))])
    assert cfg.unmappable(_qwen3(), full) is None


def _spec(name, **kw):
    return type(name, (), kw)()


@pytest.mark.parametrize("config, groups, want", [
    (SimpleNamespace(layer_types=["sliding_attention", "full_attention"]), None,
     "layer_types holds sliding_attention"),
    (SimpleNamespace(layer_types=["mamba", "full_attention"]), None, "layer_types holds mamba"),
    (SimpleNamespace(sliding_window=4096), None, "sliding-window attention (sliding_window 4096)"),
    (SimpleNamespace(attention_chunk_size=8192), None, "chunked local attention"),
    (SimpleNamespace(kv_lora_rank=512), None, "multi-head latent attention"),
    (SimpleNamespace(), [_spec("FullAttentionSpec"), _spec("SlidingWindowSpec", sliding_window=512)],
     "KV cache has 2 groups (FullAttentionSpec, SlidingWindowSpec)"),
    (SimpleNamespace(), [_spec("MambaSpec")], "caches its layers as MambaSpec"),
    (SimpleNamespace(), [_spec("FullAttentionSpec", sliding_window=1024)], "(sliding_window 1024)"),
    (SimpleNamespace(), [_spec("MLAAttentionSpec")], "caches its layers as MLAAttentionSpec"),
])
def test_hybrid_and_windowed_models_are_refused_by_name(config, groups, want):
    kv = SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=g) for g in groups]) if groups else None
    assert want in (cfg.unmappable(config, kv) or "")


def test_qwen3_sliding_window_off_is_mappable():
    assert cfg.unmappable(_qwen3(sliding_window=4096, use_sliding_window=False)) is None


# ------------------------------------------------------------------------------------------- the spec reader
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192, "rope_theta": 5e5}


def test_reader_gives_every_rope_parameter():
    s = kvspec.kv_spec_from_config(_qwen3(rope_parameters=dict(YARN)))
    assert (s["n_layers"], s["n_kv_heads"], s["head_dim"]) == (2, 2, 32)
    assert s["rope"]["type"] == "yarn" and s["rope"]["factor"] == 4.0 and s["rope"]["theta"] == 1e6
    assert s["rope"]["original_max_position_embeddings"] == 1024.0 and s["rope"]["rotary_dim"] == 32
    s = kvspec.kv_spec_from_config(_qwen3(rope_parameters=dict(LLAMA3)))
    assert {k: s["rope"][k] for k in ("factor", "low_freq_factor", "high_freq_factor")} == {
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0}


def test_reader_refuses_dynamic_rope():
    with pytest.raises(kvspec.KvSpecError, match="'dynamic' is not supported"):
        kvspec.kv_spec_from_config(_qwen3(rope_parameters={"rope_type": "dynamic", "factor": 2.0,
                                                            "rope_theta": 1e6}))


def _rope(**kw):
    return kvspec.normal_rope({"type": "yarn", "theta": 1e6, "rotary_dim": 32, "factor": 4.0,
                               "original_max_position_embeddings": 1024.0, "beta_fast": 32.0, "beta_slow": 1.0,
                               "mscale": 1.0, "mscale_all_dim": 0.0, "attention_factor": None,
                               "low_freq_factor": None, "high_freq_factor": None, **kw})


@pytest.mark.parametrize("key, value", [("type", "llama3"), ("theta", 5e5), ("rotary_dim", 16), ("factor", 8.0),
                                        ("low_freq_factor", 1.0), ("high_freq_factor", 4.0),
                                        ("original_max_position_embeddings", 4096.0), ("beta_fast", 16.0),
                                        ("beta_slow", 2.0), ("mscale", 0.707), ("mscale_all_dim", 1.0),
                                        ("attention_factor", 1.2), ("convention", "interleaved"),
                                        ("truncate", False)])
def test_every_rope_parameter_is_compared(key, value):
    want = {"n_layers": 2, "n_kv_heads": 2, "head_dim": 32, "rope": _rope()}
    got = {**want, "rope": _rope(**{key: value})}
    assert kvspec.spec_mismatch(want, want, "target") is None
    why = kvspec.spec_mismatch(want, got, "target")
    assert why and why.startswith(f"the mapper's target has RoPE {key} ")


def test_engine_override_differs_from_capture():
    """A target served with a YaRN override (hf_overrides), against a mapper captured without it, and one whose
    factor differs: both named."""
    plain = kvspec.kv_spec_from_config(_qwen3(rope_parameters={"rope_type": "default", "rope_theta": 1e6}))
    yarn4 = kvspec.kv_spec_from_config(_qwen3(rope_parameters=dict(YARN)))
    yarn2 = kvspec.kv_spec_from_config(_qwen3(rope_parameters={**YARN, "factor": 2.0}))
    assert "RoPE type 'default', the model's 'yarn'" in kvspec.spec_mismatch(plain, yarn4, "target")
    assert "RoPE factor 4.0, the model's 2.0" in kvspec.spec_mismatch(yarn4, yarn2, "target")


def _gemma3_4x(**kw):
    """Gemma 3 as transformers 4.x configures it: layer_types, one rope_theta, rope_local_base_freq."""
    base = dict(num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=1, head_dim=16, rope_theta=1e6,
                rope_scaling=None, rope_local_base_freq=1e4, sliding_window=512, model_type="gemma3_text",
                layer_types=["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"])
    return SimpleNamespace(**{**base, **kw})


def test_reader_gives_gemma3s_local_and_global_layers():
    """transformers 5 (rope_parameters per layer type) and 4.x (rope_local_base_freq) read alike: the sliding layers
    rotate with theta 1e4 and attend to 512 tokens, the global ones with 1e6."""
    from transformers import Gemma3TextConfig

    v5 = kvspec.kv_spec_from_config(Gemma3TextConfig(num_hidden_layers=6, sliding_window=512, head_dim=16,
                                                     num_attention_heads=4, num_key_value_heads=1))
    assert v5["rope"]["theta"] == 1e6
    assert [(x["attention"], x["window"], x["rope"]["theta"]) for x in v5["layers"]] == \
        [("sliding", 512, 1e4)] * 5 + [("full", None, 1e6)]
    v4 = kvspec.kv_spec_from_config(_gemma3_4x())
    assert [(x["attention"], x["window"], x["rope"]["theta"]) for x in v4["layers"]] == \
        [("sliding", 512, 1e4)] * 3 + [("full", None, 1e6)]
    assert kvspec.spec_mismatch(v4, v4, "target") is None


def test_reader_gives_the_attentions_score_scale_where_it_is_not_the_head_dims():
    """Gemma's query_pre_attn_scalar (Gemma 2 27B: 144 with head_dim 128) and Granite's attention_multiplier; none
    where the scale is 1/sqrt(head_dim) (Gemma 3 270M: 256 = head_dim)."""
    assert kvspec.kv_spec_from_config(_gemma3_4x(head_dim=128, query_pre_attn_scalar=144))["query_scale"] == \
        pytest.approx(1 / 12)
    assert "query_scale" not in kvspec.kv_spec_from_config(_gemma3_4x(query_pre_attn_scalar=16))
    assert kvspec.kv_spec_from_config(_qwen3(attention_multiplier=0.015625))["query_scale"] == 0.015625
    assert "query_scale" not in kvspec.kv_spec_from_config(_qwen3())
    with pytest.raises(kvspec.KvSpecError, match="score scale"):
        kvspec.kv_spec_from_config(_gemma3_4x(query_pre_attn_scalar=-1.0))


def test_reader_writes_no_layers_where_every_layer_is_the_default():
    assert "layers" not in kvspec.kv_spec_from_config(_qwen3())  # layer_types all full_attention
    assert "layers" not in kvspec.kv_spec_from_config(_gemma3_4x(layer_types=["full_attention"] * 4))


def test_reader_marks_layers_without_rope():
    s = kvspec.kv_spec_from_config(_gemma3_4x(layer_types=None, sliding_window=None, no_rope_layers=[1, 1, 1, 0]))
    assert [x["rope"]["type"] for x in s["layers"]] == ["default", "default", "default", "none"]
    s = kvspec.kv_spec_from_config(_gemma3_4x(model_type="cohere2", rope_local_base_freq=None))
    assert [x["rope"]["type"] for x in s["layers"]] == ["default"] * 3 + ["none"]


@pytest.mark.parametrize("kw, why", [
    (dict(attention_chunk_size=8192), "attention_chunk_size 8192 (chunked attention) is not supported"),
    (dict(layer_types=["sliding_attention"] * 3 + ["linear_attention"]), "layer_types 'linear_attention' is not"),
    (dict(layer_types=["full_attention"] * 3), "layer_types has 3 entries for 4 layers"),
    (dict(sliding_window=None), "sliding_attention layers need a positive sliding_window, got None"),
])
def test_reader_refuses_layers_it_cannot_represent(kw, why):
    with pytest.raises(kvspec.KvSpecError, match=re.escape(why)):
        kvspec.kv_spec_from_config(_gemma3_4x(**kw), "gemma.gguf")


def test_a_layers_attention_and_rope_are_compared():
    want = kvspec.kv_spec_from_config(_gemma3_4x())
    one_theta = kvspec.kv_spec_from_config(_gemma3_4x(rope_local_base_freq=None))  # every layer 1e6: before
    assert kvspec.spec_mismatch(want, one_theta, "source") == \
        "the mapper's source has layer 0 RoPE theta 10000.0, the model's 1000000.0"
    wider = kvspec.kv_spec_from_config(_gemma3_4x(sliding_window=1024))
    assert kvspec.spec_mismatch(want, wider, "target") == "the mapper's target has layer 0 window 512, the model's 1024"


# ---------------------------------------------------------------------------------------------- the guard
class Clock:
    def __init__(self):
        self.t = 0.0

    def __call__(self):
        return self.t


# ---- outcomes
def test_an_outcome_reports_what_is_set():
    from crosskv.vllm.metadata import CrossKVWorkerMetadata, applied, fallback

    f = fallback("the store is down", "store_unreachable")
    assert f.params() == {"status": "fallback_reprefill", "reason": "the store is down", "kind": "store_unreachable"}
    assert f.klass == "fallback_reprefill:store_unreachable" and f.line() == "fallback_reprefill: the store is down"
    a = applied(64, 96, "out/k2", stopped="chunk 2: damaged", map_ms=1.5)
    assert a.params() == {"status": "applied", "tokens": 64, "prefix_tokens": 96, "mapper": "out/k2", "map_ms": 1.5,
                          "stopped": "chunk 2: damaged"}
    assert "64 tokens mapped by out/k2 (the stored run stops at chunk 2: damaged)" in a.line()
    # two workers' outcomes: a failure fails the request, and the fewest tokens mapped win
    merged = CrossKVWorkerMetadata({"r": a, "s": applied(32, 32, "m")}).aggregate(
        CrossKVWorkerMetadata({"r": applied(48, 96, "out/k2"), "s": f}))
    assert merged.outcomes["r"].tokens == 48 and merged.outcomes["s"].kind == "store_unreachable"


# ---- the held-out verdict's class gates serving
def _eval_file(tmp_path, doc):
    (tmp_path / "k2").mkdir()
    (tmp_path / "eval-k2.json").write_text(json.dumps(doc))
    return str(tmp_path / "k2")


@pytest.mark.parametrize("doc,want", [
    ({"verdict": "NOT READY: x", "verdict_class": "not_ready"}, "not_ready"),
    ({"verdict": "UNCERTAIN (R2 only): x", "verdict_class": "uncertain"}, "uncertain"),
    ({"verdict": "LIKELY TO TRANSFER: x", "verdict_class": "likely"}, "likely"),
    ({"verdict": "UNCERTAIN (R2 only): written before verdict_class"}, "uncertain"),
    ({"verdict": "NOT READY: written before verdict_class"}, "not_ready")])
def test_the_verdict_class_is_read(tmp_path, doc, want):
    assert cfg.mapper_verdict(_eval_file(tmp_path, doc)) == (want, doc["verdict"])


@pytest.mark.parametrize("doc", [{"verdict": "LIKELY TO TRANSFER", "verdict_class": "probably"},
                                 {"verdict": "MAYBE: a text without a class"}])
def test_an_unknown_verdict_class_stops_the_engine(tmp_path, doc):
    with pytest.raises(cfg.CrossKVConfigError, match="verdict_class: expected one of likely, uncertain, not_ready"):
        cfg.mapper_verdict(_eval_file(tmp_path, doc))


@pytest.mark.parametrize("cls,allow,refused", [("likely", {}, False), ("uncertain", {}, True),
                                               ("not_ready", {}, True), ("uncertain", {"allow_uncertain": True}, False),
                                               ("not_ready", {"allow_not_ready": True}, False),
                                               ("not_ready", {"allow_uncertain": True}, True),
                                               ("uncertain", {"allow_not_ready": True}, True)])
def test_uncertain_and_not_ready_are_refused_each_by_name(cls, allow, refused):
    from crosskv.vllm.context import verdict_refusal

    got = verdict_refusal((cls, f"{cls.upper()}: text"), cfg.Settings(store="s", **allow))
    assert bool(got) == refused
    if refused:
        assert got.kind == cls and f"verdict is {cls} ({cls.upper()}: text)" in got.reason and f"allow_{cls}" in got.reason
    assert verdict_refusal(None, cfg.Settings(store="s")) is None  # no eval beside the mapper: served


def test_a_late_call_fails_by_its_deadline():
    g = StoreGuard("redis://test", failures=3, seconds=30)
    release = threading.Event()
    t0 = time.perf_counter()
    with pytest.raises(st.PrefixError) as e:
        g.call("be read", release.wait, 0.05)
    assert e.value.kind == "store_timeout" and "within 50 ms" in str(e.value)
    assert time.perf_counter() - t0 < 0.5
    release.set()
    g.close()


def test_the_breaker_opens_skips_probes_and_closes():
    clock = Clock()
    g = StoreGuard("redis://test", failures=3, seconds=30, clock=clock)

    def down():
        raise st.PrefixError("the store at redis://test cannot be read: ConnectionError", "store_unreachable")

    for _ in range(3):
        with pytest.raises(st.PrefixError):
            g.call("be read", down, 1.0)
    assert g.state == UNHEALTHY and g.opened == 1
    asked = []
    with pytest.raises(st.PrefixError) as e:
        g.call("be read", lambda: asked.append(1), 1.0)
    assert e.value.kind == "store_unhealthy" and not asked and "not asked for another 30 s" in str(e.value)
    clock.t = 31
    g.admit()  # the probe
    assert g.state == PROBING
    with pytest.raises(st.PrefixError, match="a probe is under way"):
        g.admit()
    g.failed("the probe failed")
    assert g.state == UNHEALTHY and g.opened == 2
    clock.t = 62
    assert g.call("be read", lambda: 7, 1.0) == 7 and g.state == HEALTHY
    g.close()


def test_other_errors_do_not_open_the_breaker():
    g = StoreGuard("s", failures=1, seconds=30)

    def damaged():
        raise st.PrefixError("chunk 0: damaged", "damaged")

    with pytest.raises(st.PrefixError):
        g.call("be read", damaged, 1.0)
    assert g.state == HEALTHY
    g.close()


# ---------------------------------------------------------------------------------------------- the saver
def _job(rid, nbytes=100, snapshot=None, write=None):
    return SaveJob(rid, nbytes, snapshot or (lambda: ("k", "v")), write or (lambda k, v: (1, 0)))


def _wait(pred, seconds=5.0):
    t0 = time.time()
    while not pred() and time.time() - t0 < seconds:
        time.sleep(0.005)
    return pred()


def _released(saver, want):
    got = set()
    assert _wait(lambda: got.update(saver.take_released()) or want <= got)
    return got


def test_saves_are_written_and_released():
    saver = Saver(1000)
    written = []
    assert saver.submit(_job("a", write=lambda k, v: written.append((k, v)) or (2, 0)))
    assert saver.submit(_job("b", write=lambda k, v: (0, 3)))
    _released(saver, {"a", "b"})
    assert _wait(saver.idle) and written == [("k", "v")]
    assert saver.take_counts()[0] == {STORED: 1, SHARED: 1}
    assert saver.close(1.0)


def test_a_store_that_raises_fails_that_save_and_no_other():
    saver = Saver(1000)

    def boom(k, v):
        raise ConnectionError("the store is down")

    saver.submit(_job("a", write=boom))
    saver.submit(_job("b"))
    _released(saver, {"a", "b"})
    assert _wait(saver.idle) and saver.take_counts()[0] == {FAILED: 1, STORED: 1}
    assert saver.queued_bytes == 0
    saver.close(1.0)


def test_a_hung_store_never_blocks_submit_and_a_full_queue_drops():
    saver = Saver(250)
    hang = threading.Event()
    t0 = time.perf_counter()
    for rid in ("a", "b"):  # a is written (hangs), b waits: 200 of 250 bytes
        assert saver.submit(_job(rid, write=lambda k, v: hang.wait() and (1, 0)))
    assert not saver.submit(_job("c"))  # 300 > 250: dropped, released at once
    assert time.perf_counter() - t0 < 0.05
    first = saver.take_released()  # c at once; a and b too where the copier was already done with them
    assert "c" in first
    _released(saver, {"a", "b"} - first)  # both copied out: their blocks are free while the store hangs
    assert saver.take_counts()[0] == {DROPPED: 1}
    hang.set()
    assert _wait(saver.idle) and saver.take_counts()[0] == {STORED: 2}
    saver.close(1.0)


def test_shutdown_with_saves_in_flight_is_bounded():
    saver = Saver(10_000)
    hang = threading.Event()
    for rid in "abc":
        saver.submit(_job(rid, write=lambda k, v: hang.wait(5) and (1, 0)))
    t0 = time.perf_counter()
    assert saver.close(0.2) is False
    assert time.perf_counter() - t0 < 1.0
    counts = saver.take_counts()[0]
    assert counts.get(ABANDONED) == 2  # one in the store's hands, two abandoned
    assert saver.take_released() == {"a", "b", "c"}
    assert not saver.submit(_job("d"))  # closed: dropped
    hang.set()


def test_a_dead_saver_releases_everything_and_drops_later_saves():
    class Bug(BaseException):
        pass

    saver = Saver(10_000)
    hang = threading.Event()
    saver.submit(_job("a", write=lambda k, v: hang.wait(5) and (1, 0)))
    saver.submit(_job("b", snapshot=lambda: (_ for _ in ()).throw(Bug("a bug in the copy"))))
    assert _wait(lambda: saver.dead is not None)
    assert "Bug" in saver.dead
    assert not saver.submit(_job("c"))
    assert {"b", "c"} <= _released(saver, {"b", "c"})
    hang.set()


def test_a_snapshot_that_fails_releases_the_blocks():
    saver = Saver(1000)

    def bad():
        raise RuntimeError("CUDA error")

    saver.submit(_job("a", snapshot=bad))
    _released(saver, {"a"})
    assert _wait(saver.idle) and saver.take_counts()[0] == {FAILED: 1}
    saver.close(1.0)


# ----------------------------------------------------------------------------------- the cache's own dtype
BLOCK, NB, L, H, D = 16, 6, 3, 2, 32


class _Impl:
    def __init__(self, write):
        self.do_kv_cache_update = write


def _writer(quantize):
    def write(layer, key, value, cache, slots):  # cache [blocks, 2, bs, H, D]
        for i, s in enumerate(slots.tolist()):
            cache[s // BLOCK, 0, s % BLOCK] = quantize(key[i], layer._k_scale_float)
            cache[s // BLOCK, 1, s % BLOCK] = quantize(value[i], layer._v_scale_float)
    return write


CACHES = {  # stored dtype -> (cache dtype, the writer's quantization, the layers' k and v scales)
    "bfloat16": (torch.bfloat16, lambda x, s: x.to(torch.bfloat16), (1.0, 1.0)),
    "float16": (torch.float16, lambda x, s: x.to(torch.float16), (1.0, 1.0)),
    "float8_e4m3fn": (torch.uint8, lambda x, s: (x.float() / s).to(torch.float8_e4m3fn).view(torch.uint8), (0.5, 2.0)),
    "float8_e5m2": (torch.uint8, lambda x, s: (x.float() / s).to(torch.float8_e5m2).view(torch.uint8), (0.25, 4.0)),
}


def _paged(kv_dtype, tokens, seed=0):
    """L layers' paged caches of one kind holding `tokens` tokens' random K and V; their layouts, slots, layers."""
    dtype, quantize, (ks, vs) = CACHES[kv_dtype]
    gen = torch.Generator().manual_seed(seed)
    slots = slots_of([4, 1, 3], BLOCK, 0, tokens)
    layers, caches, layouts = [], [], []
    for li in range(L):
        layer = SimpleNamespace(_k_scale_float=ks * (li + 1), _v_scale_float=vs * (li + 1))
        layer.impl = _Impl(_writer(quantize))
        cache = torch.zeros(NB, 2, BLOCK, H, D, dtype=dtype)
        layout = PagedLayout(layer, cache, NB, BLOCK, H, D, input_dtype=torch.float32 if dtype == torch.uint8
                             else dtype)
        k, v = torch.randn(tokens, H, D, generator=gen), torch.randn(tokens, H, D, generator=gen)
        layer.impl.do_kv_cache_update(layer, k.to(layout.input_dtype), v.to(layout.input_dtype), cache, slots)
        layers.append(layer), caches.append(cache), layouts.append(layout)
    return layers, caches, layouts, slots


def _bits(t):
    return t.view(torch.int16).numpy().view(np.uint16) if t.dtype == torch.bfloat16 else t.numpy()


META = {"source_model": "m", "n_layers": L, "n_kv_heads": H, "head_dim": D, "rope_type": "default",
        "rope_theta": 1e6, "rope": {"type": "default", "theta": 1e6, "rotary_dim": D}, "tokenizer": None}


@pytest.mark.parametrize("kv_dtype", list(CACHES))
def test_chunks_hold_the_cache_bytes_bit_exact(kv_dtype, tmp_path):
    tokens = 40  # chunks of 16: two whole and a tail
    layers, caches, layouts, slots = _paged(kv_dtype, tokens)
    assert layouts[0].stored_dtype == kv_dtype
    raw = [lay.read_raw(c, slots) for lay, c in zip(layouts, caches)]
    k = np.stack([_bits(r[0]) for r in raw], 1)
    v = np.stack([_bits(r[1]) for r in raw], 1)
    meta = {**META, "kv_dtype": kv_dtype}
    if kv_dtype.startswith("float8"):
        meta.update(k_scales=[l._k_scale_float for l in layers], v_scales=[l._v_scale_float for l in layers])
    store = st.FolderStore(str(tmp_path / "store"), BLOCK)
    ids = list(range(1, tokens + 1))
    assert store.save(ids, 0, H, meta, lambda a, b: (k[a:b], v[a:b])) == (3, 0)
    m = store.match(ids, tokens)
    got_raw = [store.read(r, raw=True) for r in m.chunks]
    assert all(c.meta["kv_dtype"] == kv_dtype for c in got_raw)
    assert np.concatenate([c.keys for c in got_raw]).tobytes() == k.tobytes()
    assert np.concatenate([c.values for c in got_raw]).tobytes() == v.tobytes()
    # decoded: exactly what the cache's own reader gives (fp8: code times the layer's scale)
    want_k = torch.stack([lay.read(c, slots, (l._k_scale_float, l._v_scale_float))[0].float()
                          for lay, c, l in zip(layouts, caches, layers)], 1).numpy()
    got_k = np.concatenate([store.read(r).keys for r in m.chunks])
    assert got_k.dtype == np.float32 and np.array_equal(got_k, want_k)
    # bytes per stored token: the cache's, up to the header
    per_token_cache = 2 * L * H * D * caches[0].element_size()
    stored = store.stored_bytes() / tokens
    assert per_token_cache <= stored <= per_token_cache * 1.6, (stored, per_token_cache)
    store.close()


# Every memory order vLLM gives a layer's cache, each with a writer that indexes it as its backend does.
def _nhd(nb):  # [blocks, K|V, slot, head, dim], contiguous (the order the tests above use)
    return torch.zeros(nb, 2, BLOCK, H, D), lambda c, kv, s: c[s // BLOCK, kv, s % BLOCK]


def _hnd(nb):  # FlashInfer's HND: the same logical shape, a permuted view of a [blocks, K|V, head, slot, dim] buffer
    return (torch.zeros(nb, 2, H, BLOCK, D).permute(0, 1, 3, 2, 4),
            lambda c, kv, s: c[s // BLOCK, kv, s % BLOCK])


def _packed(nb):  # FlashAttention's and the CPU backend's packed K|V: [blocks, head, slot, 2 * dim]
    return (torch.zeros(nb, H, BLOCK, 2 * D),
            lambda c, kv, s: c.transpose(1, 2)[s // BLOCK, s % BLOCK, :, kv * D:(kv + 1) * D])


@pytest.mark.parametrize("make", [_nhd, _hnd, _packed], ids=["nhd", "hnd_view", "packed_kv"])
def test_every_cache_memory_order_is_read_back_exactly(make):
    cache, at = make(NB)

    def write(layer, key, value, c, slots):
        for i, s in enumerate(slots.tolist()):
            at(c, 0, s).copy_(key[i])
            at(c, 1, s).copy_(value[i])

    layer = SimpleNamespace(impl=_Impl(write))
    layout = PagedLayout(layer, cache, NB, BLOCK, H, D)
    gen = torch.Generator().manual_seed(3)
    slots = slots_of([5, 0, 2], BLOCK, 3, 40)
    k, v = torch.randn(len(slots), H, D, generator=gen), torch.randn(len(slots), H, D, generator=gen)
    write(layer, k, v, cache, slots)
    got_k, got_v = layout.read(cache, slots)
    assert torch.equal(got_k, k) and torch.equal(got_v, v)
    raw_k, raw_v = layout.read_raw(cache, slots)
    assert torch.equal(raw_k, k) and torch.equal(raw_v, v)
    assert cache.is_contiguous() == (make is not _hnd)


def test_the_layout_test_catches_a_reader_that_assumes_a_contiguous_cache(monkeypatch):
    import crosskv.vllm.layout as lay

    monkeypatch.setattr(lay, "storage_view", lambda t: t.reshape(-1))  # the old reader: a copy in logical order
    with pytest.raises(AssertionError):
        test_every_cache_memory_order_is_read_back_exactly(_hnd)


def test_format_1_chunks_are_still_read(tmp_path):
    store = st.FolderStore(str(tmp_path / "store"), BLOCK)
    ids = np.arange(1, BLOCK + 1, dtype=np.int32)
    k = np.random.default_rng(0).standard_normal((BLOCK, L, H, D)).astype(np.float32)
    _put_by_hand(store, k, version="1")
    m = store.match(ids.tolist(), BLOCK)
    c = store.read(m.chunks[0])
    assert c.meta["kv_dtype"] == "float32" and np.array_equal(c.keys, k)
    source = {"n_layers": L, "n_kv_heads": H, "head_dim": D, "rope": {"type": "default", "theta": 1e6,
                                                                      "rotary_dim": D}}
    assert st.header_mismatch(store.headers(m.chunks)[0][0], source, None) is None
    yarn = {**source, "rope": {"type": "yarn", "theta": 1e6, "factor": 4.0}}
    assert "RoPE type 'yarn'" in st.header_mismatch(store.headers(m.chunks)[0][0], yarn, None)
    store.close()


def _put_by_hand(store, keys, kv_dtype=None, version="2"):
    """A chunk stored by hand: format `version`, header kv_dtype (none: as format 1 wrote), tensors `keys` (values =
    -keys)."""
    from safetensors.numpy import save

    ids = np.arange(1, BLOCK + 1, dtype=np.int32)
    t = {"token_ids": ids, "keys": keys, "values": -keys if keys.dtype.kind == "f" else keys}
    meta = META if version == "2" else {a: b for a, b in META.items() if a != "rope"}
    header = {a: b if isinstance(b, str) else json.dumps(b) if isinstance(b, dict) else str(b) for a, b in meta.items()}
    header.update(format=st.CHUNK_FORMAT, format_version=version, namespace=store.namespace, chunk_tokens=str(BLOCK),
                  index="0", start="0", tokens=str(BLOCK), parent=st.chain_root(store.namespace, BLOCK),
                  first_head="0", part_heads=str(H), part=st.part_name(0, H),
                  checksum=st._checksum(ids, t["keys"], t["values"]), **({"kv_dtype": kv_dtype} if kv_dtype else {}))
    key = st.chunk_keys(ids, BLOCK, store.namespace)[0]
    store._put([(key, st.part_name(0, H), header, save(t, metadata=header))])
    return store.match(ids.tolist(), BLOCK).chunks[0]


def test_a_chunk_whose_dtype_disagrees_with_its_tensors_is_damaged(tmp_path):
    store = st.FolderStore(str(tmp_path / "store"), BLOCK)
    ref = _put_by_hand(store, np.zeros((BLOCK, L, H, D), np.uint16), "float16")
    with pytest.raises(st.PrefixError, match="its tensors are uint16 .* its header says float16") as e:
        store.read(ref)
    assert e.value.kind == "damaged"
    store.close()


def test_an_fp8_chunk_without_its_scales_is_damaged(tmp_path):
    store = st.FolderStore(str(tmp_path / "store"), BLOCK)
    ref = _put_by_hand(store, np.zeros((BLOCK, L, H, D), np.uint8), "float8_e4m3fn")
    with pytest.raises(st.PrefixError, match="its fp8 scales are damaged") as e:
        store.read(ref)
    assert e.value.kind == "damaged"
    assert store.read(ref, raw=True).keys.dtype == np.uint8  # the bits themselves are intact
    store.close()


def test_an_unknown_dtype_is_refused_by_name():
    meta = {"format": st.CHUNK_FORMAT, "format_version": "2", "kv_dtype": "int4", "n_layers": "1"}
    assert "KV dtype 'int4' is not one this crosskv reads" in st.header_mismatch(meta, {}, None)


# ------------------------------------------------------------------------------------- the scheduler's lookup
class _SlowStore:
    """A store wrapper whose lookups wait on `gate` (set: answer at once)."""

    def __init__(self, store):
        self.inner, self.gate = store, threading.Event()
        self.gate.set()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def match(self, *a, **kw):
        if not self.gate.wait(10):
            raise st.PrefixError("the test's store stayed blocked", "store_unreachable")
        return self.inner.match(*a, **kw)


def _scheduler(tmp_path, **settings):
    """A target's scheduler side over a folder store holding 3 chunks of `ids`. The lookup deadline is 5 s unless a
    test sets its own: a machine busy with other tests misses the 50 ms default even for an answer at once."""
    from crosskv.vllm.context import EngineContext

    settings.setdefault("lookup_timeout_ms", 5000)
    from crosskv.vllm.scheduler import SchedulerSide

    folder = st.FolderStore(str(tmp_path / "store"), BLOCK)
    store = _SlowStore(folder)
    spec = {"n_layers": L, "n_kv_heads": H, "head_dim": D, "rope": {"type": "default", "theta": 1e6,
                                                                      "rotary_dim": D}}
    ctx = EngineContext(cfg.Role.TARGET, cfg.Settings(store="x", mapper="m", **settings), store, BLOCK, spec, "t",
                        torch.float32, "auto", None, False, manifest={"source": spec, "target": spec})
    ids = list(range(1, 3 * BLOCK + 2))
    k = np.zeros((len(ids), L, H, D), np.float32)
    folder.save(ids[:3 * BLOCK], 0, H, {**META, "kv_dtype": "float32"}, lambda a, b: (k[a:b], k[a:b]))
    return SchedulerSide(ctx), store, ids


def _request(rid, ids):
    return SimpleNamespace(request_id=rid, prompt_token_ids=ids, cache_salt=None, block_hashes=[], num_tokens=len(ids),
                           all_token_ids=ids)


def test_a_lookup_that_answers_at_once_maps(tmp_path):
    sched, _, ids = _scheduler(tmp_path)
    assert sched.get_num_new_matched_tokens(_request("r", ids), 0) == (3 * BLOCK, False)
    assert sched._outcomes["r"].status == "applied"


def test_a_slow_lookup_asks_again_later_then_maps(tmp_path):
    sched, store, ids = _scheduler(tmp_path, lookup_timeout_ms=5000)
    store.gate.clear()
    t0 = time.perf_counter()
    assert sched.get_num_new_matched_tokens(_request("r", ids), 0) == (None, False)  # vLLM asks again later
    assert time.perf_counter() - t0 < 0.1  # the scheduler's loop waited no more than a moment
    store.gate.set()
    assert _wait(lambda: sched._lookups["r"][0].done())
    assert sched.get_num_new_matched_tokens(_request("r", ids), 0) == (3 * BLOCK, False)


def test_a_lookup_past_its_deadline_reprefills_and_the_breaker_opens(tmp_path):
    sched, store, ids = _scheduler(tmp_path, lookup_timeout_ms=30, breaker_failures=2)
    store.gate.clear()
    for rid in ("a", "b"):
        assert sched.get_num_new_matched_tokens(_request(rid, ids), 0) == (None, False)
        time.sleep(0.05)
        assert sched.get_num_new_matched_tokens(_request(rid, ids), 0) == (0, False)
        assert sched._outcomes[rid].kind == "store_timeout" and "within 30 ms" in sched._outcomes[rid].reason
    t0 = time.perf_counter()
    assert sched.get_num_new_matched_tokens(_request("c", ids), 0) == (0, False)  # not asked at all
    assert time.perf_counter() - t0 < 0.01 and sched._outcomes["c"].kind == "store_unhealthy"
    stats = sched.get_kv_connector_stats()
    assert stats.data["store_unhealthy"] == 1 and stats.data["store_state"] == "unhealthy"
    store.gate.set()
    sched.guard.close()


def test_a_late_answer_is_no_sign_of_health():
    clock = Clock()
    g = StoreGuard("s", failures=1, seconds=30, clock=clock)
    gate = threading.Event()
    with pytest.raises(st.PrefixError):
        g.call("be read", gate.wait, 0.02)
    assert g.state == UNHEALTHY
    gate.set()
    time.sleep(0.05)  # the late call has answered by now
    assert g.state == UNHEALTHY
    g.close()


def test_one_steps_lookups_wait_a_bounded_total_not_a_bound_each(tmp_path):
    from crosskv.vllm import scheduler as sm

    sched, store, ids = _scheduler(tmp_path, lookup_timeout_ms=5000)
    store.gate.clear()
    sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=_NO_CACHED))
    t0 = time.perf_counter()
    for i in range(100):  # a burst of new requests, each with a lookup that does not answer yet
        assert sched.get_num_new_matched_tokens(_request(f"r{i}", ids), 0) == (None, False)
    waited = time.perf_counter() - t0
    store.gate.set()
    sched.guard.close()
    # 100 x 10 ms (the per-request wait before) would be a second; the step's budget bounds the total
    assert waited < sm.LOOKUP_WAIT_PER_STEP_S + 0.25, waited


def test_the_lookup_budget_test_catches_a_per_request_wait(tmp_path, monkeypatch):
    """The planted bug: every request waits the whole budget (the budget never shrinks)."""
    from crosskv.vllm import scheduler as sm

    sched, store, ids = _scheduler(tmp_path, lookup_timeout_ms=5000)
    store.gate.clear()
    monkeypatch.setattr(sm.SchedulerSide, "_wait_left", property(lambda s: sm.LOOKUP_WAIT_PER_STEP_S,
                                                                  lambda s, v: None), raising=False)
    t0 = time.perf_counter()
    for i in range(30):
        sched.get_num_new_matched_tokens(_request(f"r{i}", ids), 0)
    assert time.perf_counter() - t0 > 30 * sm.LOOKUP_WAIT_PER_STEP_S * 0.9
    store.gate.set()
    sched.guard.close()


def test_a_probe_that_reaches_the_store_closes_the_breaker_whatever_the_data():
    clock = Clock()
    g = StoreGuard("s", failures=1, seconds=30, clock=clock)

    def down():
        raise st.PrefixError("the store at s cannot be read: ConnectionError", "store_unreachable")

    def evicted():
        raise st.PrefixError("chunk 0: no longer stored (evicted, or removed)", "evicted")

    with pytest.raises(st.PrefixError):
        g.call("be read", down, 1.0)
    assert g.state == UNHEALTHY
    clock.t = 31
    with pytest.raises(st.PrefixError, match="evicted"):
        g.call("be read", evicted, 1.0)  # the probe: the store answered, the chunk is gone
    assert g.state == HEALTHY
    assert g.call("be read", lambda: 7, 1.0) == 7
    g.close()


# ------------------------------------------------------------------------- preemption and resume (scheduler)
_NO_CACHED = SimpleNamespace(req_ids=[], new_block_ids=[], resumed_req_ids=set())


def _resumable(rid, ids, preemptions=0):
    r = _request(rid, ids)
    r.num_preemptions = preemptions
    return r


def _step(sched, new=(), resumed=()):
    """One step's metadata: `new` [(req, block ids)] scheduled for the first time, `resumed` after a preemption."""
    cached = SimpleNamespace(req_ids=[r.request_id for r, _ in resumed], new_block_ids=[(b,) for _, b in resumed],
                             resumed_req_ids={r.request_id for r, _ in resumed})
    out = SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=r.request_id, block_ids=(b,),
                                                              prompt_token_ids=r.prompt_token_ids) for r, b in new],
                          scheduled_cached_reqs=cached)
    return sched.build_connector_meta(out)


def _mapped_and_scheduled(sched, ids):
    """A request mapped and scheduled into blocks 0-3, as vLLM drives the scheduler side."""
    r = _resumable("r", ids)
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, n)
    return r, _step(sched, new=[(r, [0, 1, 2, 3])])


def test_a_resumed_mapped_request_loads_its_prefix_again_into_its_new_blocks(tmp_path):
    sched, _, ids = _scheduler(tmp_path)
    r, first = _mapped_and_scheduled(sched, ids)
    assert [p.req_id for p in first.loads] == ["r"] and first.loads[0].slots[0] == 0
    r.num_preemptions = 1  # vLLM freed its blocks, and asks again on its resume
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    assert n == 3 * BLOCK
    sched.update_state_after_alloc(r, None, n)
    again = _step(sched, resumed=[(r, [7, 5, 6, 4])])
    assert len(again.loads) == 1 and again.loads[0].slots[:2] == [7 * BLOCK, 7 * BLOCK + 1]
    assert again.loads[0].slots[BLOCK] == 5 * BLOCK
    from crosskv.vllm.metadata import CrossKVWorkerMetadata, applied

    # the worker's report of the load it did (its own figures) keeps the request's life in its label
    sched.update_connector_output(SimpleNamespace(kv_connector_worker_meta=CrossKVWorkerMetadata(
        {"r": applied(3 * BLOCK, 3 * BLOCK, "m", map_ms=1.0)})))
    out = sched.request_finished(r, [7, 5, 6, 4])[1]["crosskv"]
    assert out["map_ms"] == 1.0
    assert out["status"] == "reloaded_after_preemption" and out["preemptions"] == 1 and out["tokens"] == 3 * BLOCK


def test_the_resume_test_catches_a_resumed_request_promised_but_never_loaded(tmp_path):
    """The planted bug of before: the resumed request is promised its prefix, but no load is planned for it."""
    sched, _, ids = _scheduler(tmp_path)
    r, _ = _mapped_and_scheduled(sched, ids)
    r.num_preemptions = 1
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, n)
    with pytest.raises(AssertionError, match="loads promised but not scheduled"):
        _step(sched)  # vLLM's resumed list left out: the old code planned nothing and promised the tokens


def test_a_resumed_request_whose_prefix_is_gone_is_recomputed_and_says_so(tmp_path):
    sched, store, ids = _scheduler(tmp_path)
    r, _ = _mapped_and_scheduled(sched, ids)
    store.inner._db.execute("DELETE FROM parts")  # evicted while it was preempted
    r.num_preemptions = 1
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    out = sched.request_finished(r, [3, 2, 1, 0])[1]["crosskv"]
    assert out["status"] == "recomputed_after_preemption" and out["kind"] == "evicted" and "tokens" not in out
    assert f"holds 0 of its {3 * BLOCK} mapped tokens" in out["reason"]


def test_a_resumed_request_that_had_its_own_kv_keeps_its_own(tmp_path):
    sched, _, ids = _scheduler(tmp_path)
    other = [9000 + i for i in range(70)]
    r = _resumable("r", other)
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    r.num_preemptions = 2
    assert sched.get_num_new_matched_tokens(r, 0) == (0, False)
    out = sched.request_finished(r, [0])[1]["crosskv"]
    assert out["status"] == "fallback_reprefill" and out["preemptions"] == 2


def test_a_resumed_request_that_finds_its_own_mapped_blocks_reuses_them(tmp_path):
    sched, _, ids = _scheduler(tmp_path)
    r, _ = _mapped_and_scheduled(sched, ids)
    r.num_preemptions = 1
    assert sched.get_num_new_matched_tokens(r, 3 * BLOCK) == (0, False)  # vLLM's prefix cache kept its blocks
    out = sched.request_finished(r, [0, 1, 2, 3])[1]["crosskv"]
    assert out["status"] == "mapped_prefix_cache" and out["preemptions"] == 1


# ---------------------------------------------------------------------- the worker: releases, skipped layers
def _bare_caches(n_layers=2):
    from crosskv.vllm.worker import WorkerCaches

    c = WorkerCaches(SimpleNamespace(block_size=BLOCK), num_blocks=NB)
    c.layers = {f"l{i}": None for i in range(n_layers)}
    c.placement = SimpleNamespace(rank=0)
    return c


def _bare_target(n_layers=2):
    from crosskv.vllm.worker import TargetWorker

    ctx = SimpleNamespace(block_size=BLOCK, settings=SimpleNamespace(mapper="m"), refusal=None)
    return TargetWorker(ctx, _bare_caches(n_layers), guard=None)


def _bare_source():
    from crosskv.vllm.worker import SourceWorker

    return SourceWorker(SimpleNamespace(block_size=BLOCK), _bare_caches(), guard=None)


@pytest.mark.parametrize("kv_role,maps,saves", [("kv_producer", False, True), ("kv_consumer", True, False),
                                                 ("kv_both", True, True)])
def test_a_worker_has_the_parts_its_role_names(kv_role, maps, saves):
    from crosskv.vllm.worker import Worker

    role = cfg.KV_ROLES[kv_role]
    assert (role.maps, role.saves) == (maps, saves)
    ctx = SimpleNamespace(role=role, store=SimpleNamespace(spec="folder:x"), settings=cfg.Settings(store="x"),
                          refusal=None, unmappable=None, engine_id=None)
    w = Worker(ctx, None, SimpleNamespace(num_blocks=NB))
    assert (w.target is not None, w.source is not None) == (maps, saves)
    assert w.get_block_ids_with_load_errors() == set()
    assert w.get_finished(set()) == (None, None) and w.build_connector_worker_meta() is None
    w.shutdown()


class _TwiceSaver:
    """A saver whose dying thread reports a request it already released."""

    def __init__(self):
        self.calls = 0

    def submit(self, job):
        return True

    def take_released(self):
        self.calls += 1
        return {"a"}


def test_a_request_is_released_exactly_once_whatever_the_saver_reports():
    from crosskv.vllm.metadata import SavePlan

    w = _bare_source()
    w.saver = _TwiceSaver()
    w._save_job = lambda plan: plan
    w.save(SavePlan("a", [1, 2], [0, 1]))
    assert w.get_finished() == {"a"}
    assert w.get_finished() is None  # the second report is vLLM's assert, and the engine's end
    assert w.saver.calls == 2


def test_a_load_whose_layer_hook_was_skipped_is_a_load_error_never_applied():
    from crosskv.vllm.metadata import LoadPlan

    w = _bare_target(n_layers=3)
    plan = LoadPlan("r", [], 0, 2 * BLOCK, list(range(2 * BLOCK)), list(range(2 * BLOCK)))
    w._mapped = [(plan, None, None)]
    w._written = {"r": 2}  # layer 2's hook never ran (a full CUDA graph's replay skips it)
    w.settle()
    out = w.take_outcomes()
    assert out["r"].status == "fallback_reprefill" and out["r"].kind == "layer_skipped"
    assert "written into 2 of 3 layers" in out["r"].reason
    assert w.take_invalid_blocks() == {0, 1}
    w._mapped, w._written = [(plan, None, None)], {"r": 3}
    w.settle()
    assert w.take_outcomes()["r"].status == "applied" and len(w.take_applied_seconds()) == 1


# ------------------------------------------------------------------- the GPU path's bounds, on the host
class _LayerMapper:  # layer l's keys are all l; records how far ahead of the forward each layer was mapped
    def __init__(self):
        self.passed, self.lead, self.checked = 0, [], []

    def transfer(self, keys, values, positions, layers, check_finite=True):
        self.lead.append(layers - self.passed)
        self.checked.append(check_finite)
        return torch.full((keys.shape[0], 1, 2, 4), float(layers)), torch.zeros(keys.shape[0], 1, 2, 4)


def _layer_by_layer(n_layers, ahead):
    from crosskv.vllm.metadata import LoadPlan
    from crosskv.vllm.worker import LayerByLayer, SourcePrefix

    plan = LoadPlan("r", [], 0, 5, list(range(5)), list(range(5)))
    prefix = SourcePrefix(plan, torch.zeros(5, 2, 2, 4), torch.zeros(5, 2, 2, 4), torch.arange(5), 0.0)
    mapper = _LayerMapper()
    return LayerByLayer(mapper, [prefix], n_layers, torch.device("cpu"), ahead=ahead), mapper


def _max_lead(ahead):
    by, mapper = _layer_by_layer(8, ahead)
    for li in range(8):
        time.sleep(0.01)  # the forward's compute of layer li
        got = by.wait(li)
        mapper.passed = li + 1
        assert float(got[0][1][0, 0, 0]) == li
        assert by._out[li] == []  # handed over and forgotten
    by.join()
    assert mapper.checked == [False] * 8  # checked finite once for the step, not on each layer's call
    return max(mapper.lead)


def test_the_mapping_thread_holds_at_most_two_layers_before_the_forward():
    assert _max_lead(2) <= 2  # layer l is mapped once the forward has taken layer l - 2


def test_the_lead_test_catches_an_unbounded_mapping_thread():
    assert _max_lead(100) >= 4


def test_a_layer_the_forward_asks_for_before_the_thread_reaches_it_is_still_mapped(monkeypatch):
    """The forward may ask for layer l before the mapping thread has looked at it (a loaded machine): l is then taken,
    not skipped. Before, wait(l) counted l as passed at once, the thread skipped it, and the load fell back."""

    class _LateSemaphore(threading.Semaphore):
        def acquire(self, *a, **kw):
            time.sleep(0.05)  # the thread reaches each layer after the forward has asked for it
            return super().acquire(*a, **kw)

    monkeypatch.setattr(threading, "Semaphore", _LateSemaphore)
    by, _ = _layer_by_layer(4, 2)
    got = [by.wait(li) for li in range(4)]
    by.join()
    assert [len(g) for g in got] == [1, 1, 1, 1]
    assert [float(g[0][1][0, 0, 0]) for g in got] == [0.0, 1.0, 2.0, 3.0]


def test_a_forward_that_skips_layers_never_hangs_the_mapping():
    by, _ = _layer_by_layer(8, 2)
    done = threading.Event()

    def forward():
        by.wait(5)  # layers 0-4 skipped, with room for two
        by.join()
        done.set()

    threading.Thread(target=forward, daemon=True).start()
    assert done.wait(5), "the mapping thread and the forward wait on each other"
    by2, _ = _layer_by_layer(8, 2)
    by2.wait(0)
    t0 = time.perf_counter()
    by2.join()  # the forward took one layer of eight (a full CUDA graph replay would take none)
    assert time.perf_counter() - t0 < 1


def test_a_step_checks_its_prefixes_finite_once_and_fails_only_the_one_with_nan():
    from crosskv.vllm.metadata import CrossKVMetadata, LoadPlan
    from crosskv.vllm.worker import SourcePrefix

    w = _bare_target(n_layers=2)
    w.caches.kv_caches = {"l0": torch.zeros(1)}
    w.ctx.settings.layerwise = False
    calls = []
    w._mapper = SimpleNamespace(transfer=lambda k, v, p, check_finite=True: calls.append(check_finite) or (k, v))
    plans = [LoadPlan(r, [], 0, 4, list(range(4)), [8, 9, 10, 11]) for r in ("ok", "nan")]
    keys = {"ok": torch.ones(4, 2, 2, 4), "nan": torch.ones(4, 2, 2, 4)}
    keys["nan"][2, 1, 0, 3] = float("nan")
    w._read = lambda plan: SourcePrefix(plan, keys[plan.req_id], torch.ones(4, 2, 2, 4), torch.arange(4), 0.0)
    w._start(CrossKVMetadata(loads=plans, saves=[]))
    assert calls == [False]  # the mapper is not asked to check again (on a GPU: a wait per layer)
    assert [p.req_id for p, _, _ in w._mapped] == ["ok"]
    assert w._outcomes["nan"].kind == "not_finite" and w.take_invalid_blocks() == {0}
    assert "keys at token 2, layer 1, head 0, dim 3 is NaN" in w._outcomes["nan"].reason
    assert torch.equal(w._slots["ok"], torch.tensor([8, 9, 10, 11]))


def _save_worker(make):
    from crosskv.vllm.worker import SourceWorker, WorkerCaches

    ctx = SimpleNamespace(engine={"head_dim": D})
    caches = WorkerCaches(ctx, num_blocks=NB)
    caches.placement = SimpleNamespace(count=H)
    w = SourceWorker(ctx, caches, guard=None)
    gen = torch.Generator().manual_seed(5)
    slots = slots_of([5, 0, 2, 3], BLOCK, 0, 60)
    for li in range(L):
        cache, at = make(NB)
        for s in slots.tolist():
            at(cache, 0, s).copy_(torch.randn(H, D, generator=gen))
            at(cache, 1, s).copy_(torch.randn(H, D, generator=gen))
        caches.kv_caches[f"l{li}"] = cache
        caches._layouts[f"l{li}"] = PagedLayout(SimpleNamespace(impl=_Impl(
            lambda layer, key, value, c, sl, at=at: [(at(c, 0, s).copy_(key[i]), at(c, 1, s).copy_(value[i]))
                                                     for i, s in enumerate(sl.tolist())])), cache, NB, BLOCK, H, D)
    return w, slots


def _largest_gather(w, slots, monkeypatch):
    want = [lay.read_raw(c, slots) for lay, c in zip(w.caches._layouts.values(), w.caches.kv_caches.values())]
    sizes = []
    real = PagedLayout.read_raw
    monkeypatch.setattr(PagedLayout, "read_raw", lambda self, c, s: sizes.append(len(s)) or real(self, c, s))
    k, v = w._copy_out(list(w.caches.kv_caches.items()), slots, None)
    assert np.array_equal(k, torch.stack([x[0] for x in want], 1).numpy())
    assert np.array_equal(v, torch.stack([x[1] for x in want], 1).numpy())
    return max(sizes)


@pytest.mark.parametrize("make", [_nhd, _hnd, _packed], ids=["nhd", "hnd_view", "packed_kv"])
def test_a_save_gathers_a_bounded_piece_of_one_layer_at_a_time(make, monkeypatch):
    import crosskv.vllm.worker as wk

    w, slots = _save_worker(make)
    monkeypatch.setattr(wk, "SAVE_COPY_BYTES", 16 * H * D * 4)  # 16 tokens of fp32
    assert _largest_gather(w, slots, monkeypatch) == 16


def test_the_bound_test_catches_a_save_that_gathers_the_whole_request(monkeypatch):
    import crosskv.vllm.worker as wk

    w, slots = _save_worker(_nhd)
    monkeypatch.setattr(wk, "SAVE_COPY_BYTES", 1 << 40)  # planted: no bound, the old whole-request gather
    assert _largest_gather(w, slots, monkeypatch) == len(slots) > 16


# ------------------------------------------------------------------------------ the source: saves with no step
class _LocalWorker:
    def __init__(self):
        self.saved = []

    def save(self, plan):
        self.saved.append(plan)


def _source_scheduler(tmp_path):
    from crosskv.vllm.context import EngineContext
    from crosskv.vllm.saver import LOCAL_SAVERS
    from crosskv.vllm.scheduler import SchedulerSide

    spec = {"n_layers": L, "n_kv_heads": H, "head_dim": D, "rope": {"type": "default", "theta": 1e6,
                                                                      "rotary_dim": D}}
    ctx = EngineContext(cfg.Role.SOURCE, cfg.Settings(store="x"), st.FolderStore(str(tmp_path / "s"), BLOCK), BLOCK, spec, "s",
                        torch.float32, "auto", None, False, engine_id="engine-under-test")
    worker = _LocalWorker()
    LOCAL_SAVERS["engine-under-test"] = worker
    return SchedulerSide(ctx), worker


def _finished(rid, n_tokens, computed, in_flight=0):
    ids = list(range(1, n_tokens + 1))
    return SimpleNamespace(request_id=rid, all_token_ids=ids, num_computed_tokens=computed,
                           num_in_flight_tokens=in_flight, cache_salt=None)


def test_a_finished_request_reaches_the_local_saver_at_once_with_only_the_written_tokens(tmp_path):
    from crosskv.vllm.saver import LOCAL_SAVERS

    sched, worker = _source_scheduler(tmp_path)
    try:
        delay, params = sched.request_finished(_finished("a", 70, 69), [0, 1, 2, 3, 4])
        assert delay and params == {"crosskv": {"status": "save_queued", "tokens": 69}}
        # async scheduling: the next step's token is scheduled (counted computed) but its KV is not written yet
        sched.request_finished(_finished("b", 70, 70, in_flight=1), [5, 4, 3, 2, 1])
        assert [(p.req_id, len(p.token_ids)) for p in worker.saved] == [("a", 69), ("b", 69)]
        assert not sched._to_save  # nothing waits for a next step
    finally:
        LOCAL_SAVERS.pop("engine-under-test", None)


def test_without_a_local_worker_the_save_goes_in_the_next_steps_metadata(tmp_path):
    from crosskv.vllm.saver import LOCAL_SAVERS

    sched, worker = _source_scheduler(tmp_path)
    LOCAL_SAVERS.pop("engine-under-test", None)  # the workers live in other processes (tensor parallel)
    sched.request_finished(_finished("a", 70, 69), [0, 1, 2, 3, 4])
    assert not worker.saved
    meta = sched.build_connector_meta(SimpleNamespace(scheduled_new_reqs=[], scheduled_cached_reqs=_NO_CACHED))
    assert [p.req_id for p in meta.saves] == ["a"]


def test_a_request_aborted_while_its_lookup_is_in_flight_leaves_nothing_behind(tmp_path):
    sched, store, ids = _scheduler(tmp_path, lookup_timeout_ms=5000)
    store.gate.clear()
    r = _resumable("r", ids)
    assert sched.get_num_new_matched_tokens(r, 0) == (None, False)  # the lookup is under way
    out = sched.request_finished(r, [])[1]["crosskv"]  # aborted while waiting
    assert out["status"] == "fallback_reprefill" and "never scheduled" in out["reason"]
    store.gate.set()
    assert not (sched._lookups or sched._candidates or sched._to_load or sched._outcomes or sched._mapped_span)
    assert _step(sched).loads == []
    sched.guard.close()


def test_a_request_aborted_after_its_load_was_promised_is_never_planned(tmp_path):
    sched, _, ids = _scheduler(tmp_path)
    r = _resumable("r", ids)
    n, _ = sched.get_num_new_matched_tokens(r, 0)
    sched.update_state_after_alloc(r, None, n)
    sched.request_finished(r, [0, 1, 2, 3])
    assert _step(sched).loads == []  # and no broken promise: it is gone


# ---- LayerByLayer (no engine): a failure at any layer, foreseen or not, fails that prefix and hangs no layer.
class _FlakyMapper:  # layer l's keys are all l; a layer's results reach wait() unless the prefix has failed by then
    def __init__(self, fail_at, error):
        self.fail_at, self.error = fail_at, error

    def transfer(self, keys, values, positions, layers, check_finite=True):
        if layers == self.fail_at:
            raise self.error
        return torch.full((keys.shape[0], 1, 2, 4), float(layers)), torch.zeros(keys.shape[0], 1, 2, 4)


@pytest.mark.parametrize("fail_at,error,want", [
    (1, MapperError("keys: element 3 is NaN"), "keys: element 3 is NaN"),
    (2, KeyError("unforeseen"), "the mapping thread stopped: KeyError")])
def test_layer_by_layer_a_failure_at_any_layer_fails_the_prefix_and_hangs_no_layer(fail_at, error, want):
    plan = LoadPlan("r1", "key", 0, 5, list(range(5)), list(range(5)))
    prefix = SourcePrefix(plan, torch.zeros(5, 2, 2, 4), torch.zeros(5, 2, 2, 4), torch.arange(5), 0.0)
    by = LayerByLayer(_FlakyMapper(fail_at, error), [prefix], 4, torch.device("cpu"))
    got_layers = [by.wait(li) for li in range(4)]  # returns for every layer (a hang would time the test out)
    by.join()
    assert all(not g for g in got_layers[fail_at:]) and want in by.failed.get("r1", "")
