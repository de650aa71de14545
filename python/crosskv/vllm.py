"""crosskv.vllm: serve crosskv mappers in vLLM through its V1 KV-connector interface.

The source model's engine saves each finished request's prefix KV into a store; the target model's engine finds the
longest stored prefix of a new request, maps it with a crosskv.Mapper and writes the mapped K (target RoPE applied)
and V into the blocks vLLM allocated, through the attention backend's own cache writer. vLLM then computes only the
tokens after the prefix. Anything wrong (mapper and model disagree, the stored prefix is missing, damaged or of
another source model, the mapper's held-out verdict is NOT READY) gives the request its re-prefill, never wrong KV.

    # the source engine                                  # the target engine
    --kv-transfer-config '{"kv_connector": "CrossKVConnector", "kv_connector_module_path": "crosskv.vllm",
        "kv_role": "kv_producer",                         "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "shm:pair"}} "kv_connector_extra_config": {"store": "shm:pair",
                                                                                       "mapper": "out/k4"}}'

Each target request's outcome is logged and returned in its kv_transfer_params["crosskv"]: {"status": "applied",
"tokens": N, ...}, {"status": "fallback_reprefill", "reason": "..."}, or {"status": "local_prefix_cache", "tokens": N}
where the target's own prefix cache already held as much as the store.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import threading
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Any, Optional

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.logger import init_logger

from . import Mapper, MapperError

logger = init_logger("vllm.crosskv")

# A request's outcome: the stored prefix mapped; re-prefilled (with the reason); or the target's own prefix cache
# already held at least as much.
APPLIED, FALLBACK, LOCAL = "applied", "fallback_reprefill", "local_prefix_cache"
PREFIX_FORMAT, PREFIX_VERSION = "crosskv-prefix", "1"
_EXTRA = "kv_transfer_config.kv_connector_extra_config"


class CrossKVConfigError(ValueError):
    """A bad connector configuration: the engine does not start. The message names the key."""


# ---------------------------------------------------------------------------------------------------------- config
@dataclass
class Settings:
    store: str
    mapper: Optional[str] = None
    allow_not_ready: bool = False
    mapper_device: Optional[str] = None
    min_prefix_tokens: int = 1
    layerwise: Optional[bool] = None  # None: layer by layer when the mapper runs on a GPU


def parse_settings(kv_transfer_config) -> tuple[str, Settings]:
    """('source' | 'target', Settings) from vLLM's KVTransferConfig; CrossKVConfigError names the bad key."""
    role = {"kv_producer": "source", "kv_consumer": "target"}.get(kv_transfer_config.kv_role)
    if role is None:
        raise CrossKVConfigError(f"kv_transfer_config.kv_role: expected kv_producer (the source model's engine) or "
                                 f"kv_consumer (the target's), got {kv_transfer_config.kv_role!r}")
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    known = {"store": str, "mapper": str, "allow_not_ready": bool, "mapper_device": str, "min_prefix_tokens": int,
             "layerwise": bool}
    for key, value in extra.items():
        if key not in known:
            raise CrossKVConfigError(f"{_EXTRA}.{key}: unknown key; expected one of {', '.join(known)}")
        if not isinstance(value, known[key]) or (known[key] is int and isinstance(value, bool)):
            raise CrossKVConfigError(f"{_EXTRA}.{key}: expected {known[key].__name__}, got {value!r}")
    if "store" not in extra:
        raise CrossKVConfigError(f"{_EXTRA}.store: missing; a folder, or shm:NAME for shared memory")
    s = Settings(**extra)
    if s.min_prefix_tokens < 1:
        raise CrossKVConfigError(f"{_EXTRA}.min_prefix_tokens: expected >= 1, got {s.min_prefix_tokens}")
    if role == "target":
        if s.mapper is None:
            raise CrossKVConfigError(f"{_EXTRA}.mapper: missing; the target engine needs a crosskv-fit mapper folder "
                                     "(k<K>/)")
        if not os.path.isfile(os.path.join(s.mapper, "manifest.json")):
            raise CrossKVConfigError(f"{_EXTRA}.mapper: {s.mapper}/manifest.json not found; expected a crosskv-fit "
                                     "mapper folder (k<K>/)")
        read_mapper_manifest(s.mapper)
        mapper_verdict(s.mapper)
        if kv_transfer_config.kv_load_failure_policy != "recompute":
            raise CrossKVConfigError('kv_transfer_config.kv_load_failure_policy: expected "recompute" so that a '
                                     "prefix that fails to map is re-prefilled, got "
                                     f"{kv_transfer_config.kv_load_failure_policy!r}")
    elif s.mapper is not None:
        raise CrossKVConfigError(f"{_EXTRA}.mapper: only the target engine (kv_consumer) maps; the source saves "
                                 "its own KV")
    return role, s


