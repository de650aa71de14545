"""crosskv.vllm's prefix store under pytest, without an engine: the same interface cases on every kind (a folder,
shm:, Redis), each case on a store of its own. Chunks of C tokens chained from the namespace, the longest run from a
request's start and a stored tail after it, sharing between turns and branches, parts (head ranges) that must tile
the source's heads, a damaged middle chunk, namespaces that never meet, two writers at once; eviction under a small
capacity (the folder's own capacity_bytes, least recently used first; Redis's maxmemory with allkeys-lru), Redis's
expiry and a server that is down; the store's settings refused by name.

    .venv-vllm/bin/python -m pytest tests/python/test_prefix_store.py [-k redis]   (Redis: a redis-server of its own)
"""
import multiprocessing as mp
import os
import shutil
import sys
import time
from types import SimpleNamespace

import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from redis_server import RedisServer, free_port  # noqa: E402

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


# ---- the kinds: each gives fresh stores (make) and damages a stored chunk (corrupt)
def _corrupt_file(store, key):
    folder = os.path.join(store.root, key[:2])
    path = [os.path.join(folder, f) for f in os.listdir(folder) if f.startswith(key)][0]
    with open(path, "r+b") as f:  # one byte of the tensors flipped: still a readable file
        f.seek(-7, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


def _corrupt_redis(store, key):
    field = next(f for f in store._r.hkeys(store._c(key)) if f.startswith(b"d:"))
    blob = bytearray(store._r.hget(store._c(key), field))
    blob[-7] ^= 0x10
    store._r.hset(store._c(key), field, bytes(blob))


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian's redis-server)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    yield server
    server.stop()


class Kind:
    def __init__(self, name, make, corrupt):
        self.name, self.corrupt, self._make, self._opened = name, corrupt, make, []

    def make(self, label="s"):
        s = self._make(f"{label}-{len(self._opened)}")
        self._opened.append(s)
        return s

    def close(self):
        for s in self._opened:
            s.close()


@pytest.fixture(params=["folder", "shm", "redis"])
def kind(request, tmp_path):
    if request.param == "folder":
        k = Kind("folder", lambda n: st.open_store(str(tmp_path / n), C), _corrupt_file)
    elif request.param == "shm":
        tag = f"crosskv-test-{os.getpid()}-{request.node.name.replace('[', '-').replace(']', '')}"
        k = Kind("shm", lambda n: st.open_store(f"shm:{tag}-{n}", C), _corrupt_file)
    else:
        server = request.getfixturevalue("redis_server")
        k = Kind("redis", lambda n: st.open_store(server.url(f"{request.node.name}-{n}"), C), _corrupt_redis)
    yield k
    k.close()
    if request.param == "shm":
        for d in os.listdir("/dev/shm/crosskv") if os.path.isdir("/dev/shm/crosskv") else []:
            if d.startswith(f"crosskv-test-{os.getpid()}"):
                shutil.rmtree(f"/dev/shm/crosskv/{d}", ignore_errors=True)


IDS = np.random.default_rng(1).integers(1, 999, 3 * C + 5).tolist()  # 3 whole chunks and a tail of 5


# ---- the interface, on every kind
def test_a_prefix_is_its_chunks_and_a_tail(kind):
    store = kind.make()
    assert save(store, IDS) == (4, 0)
    m = store.match(IDS + [7, 7, 7], len(IDS) + 2)
    assert [(r.start, r.end) for r in m.chunks] == [(0, C), (C, 2 * C), (2 * C, 3 * C), (3 * C, 3 * C + 5)]
    assert m.tokens == len(IDS)
    assert np.array_equal(read_run(store, m), kv_of(IDS)[0])
    m = store.match(IDS, len(IDS) - 1)  # the request itself, all but its last token: the tail in part
    assert m.tokens == len(IDS) - 1 and len(m.chunks) == 4


def test_partial_reuse_maps_what_is_shared(kind):
    store = kind.make()
    save(store, IDS)
    rng = np.random.default_rng(2)
    part = IDS[:2 * C] + rng.integers(1000, 2000, 2 * C).tolist()
    m = store.match(part, len(part) - 1)
    assert m.tokens == 2 * C and np.array_equal(read_run(store, m), kv_of(IDS)[0][:2 * C])
    inside = IDS[:3 * C + 2] + [5000, 5001, 5002]  # departing inside the tail: whole chunks only
    assert store.match(inside, len(inside) - 1).tokens == 3 * C
    assert store.match(IDS[:C - 1], C - 2).tokens == 0  # shorter than a chunk, no tail of its own
    assert store.match(rng.integers(3000, 4000, 4 * C).tolist(), 4 * C).chunks == []


def test_branches_and_turns_share_chunks(kind):
    store = kind.make()
    save(store, IDS)
    rng = np.random.default_rng(3)
    branch = IDS[:C] + rng.integers(1, 999, 2 * C).tolist()
    assert save(store, branch) == (2, 1)  # only its 2 new chunks; the shared one once
    turn3 = IDS + [9] * 7 + rng.integers(1, 999, C).tolist()  # 5C + 4 tokens: the tail chunk grows whole
    assert save(store, turn3) == (3, 3)
    assert store.match(branch + [1], len(branch)).tokens == len(branch)


def test_namespaces_never_meet(kind):
    store = kind.make()
    save(store, IDS)
    assert store.match(IDS, len(IDS), salt="tenant-b").tokens == 0
    save(store, IDS, salt="tenant-b")
    ma, mb = store.match(IDS, len(IDS)), store.match(IDS, len(IDS), salt="tenant-b")
    assert mb.tokens == len(IDS) and not {r.key for r in mb.chunks} & {r.key for r in ma.chunks}
    assert store.read(mb.chunks[0], "tenant-b").meta["namespace"].endswith("/tenant-b")
    with pytest.raises(st.PrefixError, match="belongs to namespace"):
        store.read(mb.chunks[0])  # read as if it were of the store's default namespace


def test_parts_must_tile_the_heads(kind):
    store = kind.make()
    ids = np.random.default_rng(4).integers(1, 999, 2 * C).tolist()
    save(store, ids, heads=(1, 2))
    m = store.match(ids, 2 * C)
    with pytest.raises(st.PrefixError, match=r"no stored part holds source KV heads \[0, 2\)") as e:
        store.read(m.chunks[0])
    assert e.value.kind == "incomplete"
    save(store, ids, heads=(0, 1))
    got = store.read(m.chunks[1])
    assert np.array_equal(got.keys, kv_of(ids)[0][C:]) and len(got.meta["parts"]) == 2
    assert save(store, ids) == (0, 2)  # a whole source over chunks its parts already hold writes nothing


def test_overlapping_parts_read_as_one_tiling(kind):
    store = kind.make()
    ids = np.random.default_rng(5).integers(1, 999, C).tolist()
    save(store, ids, heads=(0, 1))  # a TP-2 source's first part, then a TP-1 source's whole chunk
    assert save(store, ids) == (1, 0)
    got = store.read(store.match(ids, C).chunks[0])
    assert np.array_equal(got.keys, kv_of(ids)[0]) and [p["part"] for p in got.meta["parts"]] == ["h0-2"]


def test_a_damaged_middle_chunk_is_named(kind):
    store = kind.make()
    ids = np.random.default_rng(6).integers(1, 999, 3 * C).tolist()
    save(store, ids)
    m = store.match(ids, 3 * C)
    kind.corrupt(store, m.chunks[1].key)
    with pytest.raises(st.PrefixError, match=f"chunk 1 \\(tokens {C}-{2 * C}") as e:
        store.read(m.chunks[1])
    assert e.value.kind == "damaged"
    assert np.array_equal(store.read(m.chunks[0]).keys, kv_of(ids)[0][:C])  # the chunk before it reads


def _writer(spec, seed, n, out):
    """One of two writers at once: n prefixes that share their first chunks with the other writer's."""
    store = st.open_store(spec, C)
    rng = np.random.default_rng(seed)
    common = list(range(1, 2 * C + 1))
    try:
        for _ in range(n):
            save(store, common + rng.integers(1, 999, int(rng.integers(1, 4 * C))).tolist())
        out.put((seed, "ok"))
    except Exception as e:  # reported to the parent
        out.put((seed, f"{type(e).__name__}: {e}"))


def test_two_writers_at_once(kind):
    store = kind.make()
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=_writer, args=(store.spec, s, 15, q)) for s in (1, 2)]
    for p in procs:
        p.start()
    results = sorted(q.get(timeout=300) for _ in procs)
    for p in procs:
        p.join(60)
    assert results == [(1, "ok"), (2, "ok")]
    for seed in (1, 2):
        r2 = np.random.default_rng(seed)
        for _ in range(15):
            w = list(range(1, 2 * C + 1)) + r2.integers(1, 999, int(r2.integers(1, 4 * C))).tolist()
            mw = store.match(w, len(w))
            assert mw.tokens == len(w) and np.array_equal(read_run(store, mw), kv_of(w)[0])


