#!/usr/bin/env python3
"""crosskv.vllm's prefix store: the lookup a scheduler runs for every new request, and the bytes a conversation
stores, for the old whole-prefix store (one file per prefix, keyed by all its tokens; taken from git at OLD_COMMIT)
against the chunked stores (a folder with its SQLite index; Redis), in one run.

lookup   N stored prefixes of random lengths up to --max-tokens (random tokens, KV of one layer, head and dim: the
         lookup does not read KV), then the median of --lookups lookups each of a miss (a --max-tokens request that
         shares nothing) and a hit (a stored prefix and 10 more tokens), at each N of --sizes (filled in turn).
bytes    one conversation of --turns turns (each --user user and --answer answer tokens, at the family's source
         shape: 4 layers, 2 KV heads of 32), every turn saving the whole conversation so far, as a source engine does.

    .venv-vllm/bin/python bench/prefix_store.py WORK --sizes 100,1000,10000 --json out.json
"""
import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
OLD_COMMIT = "da79a14"  # the last commit with the whole-prefix store
sys.path.insert(0, os.path.join(ROOT, "tests", "python"))


def old_store_module(work):
    """The whole-prefix store as it was at OLD_COMMIT, importable as oldstore.store (beside today's config.py, whose
    three names it uses)."""
    pkg = os.path.join(work, "oldpkg", "oldstore")
    os.makedirs(pkg, exist_ok=True)
    src = subprocess.run(["git", "-C", ROOT, "show", f"{OLD_COMMIT}:python/crosskv/vllm/store.py"], check=True,
                         capture_output=True, text=True).stdout
    open(os.path.join(pkg, "store.py"), "w").write(src)
    shutil.copy(os.path.join(ROOT, "python", "crosskv", "vllm", "config.py"), pkg)
    open(os.path.join(pkg, "__init__.py"), "w").write("")
    sys.path.insert(0, os.path.dirname(pkg))
    import oldstore.store

    return oldstore.store


def cpu_name():
    for line in open("/proc/cpuinfo"):
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor()


class Old:
    """The old store behind the bench's three calls; lookups through a second instance, as a target engine's
    scheduler reads what a source engine writes."""

    def __init__(self, mod, root):
        self.mod, self.s, self.reader = mod, mod.DirectoryStore(root), mod.DirectoryStore(root)

    def save(self, ids, keys, values, meta):
        ids = np.asarray(ids, dtype=np.int32)
        self.s.put(self.mod.prefix_key(ids), self.mod.StoredPrefix(ids, keys, values, meta))

    def lookup(self, ids):
        hit = self.reader.longest_prefix(ids, len(ids) - 1, 1)
        return hit[1] if hit else 0

    def bytes(self):
        return sum(os.path.getsize(os.path.join(self.s.root, f)) for f in os.listdir(self.s.root))


class New:
    def __init__(self, store, reader):
        self.s, self.reader = store, reader  # the reader: a connection of its own, as a target engine's scheduler

    def save(self, ids, keys, values, meta):
        self.s.save(ids, 0, keys.shape[2], meta, lambda a, b: (keys[a:b], values[a:b]))

    def lookup(self, ids):
        return self.reader.match(ids, len(ids) - 1).tokens

    def bytes(self):
        if hasattr(self.s, "root"):
            return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(self.s.root) for f in fs
                       if f.endswith(".safetensors"))
        r = self.s._r  # the chunks' and tails' values, not the server's own overhead
        return sum(r.memory_usage(k) or 0 for k in r.scan_iter(f"{self.s._prefix}*", count=1000))


def meta_of(layers, heads, dim):
    return {"source_model": "bench", "n_layers": layers, "n_kv_heads": heads, "head_dim": dim,
            "rope_type": "default", "rope_theta": 1e6, "tokenizer": None}