# ------------------------------------------------------------------------------------------------- model identity
def engine_spec(model_config) -> dict:
    """The engine model's KV shape and RoPE, as a mapper's kv_spec names them."""
    c = model_config.hf_text_config
    heads = c.num_attention_heads
    rope = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
    theta = getattr(c, "rope_theta", None) or rope.get("rope_theta")
    return {"n_layers": int(c.num_hidden_layers), "n_kv_heads": int(getattr(c, "num_key_value_heads", heads) or heads),
            "head_dim": int(getattr(c, "head_dim", None) or c.hidden_size // heads),
            "rope_type": rope.get("rope_type", rope.get("type", "default")) or "default",
            "rope_theta": float(theta) if theta is not None else None}


def tokenizer_fingerprint(model_config) -> Optional[str]:
    """SHA-256 of the model's tokenizer.json where it is a local file; None where unknown."""
    path = os.path.join(str(getattr(model_config, "tokenizer", "") or ""), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def spec_mismatch(mapper_spec: dict, engine: dict, side: str) -> Optional[str]:
    for key, what in (("n_layers", "layers"), ("n_kv_heads", "KV heads"), ("head_dim", "head dim")):
        if int(mapper_spec[key]) != engine[key]:
            return f"the mapper's {side} has {mapper_spec[key]} {what}, the model has {engine[key]}"
    rope = mapper_spec.get("rope", {})
    theta = rope.get("theta", mapper_spec.get("rope_theta"))
    if engine["rope_theta"] is not None and theta is not None and abs(float(theta) - engine["rope_theta"]) > 1e-6 * abs(
            engine["rope_theta"]):
        return f"the mapper's {side} has RoPE theta {theta}, the model has {engine['rope_theta']}"
    kind = rope.get("type", mapper_spec.get("rope_type", "default"))
    if engine["rope_type"] != kind:
        return f"the mapper's {side} has RoPE {kind!r}, the model has {engine['rope_type']!r}"
    return None


def _json_file(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CrossKVConfigError(f"{_EXTRA}.mapper: {path}: {what} does not read as JSON ({e})") from None
    if not isinstance(d, dict):
        raise CrossKVConfigError(f"{_EXTRA}.mapper: {path}: {what} is not a JSON object")
    return d


def read_mapper_manifest(mapper_dir: str) -> dict:
    """The mapper's manifest.json, with the two kv_specs the connector checks; CrossKVConfigError otherwise."""
    path = os.path.join(mapper_dir, "manifest.json")
    m = _json_file(path, "the mapper's manifest")
    for side in ("source", "target"):
        spec = m.get(side, {}).get("kv_spec") if isinstance(m.get(side), dict) else None
        if not isinstance(spec, dict) or not all(k in spec for k in ("n_layers", "n_kv_heads", "head_dim")):
            raise CrossKVConfigError(f"{_EXTRA}.mapper: {path}: no {side}.kv_spec with n_layers, n_kv_heads and "
                                     "head_dim; expected a crosskv-fit manifest")
    return m


def mapper_verdict(mapper_dir: str) -> Optional[str]:
    """The held-out verdict crosskv-fit wrote beside the mapper (eval-<k>.json), or None where it ran no eval. One
    that cannot be read stops the engine (CrossKVConfigError): a NOT READY mapper must not be served by accident."""
    folder = os.path.normpath(os.path.abspath(mapper_dir))
    path = os.path.join(os.path.dirname(folder), f"eval-{os.path.basename(folder)}.json")
    if not os.path.isfile(path):
        return None
    return str(_json_file(path, "the held-out verdict").get("verdict", ""))


# ------------------------------------------------------------------------------------------------------ the store
def prefix_key(token_ids) -> str:
    ids = np.asarray(token_ids, dtype=np.int32)
    return f"{len(ids)}-{hashlib.sha256(ids.tobytes()).hexdigest()[:40]}"


@dataclass
class StoredPrefix:
    token_ids: np.ndarray  # [n] int32
    keys: np.ndarray  # [n, L, H, D] float32, post-RoPE at positions 0..n-1
    values: np.ndarray
    meta: dict  # source_model, n_layers, n_kv_heads, head_dim, rope_theta, rope_type, tokenizer


def _checksum(*arrays) -> str:
    h = hashlib.blake2b(digest_size=16)
    for a in arrays:
        h.update(np.ascontiguousarray(a).data)
    return h.hexdigest()


class KVStore(ABC):
    """Where the source's prefixes live between the two engines. Keys: prefix_key(token ids)."""

    @abstractmethod
    def put(self, key: str, prefix: StoredPrefix) -> None: ...

    @abstractmethod
    def lengths(self) -> list[int]:
        """The token counts of the stored prefixes, longest first."""

    @abstractmethod
    def header(self, key: str) -> Optional[dict]:
        """The prefix's metadata without its tensors; None where it is not stored. ValueError where unreadable."""

    @abstractmethod
    def get(self, key: str) -> StoredPrefix:
        """The whole prefix, its checksum verified; ValueError where missing or damaged."""

    def longest_prefix(self, token_ids, limit: int, shortest: int) -> Optional[tuple[str, int]]:
        """(key, n) of the longest stored prefix of token_ids with shortest <= n <= limit."""
        for n in self.lengths():
            if shortest <= n <= limit:
                key = prefix_key(token_ids[:n])
                if self.contains(key):
                    return key, n
        return None

    def contains(self, key: str) -> bool:
        try:
            return self.header(key) is not None
        except ValueError:
            return True  # there, but damaged: the caller reads the header and says so


class DirectoryStore(KVStore):
    """One safetensors file per prefix in a folder: a local disk, or shared memory (/dev/shm) with shm:NAME."""

    def __init__(self, spec: str):
        self.root = os.path.join("/dev/shm", "crosskv", spec[4:]) if spec.startswith("shm:") else spec
        os.makedirs(self.root, exist_ok=True)
        self._listing = (None, [])

    def _path(self, key):
        return os.path.join(self.root, key + ".safetensors")

    def contains(self, key):  # the file's presence: its header is read once, by the caller
        return os.path.exists(self._path(key))

    def put(self, key, p):
        from safetensors.numpy import save_file

        meta = {k: str(v) for k, v in p.meta.items()}
        meta.update(format=PREFIX_FORMAT, format_version=PREFIX_VERSION, tokens=str(len(p.token_ids)),
                    checksum=_checksum(p.token_ids, p.keys, p.values))
        tmp = self._path(key) + f".tmp-{os.getpid()}"
        save_file({"token_ids": p.token_ids, "keys": p.keys, "values": p.values}, tmp, metadata=meta)
        os.replace(tmp, self._path(key))

    def lengths(self):
        stamp = os.stat(self.root).st_mtime_ns
        if self._listing[0] != stamp:
            ns = {int(m.group(1)) for f in os.listdir(self.root) if (m := re.match(r"(\d+)-[0-9a-f]+\.safetensors$", f))}
            self._listing = (stamp, sorted(ns, reverse=True))
        return self._listing[1]

    def header(self, key):
        from safetensors import safe_open

        path = self._path(key)
        if not os.path.exists(path):
            return None
        try:
            with safe_open(path, "np") as f:
                return dict(f.metadata() or {})
        except Exception as e:  # safetensors raises its own error types for a damaged header
            raise ValueError(f"{path}: unreadable ({e})") from None

    def get(self, key):
        from safetensors.numpy import load_file

        path = self._path(key)
        meta = self.header(key)
        if meta is None:
            raise ValueError(f"{path}: missing")
        try:
            t = load_file(path)
        except Exception as e:
            raise ValueError(f"{path}: unreadable ({e})") from None
        if set(t) != {"token_ids", "keys", "values"} or meta.get("checksum") != _checksum(t["token_ids"], t["keys"],
                                                                                          t["values"]):
            raise ValueError(f"{path}: damaged (its checksum does not match its tensors)")
        return StoredPrefix(t["token_ids"], t["keys"], t["values"], meta)


def open_store(spec: str) -> KVStore:
    try:
        return DirectoryStore(spec)
    except OSError as e:
        raise CrossKVConfigError(f"{_EXTRA}.store: cannot use {spec!r} ({e.strerror})") from None


def header_mismatch(meta: dict, mapper_spec: dict, source_model: str, tokenizer: Optional[str]) -> Optional[str]:
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


# ------------------------------------------------------------------------------------ the paged cache, either way
def slots_of(block_ids, block_size: int, first: int, end: int) -> torch.Tensor:
    t = torch.arange(first, end, dtype=torch.int64)
    return torch.as_tensor(block_ids, dtype=torch.int64)[t // block_size] * block_size + t % block_size


class PagedLayout:
    """Where each slot's K and V sit in one attention layer's paged cache, learnt from the backend's own writer
    (impl.do_kv_cache_update) on a scratch cache of three blocks: the writer is fed codes, and where each code lands
    is where that (slot, head, dim) lives. Any layout the writer permutes values into is read back exactly; one it
    transforms (fp8) is refused."""

    def __init__(self, attn_layer, kv_cache: torch.Tensor, num_blocks: int, block_size: int, heads: int, dim: int):
        block_dims = [d for d, n in enumerate(kv_cache.shape) if n == num_blocks]
        if len(block_dims) != 1 or not kv_cache.is_contiguous():
            raise ValueError(f"cannot find the block dimension of a {tuple(kv_cache.shape)} cache of {num_blocks} "
                             "blocks")
        bd = block_dims[0]
        shape = list(kv_cache.shape)
        shape[bd] = 3
        nslots = 3 * block_size
        count = nslots * heads * dim
        base, digits = 128, 1
        while base**digits < 2 * count:
            digits += 1
        code = torch.full((2 * count,), -1, dtype=torch.int64)  # the code found at each scratch element, -1: none
        where = None
        slots = torch.arange(nslots, dtype=torch.int64)
        k_codes = torch.arange(count, dtype=torch.int64).reshape(nslots, heads, dim)
        for i in range(digits):
            scratch = torch.full(shape, -1.0, dtype=kv_cache.dtype, device=kv_cache.device)
            digit = lambda c: ((c // base**i) % base).to(kv_cache.dtype).to(kv_cache.device)
            attn_layer.impl.do_kv_cache_update(attn_layer, digit(k_codes), digit(k_codes + count), scratch,
                                               slots.to(kv_cache.device))
            flat = scratch.reshape(-1).to("cpu", torch.float64)
            if where is None:
                where = torch.nonzero(flat >= 0).flatten()
                if where.numel() != 2 * count:
                    raise ValueError(f"the cache writer wrote {where.numel()} values for {2 * count}")
                code = torch.zeros(where.numel(), dtype=torch.int64)
            code += flat[where].round().to(torch.int64) * base**i
        if not torch.equal(torch.sort(code).values, torch.arange(2 * count)):
            raise ValueError("the cache writer does not store values as given (a quantized cache?)")
        # Scratch element -> (block, the rest); the real cache's offset of the rest, with the block stride apart.
        idx = torch.stack(torch.unravel_index(where, tuple(shape)))  # [ndim, 2*count]
        strides = torch.tensor(kv_cache.stride(), dtype=torch.int64)
        rest = (idx * strides[:, None]).sum(0) - idx[bd] * strides[bd]
        offset = torch.empty(2 * count, dtype=torch.int64)
        offset[code] = rest
        block = torch.empty(2 * count, dtype=torch.int64)
        block[code] = idx[bd]
        slot_of_code = (torch.arange(2 * count) % count) // (heads * dim)
        if not torch.equal(block, slot_of_code // block_size):
            raise ValueError("the cache writer puts a slot outside its block")
        per_block = offset.reshape(2, 3, block_size, heads, dim)
        if not (torch.equal(per_block[:, 0], per_block[:, 1]) and torch.equal(per_block[:, 0], per_block[:, 2])):
            raise ValueError("the cache's blocks are not laid out alike")
        self.offsets = per_block[:, 0].to(kv_cache.device)  # [K|V, slot in block, head, dim]
        self.block_stride, self.block_size = int(strides[bd]), block_size

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [tokens, heads, dim] of the given slots."""
        slots = slots.to(kv_cache.device)
        at = (slots // self.block_size * self.block_stride)[:, None, None] + self.offsets[:, slots % self.block_size]
        flat = kv_cache.reshape(-1)
        return flat[at[0]], flat[at[1]]


# ------------------------------------------------------------------------------------------------------ metadata
@dataclass
class LoadPlan:
    req_id: str
    key: str
    first: int  # tokens [first, end) are loaded; [0, first) the target's own prefix cache holds
    end: int
    token_ids: list[int]  # [0, end), to check the stored prefix against
    slots: list[int]


@dataclass
class SavePlan:
    req_id: str
    token_ids: list[int]
    slots: list[int]


@dataclass
class CrossKVMetadata(KVConnectorMetadata):
    loads: list[LoadPlan] = field(default_factory=list)
    saves: list[SavePlan] = field(default_factory=list)


@dataclass
class CrossKVWorkerMetadata(KVConnectorWorkerMetadata):
    outcomes: dict[str, dict] = field(default_factory=dict)  # req_id -> outcome

    def aggregate(self, other):
        merged = dict(self.outcomes)
        for req, o in other.outcomes.items():  # one worker's failure fails the request
            if req not in merged or o["status"] == FALLBACK:
                merged[req] = o
        return CrossKVWorkerMetadata(merged)


def fallback(reason: str) -> dict:
    return {"status": FALLBACK, "reason": reason}


@dataclass
class SourcePrefix:
    """A load's stored prefix, read and checked, on the mapper's side: source keys and values [tokens, Ls, Hs, Ds]
    and their positions."""
    plan: LoadPlan
    keys: torch.Tensor
    values: torch.Tensor
    positions: torch.Tensor
    read_s: float  # seconds to read, check and place it


class LayerByLayer:
    """Maps the step's prefixes one target layer at a time on a thread of its own, so that mapping layer l overlaps
    the model's compute of the layers before it; wait(l) returns layer l's (plan, keys, values) for each prefix whose
    mapping has not failed. On a GPU the mapping runs on a side stream, and wait(l) orders the caller's stream after
    it. A prefix whose mapping fails at any layer is reported through `failed` (its blocks are then recomputed, so
    the layers written before the failure are overwritten)."""

    def __init__(self, mapper: Mapper, prefixes: list[SourcePrefix], n_layers: int, device: torch.device):
        self.mapper, self.prefixes, self.n_layers = mapper, prefixes, n_layers
        self.failed: dict[str, str] = {}  # req_id -> reason
        self.map_s: dict[str, float] = {}  # req_id -> seconds of mapping
        self._done = [threading.Event() for _ in range(n_layers)]
        self._out: list[list] = [[] for _ in range(n_layers)]
        self._cuda_events: list[Optional[torch.cuda.Event]] = [None] * n_layers
        self._side = None
        if device.type == "cuda":
            self._side = torch.cuda.Stream(device)
            self._side.wait_stream(torch.cuda.current_stream(device))  # the prefixes were uploaded on it
        self._thread = threading.Thread(target=self._run, name="crosskv-map", daemon=True)
        self._thread.start()

    def _run(self):
        try:
            with torch.cuda.stream(self._side) if self._side is not None else contextlib.nullcontext():
                for li in range(self.n_layers):
                    self._map_layer(li)
        except BaseException as e:  # anything unforeseen fails every prefix still mapping, never the engine
            for p in self.prefixes:
                self.failed.setdefault(p.plan.req_id, f"the mapping thread stopped: {type(e).__name__}: {e}")
        finally:
            for done in self._done:  # no layer waits forever
                done.set()

    def _map_layer(self, li: int):
        for p in self.prefixes:
            rid = p.plan.req_id
            if rid in self.failed:
                continue
            t0 = time.perf_counter()
            try:
                k, v = self.mapper.transfer(p.keys, p.values, p.positions, layers=li)
                self._out[li].append((p.plan, k[:, 0], v[:, 0]))
            except (ValueError, MapperError, RuntimeError) as e:
                self.failed[rid] = str(e)
            self.map_s[rid] = self.map_s.get(rid, 0.0) + time.perf_counter() - t0
        if self._side is not None:
            self._cuda_events[li] = torch.cuda.Event()
            self._cuda_events[li].record(self._side)
        self._done[li].set()

    def wait(self, li: int):
        self._done[li].wait()
        if self._cuda_events[li] is not None:
            main = torch.cuda.current_stream()
            main.wait_event(self._cuda_events[li])
            for _, k, v in self._out[li]:  # freed once the caller's stream is done with them
                k.record_stream(main)
                v.record_stream(main)
        return [(plan, k, v) for plan, k, v in self._out[li] if plan.req_id not in self.failed]

    def join(self):
        self._thread.join()


# ----------------------------------------------------------------------------------------------------- connector
class CrossKVConnector(KVConnectorBase_V1):
    """kv_producer: the source model's engine, saving finished requests' KV. kv_consumer: the target's, mapping
    stored prefixes into its cache."""

    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.side, self.settings = parse_settings(vllm_config.kv_transfer_config)
        self.store = open_store(self.settings.store)
        self.block_size = vllm_config.cache_config.block_size
        mc = vllm_config.model_config
        self.engine = engine_spec(mc)
        self.model_name = str(mc.model)
        self.tokenizer = tokenizer_fingerprint(mc)
        self.unusable: Optional[str] = None  # why no request can be mapped (target)
        if self.side == "source" and str(vllm_config.cache_config.cache_dtype) not in ("auto", "float32", "bfloat16",
                                                                                         "float16"):
            raise CrossKVConfigError(f"cache_config.cache_dtype: the source engine's KV is saved as computed; "
                                     f"expected an unquantized cache, got {vllm_config.cache_config.cache_dtype!r}")
        if self.side == "target":
            self.manifest = read_mapper_manifest(self.settings.mapper)
            self.source_spec = self.manifest["source"]["kv_spec"]
            self.unusable = spec_mismatch(self.manifest["target"]["kv_spec"], self.engine, "target")
            if self.unusable:
                self.unusable = f"the mapper does not match this engine's model: {self.unusable}"
            verdict = mapper_verdict(self.settings.mapper)
            if not self.unusable and verdict and verdict.startswith("NOT READY"):
                if self.settings.allow_not_ready:
                    logger.warning("crosskv: the mapper's held-out verdict is %s; served anyway (allow_not_ready)",
                                   verdict)
                else:
                    detail = verdict[len("NOT READY"):].lstrip(" :")
                    self.unusable = (f"the mapper's held-out verdict is NOT READY ({detail}); set {_EXTRA}."
                                     "allow_not_ready to serve it anyway")
            if self.unusable:
                logger.warning("crosskv: every request re-prefills: %s", self.unusable)
        # scheduler side
        self._outcomes: dict[str, dict] = {}
        self._candidates: dict[str, tuple[str, int, int]] = {}  # req_id -> (key, first, end)
        self._to_load: dict[str, Any] = {}
        self._to_save: list[SavePlan] = []
        # worker side
        self._mapper: Optional[Mapper] = None
        self._layers: dict[str, Any] = {}  # attention layer name -> layer, in model order
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._layouts: dict[str, PagedLayout] = {}
        self._mapped: list[tuple[LoadPlan, torch.Tensor, torch.Tensor]] = []
        self._by_layer: Optional[LayerByLayer] = None
        self._worker_outcomes: dict[str, dict] = {}
        self._invalid_blocks: set[int] = set()
        self._saved: set[str] = set()

    # ------------------------------------------------------------------------------------------- scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens):
        if self.side == "source":
            return 0, False
        rid = request.request_id
        tokens = list(request.prompt_token_ids or [])
        if self.unusable:
            self._outcomes[rid] = fallback(self.unusable)
            return 0, False
        # The last prompt token is always computed: it gives the first output token's logits.
        hit = self.store.longest_prefix(tokens, len(tokens) - 1, self.settings.min_prefix_tokens)
        if hit is None:
            self._outcomes[rid] = fallback("no stored prefix of this request")
            return 0, False
        key, n = hit
        try:
            meta = self.store.header(key)
        except ValueError as e:
            self._outcomes[rid] = fallback(f"the stored prefix is damaged: {e}")
            return 0, False
        why = header_mismatch(meta or {}, self.source_spec, self.manifest["source"].get("model", ""), self.tokenizer)
        if why:
            self._outcomes[rid] = fallback(why)
            return 0, False
        if n <= num_computed_tokens:
            self._outcomes[rid] = {"status": LOCAL, "tokens": num_computed_tokens, "prefix_tokens": n}
            return 0, False
        self._candidates[rid] = (key, num_computed_tokens, n)
        self._outcomes[rid] = {"status": APPLIED, "tokens": n - num_computed_tokens, "prefix_tokens": n,
                               "mapper": self.settings.mapper}
        return n - num_computed_tokens, False

    def update_state_after_alloc(self, request, blocks, num_external_tokens):
        if num_external_tokens > 0 and request.request_id in self._candidates:
            self._to_load[request.request_id] = request

    def build_connector_meta(self, scheduler_output):
        meta = CrossKVMetadata(saves=self._to_save)
        self._to_save = []
        for new in scheduler_output.scheduled_new_reqs:
            if new.req_id not in self._to_load:
                continue
            key, first, end = self._candidates[new.req_id]
            meta.loads.append(LoadPlan(new.req_id, key, first, end, list(new.prompt_token_ids[:end]),
                                       slots_of(new.block_ids[0], self.block_size, first, end).tolist()))
            del self._to_load[new.req_id]
        for rid in list(self._to_load):  # resumed after preemption: vLLM recomputes; say so
            self._outcomes[rid] = fallback("preempted before its prefix was loaded")
            del self._to_load[rid]
        return meta

    def update_connector_output(self, connector_output):
        wm = connector_output.kv_connector_worker_meta
        if isinstance(wm, CrossKVWorkerMetadata):
            # A failed load is known before its request can finish (vLLM recomputes its blocks first); a request
            # that finished in the step that loaded it already returned its outcome.
            self._outcomes.update({r: o for r, o in wm.outcomes.items() if r in self._outcomes})

    def request_finished(self, request, block_ids):
        rid = request.request_id
        self._candidates.pop(rid, None)
        if self.side == "source":
            n = request.num_computed_tokens
            if n < self.settings.min_prefix_tokens or not block_ids:
                return False, None
            self._to_save.append(SavePlan(rid, list(request.all_token_ids[:n]),
                                          slots_of(block_ids, self.block_size, 0, n).tolist()))
            return True, {"crosskv": {"status": "saved", "tokens": n}}  # blocks kept until the worker saved them
        outcome = self._outcomes.pop(rid, fallback("never scheduled through the connector"))
        logger.info("crosskv: request %s: %s", rid, outcome_line(outcome))
        return False, {"crosskv": outcome}

    # ---------------------------------------------------------------------------------------------- worker side
    def register_kv_caches(self, kv_caches):
        from vllm.model_executor.models.utils import extract_layer_index

        ctx = self._vllm_config.compilation_config.static_forward_context
        names = sorted(kv_caches, key=extract_layer_index)
        self._kv_caches = {n: kv_caches[n] for n in names}
        self._layers = {n: ctx[n] for n in names}
        if self.side == "target" and not self.unusable:
            if len(names) != self.engine["n_layers"]:
                self.unusable = (f"the engine caches {len(names)} attention layers, its model config says "
                                 f"{self.engine['n_layers']}")
            elif not all(hasattr(l.impl, "do_kv_cache_update") for l in self._layers.values()):
                self.unusable = "this attention backend has no cache writer (do_kv_cache_update)"
            else:
                cache = next(iter(kv_caches.values()))
                device = self.settings.mapper_device or (str(cache.device) if cache.is_cuda else "cpu")
                try:
                    self._mapper = Mapper(self.settings.mapper, device=device)
                except MapperError as e:  # a damaged mapper, or a device this package cannot use
                    self.unusable = f"the mapper cannot be loaded: {e}"
            if self.unusable:
                logger.warning("crosskv: every request re-prefills: %s", self.unusable)

    def _layout(self, name):
        if name not in self._layouts:
            self._layouts[name] = PagedLayout(self._layers[name], self._kv_caches[name],
                                              self._kv_cache_config.num_blocks, self.block_size,
                                              self.engine["n_kv_heads"], self.engine["head_dim"])
        return self._layouts[name]

    def start_load_kv(self, forward_context, **kwargs):
        meta = self._get_connector_metadata()
        if not isinstance(meta, CrossKVMetadata) or not meta.loads:
            return
        prefixes = []
        for plan in meta.loads:
            try:
                prefixes.append(self._read(plan))
            except (ValueError, MapperError, RuntimeError) as e:
                self._fail(plan, str(e))
        if not prefixes:
            return
        layerwise = self.settings.layerwise
        if layerwise is None:  # on 2 CPU cores the thread only competes with the model's (docs/PERFORMANCE.md)
            layerwise = prefixes[0].keys.device.type == "cuda"
        if layerwise:  # mapped on a thread, layer l while the model computes the layers before it
            self._by_layer = LayerByLayer(self._mapper, prefixes, len(self._layers), prefixes[0].keys.device)
            return
        for p in prefixes:
            t0 = time.perf_counter()
            try:
                k, v = self._mapper.transfer(p.keys, p.values, p.positions)
                self._mapped.append((p.plan, k, v))
                self._applied(p.plan, p.read_s + time.perf_counter() - t0)
            except (ValueError, MapperError, RuntimeError) as e:
                self._fail(p.plan, str(e))

    def _read(self, plan: LoadPlan) -> SourcePrefix:
        """The plan's stored prefix, checked against its tokens, on the mapper's device."""
        if self._mapper is None:
            raise ValueError(self.unusable or "no mapper on this worker")
        t0 = time.perf_counter()
        p = self.store.get(plan.key)
        if p.token_ids.tolist() != plan.token_ids:
            raise ValueError("the stored prefix holds other tokens than its key says")
        dev = next(iter(self._kv_caches.values())).device
        keys = torch.from_numpy(p.keys[plan.first:plan.end]).to(dev)
        values = torch.from_numpy(p.values[plan.first:plan.end]).to(dev)
        pos = torch.arange(plan.first, plan.end, dtype=torch.int32, device=dev)
        return SourcePrefix(plan, keys, values, pos, time.perf_counter() - t0)

    def _applied(self, plan: LoadPlan, seconds: float):
        self._worker_outcomes[plan.req_id] = {"status": APPLIED, "tokens": plan.end - plan.first,
                                              "prefix_tokens": plan.end, "mapper": self.settings.mapper,
                                              "map_ms": round(seconds * 1e3, 3)}

    def _fail(self, plan: LoadPlan, reason: str):
        logger.warning("crosskv: request %s re-prefills its prefix: %s", plan.req_id, reason)
        self._worker_outcomes[plan.req_id] = fallback(reason)
        self._invalid_blocks.update(s // self.block_size for s in plan.slots)

    def wait_for_layer_load(self, layer_name):
        if (not self._mapped and self._by_layer is None) or layer_name not in self._layers:
            return
        layer, cache = self._layers[layer_name], self._kv_caches[layer_name]
        li = list(self._layers).index(layer_name)
        if self._by_layer is not None:
            ready = self._by_layer.wait(li)
        else:
            ready = [(plan, k[:, li], v[:, li]) for plan, k, v in self._mapped]
        for plan, k, v in ready:
            slots = torch.as_tensor(plan.slots, dtype=torch.int64, device=cache.device)
            layer.impl.do_kv_cache_update(layer, k.to(cache.dtype).contiguous(), v.to(cache.dtype).contiguous(),
                                          cache, slots)

    def _finish_layer_by_layer(self):
        """The step's layer-by-layer mapping joined, and each prefix's outcome recorded."""
        by, self._by_layer = self._by_layer, None
        if by is None:
            return
        by.join()
        for p in by.prefixes:
            rid = p.plan.req_id
            if rid in by.failed:
                self._fail(p.plan, by.failed[rid])
            else:
                self._applied(p.plan, p.read_s + by.map_s.get(rid, 0.0))

    def save_kv_layer(self, layer_name, kv_layer, attn_metadata, **kwargs):
        return

    def wait_for_save(self):
        self._finish_layer_by_layer()
        self._mapped = []
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        if not isinstance(meta, CrossKVMetadata):
            return
        for plan in meta.saves:
            try:
                self._save(plan)
            except (ValueError, OSError, RuntimeError) as e:
                logger.warning("crosskv: request %s: its KV was not saved: %s", plan.req_id, e)
            self._saved.add(plan.req_id)

    def _save(self, plan: SavePlan):
        slots = torch.as_tensor(plan.slots, dtype=torch.int64)
        ks, vs = [], []
        for name, cache in self._kv_caches.items():
            k, v = self._layout(name).read(cache, slots)
            ks.append(k.to("cpu", torch.float32))
            vs.append(v.to("cpu", torch.float32))
        e = self.engine
        meta = {"source_model": self.model_name, "n_layers": e["n_layers"], "n_kv_heads": e["n_kv_heads"],
                "head_dim": e["head_dim"], "rope_type": e["rope_type"], "rope_theta": e["rope_theta"],
                "tokenizer": self.tokenizer}
        ids = np.asarray(plan.token_ids, dtype=np.int32)
        self.store.put(prefix_key(ids), StoredPrefix(ids, torch.stack(ks, 1).numpy(), torch.stack(vs, 1).numpy(),
                                                     meta))
        logger.info("crosskv: saved request %s's %d tokens", plan.req_id, len(ids))

    def get_finished(self, finished_req_ids):
        done, self._saved = self._saved, set()
        return (done or None), None

    def get_block_ids_with_load_errors(self):
        bad, self._invalid_blocks = self._invalid_blocks, set()
        return bad

    def build_connector_worker_meta(self):
        if not self._worker_outcomes:
            return None
        out, self._worker_outcomes = CrossKVWorkerMetadata(self._worker_outcomes), {}
        return out


def outcome_line(o: dict) -> str:
    if o["status"] == APPLIED:
        return f"applied: {o['tokens']} tokens mapped by {o.get('mapper')}"
    if o["status"] == LOCAL:
        return f"{LOCAL}: the target's own cache holds {o['tokens']} tokens, the store {o['prefix_tokens']}"
    return f"{o['status']}: {o.get('reason', '')}"
