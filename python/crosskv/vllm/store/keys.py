"""Chunk keys and their chain: a chunk's key hashes its tokens and its parent's key, chunk 0's the namespace and the
chunk size, so a key names its whole prefix; references to stored chunks and a lookup's match; PrefixError."""
from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass

import numpy as np

DEFAULT_CHUNK_TOKENS = 256
DEFAULT_NAMESPACE = "default"



class PrefixError(ValueError):
    """A stored chunk that cannot be used; `kind` is its class for the metrics: missing, damaged, incomplete,
    evicted, store_unreachable."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


def _digest(*parts: bytes) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(struct.pack("<Q", len(p)))
        h.update(p)
    return h.hexdigest()[:40]


def chain_root(namespace: str, chunk_tokens: int) -> str:
    """The parent of a namespace's chunk 0: its chain cannot meet another namespace's, nor another chunk size's."""
    return _digest(b"crosskv-chunk-root", namespace.encode(), str(chunk_tokens).encode())


def chunk_key(parent: str, tokens) -> str:
    return _digest(parent.encode(), np.asarray(tokens, dtype=np.int32).tobytes())


def chunk_keys(token_ids, chunk_tokens: int, namespace: str) -> list[str]:
    """The chained keys of token_ids' whole chunks."""
    ids = np.asarray(token_ids, dtype=np.int32)
    keys, parent = [], chain_root(namespace, chunk_tokens)
    for start in range(0, len(ids) - chunk_tokens + 1, chunk_tokens):
        parent = chunk_key(parent, ids[start:start + chunk_tokens])
        keys.append(parent)
    return keys


@dataclass
class ChunkRef:
    key: str
    start: int  # tokens [start, end) of the prefix
    end: int


@dataclass
class Match:
    """The longest run of stored chunks from a request's start: chunks[i] holds tokens [start, end); the last may be
    used only up to `tokens` (the request's limit)."""
    chunks: list[ChunkRef]
    tokens: int = 0


def part_name(first_head: int, heads: int) -> str:
    return f"h{first_head}-{first_head + heads}"
