"""Where the source engine's prefixes live until a target engine maps them. A prefix is stored in parts, each the KV
of a range of the source's KV heads: a source engine with tensor parallelism N saves one part per distinct head
range, from the worker that holds it, with no collective; a target reads every part and checks that together they
are the whole source KV before it maps any of it."""
from __future__ import annotations

import hashlib
import os
import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Optional

import numpy as np

from .config import CrossKVConfigError, EXTRA, spec_mismatch

PREFIX_FORMAT, PREFIX_VERSION = "crosskv-prefix", "2"


class PrefixError(ValueError):
    """A stored prefix that cannot be used; `kind` is its class for the metrics: missing, damaged, incomplete."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def prefix_key(token_ids) -> str:
    ids = np.asarray(token_ids, dtype=np.int32)
    return f"{len(ids)}-{hashlib.sha256(ids.tobytes()).hexdigest()[:40]}"


@dataclass
class StoredPrefix:
    token_ids: np.ndarray  # [n] int32
    keys: np.ndarray  # [n, L, h, D] float32, post-RoPE at positions 0..n-1: KV heads [first_head, first_head + h)
    values: np.ndarray
    meta: dict  # source_model, n_layers, n_kv_heads (all of the model's), head_dim, rope_theta, rope_type, tokenizer
    first_head: int = 0


def _checksum(*arrays) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


class KVStore(ABC):
    """Keys: prefix_key(token ids). Each key holds parts (head ranges) that together are the whole source KV."""

    @abstractmethod
    def put(self, key: str, prefix: StoredPrefix) -> None:
        """Stores one part: prefix.keys holds heads [prefix.first_head, prefix.first_head + h)."""

    @abstractmethod
    def lengths(self) -> list[int]:
        """The token counts of the stored prefixes, longest first."""

    @abstractmethod
    def contains(self, key: str) -> bool:
        """Whether any part of the prefix is stored (header() then says whether it is whole and sound)."""

    @abstractmethod
    def part_headers(self, key: str) -> list[dict]:
        """Each stored part's metadata, without its tensors. PrefixError where a part is unreadable."""

    @abstractmethod
    def read_part(self, key: str, part: dict) -> dict:
        """One part's tensors {token_ids, keys, values}; PrefixError where missing or unreadable."""

    def header(self, key: str) -> Optional[dict]:
        """The prefix's metadata where its parts are sound and cover every source KV head; None where nothing is
        stored; PrefixError naming what is wrong otherwise."""
        parts = self.part_headers(key)
        if not parts:
            return None
        return whole_header(key, parts)

    def get(self, key: str) -> StoredPrefix:
        """The whole prefix (every part, checksums verified, heads side by side); ValueError where missing or
        damaged."""
        meta = self.header(key)
        if meta is None:
            raise PrefixError(f"{key}: missing", "missing")
        ids, keys, values = None, [], []
        for part in meta["parts"]:
            t = self.read_part(key, part)
            if set(t) != {"token_ids", "keys", "values"} or part.get("checksum") != _checksum(
                    t["token_ids"], t["keys"], t["values"]):
                raise PrefixError(f"{part['where']}: damaged (its checksum does not match its tensors)", "damaged")
            if ids is not None and not np.array_equal(ids, t["token_ids"]):
                raise PrefixError(f"{part['where']}: holds other tokens than the prefix's other parts", "damaged")
            ids = t["token_ids"]
            keys.append(t["keys"])
            values.append(t["values"])
        cat = (lambda xs: xs[0]) if len(keys) == 1 else (lambda xs: np.concatenate(xs, axis=2))
        return StoredPrefix(ids, cat(keys), cat(values), meta)

    def longest_prefix(self, token_ids, limit: int, shortest: int) -> Optional[tuple[str, int]]:
        """(key, n) of the longest stored prefix of token_ids with shortest <= n <= limit."""
        for n in self.lengths():
            if shortest <= n <= limit:
                key = prefix_key(token_ids[:n])
                if self.contains(key):
                    return key, n
        return None


def whole_header(key: str, parts: list[dict]) -> dict:
    """One prefix's metadata from its parts' headers (sorted by first head, in meta['parts']); ValueError unless
    they agree and tile the source's KV heads exactly (PrefixError)."""
    try:
        parts = sorted(parts, key=lambda p: int(p["first_head"]))
        heads = int(parts[0]["n_kv_heads"])
        covered = 0
        for p in parts:
            first, count = int(p["first_head"]), int(p["part_heads"])
            if first != covered or count < 1:
                break
            covered += count
    except (KeyError, ValueError) as e:
        raise PrefixError(f"{key}: a part's metadata is damaged ({e})", "damaged") from None
    if covered != heads:
        raise PrefixError(f"{key}: incomplete: no stored part holds source KV heads [{covered}, {heads}) (a source "
                          "worker has not saved its part, or it was lost)", "incomplete")
    identity = ("format", "format_version", "source_model", "n_layers", "n_kv_heads", "head_dim", "tokens",
                "rope_type", "rope_theta", "tokenizer")
    for p in parts[1:]:
        for k in identity:
            if p.get(k) != parts[0].get(k):
                raise PrefixError(f"{key}: its parts disagree on {k} ({parts[0].get(k)!r} and {p.get(k)!r})",
                                  "damaged")
    return {**{k: v for k, v in parts[0].items() if k in identity}, "parts": parts}


