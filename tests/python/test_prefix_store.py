"""crosskv.vllm's prefix store, without an engine: the same interface checks on every kind (a folder, shm:, Redis).
Chunks of C tokens chained from the namespace, the longest run from a request's start and a stored tail after it,
sharing between turns and branches, parts (head ranges) that must tile the source's heads, a damaged middle chunk,
namespaces that never meet, two writers at once, and eviction under a small capacity (the folder's own
capacity_bytes; Redis's maxmemory with allkeys-lru), plus the store's settings refused by name.

    python test_prefix_store.py WORKDIR folder|redis        (redis: starts its own redis-server on a free port)
"""
import multiprocessing as mp
import os
import shutil
import socket
import subprocess
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from vllm_engine import check, finish  # noqa: E402
from crosskv.vllm import config as cfg  # noqa: E402
from crosskv.vllm import store as st  # noqa: E402

C, L, H, D = 8, 2, 2, 4
META = {"source_model": "m", "n_layers": L, "n_kv_heads": H, "head_dim": D, "rope_type": "default",
        "rope_theta": 1e6, "tokenizer": None}


def kv_of(ids):
    """Deterministic KV of token ids at their positions: keys [n, L, H, D], values = -keys."""
    ids = np.asarray(ids, dtype=np.float32)
    pos = np.arange(len(ids), dtype=np.float32)
    k = (ids[:, None, None, None] * 1e-3 + pos[:, None, None, None] * 1e-5
         + np.arange(L * H * D, dtype=np.float32).reshape(1, L, H, D))
    return k, -k


def save(store, ids, heads=(0, H), salt=None, kv=kv_of, meta=META):
    """Saves the part [heads) of ids' chunks; (written, shared)."""
    k, v = kv(ids)
    a, b = heads
    return store.save(ids, a, b - a, meta, lambda s, e: (k[s:e, :, a:b], v[s:e, :, a:b]), salt)


def read_run(store, match, salt=None):
    ks = [store.read(r, salt).keys for r in match.chunks]
    return np.concatenate(ks)[:match.tokens] if ks else np.zeros((0, L, H, D), np.float32)


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """A redis-server of the test's own on a loopback port (no persistence)."""

    def __init__(self, workdir, maxmemory=None):
        self.port = free_port()
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", workdir]
        if maxmemory:
            args += ["--maxmemory", str(maxmemory), "--maxmemory-policy", "allkeys-lru"]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
        t0 = time.time()
        while time.time() - t0 < 20:
            try:
                socket.create_connection(("127.0.0.1", self.port), 0.5).close()
                return
            except OSError:
                time.sleep(0.1)
        raise SystemExit("redis-server did not start")

    def url(self, ns):
        return f"redis://127.0.0.1:{self.port}/{ns}"

    def stop(self):
        self.proc.terminate()
        self.proc.wait(10)


def _writer(spec, seed, n, out):
    """One of two writers at once: n prefixes that share their first chunks with the other writer's."""
    store = st.open_store(spec, C)
    rng = np.random.default_rng(seed)
    common = list(range(1, 2 * C + 1))
    try:
        for i in range(n):
            save(store, common + rng.integers(1, 999, int(rng.integers(1, 4 * C))).tolist())
        out.put((seed, "ok"))
    except Exception as e:  # reported to the parent, which fails the check
        out.put((seed, f"{type(e).__name__}: {e}"))


