"""A Redis store: a chunk is one hash, capacity and eviction the server's own."""
from __future__ import annotations

import json
from typing import Optional
from urllib.parse import urlparse

from .base import PrefixStore
from .keys import DEFAULT_CHUNK_TOKENS, DEFAULT_NAMESPACE, PrefixError

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
