#!/usr/bin/env python3
"""A conversation moved between two vLLM servers with the openai client: the first turns on the source model's
server, the next on the target's, which maps the source's saved KV of the whole history (crosskv.vllm) instead of
prefilling it. Each response says what was mapped in its kv_transfer_params["crosskv"].

Both servers run `vllm serve` with the connector on one shared store (docs/SERVING.md); with
kv_role kv_both each also saves its own turns, so the conversation can move back:

    vllm serve SOURCE --kv-transfer-config '{"kv_connector": "CrossKVConnector", "kv_connector_module_path":
        "crosskv.vllm", "kv_role": "kv_both", "kv_load_failure_policy": "recompute", "kv_connector_extra_config":
        {"store": "redis://HOST:6379/chat", "mapper": "TARGET_TO_SOURCE/kall", "save_namespace": "source",
         "load_namespace": "target"}}'
    (the target's server the same with its model, SOURCE_TO_TARGET/kall, and the two namespaces swapped)

    python examples/switch_conversation.py --source http://HOST:8000/v1 --target http://HOST:8001/v1 \
        --user "Hi" --user "Tell me more" --user "And then?" --switch-at 2
"""
import argparse
import json
import time


def turn(client, model, messages, max_tokens, extra_body):
    """One chat turn: the reply, what the connector says it mapped, and the prompt's length in tokens."""
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=max_tokens, temperature=0,
                                       extra_body=extra_body)
    kv = ((r.model_extra or {}).get("kv_transfer_params") or {}).get("crosskv", {})
    return r.choices[0].message.content, kv, r.usage.prompt_tokens, r


def main(argv=None):
    from openai import OpenAI

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--source", required=True, help="the source model's server, http://HOST:PORT/v1")
    p.add_argument("--target", required=True, help="the target model's server")
    p.add_argument("--user", action="append", required=True, help="a user turn (repeat, in order)")
    p.add_argument("--switch-at", type=int, default=1, help="the first turn (from 0) the target answers")
    p.add_argument("--switch-back-at", type=int, default=None, help="the first turn the source answers again")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--pause-s", type=float, default=0.0,
                   help="a user's think time before each turn (the source's save of its last reply lands in tens "
                        "of milliseconds; a switch that comes sooner maps the history stored so far)")
    p.add_argument("--extra-body", default="{}", help="JSON merged into each request (vLLM's sampling options)")
    a = p.parse_args(argv)
    servers = {name: OpenAI(base_url=url, api_key="none") for name, url in (("source", a.source), ("target", a.target))}
    models = {name: c.models.list().data[0].id for name, c in servers.items()}
    messages, log = [], []
    for i, user in enumerate(a.user):
        side = "target" if a.switch_at <= i < (a.switch_back_at or len(a.user)) else "source"
        messages.append({"role": "user", "content": user})
        time.sleep(a.pause_s if i else 0.0)
        reply, kv, prompt_tokens, r = turn(servers[side], models[side], messages, a.max_tokens, json.loads(a.extra_body))
        messages.append({"role": "assistant", "content": reply})
        log.append({"turn": i, "server": side, "prompt_tokens": prompt_tokens, "crosskv": kv, "reply": reply})
        extra = {**(r.model_extra or {}), **(r.choices[0].model_extra or {})}
        for key in ("prompt_token_ids", "token_ids"):  # with extra body {"return_token_ids": true}
            if extra.get(key) is not None:
                log[-1][key] = extra[key]
        print(json.dumps(log[-1]), flush=True)
    return log


if __name__ == "__main__":
    main()
