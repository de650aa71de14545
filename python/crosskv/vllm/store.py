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

import hashlib
import json
import os
import sqlite3
import struct
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, Optional
from urllib.parse import urlparse

import numpy as np

from .config import EXTRA, CrossKVConfigError, spec_mismatch

CHUNK_FORMAT, CHUNK_VERSION = "crosskv-chunk", "2"
READABLE_VERSIONS = ("1", "2")  # 1: float32 tensors (before the cache's own dtype was stored); still read
# A chunk's tensors in the engine's KV-cache dtype: the stored dtype's name -> the numpy container of its bits. fp8
# chunks carry each layer's K and V scales (k_scales, v_scales); a value is its fp8 code times its layer's scale.
KV_DTYPES = {"float32": np.float32, "float16": np.float16, "bfloat16": np.uint16, "float8_e4m3fn": np.uint8,
             "float8_e5m2": np.uint8}
FP8_DTYPES = ("float8_e4m3fn", "float8_e5m2")
DEFAULT_CHUNK_TOKENS = 256
DEFAULT_NAMESPACE = "default"


class PrefixError(ValueError):
    """A stored chunk that cannot be used; `kind` is its class for the metrics: missing, damaged, incomplete,
    evicted, store_unreachable."""

    def __init__(self, message: str, kind: str):
        super().__init__(message)
        self.kind = kind


# ------------------------------------------------------------------------------------------------------- keys
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


def part_name(first_head: int, heads: int) -> str:
    return f"h{first_head}-{first_head + heads}"


# ------------------------------------------------------------------------------------------------- the store
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
                "rope_type", "rope_theta", "rope", "tokenizer", "namespace", "parent", "chunk_tokens", "kv_dtype")
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


def header_mismatch(meta: dict, mapper_spec: dict, tokenizer: Optional[str]) -> Optional[str]:
    """Why a stored chunk cannot feed this mapper, or None."""
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
    return None


# ------------------------------------------------------------------------------------------------ a folder
_SCHEMA = """
CREATE TABLE IF NOT EXISTS parts (key TEXT NOT NULL, part TEXT NOT NULL, bytes INTEGER NOT NULL, used REAL NOT NULL,
  header TEXT NOT NULL, PRIMARY KEY (key, part));
CREATE INDEX IF NOT EXISTS parts_used ON parts (used);
"""


class FolderStore(PrefixStore):
    """Chunks as safetensors files in a folder (<root>/<key[:2]>/<key>.<part>.safetensors), indexed in SQLite
    (<root>/index.sqlite3: which parts exist, their headers, size and last use). Writes are atomic (a file is renamed
    into place, then indexed); SQLite serializes writers across processes. With capacity_bytes, each write evicts the
    least recently used chunks (written or read) until the store fits."""

    def __init__(self, spec: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, namespace: str = DEFAULT_NAMESPACE,
                 capacity_bytes: Optional[int] = None):
        super().__init__(spec, chunk_tokens, namespace)
        self.root = os.path.join("/dev/shm", "crosskv", spec[4:]) if spec.startswith("shm:") else spec
        self.capacity_bytes = capacity_bytes
        os.makedirs(self.root, exist_ok=True)
        self._local = threading.local()  # a connection per thread: the saver's writes and the loads run apart
        self._connections: list = []
        self._db.executescript(_SCHEMA)

    @property
    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(os.path.join(self.root, "index.sqlite3"), timeout=60, isolation_level=None,
                                 check_same_thread=False)
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA mmap_size=268435456")  # the index read through the page cache, not read() calls
            self._local.db = db
            self._connections.append(db)
        return db

    def _path(self, key: str, part: str) -> str:
        return os.path.join(self.root, key[:2], f"{key}.{part}.safetensors")

    def _present(self, keys) -> set:
        got = set()
        for i in range(0, len(keys), 500):
            batch = keys[i:i + 500]
            got.update(r[0] for r in self._db.execute(
                f"SELECT DISTINCT key FROM parts WHERE key IN ({','.join('?' * len(batch))})", batch))
        return got

    def _run_length(self, keys):
        got = self._present(keys)
        return next((i for i, k in enumerate(keys) if k not in got), len(keys))

    def _first_stored(self, keys):
        got = self._present(keys)
        return next((i for i, k in enumerate(keys) if k in got), None)

    def _headers(self, keys):
        out = {k: [] for k in keys}
        for i in range(0, len(keys), 500):
            batch = keys[i:i + 500]
            for key, header in self._db.execute(
                    f"SELECT key, header FROM parts WHERE key IN ({','.join('?' * len(batch))})", batch):
                out[key].append(json.loads(header))
        return [out[k] for k in keys]

    def _put(self, items):
        for key, part, _, blob in items:  # each file renamed into place whole, then indexed
            path = self._path(key, part)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            tmp = f"{path}.tmp-{os.getpid()}-{id(blob)}"
            with open(tmp, "wb") as f:
                f.write(blob)
            os.replace(tmp, path)
        db, now = self._db, time.time()
        db.execute("BEGIN IMMEDIATE")
        try:
            db.executemany("INSERT OR REPLACE INTO parts VALUES (?, ?, ?, ?, ?)",
                           [(key, part, len(blob), now, json.dumps(h))
                            for key, part, h, blob in items])
            if self.capacity_bytes is not None:
                self._evict(keep={key for key, *_ in items})
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def _evict(self, keep: set):
        """Least recently used chunks out (all their parts) until the store fits capacity_bytes; inside the write's
        transaction, so two writers never evict past each other."""
        db = self._db
        (total,) = db.execute("SELECT COALESCE(SUM(bytes), 0) FROM parts").fetchone()
        if total <= self.capacity_bytes:
            return
        for key, size in db.execute("SELECT key, SUM(bytes) FROM parts GROUP BY key ORDER BY MAX(used)").fetchall():
            if total <= self.capacity_bytes:
                break
            if key in keep:
                continue
            parts = [r[0] for r in db.execute("SELECT part FROM parts WHERE key = ?", (key,))]
            db.execute("DELETE FROM parts WHERE key = ?", (key,))
            for part in parts:
                try:
                    os.unlink(self._path(key, part))
                except FileNotFoundError:
                    pass
            total -= size

    def _blobs(self, key):
        out = {}
        for (part,) in self._db.execute("SELECT part FROM parts WHERE key = ?", (key,)).fetchall():
            try:
                with open(self._path(key, part), "rb") as f:
                    out[part] = f.read()
            except FileNotFoundError:  # evicted since the index was read
                continue
        return out

    def _touch(self, keys):
        if keys:
            self._db.execute(f"UPDATE parts SET used = ? WHERE key IN ({','.join('?' * len(keys))})",
                             [time.time(), *keys])

    def stored_bytes(self) -> int:
        return int(self._db.execute("SELECT COALESCE(SUM(bytes), 0) FROM parts").fetchone()[0])

    def close(self):
        for db in self._connections:
            db.close()
        self._connections.clear()
        self._local = threading.local()


