#!/usr/bin/env python3
"""A model switch mid-conversation: the source model answers a turn, then the target model continues the same
conversation from the source's KV cache mapped by crosskv — no re-prefill — and, for comparison, after its own
re-prefill of the whole context. Prints both continuations, the time each way took, and how often they agree.

    .venv-capture/bin/python examples/handoff.py --source WORK/model-source --target WORK/model-target \
        --mapper WORK/out/kall --prompt "ROMEO. " --answer-tokens 32 --continue-tokens 32

WORK: tools/family/run_family.py's folder (or any source/target pair of one tokenizer with a crosskv-fit mapper).
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import crosskv
import crosskv.hf


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--source", required=True, help="the source model (a folder or hub name)")
    ap.add_argument("--target", required=True, help="the target model, of the same tokenizer")
    ap.add_argument("--mapper", required=True, help="a crosskv-fit mapper folder (k<K>/) for this pair")
    ap.add_argument("--prompt", default="ROMEO. ")
    ap.add_argument("--answer-tokens", type=int, default=32)
    ap.add_argument("--continue-tokens", type=int, default=32)
    a = ap.parse_args()
    tok = AutoTokenizer.from_pretrained(a.source)
    src = AutoModelForCausalLM.from_pretrained(a.source).eval()
    tgt = AutoModelForCausalLM.from_pretrained(a.target).eval()
    mapper = crosskv.Mapper(a.mapper)  # weights resident from the first transfer on
    prompt = tok(a.prompt, return_tensors="pt", add_special_tokens=False).input_ids
    greedy = dict(do_sample=False, pad_token_id=tok.eos_token_id)
    ones = torch.ones_like
    with torch.no_grad():
        # The source answers the turn; its cache covers the whole conversation but the last token.
        turn = src.generate(prompt, attention_mask=ones(prompt), max_new_tokens=a.answer_tokens, **greedy)
        src_cache = src(turn[:, :-1], use_cache=True).past_key_values
        # The switch with crosskv: the source's cache mapped into the target's (after one call that loads the
        # mapper's weights, as a server does once).
        crosskv.hf.transfer_cache(mapper, src_cache)
        t0 = time.perf_counter()
        mapped = crosskv.hf.transfer_cache(mapper, src_cache)
        t_transfer = time.perf_counter() - t0
        out_mapped = tgt.generate(turn, attention_mask=ones(turn), past_key_values=mapped,
                                  max_new_tokens=a.continue_tokens, **greedy)
        # The switch without: the target re-prefills the whole context.
        t0 = time.perf_counter()
        own = tgt(turn[:, :-1], use_cache=True).past_key_values
        t_prefill = time.perf_counter() - t0
        out_own = tgt.generate(turn, attention_mask=ones(turn), past_key_values=own, max_new_tokens=a.continue_tokens,
                               **greedy)
    n = turn.shape[1]
    new_mapped, new_own = out_mapped[0, n:], out_own[0, n:]
    agree = (new_mapped[: len(new_own)] == new_own[: len(new_mapped)]).float().mean().item()
    print(f"mapper: {mapper!r}")
    print(f"context: {n} tokens; the source's turn: {tok.decode(turn[0, prompt.shape[1]:])!r}")
    print(f"target after crosskv transfer ({t_transfer * 1e3:.1f} ms): {tok.decode(new_mapped)!r}")
    print(f"target after its own prefill ({t_prefill * 1e3:.1f} ms): {tok.decode(new_own)!r}")
    print(f"greedy tokens that agree: {agree:.0%}; transfer {t_prefill / t_transfer:.1f}x faster than re-prefill")


if __name__ == "__main__":
    main()
