"""A folder store: safetensors files with an SQLite index, capacity and least-recently-used eviction."""
from __future__ import annotations

import json
import os
import sqlite3
import threading
import time
from typing import Optional

from .base import PrefixStore
from .keys import DEFAULT_CHUNK_TOKENS, DEFAULT_NAMESPACE

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
