#!/usr/bin/env python3
"""A model switch mid-conversation in vLLM: the source model's engine answers the first turn and saves its KV
(crosskv.vllm, kv_producer); the target model's engine continues the conversation from that KV mapped by a
crosskv-fit mapper (kv_consumer) instead of prefilling it, then answers the next turns from its own prefix cache.
The same turns run on a target engine without the connector, for comparison. Prints, per turn, the connector's
outcome, the time to the first token both ways and how many greedy tokens agree with the target's own prefill.

    .venv-vllm/bin/python examples/vllm_handoff.py --source WORK/model-source --target WORK/model-target \
        --mapper WORK/out/kall --turns 6

WORK: tools/family/run_family.py's folder, or any source/target pair of one tokenizer with a crosskv-fit mapper.
Each engine runs in a process of its own (vLLM holds one KV connector per process).
"""
import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}


def engine(model, connector=None, role=None):
    from vllm import LLM

    kv = None
    if connector is not None:
        kv = {"kv_connector": "CrossKVConnector", "kv_connector_module_path": "crosskv.vllm", "kv_role": role,
              "kv_load_failure_policy": "recompute", "kv_connector_extra_config": connector}
    return LLM(model=model, enforce_eager=True, dtype="float32", block_size=32, kv_cache_memory_bytes=256 << 20,
               kv_transfer_config=kv, seed=0)


def serve_turns(a):
    """One engine: a list of turns in, each turn's prompt extended by the engine's own answers; results to JSON."""
    from vllm import SamplingParams

    job = json.load(open(a.serve))
    llm = engine(job["model"], job.get("connector"), job.get("role"))
    greedy = SamplingParams(max_tokens=job["answer_tokens"], temperature=0)
    first = SamplingParams(max_tokens=1, temperature=0)
    history, turns = [], []
    for i, user in enumerate(job["users"]):
        prompt = (job["histories"][i] if job.get("histories") else history) + user
        t0 = time.perf_counter()
        head = llm.generate([{"prompt_token_ids": prompt}], first, use_tqdm=False)[0]  # time to the first token
        ttft = time.perf_counter() - t0
        out = llm.generate([{"prompt_token_ids": prompt}], greedy, use_tqdm=False)[0]
        answer = list(out.outputs[0].token_ids)
        turns.append({"prompt": prompt, "answer": answer, "ttft_s": ttft,
                      "outcome": (head.kv_transfer_params or {}).get("crosskv")})
        history = prompt + answer
    llm.llm_engine.step()  # a source engine hands its finished requests' KV to its saver on the next step
    llm.llm_engine.engine_core.shutdown()  # and its saver writes them before the engine goes (a bounded drain)
    json.dump(turns, open(a.out, "w"))


def run(job, out, work):
    path = os.path.join(work, out + ".job.json")
    json.dump(job, open(path, "w"))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "--serve", path, "--out",
                        os.path.join(work, out + ".json")], env={**os.environ, **ENV}, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"the {out} engine failed:\n{r.stderr[-3000:]}")
    return json.load(open(os.path.join(work, out + ".json")))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", help="the source model (a folder or hub name)")
    ap.add_argument("--target", help="the target model, of the same tokenizer")
    ap.add_argument("--mapper", help="a crosskv-fit mapper folder (k<K>/) for this pair")
    ap.add_argument("--turns", type=int, default=6, help="turns after the switch")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--prompt", default="ROMEO. ")
    ap.add_argument("--store", help="where the source's KV is kept (default: a temporary folder)")
    ap.add_argument("--allow-not-ready", action="store_true",
                    help="serve the mapper even if its held-out verdict is NOT READY (otherwise the target re-prefills)")
    ap.add_argument("--serve", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.serve:
        return serve_turns(a)
    if not (a.source and a.target and a.mapper):
        ap.error("--source, --target and --mapper are required")
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(a.source)
    say = lambda text: tok(text, add_special_tokens=False).input_ids
    users = [say(a.prompt)] + [say(f"\nNEXT. Turn {i + 2}: ") for i in range(a.turns)]
    with tempfile.TemporaryDirectory() as work:
        store = a.store or os.path.join(work, "store")
        common = dict(answer_tokens=a.answer_tokens)
        src = run({"model": a.source, "connector": {"store": store}, "role": "kv_producer", "users": users[:1],
                   **common}, "source", work)
        history = src[0]["prompt"] + src[0]["answer"]
        print(f"turn 1 (source {a.source}): {tok.decode(src[0]['answer'])!r}")
        connector = {"store": store, "mapper": a.mapper, "allow_not_ready": a.allow_not_ready}
        mapped = run({"model": a.target, "connector": connector, "role": "kv_consumer",
                      "users": [history + users[1]] + users[2:], **common}, "target", work)
        # The target without the connector, on the same conversation (the connector run's prompts).
        own = run({"model": a.target, "users": [[] for _ in mapped], "histories": [t["prompt"] for t in mapped],
                   **common}, "own", work)
    agree_all = []
    for i, (m, o) in enumerate(zip(mapped, own)):
        n = min(len(m["answer"]), len(o["answer"]))
        agree = sum(x == y for x, y in zip(m["answer"], o["answer"])) / max(n, 1)
        agree_all.append(agree)
        oc = m["outcome"] or {}
        what = f"{oc.get('status')}" + (f", {oc['tokens']} tokens mapped" if oc.get("status") == "applied" else
                                         f": {oc.get('reason', '')}" if oc.get("reason") else "")
        print(f"turn {i + 2} (target, {len(m['prompt'])}-token context; {what}): first token {m['ttft_s'] * 1e3:.0f} "
              f"ms, own prefill {o['ttft_s'] * 1e3:.0f} ms; greedy tokens that agree with the target's own: "
              f"{agree:.0%}\n    {tok.decode(m['answer'])!r}")
    print(f"greedy tokens that agree over {len(agree_all)} turns: {sum(agree_all) / len(agree_all):.0%}; time to "
          f"the first token at the switch: {mapped[0]['ttft_s'] * 1e3:.0f} ms with crosskv, "
          f"{own[0]['ttft_s'] * 1e3:.0f} ms re-prefilling")


if __name__ == "__main__":
    main()
