"""A conversation moved between two servers, as users deploy crosskv: two OpenAI-compatible vLLM servers (the tests'
family: the source model and the target, tiny random Qwen3 models with a byte tokenizer) sharing a Redis store, each
kv_both (it maps its mapper's source KV and saves its own turns, replies included), driven by the openai client
through examples/switch_conversation.py.
- 20 six-turn chats, 4 under way at once, turns 1-3 on the source and 4-6 on the target: every target turn maps the
  whole history the source saved (its prompt and reply of turn 3: all but the new user turn), and says so in
  kv_transfer_params;
- one chat switched back to the source at turn 7, with the reverse mapper: the stored run it finds ends where the
  target's save of turn 6 does (it maps what its own prefix cache does not still hold of its first turns);
- per switch, measured: tokens mapped (and their share of the prompt), time to the first token against the target's
  own prefill of the same messages (the same server, a cache_salt whose namespace holds nothing), and agreement of
  the replies. The own-prefill requests are fallbacks: the check that a switch mapped its history catches them.
Each turn comes 0.3 s after the last reply (a user's think time; a save lands in tens of milliseconds, and a switch
sooner than that maps the history stored so far). Replies are drawn from the byte tokenizer's printable ASCII (allowed_token_ids), so that a reply read back as chat
text is the same tokens the server generated, as a real tokenizer's replies are.
Run by tests/python/vllm.sh WORK test_vllm_chat.py.
"""
import json
import os
import subprocess
import sys
import time
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from redis_server import RedisServer, free_port
from vllm_engine import BLOCK, Server

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "examples"))
import switch_conversation  # noqa: E402

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ASCII = list(range(94))  # the byte tokenizer's ids of '!'..'~'
REPLY_TOKENS = 16
N_CHATS = 20
CONCURRENT = 4  # chats under way at once
rng = np.random.default_rng(61)


def server(name, model, mapper, saves, loads, store):
    port = free_port()
    kvc = {"kv_connector": "CrossKVConnector", "kv_connector_module_path": "crosskv.vllm", "kv_role": "kv_both",
           "kv_load_failure_policy": "recompute",
           "kv_connector_extra_config": {"store": store, "chunk_tokens": BLOCK, "mapper": mapper,
                                         "save_namespace": saves, "load_namespace": loads}}
    proc = Server(["--model", model, "--port", str(port), "--enforce-eager", "--dtype", "float32", "--block-size",
                   str(BLOCK), "--max-model-len", "2048", "--kv-cache-memory-bytes", str(64 << 20), "--chat-template",
                   "chat-template.jinja", "--kv-transfer-config", json.dumps(kvc)], f"{name}.log")
    return proc, f"http://127.0.0.1:{port}"


def wait_up(proc, url, name):
    t0 = time.time()
    while time.time() - t0 < 300 and proc.poll() is None:
        try:
            if urllib.request.urlopen(f"{url}/health", timeout=2).status == 200:
                return
        except OSError:
            time.sleep(1)
    raise RuntimeError(f"the {name} server did not start ({os.getcwd()}/{name}.log)")


@pytest.fixture(scope="module")
def servers(family):
    os.chdir(family.work)
    with open("fit-reverse.yaml", "w") as f:
        f.write("source: {store: kv-target}\ntarget: {store: kv-source}\nfit: {k: [all], probe: all_heads}\n"
                "output: {dir: out-reverse}\n")
    subprocess.run([family.fit, "fit-reverse.yaml"], check=True, capture_output=True)
    open("chat-template.jinja", "w").write(TEMPLATE)
    redis = RedisServer(family.work)
    store = redis.url("chat")
    procs = {"source": server("chat_source", "model-source", "out-reverse/kall", "source", "target", store),
             "target": server("chat_target", "model-target", "out/kall", "target", "source", store)}
    try:
        for name, (proc, url) in procs.items():
            wait_up(proc, url, f"chat_{name}")
        yield {name: url for name, (_, url) in procs.items()}
    finally:
        for proc, _ in procs.values():
            proc.terminate()
        for proc, _ in procs.values():
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
        redis.stop()


def words(n):
    return " ".join("".join(chr(c) for c in rng.integers(97, 123, rng.integers(2, 8))) for _ in range(n))


def chat(urls, users, switch_at=3, switch_back_at=None):
    argv = ["--source", f"{urls['source']}/v1", "--target", f"{urls['target']}/v1", "--switch-at", str(switch_at),
            "--max-tokens", str(REPLY_TOKENS), "--pause-s", "0.3", "--extra-body", json.dumps({"allowed_token_ids": ASCII, "return_token_ids": True})]
    argv += ["--switch-back-at", str(switch_back_at)] if switch_back_at else []
    for u in users:
        argv += ["--user", u]
    return switch_conversation.main(argv)


