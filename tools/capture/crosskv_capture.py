#!/usr/bin/env python3
"""crosskv-capture: run a Hugging Face causal LM over a text corpus and write calibration shards (SPEC §5).

    crosskv-capture --model HF_ID_OR_LOCAL_PATH --text FILE(.txt|.jsonl) --seq-len 1024 --n-seq 500 --stride 4 \\
                    --dtype bf16 --out STORE/DOMAIN [--queries] [--same-tokens-as OTHER_MODEL_OR_STORE/DOMAIN]

Keys and values come from the model's own cache (keys post-RoPE, exactly what serving hands over); queries
(post-RoPE) from a hook on the attention's rotary embedding when --queries is given. kv_spec is filled from the
model config (rope_theta, rope_scaling: linear, llama3, yarn; head_dim; partial rotary); what the fit cannot
handle is refused by name. Tokenisation and packing are deterministic: the text is tokenized document by
document (no special tokens), joined with the EOS token, and cut into consecutive sequences of --seq-len tokens,
so two models of one family give identical token_ids. Shards of --shard-seqs sequences are written atomically and
skipped when already complete (resumable). Works offline from a local model folder.
"""
import argparse
import json
import os
import sys
import time

import numpy as np

FORMAT = "kv-shard"
FORMAT_VERSION = 1


class CaptureError(Exception):
    """A user's mistake: one line naming the model, file or key."""


# ---- kv_spec from a model config ---------------------------------------------------------------------------------

