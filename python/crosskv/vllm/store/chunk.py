"""The chunk format (docs/FORMATS.md, the prefix store): a part's tensors in the cache's own dtype, its checksum, its
header, and the checks that a chunk's parts are whole and can feed this mapper."""
from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..config import spec_mismatch, weights_mismatch
from .keys import PrefixError

CHUNK_FORMAT, CHUNK_VERSION = "crosskv-chunk", "2"
READABLE_VERSIONS = ("1", "2")  # 1: float32 tensors (before the cache's own dtype was stored); still read
# A chunk's tensors in the engine's KV-cache dtype: the stored dtype's name -> the numpy container of its bits. fp8
# chunks carry each layer's K and V scales (k_scales, v_scales); a value is its fp8 code times its layer's scale.
KV_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8,
             "float8_e5m2": np.uint8}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")

@dataclass
class Chunk:
    """One chunk read back whole: every part's tensors checked against its checksum, heads side by side."""
    token_ids: np.ndarray  # [m] int32
    keys: np.ndarray  # [m, L, H, D] float32 (raw: the stored bits), post-RoPE at the chunk's own positions
    values: np.ndarray
    meta: dict = field(default_factory=dict)


def decode_kv(raw: np.ndarray, kv_dtype: str, scales=None) -> np.ndarray:
    """Stored KV bits [m, L, h, D] as float32 values: exact for float32, float16 and bfloat16; an fp8 code times its
    layer's scale (scales: one per layer), as vLLM's own fp8 cache is read."""
    if kv_dtype in ("float32", "float16"):
        return raw.astype(np.float32, copy=False)
    if kv_dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32)
    import torch

    fmt = {"float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2}[kv_dtype]
    x = torch.from_numpy(np.ascontiguousarray(raw)).view(fmt).to(torch.float32)
    s = torch.tensor([float(v) for v in scales], dtype=torch.float32).reshape(1, -1, 1, 1)
    return (x * s).numpy()


def _checksum(*arrays) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


def safetensors_metadata(blob: bytes) -> dict:
    """The __metadata__ of safetensors bytes (the format's 8-byte header length, then its JSON header)."""
    (n,) = struct.unpack("<Q", blob[:8])
    return dict(json.loads(blob[8:8 + n]).get("__metadata__") or {})


def whole_header(where: str, parts: list[dict]) -> dict:
    """One chunk's metadata from its parts' headers: parts that tile the source's KV heads from head 0 (in
    meta['parts']; where sources of different tensor parallelism saved overlapping parts, one tiling is taken);
    PrefixError unless such parts exist and agree."""
    try:
        heads = int(parts[0]["n_kv_heads"])
        by_first: dict[int, dict] = {}
        for p in sorted(parts, key=lambda p: -int(p["part_heads"])):  # the widest part from each first head
            by_first.setdefault(int(p["first_head"]), p)
        chosen, covered = [], 0
        while covered in by_first and int(by_first[covered]["part_heads"]) >= 1:
            chosen.append(by_first[covered])
            covered += int(by_first[covered]["part_heads"])
    except (KeyError, ValueError) as e:
        raise PrefixError(f"{where}: a part's metadata is damaged ({e})", "damaged") from None
    if covered != heads:
        raise PrefixError(f"{where}: incomplete: no stored part holds source KV heads [{covered}, {heads}) (a source "
                          "worker has not saved its part, or it was lost)", "incomplete")
    identity = ("format", "format_version", "source_model", "n_layers", "n_kv_heads", "head_dim", "tokens", "start",
                "rope_type", "rope_theta", "rope", "tokenizer", "namespace", "parent", "chunk_tokens", "kv_dtype",
                "source_weights")
    for p in chosen[1:]:
        for k in identity:
            if p.get(k) != chosen[0].get(k):
                raise PrefixError(f"{where}: its parts disagree on {k} ({chosen[0].get(k)!r} and {p.get(k)!r})",
                                  "damaged")
    return {**{k: v for k, v in chosen[0].items() if k in identity}, "parts": chosen}


def _covers(parts: list[dict], first: int, heads: int) -> bool:
    """Whether stored parts already hold KV heads [first, first + heads)."""
    held = set()
    for p in parts:
        try:
            held.update(range(int(p["first_head"]), int(p["first_head"]) + int(p["part_heads"])))
        except (KeyError, ValueError):
            continue
    return held.issuperset(range(first, first + heads))


def header_mismatch(meta: dict, mapper_spec: dict, tokenizer: Optional[str], source_weights: Optional[str] = None,
                    accepted: tuple = ()) -> Optional[str]:
    """Why a stored chunk cannot feed this mapper, or None: its format, shape, RoPE, tokenizer, and its source's
    weights fingerprint against the one the mapper was fitted on (`source_weights`; `accepted` ones too)."""
    if meta.get("format") != CHUNK_FORMAT or meta.get("format_version") not in READABLE_VERSIONS:
        return (f"it is not a {CHUNK_FORMAT} entry of a version this crosskv reads ({', '.join(READABLE_VERSIONS)}; "
                f"got {meta.get('format')} {meta.get('format_version')})")
    if meta.get("kv_dtype", "float32") not in KV_DTYPES:
        return f"its KV dtype {meta.get('kv_dtype')!r} is not one this crosskv reads ({', '.join(KV_DTYPES)})"
    try:
        if meta.get("rope"):  # every RoPE parameter (format 2)
            rope = json.loads(meta["rope"])
        else:  # format 1 recorded the type and theta alone: any other parameter the mapper's source has differs
            theta = meta.get("rope_theta")
            rope = {"type": meta.get("rope_type", "default"),
                    "theta": float(theta) if theta not in (None, "None") else None}
        got = {"n_layers": int(meta["n_layers"]), "n_kv_heads": int(meta["n_kv_heads"]),
               "head_dim": int(meta["head_dim"]), "rope": rope}
    except (KeyError, ValueError, TypeError) as e:
        return f"its metadata is damaged ({e})"
    why = spec_mismatch(mapper_spec, got, "source")
    if why:
        return f"it is of another source model ({meta.get('source_model', '?')}: {why})"
    known = meta.get("tokenizer")
    if tokenizer and known and known != "None" and known != tokenizer:
        return "it was made with another tokenizer"
    got = meta.get("source_weights")
    why = weights_mismatch(source_weights, got if got not in ("", "None") else None, accepted, "source")
    return f"it is of another source model ({meta.get('source_model', '?')}: {why})" if why else None