# ---- eviction, per kind
def evict(store, n=40, kv=kv_of, meta=META):
    """Many prefixes into a small store: no write fails, the oldest goes, the newest stays, and a chunk evicted since
    its lookup is refused with the reason. The prefixes."""
    rng = np.random.default_rng(2)
    prefixes = [rng.integers(1, 999, 4 * C).tolist() for _ in range(n)]
    first = None
    for i, ids in enumerate(prefixes):
        save(store, ids, kv=kv, meta=meta)
        if i == 0:
            first = store.match(ids, len(ids))
    assert store.match(prefixes[0], 4 * C).tokens < 4 * C
    assert store.match(prefixes[-1], 4 * C).tokens == 4 * C
    gone = []
    for ref in first.chunks:  # chunks looked up before they were evicted
        try:
            store.read(ref)
        except st.PrefixError as e:
            gone.append(e)
    assert gone and all(e.kind == "evicted" and "no longer stored" in str(e) for e in gone), gone
    return prefixes


def test_a_folder_stays_within_its_capacity(tmp_path):
    one = st.open_store(str(tmp_path / "one"), C)
    save(one, list(range(1, 4 * C + 1)))
    capacity = one.stored_bytes() * 5  # room for five prefixes of 4 chunks
    small = st.open_store(str(tmp_path / "small"), C, capacity_bytes=capacity)
    evict(small)
    assert small.stored_bytes() <= capacity
    files = sum(len(fs) for where, _, fs in os.walk(small.root) if where != small.root)
    assert files == small._db.execute("SELECT COUNT(*) FROM parts").fetchone()[0]  # evicted files are removed