def interface(kind, make, corrupt):
    """The interface checks on one kind: make(name) opens a fresh store, corrupt(store, key) damages a chunk."""
    rng = np.random.default_rng(1)
    store = make("main")
    ids = rng.integers(1, 999, 3 * C + 5).tolist()  # 3 whole chunks and a tail of 5
    written, shared = save(store, ids)
    check((written, shared) == (4, 0), f"{kind}: a prefix of 3 chunks and a tail is 4 chunks ({written}, {shared})")
    m = store.match(ids + [7, 7, 7], len(ids) + 2)
    check([(r.start, r.end) for r in m.chunks] == [(0, C), (C, 2 * C), (2 * C, 3 * C), (3 * C, 3 * C + 5)]
          and m.tokens == len(ids), f"{kind}: the next turn matches the 3 chunks and the tail ({m.tokens} tokens)")
    check(np.array_equal(read_run(store, m), kv_of(ids)[0]), f"{kind}: the chunks read back as the saved KV")
    m = store.match(ids, len(ids) - 1)
    check(m.tokens == len(ids) - 1 and len(m.chunks) == 4,
          f"{kind}: the request itself, all but its last token: 3 chunks and the tail in part, {m.tokens} tokens")
    # Partial reuse: a request sharing 2 of 3 chunks, then departing.
    part = ids[:2 * C] + rng.integers(1000, 2000, 2 * C).tolist()
    m = store.match(part, len(part) - 1)
    check(m.tokens == 2 * C and np.array_equal(read_run(store, m), kv_of(ids)[0][:2 * C]),
          f"{kind}: a request sharing 2 of 3 chunks maps those 2 ({m.tokens} tokens)")
    # Departing inside the tail: the tail is not matched.
    inside = ids[:3 * C + 2] + [5000, 5001, 5002]
    check(store.match(inside, len(inside) - 1).tokens == 3 * C, f"{kind}: a request departing inside the tail maps "
          f"the whole chunks only")
    # A request shorter than one chunk, and one with nothing stored.
    check(store.match(ids[:C - 1], C - 2).tokens == 0, f"{kind}: shorter than a chunk and no tail of its own: nothing")
    check(store.match(rng.integers(3000, 4000, 4 * C).tolist(), 4 * C).chunks == [],
          f"{kind}: a request with nothing stored matches nothing")
    # Branching: a second conversation shares the first chunk; the third turn shares both turns' chunks.
    branch = ids[:C] + rng.integers(1, 999, 2 * C).tolist()
    check(save(store, branch) == (2, 1), f"{kind}: a branch stores only its 2 new chunks (the shared one once)")
    turn3 = ids + [9] * 7 + rng.integers(1, 999, C).tolist()  # 3C + 5 + 7 + C = 5C + 4: the tail chunk grows whole
    check(save(store, turn3) == (3, 3), f"{kind}: the next turn stores 3 chunks, shares 3")
    check(store.match(branch + [1], len(branch)).tokens == len(branch), f"{kind}: the branch matches its own run")
    # Namespaces: another cache_salt never sees these chunks; its own are its own.
    check(store.match(ids, len(ids), salt="tenant-b").tokens == 0, f"{kind}: another namespace sees nothing")
    save(store, ids, salt="tenant-b")
    mb = store.match(ids, len(ids), salt="tenant-b")
    check(mb.tokens == len(ids) and all(r.key not in {x.key for x in m.chunks} for r in mb.chunks)
          and store.read(mb.chunks[0], "tenant-b").meta["namespace"].endswith("/tenant-b"),
          f"{kind}: the same tokens in another namespace are other chunks, carrying their namespace")
    try:
        store.read(mb.chunks[0])  # a chunk read as if it were of the store's default namespace
        check(False, f"{kind}: a chunk of another namespace is refused")
    except st.PrefixError as e:
        check("belongs to namespace" in str(e), f"{kind}: a chunk read in the wrong namespace is refused: {e}")
    # Parts: heads [0, 1) alone are incomplete; with [1, 2) whole.
    p_ids = rng.integers(1, 999, 2 * C).tolist()
    save(store, p_ids, heads=(1, 2))
    m = store.match(p_ids, 2 * C)
    try:
        store.read(m.chunks[0])
        check(False, f"{kind}: a chunk missing a part is refused")
    except st.PrefixError as e:
        check(e.kind == "incomplete" and "no stored part holds source KV heads [0, 2)" in str(e),
              f"{kind}: a chunk missing a part: {e}")
    save(store, p_ids, heads=(0, 1))
    got = store.read(m.chunks[1])
    check(np.array_equal(got.keys, kv_of(p_ids)[0][C:]) and len(got.meta["parts"]) == 2,
          f"{kind}: two parts (heads [0, 1) and [1, 2)) read back as the whole chunk")
    check(save(store, p_ids) == (0, 2), f"{kind}: a whole source saving chunks its parts already hold writes nothing")
    o_ids = rng.integers(1, 999, C).tolist()  # a TP-2 source's first part, then a TP-1 source's whole chunk
    save(store, o_ids, heads=(0, 1))
    check(save(store, o_ids) == (1, 0), f"{kind}: a whole part over a chunk that lacks heads is written")
    got = store.read(store.match(o_ids, C).chunks[0])
    check(np.array_equal(got.keys, kv_of(o_ids)[0]) and [p["part"] for p in got.meta["parts"]] == ["h0-2"],
          f"{kind}: overlapping parts of two sources read as one tiling ({[p['part'] for p in got.meta['parts']]})")
    # A damaged middle chunk: reading it names it; the chunks before it still read.
    d_ids = rng.integers(1, 999, 3 * C).tolist()
    save(store, d_ids)
    m = store.match(d_ids, 3 * C)
    corrupt(store, m.chunks[1].key)
    try:
        store.read(m.chunks[1])
        check(False, f"{kind}: a damaged chunk is refused")
    except st.PrefixError as e:
        check(e.kind == "damaged" and f"chunk 1 (tokens {C}-{2 * C}" in str(e), f"{kind}: a damaged middle chunk is "
              f"named: {e}")
    check(np.array_equal(store.read(m.chunks[0]).keys, kv_of(d_ids)[0][:C]), f"{kind}: the chunk before it reads")
    # Two writers at once, sharing chunks.
    q = mp.get_context("spawn").Queue()
    procs = [mp.get_context("spawn").Process(target=_writer, args=(store.spec, s, 15, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    check(results == [(1, "ok"), (2, "ok")], f"{kind}: two writers at once, sharing chunks, both succeed: {results}")
    bad = []
    for seed in (1, 2):
        r2 = np.random.default_rng(seed)
        for _ in range(15):
            w = list(range(1, 2 * C + 1)) + r2.integers(1, 999, int(r2.integers(1, 4 * C))).tolist()
            mw = store.match(w, len(w))
            if mw.tokens != len(w) or not np.array_equal(read_run(store, mw), kv_of(w)[0]):
                bad.append(len(w))
    check(not bad, f"{kind}: every prefix both writers saved reads back whole and exact ({len(bad)} not)")
    store.close()


def eviction(kind, store, n=40, kv=kv_of, meta=META):
    """Many prefixes into a small store: the oldest go, nothing errors, a recent one still matches, and a chunk
    evicted since its lookup is refused with the reason."""
    rng = np.random.default_rng(2)
    prefixes = [rng.integers(1, 999, 4 * C).tolist() for _ in range(n)]
    first = None
    errors = []
    for i, ids in enumerate(prefixes):
        try:
            save(store, ids, kv=kv, meta=meta)
        except Exception as e:
            errors.append(f"{type(e).__name__}: {e}")
        if i == 0:
            first = store.match(ids, len(ids))
    check(not errors, f"{kind}: {n} prefixes into a small store: no write fails ({errors[:1]})")
    check(store.match(prefixes[0], 4 * C).tokens < 4 * C, f"{kind}: the oldest prefix was evicted "
          f"({store.match(prefixes[0], 4 * C).tokens} of its {4 * C} tokens left)")
    check(store.match(prefixes[-1], 4 * C).tokens == 4 * C, f"{kind}: the newest prefix is whole")
    gone = []
    for ref in first.chunks:  # chunks looked up before they were evicted
        try:
            store.read(ref)
        except st.PrefixError as e:
            gone.append(e)
    check(gone and all(e.kind == "evicted" and "no longer stored" in str(e) for e in gone),
          f"{kind}: a chunk evicted since its lookup is refused with the reason: {gone[0] if gone else None}")
    return prefixes


def settings():
    """The store's settings refused by name (as the engine's start runs them)."""
    from types import SimpleNamespace

    for extra, want in (
            ({"store": "s", "chunk_tokens": 0}, "kv_connector_extra_config.chunk_tokens: expected >= 1, got 0"),
            ({"store": "s", "capacity_bytes": -5}, "kv_connector_extra_config.capacity_bytes: expected >= 1"),
            ({"store": "s", "ttl_seconds": "1"}, "kv_connector_extra_config.ttl_seconds: expected int, got '1'")):
        try:
            cfg.parse_settings(SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=extra,
                                               kv_load_failure_policy="recompute"))
            check(False, f"refused: {want}")
        except cfg.CrossKVConfigError as e:
            check(want in str(e), f"refused: {e}")
    for spec, kw, want in (
            ("redis://127.0.0.1:1/x", {"capacity_bytes": 10}, "capacity_bytes: a Redis store's capacity is the "
                                                              "server's own"),
            ("folder", {"ttl_seconds": 10}, "ttl_seconds: only a Redis store expires entries"),
            ("http://host/x", {}, "store: 'http://host/x': expected a folder, shm:NAME or redis://"),
            ("/proc/forbidden/x", {}, "store: cannot use '/proc/forbidden/x'")):
        try:
            st.open_store(spec, C, **kw)
            check(False, f"refused: {want}")
        except cfg.CrossKVConfigError as e:
            check(want in str(e), f"refused: {e}")


def main():
    work, kind = os.path.abspath(sys.argv[1]), sys.argv[2]
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    os.chdir(work)
    if kind == "folder":
        def corrupt_file(store, key):
            path = [os.path.join(store.root, key[:2], f) for f in os.listdir(os.path.join(store.root, key[:2]))
                    if f.startswith(key)][0]
            with open(path, "r+b") as f:  # one byte of the tensors flipped: still a readable file
                f.seek(-7, 2)
                b = f.read(1)
                f.seek(-1, 1)
                f.write(bytes([b[0] ^ 0x10]))

        interface("folder", lambda name: st.open_store(os.path.join(work, name), C), corrupt_file)
        shm = f"crosskv-test-{os.getpid()}"
        try:
            interface("shm", lambda name: st.open_store(f"shm:{shm}-{name}", C), corrupt_file)
        finally:
            shutil.rmtree(f"/dev/shm/crosskv/{shm}-main", ignore_errors=True)
        one = st.open_store(os.path.join(work, "one"), C)
        save(one, list(range(1, 4 * C + 1)))
        capacity = one.stored_bytes() * 5  # room for five prefixes of 4 chunks
        small = st.open_store(os.path.join(work, "small"), C, capacity_bytes=capacity)
        eviction("folder", small)
        check(small.stored_bytes() <= capacity, f"folder: the store stays within capacity_bytes "
              f"({small.stored_bytes()} <= {capacity})")
        files = sum(len(fs) for where, _, fs in os.walk(small.root) if where != small.root)
        check(files == small._db.execute("SELECT COUNT(*) FROM parts").fetchone()[0],
              f"folder: evicted chunks' files are removed ({files} files for the indexed parts)")
        # Least recently *used*: a prefix read since it was written outlives one written after it and not read.
        lru = st.open_store(os.path.join(work, "lru"), C, capacity_bytes=capacity * 3 // 5)
        a_ids, b_ids, c_ids, d_ids = (list(range(100 * i + 1, 100 * i + 1 + 4 * C)) for i in range(4))
        for ids in (a_ids, b_ids, c_ids):
            save(lru, ids)
            time.sleep(0.01)
        lru.touch(lru.match(a_ids, 4 * C).chunks)  # as a target's worker does after reading a load's chunks
        save(lru, d_ids)
        got = [lru.match(ids, 4 * C).tokens for ids in (a_ids, b_ids, c_ids, d_ids)]
        check(got[0] == 4 * C and got[1] < 4 * C and got[3] == 4 * C,
              f"folder: the prefix read since it was written stays, the least recently used goes (tokens {got})")
        settings()
    elif kind == "redis":
        if not shutil.which("redis-server"):
            print("SKIPPED: redis-server is not installed (Debian's redis-server)")
            sys.exit(77)
        server = RedisServer(work)
        small = RedisServer(work, maxmemory=3 << 20)
        try:
            n = [0]

            def make(name):
                n[0] += 1
                return st.open_store(server.url(f"ns{n[0]}"), C)

            def corrupt_redis(store, key):
                field = next(f for f in store._r.hkeys(store._c(key)) if f.startswith(b"d:"))
                blob = bytearray(store._r.hget(store._c(key), field))
                blob[-7] ^= 0x10
                store._r.hset(store._c(key), field, bytes(blob))

            interface("redis", make, corrupt_redis)
            a, b = st.open_store(server.url("team-a"), C), st.open_store(server.url("team-b"), C)
            save(a, list(range(1, 3 * C)))
            check(b.match(list(range(1, 3 * C)), 3 * C).tokens == 0 and a.match(list(range(1, 3 * C)),
                                                                                3 * C).tokens == 3 * C - 1,
                  "redis: the URL's namespace keeps two stores on one server apart")
            # ~200 KiB a chunk: 40 prefixes of 4 chunks are 32 MiB against 3 MiB of maxmemory
            wide = 200
            eviction("redis (maxmemory 3 MiB, allkeys-lru)", st.open_store(small.url("evict"), C),
                     kv=lambda ids: tuple(np.repeat(x, wide, axis=3) for x in kv_of(ids)),
                     meta={**META, "head_dim": D * wide})
            ttl = st.open_store(server.url("ttl"), C, ttl_seconds=1)
            save(ttl, list(range(1, 2 * C + 3)))
            had = ttl.match(list(range(1, 2 * C + 3)), 2 * C + 2).tokens
            time.sleep(2.2)
            check(had == 2 * C + 2 and ttl.match(list(range(1, 2 * C + 3)), 2 * C + 2).tokens == 0,
                  f"redis: ttl_seconds 1 expires the chunks ({had} tokens, then none)")
        finally:
            server.stop()
            small.stop()
        down = st.open_store(f"redis://127.0.0.1:{free_port()}/x", C)
        try:
            down.match(list(range(20)), 19)
            check(False, "redis: a server that is down is reported")
        except st.PrefixError as e:
            check(e.kind == "store_unreachable" and "cannot be read" in str(e), f"redis: a server that is down: {e}")
    finish(f"prefix store ({kind})")


if __name__ == "__main__":
    main()