def ask(url, model, messages, salt=None, max_tokens=REPLY_TOKENS):
    """(reply, seconds, kv_transfer_params["crosskv"]) of one chat request; with max_tokens 1 the seconds are its time
    to the first token (vLLM's streamed chunks carry no kv_transfer_params, so the outcome is read this way)."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{url}/v1", api_key="none")
    extra = {"allowed_token_ids": ASCII, **({"cache_salt": salt} if salt else {})}
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=extra)
    seconds = time.perf_counter() - t0
    return r.choices[0].message.content, seconds, ((r.model_extra or {}).get("kv_transfer_params") or {}).get(
        "crosskv", {})


def history(log, users, upto):
    msgs = []
    for i in range(upto):
        msgs += [{"role": "user", "content": users[i]}, {"role": "assistant", "content": log[i]["reply"]}]
    return msgs + [{"role": "user", "content": users[upto]}]


def test_twenty_chats_move_to_the_target_which_maps_their_whole_history(servers, family):
    chats = [[words(int(rng.integers(3, 9))) for _ in range(6)] for _ in range(N_CHATS)]

    def one(c):
        users = chats[c]
        log = chat(servers, users)
        saved = [t["crosskv"].get("saved_tokens") for t in log]
        assert all(saved), log
        for t in log[:3]:  # the source finds nothing of the target's: its own prefill
            assert t["server"] == "source" and t["crosskv"]["status"] == "fallback_reprefill", t
        for t in log[3:]:  # the target maps everything the source saved: turns 1-3, the replies included
            assert t["server"] == "target" and t["crosskv"]["status"] == "applied", t
            assert t["crosskv"]["tokens"] == t["crosskv"]["prefix_tokens"] == saved[2], (t, saved)
        own_reply, _, own_kv = ask(servers["target"], "model-target", history(log, users, 3), salt=f"own-{c}")
        return {"mapped_tokens": log[3]["crosskv"]["tokens"], "prompt_tokens": log[3]["prompt_tokens"],
                "reply": log[3]["reply"], "own_reply": own_reply, "own_status": own_kv.get("status")}

    # CONCURRENT users at a time, as a server meets them: their requests share the servers' steps.
    with ThreadPoolExecutor(CONCURRENT) as users:
        switches = list(users.map(one, range(N_CHATS)))
    # The target's own prefill of the same messages (a namespace that holds nothing) is a fallback, which the
    # check above refuses: it catches a switch that did not map.
    assert all(s["own_status"] == "fallback_reprefill" for s in switches), switches
    agree = [sum(a == b for a, b in zip(s["reply"], s["own_reply"])) / REPLY_TOKENS for s in switches]
    summary = {"switches": len(switches), "mapped_tokens_mean": float(np.mean([s["mapped_tokens"] for s in switches])),
               "mapped_share_mean": float(np.mean([s["mapped_tokens"] / s["prompt_tokens"] for s in switches])),
               "reply_agreement_mean": float(np.mean(agree)),
               "replies_equal": sum(s["reply"] == s["own_reply"] for s in switches)}
    print(f"     chats: {json.dumps(summary)}", flush=True)
    json.dump({"summary": summary, "switches": switches}, open("chat-switches.json", "w"), indent=1)


def test_a_chat_switched_back_maps_everything_the_target_saved(servers):
    users = [words(4) for _ in range(7)]
    log = chat(servers, users, switch_at=3, switch_back_at=6)
    assert [t["server"] for t in log] == ["source"] * 3 + ["target"] * 3 + ["source"]
    # what the target saved of turn 6 (its prompt and reply) is where the source's turn-7 prompt starts
    assert log[6]["prompt_token_ids"][:log[5]["crosskv"]["saved_tokens"]] == \
        (log[5]["prompt_token_ids"] + log[5]["token_ids"])[:log[5]["crosskv"]["saved_tokens"]]
    back = log[6]["crosskv"]
    # the stored run ends where the target's save does; the source's own prefix cache may still hold its first
    # turns' blocks (exact KV), and it maps only the tokens after them
    assert back["status"] == "applied" and back["prefix_tokens"] == log[5]["crosskv"]["saved_tokens"], back
    assert back["tokens"] > log[5]["crosskv"]["saved_tokens"] - log[2]["crosskv"]["saved_tokens"], back
    assert back["mapper"].endswith("out-reverse/kall")


def test_a_switch_maps_faster_than_the_targets_own_prefill(servers):
    """TTFT per switch on long histories (where prefill costs): mapped against own prefill, median of 5."""
    users = [words(60) for _ in range(4)]
    log = chat(servers, users, switch_at=3)
    msgs = history(log, users, 3)
    mapped, own = [], []
    for i in range(5):
        _, t, kv = ask(servers["target"], "model-target", msgs, max_tokens=1)
        assert kv.get("status") == "applied", kv
        mapped.append(t)
        _, t, kv = ask(servers["target"], "model-target", msgs, salt=f"own-ttft-{i}", max_tokens=1)
        assert kv.get("status") == "fallback_reprefill", kv
        own.append(t)
    out = {"history_tokens": log[3]["crosskv"]["tokens"], "prompt_tokens": log[3]["prompt_tokens"],
           "ttft_mapped_ms": 1e3 * float(np.median(mapped)),
           "ttft_own_ms": 1e3 * float(np.median(own))}
    print(f"     switch TTFT: {json.dumps(out)}", flush=True)
    json.dump(out, open("chat-ttft.json", "w"))
