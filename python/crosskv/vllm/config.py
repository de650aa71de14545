"""The connector's settings (kv_connector_extra_config), the engine model's identity, and the mapper's manifest and
held-out verdict as the connector checks them. Anything wrong here stops the engine's start with one line naming the
key (CrossKVConfigError)."""
from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from typing import Optional

EXTRA = "kv_transfer_config.kv_connector_extra_config"
# What a later request may take from the target's own prefix cache of blocks that hold mapped KV (or KV computed
# after it): "none" (the default: they are hashed apart, so no later lookup finds them), or "namespace" (requests of
# the same cache_salt reuse them, labelled mapped_prefix_cache, never local_prefix_cache).
MAPPED_REUSE = ("none", "namespace")


class CrossKVConfigError(ValueError):
    """A bad connector configuration: the engine does not start. The message names the key."""


@dataclass
class Settings:
    store: str
    mapper: Optional[str] = None
    allow_not_ready: bool = False
    mapper_device: Optional[str] = None
    min_prefix_tokens: int = 1
    layerwise: Optional[bool] = None  # None: layer by layer when the mapper runs on a GPU
    mapped_prefix_reuse: str = "none"
    chunk_tokens: int = 256  # the store's chunk: a multiple of the engine's block size
    capacity_bytes: Optional[int] = None  # a folder store's bound (least recently used chunks go first)
    ttl_seconds: Optional[int] = None  # a Redis store's expiry of each chunk


def parse_settings(kv_transfer_config) -> tuple[str, Settings]:
    """('source' | 'target', Settings) from vLLM's KVTransferConfig; CrossKVConfigError names the bad key."""
    role = {"kv_producer": "source", "kv_consumer": "target"}.get(kv_transfer_config.kv_role)
    if role is None:
        raise CrossKVConfigError(f"kv_transfer_config.kv_role: expected kv_producer (the source model's engine) or "
                                 f"kv_consumer (the target's), got {kv_transfer_config.kv_role!r}")
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    known = {"store": str, "mapper": str, "allow_not_ready": bool, "mapper_device": str, "min_prefix_tokens": int,
             "layerwise": bool, "mapped_prefix_reuse": str, "chunk_tokens": int, "capacity_bytes": int,
             "ttl_seconds": int}
    for key, value in extra.items():
        if key not in known:
            raise CrossKVConfigError(f"{EXTRA}.{key}: unknown key; expected one of {', '.join(known)}")
        if not isinstance(value, known[key]) or (known[key] is int and isinstance(value, bool)):
            raise CrossKVConfigError(f"{EXTRA}.{key}: expected {known[key].__name__}, got {value!r}")
    if "store" not in extra:
        raise CrossKVConfigError(f"{EXTRA}.store: missing; a folder, shm:NAME for shared memory, or "
                                 "redis://HOST:PORT/NAMESPACE")
    s = Settings(**extra)
    for key in ("min_prefix_tokens", "chunk_tokens", "capacity_bytes", "ttl_seconds"):
        if getattr(s, key) is not None and getattr(s, key) < 1:
            raise CrossKVConfigError(f"{EXTRA}.{key}: expected >= 1, got {getattr(s, key)}")
    if s.mapped_prefix_reuse not in MAPPED_REUSE:
        raise CrossKVConfigError(f"{EXTRA}.mapped_prefix_reuse: expected one of {', '.join(MAPPED_REUSE)}, got "
                                 f"{s.mapped_prefix_reuse!r}")
    if role == "target":
        if s.mapper is None:
            raise CrossKVConfigError(f"{EXTRA}.mapper: missing; the target engine needs a crosskv-fit mapper folder "
                                     "(k<K>/)")
        if not os.path.isfile(os.path.join(s.mapper, "manifest.json")):
            raise CrossKVConfigError(f"{EXTRA}.mapper: {s.mapper}/manifest.json not found; expected a crosskv-fit "
                                     "mapper folder (k<K>/)")
        read_mapper_manifest(s.mapper)
        mapper_verdict(s.mapper)
        if kv_transfer_config.kv_load_failure_policy != "recompute":
            raise CrossKVConfigError('kv_transfer_config.kv_load_failure_policy: expected "recompute" so that a '
                                     "prefix that fails to map is re-prefilled, got "
                                     f"{kv_transfer_config.kv_load_failure_policy!r}")
    elif s.mapper is not None:
        raise CrossKVConfigError(f"{EXTRA}.mapper: only the target engine (kv_consumer) maps; the source saves "
                                 "its own KV")
    return role, s


def engine_spec(model_config) -> dict:
    """The engine model's KV shape and RoPE (all its KV heads, not one worker's), as a mapper's kv_spec names them."""
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
    """Why a mapper's kv_spec (as the extension reports it, or as a stored prefix's header gives it) does not fit an
    engine's model, or None."""
    for key, what in (("n_layers", "layers"), ("n_kv_heads", "KV heads"), ("head_dim", "head dim")):
        if int(mapper_spec[key]) != engine[key]:
            return f"the mapper's {side} has {mapper_spec[key]} {what}, the model has {engine[key]}"
    theta = mapper_spec.get("rope_theta")
    if engine["rope_theta"] is not None and theta is not None and abs(float(theta) - engine["rope_theta"]) > 1e-6 * abs(
            engine["rope_theta"]):
        return f"the mapper's {side} has RoPE theta {theta}, the model has {engine['rope_theta']}"
    kind = mapper_spec.get("rope_type", "default")
    if engine["rope_type"] != kind:
        return f"the mapper's {side} has RoPE {kind!r}, the model has {engine['rope_type']!r}"
    return None


def _json_file(path: str, what: str) -> dict:
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, ValueError) as e:
        raise CrossKVConfigError(f"{EXTRA}.mapper: {path}: {what} does not read as JSON ({e})") from None
    if not isinstance(d, dict):
        raise CrossKVConfigError(f"{EXTRA}.mapper: {path}: {what} is not a JSON object")
    return d


def read_mapper_manifest(mapper_dir: str) -> dict:
    """The mapper's identity as the connector checks it: {source, target: kv_spec (flat: n_layers, n_kv_heads,
    head_dim, rope_type, rope_theta), source_model, structure}, read by the crosskv extension (artifact/'s own
    reader, hardened and fuzzed), without loading a weight; CrossKVConfigError naming the file otherwise."""
    from .. import MapperError, read_manifest

    try:
        return read_manifest(mapper_dir)
    except MapperError as e:  # it names the file and the field
        raise CrossKVConfigError(f"{EXTRA}.mapper: {e}") from None


def mapper_verdict(mapper_dir: str) -> Optional[str]:
    """The held-out verdict crosskv-fit wrote beside the mapper (eval-<k>.json), or None where it ran no eval. One
    that cannot be read stops the engine (CrossKVConfigError): a NOT READY mapper must not be served by accident."""
    folder = os.path.normpath(os.path.abspath(mapper_dir))
    path = os.path.join(os.path.dirname(folder), f"eval-{os.path.basename(folder)}.json")
    if not os.path.isfile(path):
        return None
    return str(_json_file(path, "the held-out verdict").get("verdict", ""))