def test_a_folder_evicts_the_least_recently_used(tmp_path):
    one = st.open_store(str(tmp_path / "one"), C)
    save(one, list(range(1, 4 * C + 1)))
    lru = st.open_store(str(tmp_path / "lru"), C, capacity_bytes=one.stored_bytes() * 3)
    a_ids, b_ids, c_ids, d_ids = (list(range(100 * i + 1, 100 * i + 1 + 4 * C)) for i in range(4))
    for ids in (a_ids, b_ids, c_ids):
        save(lru, ids)
        time.sleep(0.01)
    lru.touch(lru.match(a_ids, 4 * C).chunks)  # as a target's worker does after reading a load's chunks
    save(lru, d_ids)
    got = [lru.match(ids, 4 * C).tokens for ids in (a_ids, b_ids, c_ids, d_ids)]
    assert got[0] == 4 * C and got[1] < 4 * C and got[3] == 4 * C, got


def test_redis_evicts_under_maxmemory(tmp_path):
    if not shutil.which("redis-server"):
        pytest.skip("redis-server is not installed (Debian's redis-server)")
    small = RedisServer(tmp_path, maxmemory=3 << 20)
    try:
        wide = 200  # ~200 KiB a chunk: 40 prefixes of 4 chunks are 32 MiB against 3 MiB of maxmemory
        evict(st.open_store(small.url("evict"), C), kv=lambda ids: tuple(np.repeat(x, wide, axis=3) for x in kv_of(ids)),
              meta={**META, "head_dim": D * wide})
    finally:
        small.stop()


def test_redis_url_namespaces_keep_stores_apart(redis_server):
    a, b = st.open_store(redis_server.url("team-a"), C), st.open_store(redis_server.url("team-b"), C)
    save(a, list(range(1, 3 * C)))
    assert b.match(list(range(1, 3 * C)), 3 * C).tokens == 0
    assert a.match(list(range(1, 3 * C)), 3 * C).tokens == 3 * C - 1


def test_redis_ttl_expires_chunks(redis_server):
    ttl = st.open_store(redis_server.url("ttl"), C, ttl_seconds=1)
    ids = list(range(1, 2 * C + 3))
    save(ttl, ids)
    assert ttl.match(ids, 2 * C + 2).tokens == 2 * C + 2
    time.sleep(2.2)
    assert ttl.match(ids, 2 * C + 2).tokens == 0


def test_a_redis_server_that_is_down_is_reported():
    down = st.open_store(f"redis://127.0.0.1:{free_port()}/x", C)
    with pytest.raises(st.PrefixError, match="cannot be read") as e:
        down.match(list(range(20)), 19)
    assert e.value.kind == "store_unreachable"


# ---- settings refused by name (as the engine's start runs them)
@pytest.mark.parametrize("extra,want", [
    ({"store": "s", "chunk_tokens": 0}, "kv_connector_extra_config.chunk_tokens: expected >= 1, got 0"),
    ({"store": "s", "capacity_bytes": -5}, "kv_connector_extra_config.capacity_bytes: expected >= 1"),
    ({"store": "s", "ttl_seconds": "1"}, "kv_connector_extra_config.ttl_seconds: expected int, got '1'")])
def test_bad_settings_are_refused_by_name(extra, want):
    with pytest.raises(cfg.CrossKVConfigError, match=want.replace("(", r"\(")):
        cfg.parse_settings(SimpleNamespace(kv_role="kv_producer", kv_connector_extra_config=extra,
                                           kv_load_failure_policy="recompute"))


@pytest.mark.parametrize("spec,kw,want", [
    ("redis://127.0.0.1:1/x", {"capacity_bytes": 10}, "capacity_bytes: a Redis store's capacity is the server's own"),
    ("folder", {"ttl_seconds": 10}, "ttl_seconds: only a Redis store expires entries"),
    ("http://host/x", {}, "store: 'http://host/x': expected a folder, shm:NAME or redis://"),
    ("/proc/forbidden/x", {}, "store: cannot use '/proc/forbidden/x'")])
def test_bad_stores_are_refused_by_name(spec, kw, want):
    with pytest.raises(cfg.CrossKVConfigError, match=want.replace("(", r"\(")):
        st.open_store(spec, C, **kw)