def kv_spec_from_config(cfg, where="model config"):
    get = lambda k, d=None: getattr(cfg, k, d)
    L, Hq = get("num_hidden_layers"), get("num_attention_heads")
    if L is None or Hq is None:
        raise CaptureError(f"{where}: not a decoder config (num_hidden_layers/num_attention_heads missing)")
    H = get("num_key_value_heads") or Hq
    D = get("head_dim") or (get("hidden_size") // Hq)
    partial = get("partial_rotary_factor", 1.0) or 1.0
    rotary = int(D * partial)
    if rotary % 2 or rotary <= 0:
        raise CaptureError(f"{where}: partial_rotary_factor {partial} gives an odd rotary dim {rotary}")
    scaling = get("rope_scaling") or {}
    rope_params = get("rope_parameters") or {}
    if not scaling and rope_params and rope_params.get("rope_type", "default") != "default":
        scaling = rope_params
    theta = get("rope_theta") or rope_params.get("rope_theta") or 10000.0
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    rope = {"type": kind, "theta": float(theta), "rotary_dim": rotary, "convention": "half",
            "factor": None, "low_freq_factor": None, "high_freq_factor": None,
            "original_max_position_embeddings": None, "beta_fast": None, "beta_slow": None,
            "mscale": None, "mscale_all_dim": None, "attention_factor": None, "truncate": True}
    if kind == "default":
        pass
    elif kind == "linear":
        rope["factor"] = float(scaling["factor"])
    elif kind == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in scaling:
                raise CaptureError(f"{where}: rope_scaling llama3 needs {k}")
            rope[k] = float(scaling[k])
    elif kind == "yarn":
        rope["factor"] = float(scaling["factor"])
        orig = scaling.get("original_max_position_embeddings")
        if orig is not None:
            # As transformers' _compute_yarn_parameters does: with original_max_position_embeddings in rope_scaling,
            # the factor it uses is max_position_embeddings / original_max_position_embeddings.
            rope["factor"] = float(get("max_position_embeddings")) / float(orig)
        else:
            orig = get("max_position_embeddings")
        rope["original_max_position_embeddings"] = float(orig)
        for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if scaling.get(k) is not None:
                rope[k] = float(scaling[k])
        if "truncate" in scaling:
            rope["truncate"] = bool(scaling["truncate"])
    elif kind == "dynamic":
        raise CaptureError(f"{where}: rope_scaling 'dynamic' is not supported (its frequencies depend on the "
                           "sequence length, so a position-free mapper cannot be fitted)")
    else:
        raise CaptureError(f"{where}: rope_scaling '{kind}' is not supported (crosskv handles default, linear, "
                           "llama3 and yarn)")
    return {"n_layers": int(L), "n_kv_heads": int(H), "head_dim": int(D), "n_q_heads": int(Hq), "rope": rope}


# ---- text and tokens ---------------------------------------------------------------------------------------------

def read_documents(path):
    if not os.path.exists(path):
        raise CaptureError(f"--text {path}: no such file")
    if path.endswith(".jsonl"):
        docs = []
        with open(path, encoding="utf-8") as f:
            for i, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except json.JSONDecodeError as e:
                    raise CaptureError(f"{path}:{i}: not JSON ({e})")
                if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
                    raise CaptureError(f"{path}:{i}: expected an object with a string field 'text'")
                docs.append(obj["text"])
        return docs
    with open(path, encoding="utf-8") as f:
        return [f.read()]


def pack(tokenizer, docs, seq_len, n_seq):
    """Consecutive sequences of seq_len tokens from the documents joined by EOS; deterministic."""
    eos = tokenizer.eos_token_id
    stream = []
    need = seq_len * n_seq
    for d in docs:
        stream.extend(tokenizer(d, add_special_tokens=False)["input_ids"])
        if eos is not None:
            stream.append(eos)
        if len(stream) >= need:
            break
    n = min(n_seq, len(stream) // seq_len)
    if n == 0:
        raise CaptureError(f"the text gives {len(stream)} tokens, fewer than one sequence of {seq_len}")
    return np.asarray(stream[: n * seq_len], dtype=np.int64).reshape(n, seq_len)


# ---- hooks -------------------------------------------------------------------------------------------------------

class RopeHook:
    """Wraps the model module's apply_rotary_pos_emb: records queries/keys before and after RoPE, per layer call."""

    def __init__(self, model):
        import importlib
        self.module = importlib.import_module(type(model).__module__)
        if not hasattr(self.module, "apply_rotary_pos_emb"):
            raise CaptureError(f"{type(model).__name__}: no apply_rotary_pos_emb in {self.module.__name__} to hook")
        self.original = self.module.apply_rotary_pos_emb
        self.calls = []  # (q_pre, k_pre, q_post, k_post) per attention call, in layer order

    def __enter__(self):
        def wrapped(q, k, *args, **kwargs):
            qo, ko = self.original(q, k, *args, **kwargs)
            self.calls.append((q.detach(), k.detach(), qo.detach(), ko.detach()))
            return qo, ko
        self.module.apply_rotary_pos_emb = wrapped
        return self

    def __exit__(self, *exc):
        self.module.apply_rotary_pos_emb = self.original


def cache_layers(cache, n_layers):
    """(keys, values) per layer from a transformers cache object or a legacy tuple: [B, H, T, D] each."""
    out = []
    for l in range(n_layers):
        if hasattr(cache, "layers"):
            out.append((cache.layers[l].keys, cache.layers[l].values))
        elif hasattr(cache, "key_cache"):
            out.append((cache.key_cache[l], cache.value_cache[l]))
        else:
            out.append((cache[l][0], cache[l][1]))
    return out


# ---- shards ------------------------------------------------------------------------------------------------------

def to_stored(a, dtype):
    if dtype == "fp32":
        return a.astype(np.float32), None
    if dtype == "fp16":
        return a.astype(np.float16), None
    u = np.ascontiguousarray(a.astype(np.float32)).view(np.uint32)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)  # round to nearest even
    return rounded, "bfloat16"


def write_shard(path, model_name, domain, spec, token_ids, positions, seq_offsets, keys, values, queries, dtype):
    import h5py
    tmp = f"{path}.tmp-{os.getpid()}"
    T = keys.shape[0]
    chunk = max(1, min(T, 256))
    with h5py.File(tmp, "w") as f:
        f.attrs["crosskv_format"] = FORMAT
        f.attrs["crosskv_format_version"] = np.int64(FORMAT_VERSION)
        f.attrs["model"] = model_name
        f.attrs["domain"] = domain
        f.attrs["kv_spec"] = json.dumps(spec)
        # Every dataset checksummed (HDF5's Fletcher-32 per chunk): damage to the data fails its read.
        f.create_dataset("token_ids", data=token_ids.astype(np.int32), fletcher32=True)
        f.create_dataset("positions", data=positions.astype(np.int32), fletcher32=True)
        f.create_dataset("seq_offsets", data=seq_offsets.astype(np.int64), fletcher32=True)
        for name, a in (("keys", keys), ("values", values), ("queries", queries)):
            if a is None:
                continue
            stored, tag = to_stored(a, dtype)
            d = f.create_dataset(name, data=stored, chunks=(chunk,) + stored.shape[1:], fletcher32=True)
            if tag:
                d.attrs["dtype"] = tag
    os.replace(tmp, path)


# ---- capture -----------------------------------------------------------------------------------------------------

def load(model_path, device, dtype_name):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    local = os.path.isdir(model_path)
    try:
        tok = AutoTokenizer.from_pretrained(model_path, local_files_only=local)
        model = AutoModelForCausalLM.from_pretrained(model_path, local_files_only=local,
                                                     torch_dtype=getattr(torch, dtype_name))
    except OSError as e:
        raise CaptureError(f"--model {model_path}: cannot load ({str(e).splitlines()[0]})")
    model.eval().to(device)
    return tok, model


def capture_sequences(model, ids, want_queries, stride, device):
    """ids [B, S] -> keys, values [B, S', L, H, D] post-RoPE (S' = S / stride), queries [B, S', L, Hq, D] or None."""
    import torch
    cfg = model.config
    L = cfg.num_hidden_layers
    keep = np.arange(0, ids.shape[1], stride)
    with torch.no_grad(), RopeHook(model) as hook:
        out = model(torch.as_tensor(ids, device=device), use_cache=True)
    layers = cache_layers(out.past_key_values, L)
    k = torch.stack([kv[0] for kv in layers], dim=2)  # [B, H, L, S, D]
    v = torch.stack([kv[1] for kv in layers], dim=2)
    k = k.permute(0, 3, 2, 1, 4)[:, keep].float().cpu().numpy()  # [B, S', L, H, D]
    v = v.permute(0, 3, 2, 1, 4)[:, keep].float().cpu().numpy()
    q = None
    if want_queries:
        if len(hook.calls) != L:
            raise CaptureError(f"expected {L} rotary calls in one forward pass, saw {len(hook.calls)}")
        q = torch.stack([c[2] for c in hook.calls], dim=2)  # [B, Hq, L, S, D]
        q = q.permute(0, 3, 2, 1, 4)[:, keep].float().cpu().numpy()
    return k, v, q, hook.calls


def check_same_tokens(other, tokens, tok, docs, seq_len):
    """Before any work: the other model's tokenizer (or the other store's first shard) gives the same token_ids."""
    if os.path.isdir(other) and any(n.endswith(".h5") for n in os.listdir(other)):
        import h5py
        first = sorted(n for n in os.listdir(other) if n.endswith(".h5"))[0]
        with h5py.File(os.path.join(other, first), "r") as f:
            theirs = f["token_ids"][()]
            stride = int(f["positions"][1] - f["positions"][0]) if f["positions"].shape[0] > 1 else 1
        mine = tokens[:, ::stride].reshape(-1)[: len(theirs)]
        if not np.array_equal(mine, theirs[: len(mine)]):
            raise CaptureError(f"--same-tokens-as {other}: its token_ids differ from this model's (different "
                               "tokenizers or text): the shards could not be paired")
        return
    from transformers import AutoTokenizer
    other_tok = AutoTokenizer.from_pretrained(other, local_files_only=os.path.isdir(other))
    theirs = pack(other_tok, docs, seq_len, tokens.shape[0])
    if theirs.shape != tokens.shape or not np.array_equal(theirs, tokens):
        raise CaptureError(f"--same-tokens-as {other}: the tokenizers differ on this text; the shards could not be "
                           "paired")


class Progress:
    def __init__(self, total):
        self.total, self.done, self.t0, self.last = total, 0, time.time(), 0.0

    def add(self, n):
        self.done += n
        now = time.time()
        if now - self.last > 2 or self.done == self.total:
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            print(f"[capture] {self.done}/{self.total} sequences ({100 * self.done / self.total:.0f}%), "
                  f"{rate:.2f} seq/s, ETA {eta:.0f} s", file=sys.stderr, flush=True)
            self.last = now


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model id or local folder")
    p.add_argument("--text", required=True, help="corpus: .txt (one document) or .jsonl (field 'text')")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-seq", type=int, default=500)
    p.add_argument("--stride", type=int, default=1, help="keep every stride-th token of a sequence (positions kept)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="stored dtype")
    p.add_argument("--out", required=True, help="STORE/DOMAIN folder for shard-NNN.h5")
    p.add_argument("--queries", action="store_true", help="also store post-RoPE queries (for crosskv-eval)")
    p.add_argument("--shard-seqs", type=int, default=64, help="sequences per shard")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="auto", help="auto, cpu or cuda")
    p.add_argument("--model-dtype", default="float32", help="torch dtype to run the model in")
    p.add_argument("--same-tokens-as", help="another model (or STORE/DOMAIN of its shards) that must tokenize alike")
    p.add_argument("--name", help="model name recorded in the shards (default: --model)")
    a = p.parse_args(argv)
    try:
        for k in ("seq_len", "n_seq", "stride", "shard_seqs", "batch"):
            if getattr(a, k) < 1:
                raise CaptureError(f"--{k.replace('_', '-')} must be >= 1")
        import torch
        device = ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
        docs = read_documents(a.text)
        tok, model = load(a.model, device, a.model_dtype)
        spec = kv_spec_from_config(model.config, f"--model {a.model}")
        tokens = pack(tok, docs, a.seq_len, a.n_seq)
        if a.same_tokens_as:
            check_same_tokens(a.same_tokens_as, tokens, tok, docs, a.seq_len)
        domain = os.path.basename(os.path.normpath(a.out))
        os.makedirs(a.out, exist_ok=True)
        name = a.name or os.path.basename(os.path.normpath(a.model))
        n = tokens.shape[0]
        prog = Progress(n)
        keep = np.arange(0, a.seq_len, a.stride)
        for s0 in range(0, n, a.shard_seqs):
            path = os.path.join(a.out, f"shard-{s0 // a.shard_seqs:03d}.h5")
            seqs = tokens[s0: s0 + a.shard_seqs]
            if os.path.exists(path):  # complete (written atomically): resume after it
                prog.add(len(seqs))
                continue
            ks, vs, qs = [], [], []
            for b0 in range(0, len(seqs), a.batch):
                k, v, q, _ = capture_sequences(model, seqs[b0: b0 + a.batch], a.queries, a.stride, device)
                ks.append(k.reshape((-1,) + k.shape[2:]))
                vs.append(v.reshape((-1,) + v.shape[2:]))
                if q is not None:
                    qs.append(q.reshape((-1,) + q.shape[2:]))
                prog.add(len(seqs[b0: b0 + a.batch]))
            m = len(seqs)
            write_shard(path, name, domain, spec, seqs[:, keep].reshape(-1), np.tile(keep, m),
                        np.arange(m + 1) * len(keep), np.concatenate(ks), np.concatenate(vs),
                        np.concatenate(qs) if qs else None, a.dtype)
        print(f"[capture] {n} sequences of {a.seq_len} tokens ({len(keep)} kept each) from {name} in {a.out}",
              file=sys.stderr)
        return 0
    except CaptureError as e:
        print(f"crosskv-capture: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