class DirectoryStore(KVStore):
    """A safetensors file per part in a folder: a local disk, or shared memory (/dev/shm) with shm:NAME. File names:
    <key>.h<first>-<end>.safetensors."""

    _NAME = re.compile(r"((\d+)-[0-9a-f]+)\.h(\d+)-(\d+)\.safetensors$")

    def __init__(self, spec: str):
        self.root = os.path.join("/dev/shm", "crosskv", spec[4:]) if spec.startswith("shm:") else spec
        os.makedirs(self.root, exist_ok=True)
        self._stamp, self._lengths, self._parts = None, [], {}

    def _refresh(self):
        """The folder's listing, read again only when the folder changed."""
        stamp = os.stat(self.root).st_mtime_ns
        if stamp == self._stamp:
            return
        parts: dict[str, list[str]] = {}
        for f in os.listdir(self.root):
            if m := self._NAME.match(f):
                parts.setdefault(m.group(1), []).append(f)
        self._stamp, self._parts = stamp, parts
        self._lengths = sorted({int(k.split("-", 1)[0]) for k in parts}, reverse=True)

    def put(self, key, p):
        from safetensors.numpy import save_file

        h = p.keys.shape[2]
        ids, keys, values = (np.ascontiguousarray(a) for a in (p.token_ids, p.keys, p.values))
        meta = {k: str(v) for k, v in p.meta.items()}
        meta.update(format=PREFIX_FORMAT, format_version=PREFIX_VERSION, tokens=str(len(p.token_ids)),
                    first_head=str(p.first_head), part_heads=str(h),
                    checksum=_checksum(ids, keys, values))
        path = os.path.join(self.root, f"{key}.h{p.first_head}-{p.first_head + h}.safetensors")
        tmp = path + f".tmp-{os.getpid()}"
        save_file({"token_ids": ids, "keys": keys, "values": values}, tmp, metadata=meta)
        os.replace(tmp, path)

    def lengths(self):
        self._refresh()
        return self._lengths

    def contains(self, key):
        self._refresh()
        return key in self._parts

    def part_headers(self, key):
        from safetensors import safe_open

        self._refresh()
        out = []
        for f in self._parts.get(key, []):
            path = os.path.join(self.root, f)
            try:
                with safe_open(path, "np") as h:
                    out.append({**dict(h.metadata() or {}), "where": path})
            except FileNotFoundError:
                continue  # replaced or removed since the listing
            except Exception as e:  # safetensors raises its own error types for a damaged header
                raise PrefixError(f"{path}: unreadable ({e})", "damaged") from None
        return out

    def read_part(self, key, part):
        from safetensors.numpy import load_file

        try:
            return load_file(part["where"])
        except Exception as e:
            raise PrefixError(f"{part['where']}: unreadable ({e})", "damaged") from None


def open_store(spec: str) -> KVStore:
    try:
        return DirectoryStore(spec)
    except OSError as e:
        raise CrossKVConfigError(f"{EXTRA}.store: cannot use {spec!r} ({e.strerror})") from None


def header_mismatch(meta: dict, mapper_spec: dict, tokenizer: Optional[str]) -> Optional[str]:
    """Why a stored prefix cannot feed this mapper, or None."""
    if meta.get("format") != PREFIX_FORMAT or meta.get("format_version") != PREFIX_VERSION:
        return f"the stored prefix is not a {PREFIX_FORMAT} v{PREFIX_VERSION} entry"
    try:
        got = {"n_layers": int(meta["n_layers"]), "n_kv_heads": int(meta["n_kv_heads"]),
               "head_dim": int(meta["head_dim"]), "rope_type": meta.get("rope_type", "default"),
               "rope_theta": float(meta["rope_theta"]) if meta.get("rope_theta") not in (None, "None") else None}
    except (KeyError, ValueError) as e:
        return f"the stored prefix's metadata is damaged ({e})"
    why = spec_mismatch(mapper_spec, got, "source")
    if why:
        return f"the stored prefix is of another source model ({meta.get('source_model', '?')}: {why})"
    known = meta.get("tokenizer")
    if tokenizer and known and known != "None" and known != tokenizer:
        return "the stored prefix was made with another tokenizer"
    return None