# ------------------------------------------------------------------------------------------------------ Redis
class RedisStore(PrefixStore):
    """Chunks in a Redis server (redis://HOST:PORT/NAMESPACE): a chunk is one hash, crosskv:<ns>:c:<key>, with a
    field per part for its header (m:<part>, JSON) and one for its tensors (d:<part>, safetensors bytes), so eviction
    takes a chunk whole, and nothing else is stored. Capacity and eviction are the
    server's (maxmemory, maxmemory-policy allkeys-lru; a chunk read counts as a use); ttl_seconds expires entries."""

    def __init__(self, spec: str, chunk_tokens: int = DEFAULT_CHUNK_TOKENS, ttl_seconds: Optional[int] = None,
                 timeout_ms: int = 5000):
        u = urlparse(spec)
        namespace = u.path.strip("/") or DEFAULT_NAMESPACE
        super().__init__(spec, chunk_tokens, namespace)
        import redis
        from redis.backoff import NoBackoff
        from redis.retry import Retry

        self.ttl = ttl_seconds
        # No client retries: redis-py's default backs off and retries a refused connection for seconds; the guard
        # (guard.py) decides what a failed call costs, and the breaker what the next one does.
        self._r = redis.Redis(host=u.hostname or "127.0.0.1", port=u.port or 6379, password=u.password,
                              socket_timeout=timeout_ms / 1e3, socket_connect_timeout=min(timeout_ms / 1e3, 5.0),
                              retry=Retry(NoBackoff(), 0))
        self._prefix = f"crosskv:{namespace}:"
        self._errors = (redis.RedisError, OSError)
        self._run_script = self._r.register_script(self._RUN)
        self._first_script = self._r.register_script(self._FIRST)

    def _call(self, what, fn):
        try:
            return fn()
        except self._errors as e:
            raise PrefixError(f"the store at {self.spec} cannot {what}: {type(e).__name__}: {e}",
                              "store_unreachable") from None

    def _c(self, key):
        return f"{self._prefix}c:{key}"

    # One round trip each, on the server: the run's length (EXISTS in order until the first miss), and the first of
    # some keys that exists (-1: none).
    _RUN = "for i, k in ipairs(KEYS) do if redis.call('EXISTS', k) == 0 then return i - 1 end end return #KEYS"
    _FIRST = "for i, k in ipairs(KEYS) do if redis.call('EXISTS', k) == 1 then return i - 1 end end return -1"

    def _run_length(self, keys):
        return int(self._call("be read", lambda: self._run_script(keys=[self._c(k) for k in keys])))

    def _first_stored(self, keys):
        if not keys:
            return None
        i = int(self._call("be read", lambda: self._first_script(keys=[self._c(k) for k in keys])))
        return None if i < 0 else i

    def _headers(self, keys):
        def run():
            p = self._r.pipeline(transaction=False)
            for k in keys:
                p.hkeys(self._c(k))
            names = [[f.decode() for f in fs if f.startswith(b"m:")] for fs in p.execute()]
            for k, fs in zip(keys, names):
                p.hmget(self._c(k), fs) if fs else p.echo("")
            got = p.execute()
            return [[json.loads(h) for h in hs if h is not None] if fs else [] for fs, hs in zip(names, got)]
        return self._call("be read", run)

    def _put(self, items):
        def run():
            p = self._r.pipeline(transaction=True)
            for key, part, header, blob in items:
                p.hset(self._c(key), mapping={f"m:{part}": json.dumps(header), f"d:{part}": blob})
                if self.ttl:
                    p.expire(self._c(key), self.ttl)
            p.execute()
        self._call("be written", run)

    def _blobs(self, key):
        got = self._call("be read", lambda: self._r.hgetall(self._c(key)))
        return {f.decode()[2:]: v for f, v in got.items() if f.startswith(b"d:")}

    def stored_bytes(self) -> int:
        return int(self._call("be read", lambda: self._r.info("memory"))["used_memory"])

    def close(self):
        self._r.close()


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