def lookups(stores, sizes, max_tokens, n_lookups, rng):
    rows = []
    kv = np.zeros((max_tokens, 1, 1, 1), np.float32)
    meta = meta_of(1, 1, 1)
    stored = []
    for n in sizes:
        t0 = time.perf_counter()
        while len(stored) < n:
            ids = rng.integers(1, 150000, int(rng.integers(16, max_tokens + 1))).tolist()
            stored.append(ids)
            for s in stores.values():
                s.save(ids, kv[:len(ids)], kv[:len(ids)], meta)
            if len(stored) % 1000 == 0:
                el = time.perf_counter() - t0
                print(f"  filled {len(stored)}/{sizes[-1]} prefixes ({el:.0f} s)", flush=True)
        miss = rng.integers(150000, 151000, max_tokens).tolist()
        row = {"stored": n}
        for name, s in stores.items():
            ts_miss, ts_hit = [], []
            for i in range(n_lookups):
                t = time.perf_counter()
                got = s.lookup(miss)
                ts_miss.append(time.perf_counter() - t)
                assert got == 0, (name, got)
                want = stored[int(rng.integers(0, len(stored)))]
                t = time.perf_counter()
                got = s.lookup(want + [7] * 10)
                ts_hit.append(time.perf_counter() - t)
                assert got == len(want), (name, got, len(want))
            row[name] = {"miss_ms": statistics.median(ts_miss) * 1e3, "hit_ms": statistics.median(ts_hit) * 1e3}
        rows.append(row)
        print(f"  {n:6d} stored:" + "".join(f"   {k}: miss {v['miss_ms']:8.2f} ms, hit {v['hit_ms']:8.2f} ms"
                                             for k, v in row.items() if k != "stored"), flush=True)
    return rows


def conversation(stores, turns, user, answer, rng):
    L, H, D = 4, 2, 32
    meta = meta_of(L, H, D)
    conv = []
    for _ in range(turns):
        conv += rng.integers(1, 150000, user + answer).tolist()
        kv = rng.standard_normal((len(conv), L, H, D)).astype(np.float32)
        for s in stores.values():
            s.save(conv, kv, kv, meta)
    return {name: s.bytes() for name, s in stores.items()}, len(conv)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("work")
    ap.add_argument("--sizes", default="100,1000,10000")
    ap.add_argument("--max-tokens", type=int, default=16384)
    ap.add_argument("--lookups", type=int, default=20)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--user", type=int, default=300)
    ap.add_argument("--answer", type=int, default=200)
    ap.add_argument("--no-redis", action="store_true")
    ap.add_argument("--json")
    a = ap.parse_args()
    from crosskv.vllm import store as st

    work = os.path.abspath(a.work)
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    old = old_store_module(work)
    server = None
    if not a.no_redis and shutil.which("redis-server"):
        from redis_server import RedisServer

        server = RedisServer(work)
    try:
        def stores(tag):
            folder = os.path.join(work, f"folder-{tag}")
            out = {"old (whole prefixes)": Old(old, os.path.join(work, f"old-{tag}")),
                   "folder (chunks)": New(st.open_store(folder, a.chunk), st.open_store(folder, a.chunk))}
            if server:
                out["redis (chunks)"] = New(st.open_store(server.url(tag), a.chunk),
                                            st.open_store(server.url(tag), a.chunk))
            return out

        print(f"CPU: {cpu_name()}, {os.cpu_count()} cores; chunk {a.chunk} tokens; {a.lookups} lookups a size")
        rng = np.random.default_rng(0)
        rows = lookups(stores("lookup"), [int(x) for x in a.sizes.split(",")], a.max_tokens, a.lookups, rng)
        conv_bytes, conv_tokens = conversation(stores("conv"), a.turns, a.user, a.answer, rng)
        print(f"  a {a.turns}-turn conversation ({conv_tokens} tokens): " + ", ".join(
            f"{k} {v / 2**20:.1f} MiB" for k, v in conv_bytes.items()))
    finally:
        if server:
            server.stop()
    if a.json:
        json.dump({"cpu": cpu_name(), "chunk": a.chunk, "max_tokens": a.max_tokens, "lookup": rows,
                   "conversation": {"turns": a.turns, "tokens": conv_tokens, "bytes": conv_bytes}},
                  open(a.json, "w"), indent=2)


if __name__ == "__main__":
    main()
