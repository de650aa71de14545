"""PrefixStore: the chain, the lookups, the checks and the saves, written once over six primitives a kind
implements."""
from __future__ import annotations

import json
from abc import ABC, abstractmethod
from typing import Callable, Optional

import numpy as np

from .chunk import (CHUNK_FORMAT, CHUNK_VERSION, FP8_DTYPES, KV_DTYPES, Chunk, _checksum, _covers, decode_kv,
                    safetensors_metadata, whole_header)
from .keys import ChunkRef, Match, PrefixError, chain_root, chunk_key, chunk_keys, part_name

class PrefixStore(ABC):
    """The chunk store every kind implements: a kind supplies the six primitives below (how long a run of chunks is
    stored, the first of some chunks that is, the parts' writes, headers and tensors, and marking chunks used); the
    chain, the checks and the saves are here, once."""

    def __init__(self, spec: str, chunk_tokens: int, namespace: str):
        self.spec, self.chunk_tokens, self.namespace = spec, chunk_tokens, namespace

    # -- what a kind implements
    @abstractmethod
    def _run_length(self, keys: list[str]) -> int:
        """How many of the chunks, from the first, are stored (any part of each)."""

    @abstractmethod
    def _first_stored(self, keys: list[str]) -> Optional[int]:
        """The index of the first of the chunks that is stored, or None."""

    @abstractmethod
    def _put(self, items: list[tuple[str, str, dict, bytes]]) -> None:
        """Stores parts, together: (key, part, its header (metadata), its safetensors bytes)."""

    @abstractmethod
    def _headers(self, keys: list[str]) -> list[list[dict]]:
        """Each chunk's parts' headers (empty where none is stored)."""

    @abstractmethod
    def _blobs(self, key: str) -> dict[str, bytes]:
        """Each stored part of the chunk: part name -> its safetensors bytes."""

    def _touch(self, keys: list[str]) -> None:
        """Marks chunks used now (least-recently-used eviction); a kind whose engine tracks use itself keeps this."""

    # -- lookups
    def ns(self, salt: Optional[str] = None) -> str:
        """The namespace of a request: the store's, and the request's cache_salt where it has one."""
        return self.namespace if not salt else f"{self.namespace}/{salt}"

    def match(self, token_ids, limit: int, salt: Optional[str] = None) -> Match:
        """The longest run of stored chunks from the start of token_ids, then the longest stored tail after it, used
        up to `limit` tokens (a chunk reaching past it is used in part). Two reads of the store: the run's whole
        chunks, then every tail the request could continue with (fewer than C keys): the cost is in the request's
        length, never in the store's size."""
        ids = np.asarray(token_ids, dtype=np.int32)
        ns, C = self.ns(salt), self.chunk_tokens
        keys = chunk_keys(ids[:-(-limit // C) * C], C, ns)
        run = self._run_length(keys) if keys else 0
        chunks = [ChunkRef(keys[i], i * C, (i + 1) * C) for i in range(run)]
        start = run * C
        if start < limit:
            parent = keys[run - 1] if run else chain_root(ns, C)
            lengths = range(min(C - 1, len(ids) - start), 0, -1)  # longest first
            first = self._first_stored([chunk_key(parent, ids[start:start + m]) for m in lengths])
            if first is not None:
                m = lengths[first]
                chunks.append(ChunkRef(chunk_key(parent, ids[start:start + m]), start, start + m))
        return Match(chunks, min(chunks[-1].end, limit) if chunks else 0)

    def headers(self, refs: list[ChunkRef]) -> list[list[dict]]:
        return self._headers([r.key for r in refs])

    def read(self, ref: ChunkRef, salt: Optional[str] = None, raw: bool = False) -> Chunk:
        """One chunk, whole: every part, checksums verified, heads side by side, as float32 (raw: the stored bits,
        in meta['kv_dtype']); PrefixError naming the chunk otherwise."""
        where = self.where(ref)
        blobs = self._blobs(ref.key)
        if not blobs:
            raise PrefixError(f"{where}: no longer stored (evicted, or removed)", "evicted")
        from safetensors.numpy import load

        parts = []
        for name, blob in blobs.items():
            try:
                header = safetensors_metadata(blob)
                tensors = load(blob)
            except Exception as e:  # safetensors raises its own types for damaged bytes
                raise PrefixError(f"{where} part {name}: unreadable ({e})", "damaged") from None
            parts.append((header, tensors, name))
        meta = whole_header(where, [{**h, "where": f"{where} part {n}"} for h, _, n in parts])
        if meta.get("namespace") != self.ns(salt):
            raise PrefixError(f"{where}: belongs to namespace {meta.get('namespace')!r}, not {self.ns(salt)!r}",
                              "damaged")
        if int(meta["tokens"]) != ref.end - ref.start or int(meta["start"]) != ref.start:
            raise PrefixError(f"{where}: holds tokens [{meta['start']}, +{meta['tokens']}), not the chunk's", "damaged")
        by_part = {n: (h, t, n) for h, t, n in parts}
        ids, keys, values = None, [], []
        for p in meta["parts"]:
            if p.get("part") not in by_part:
                raise PrefixError(f"{where}: a part's metadata is damaged (its name)", "damaged")
            h, t, n = by_part[p["part"]]
            if set(t) != {"token_ids", "keys", "values"} or h.get("checksum") != _checksum(
                    t["token_ids"], t["keys"], t["values"]):
                raise PrefixError(f"{where} part {n}: damaged (its checksum does not match its tensors)", "damaged")
            if ids is not None and not np.array_equal(ids, t["token_ids"]):
                raise PrefixError(f"{where}: its parts hold other tokens", "damaged")
            ids = t["token_ids"]
            k, v = t["keys"], t["values"]
            kv_dtype = p.get("kv_dtype", "float32")
            if KV_DTYPES.get(kv_dtype) != k.dtype or k.dtype != v.dtype or k.ndim != 4 or k.shape != v.shape:
                raise PrefixError(f"{where} part {n}: damaged (its tensors are {k.dtype} {list(k.shape)}, its header "
                                  f"says {kv_dtype})", "damaged")
            if not raw:
                try:
                    scales = [json.loads(p["k_scales"]), json.loads(p["v_scales"])] if kv_dtype in FP8_DTYPES \
                        else [None, None]
                    if scales[0] is not None and not (len(scales[0]) == len(scales[1]) == k.shape[1]):
                        raise ValueError("one scale per layer expected")
                except (KeyError, ValueError, TypeError) as e:
                    raise PrefixError(f"{where} part {n}: its fp8 scales are damaged ({e})", "damaged") from None
                k, v = decode_kv(k, kv_dtype, scales[0]), decode_kv(v, kv_dtype, scales[1])
            keys.append(k)
            values.append(v)
        cat = (lambda xs: xs[0]) if len(keys) == 1 else (lambda xs: np.concatenate(xs, axis=2))
        return Chunk(ids, cat(keys), cat(values), {**meta, "kv_dtype": meta.get("kv_dtype") or "float32"})

    def touch(self, refs: list[ChunkRef]) -> None:
        """Marks chunks used now (one write for a whole load), so that least-recently-used eviction keeps them."""
        if refs:
            self._touch([r.key for r in refs])

    def where(self, ref: ChunkRef) -> str:
        return f"chunk {ref.start // self.chunk_tokens} (tokens {ref.start}-{ref.end}, {ref.key[:12]})"

    # -- saves
    def save(self, token_ids, first_head: int, heads: int, meta: dict, kv: Callable[[int, int], tuple],
             salt: Optional[str] = None) -> tuple[int, int]:
        """Stores the part [first_head, first_head + heads) of every chunk of token_ids not stored yet: whole chunks,
        then the tail. kv(start, end) gives that part's keys and values [end - start, L, heads, D], post-RoPE at
        positions start..end-1, in the cache's own dtype meta['kv_dtype'] (KV_DTYPES' container: bfloat16 as its
        uint16 bits, fp8 as its bytes with meta['k_scales'] and ['v_scales'], a JSON list per layer; float32 where
        meta names none). Returns (chunks written, chunks already stored)."""
        ids = np.asarray(token_ids, dtype=np.int32)
        ns, C = self.ns(salt), self.chunk_tokens
        keys = chunk_keys(ids, C, ns)
        refs = [ChunkRef(k, i * C, (i + 1) * C) for i, k in enumerate(keys)]
        parents = [chain_root(ns, C)] + keys
        if len(ids) % C:
            parent = parents[len(keys)]
            refs.append(ChunkRef(chunk_key(parent, ids[len(keys) * C:]), len(keys) * C, len(ids)))
        from safetensors.numpy import save

        part = part_name(first_head, heads)
        items = []
        for i, (ref, stored) in enumerate(zip(refs, self._headers([r.key for r in refs]))):
            if _covers(stored, first_head, heads):  # stored by another request (or another source's worker)
                continue
            k, v = kv(ref.start, ref.end)
            want = KV_DTYPES[meta.get("kv_dtype", "float32")]
            assert k.dtype == want and v.dtype == want, f"kv() gave {k.dtype}, the chunk's dtype is {want}"
            t = {"token_ids": np.ascontiguousarray(ids[ref.start:ref.end]), "keys": np.ascontiguousarray(k),
                 "values": np.ascontiguousarray(v)}
            header = {str(a): b if isinstance(b, str) else json.dumps(b) if isinstance(b, (dict, list)) else str(b)
                      for a, b in meta.items()}
            header.setdefault("kv_dtype", "float32")
            header.update(format=CHUNK_FORMAT, format_version=CHUNK_VERSION, namespace=ns, chunk_tokens=str(C),
                          index=str(i), start=str(ref.start), tokens=str(ref.end - ref.start), parent=parents[i],
                          first_head=str(first_head), part_heads=str(heads), part=part,
                          checksum=_checksum(t["token_ids"], t["keys"], t["values"]))
            items.append((ref.key, part, header, save(t, metadata=header)))
        if items:
            self._put(items)
        return len(items), len(refs) - len(items)

    def close(self) -> None:
        pass
