"""Where the source engine's KV lives until a target engine maps it: a store of *chunks*.

A prefix is cut into chunks of C tokens (C a multiple of the engine's block size; the last chunk of a finished
request may be shorter: a *tail*). Chunk keys are chained as vLLM's block hashes are: chunk i's key hashes its tokens
and chunk i-1's key, and chunk 0's hashes the namespace and C, so a key names its whole prefix, and a lookup never
crosses namespaces. A lookup walks the request's chunks (its cost is in the request's chunk count, not in the
store's size) and returns the longest run of stored chunks from its start, then a stored tail after it. Chunks are
shared by every prefix that holds them, so storage grows with distinct tokens, not with the square of a
conversation.

Each chunk is stored in *parts*, each the KV of a range of the source's KV heads: a source engine with tensor
parallelism N saves one part per distinct head range, from the worker that holds it, with no collective; a target
reads every part and checks that together they are the whole source KV. Every part carries its metadata (source
model, RoPE, tokenizer, namespace, place in the chain) and a checksum of its tensors.

Kinds: a folder (`/path`, or `shm:NAME` for /dev/shm/crosskv/NAME) with an SQLite index, `capacity_bytes` and
least-recently-used eviction, safe for several writers at once; and Redis (`redis://HOST:PORT/NAMESPACE`), where
capacity and eviction are the server's own (maxmemory, allkeys-lru) and `ttl_seconds` sets an expiry."""
from __future__ import annotations

import sqlite3
from typing import Optional

from ..config import EXTRA, CrossKVConfigError
from .base import PrefixStore
from .chunk import (CHUNK_FORMAT, CHUNK_VERSION, FP8_DTYPES, KV_DTYPES, READABLE_VERSIONS, Chunk, _checksum, decode_kv,
                    header_mismatch, safetensors_metadata, whole_header)
from .folder import FolderStore
from .keys import (DEFAULT_CHUNK_TOKENS, DEFAULT_NAMESPACE, ChunkRef, Match, PrefixError, chain_root, chunk_key,
                   chunk_keys, part_name)
from .redis_store import RedisStore

# `_checksum` too: the tests write chunks by hand.
__all__ = ["CHUNK_FORMAT", "CHUNK_VERSION", "DEFAULT_CHUNK_TOKENS", "DEFAULT_NAMESPACE", "FP8_DTYPES", "KV_DTYPES",
           "READABLE_VERSIONS", "Chunk", "ChunkRef", "FolderStore", "Match", "PrefixError", "PrefixStore", "RedisStore",
           "chain_root", "chunk_key", "chunk_keys", "decode_kv", "header_mismatch", "open_store", "part_name",
           "safetensors_metadata", "whole_header", "_checksum"]


def open_store(spec: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, capacity_bytes: Optional[int] = None,
               ttl_seconds: Optional[int] = None, timeout_ms: int = 5000) -> PrefixStore:
    """The store a spec names; CrossKVConfigError naming the key where it cannot be used."""
    if spec.startswith("redis://"):
        if capacity_bytes is not None:
            raise CrossKVConfigError(f"{EXTRA}.capacity_bytes: a Redis store's capacity is the server's own; set its "
                                     "maxmemory (and maxmemory-policy allkeys-lru) instead")
        try:
            import redis  # noqa: F401
        except ImportError:
            raise CrossKVConfigError(f"{EXTRA}.store: {spec} needs the redis Python package (pip install redis)") \
                from None
        return RedisStore(spec, chunk_tokens, ttl_seconds, timeout_ms)
    if ttl_seconds is not None:
        raise CrossKVConfigError(f"{EXTRA}.ttl_seconds: only a Redis store expires entries; a folder store is bounded "
                                 "by capacity_bytes")
    if "://" in spec:
        raise CrossKVConfigError(f"{EXTRA}.store: {spec!r}: expected a folder, shm:NAME or redis://HOST:PORT/NAMESPACE")
    try:
        return FolderStore(spec, chunk_tokens, capacity_bytes=capacity_bytes)
    except (OSError, sqlite3.Error) as e:
        raise CrossKVConfigError(f"{EXTRA}.store: cannot use {spec!r} ({getattr(e, 'strerror', None) or e})") from None
