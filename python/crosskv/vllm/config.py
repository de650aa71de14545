"""The connector's settings (kv_connector_extra_config), the engine model's identity, and the mapper's manifest and
held-out verdict as the connector checks them. Anything wrong here stops the engine's start with one line naming the
key (CrossKVConfigError)."""
from __future__ import annotations

import enum
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
    allow_not_ready: bool = False  # serve a mapper whose held-out verdict is not_ready
    allow_uncertain: bool = False  # serve one whose verdict is uncertain (R² figures only, nothing on attention)
    mapper_device: Optional[str] = None
    min_prefix_tokens: int = 1
    layerwise: Optional[bool] = None  # None: layer by layer when the mapper runs on a GPU
    mapped_prefix_reuse: str = "none"
    chunk_tokens: int = 256  # the store's chunk: a multiple of the engine's block size
    capacity_bytes: Optional[int] = None  # a folder store's bound (least recently used chunks go first)
    ttl_seconds: Optional[int] = None  # a Redis store's expiry of each chunk
    # A store that is slow or down never stalls an engine (docs/SERVING.md):
    lookup_timeout_ms: int = 50  # the target's lookup of a request's stored prefix, in the scheduler
    load_timeout_ms: int = 2000  # the target worker's read of a planned prefix's chunks
    store_timeout_ms: int = 5000  # any one store call (a Redis socket's timeout); the saver's writes too
    breaker_failures: int = 3  # consecutive failed or late store calls that mark the store unhealthy
    breaker_seconds: int = 30  # how long an unhealthy store is not asked at all (then one call probes it)
    # The source's background saver:
    save_queue_bytes: Optional[int] = None  # saves waiting or being written; None: 1/16 of the host's memory
    save_drain_seconds: int = 4  # at shutdown, how long queued saves may still be written (vLLM waits 5 s)
    # Weights fingerprints (crosskv.fingerprint) accepted as the mapper's source or target although they differ from
    # the ones it was fitted on: a deliberate reuse, such as the same weights quantized.
    accept_weights: tuple = ()
    # A saving engine stores each finished request's prompt and its reply (so that a conversation moved to another
    # model maps its whole history but the new user turn); false: the prompt alone.
    save_replies: bool = True
    # Where a model's KV lives in the store, when several models save into one (engines that map and save,
    # kv_both): a saving engine writes under save_namespace, a mapping engine reads its mapper's source under
    # load_namespace. Unset: the store's own namespace (one source model per store).
    save_namespace: Optional[str] = None
    load_namespace: Optional[str] = None


class Role(enum.Enum):
    """What an engine does with crosskv, from vLLM's kv_role: a SOURCE saves its finished requests' KV
    (kv_producer), a TARGET maps stored prefixes into its cache (kv_consumer), BOTH does both (kv_both: an engine a
    conversation moves to and back from)."""
    SOURCE = "source"
    TARGET = "target"
    BOTH = "both"

    @property
    def saves(self) -> bool:
        return self in (Role.SOURCE, Role.BOTH)

    @property
    def maps(self) -> bool:
        return self in (Role.TARGET, Role.BOTH)


KV_ROLES = {"kv_producer": Role.SOURCE, "kv_consumer": Role.TARGET, "kv_both": Role.BOTH}


def parse_settings(kv_transfer_config) -> tuple[Role, Settings]:
    """(Role, Settings) from vLLM's KVTransferConfig; CrossKVConfigError names the bad key."""
    role = KV_ROLES.get(kv_transfer_config.kv_role)
    if role is None:
        raise CrossKVConfigError(f"kv_transfer_config.kv_role: expected kv_producer (the source model's engine), "
                                 f"kv_consumer (the target's) or kv_both (one that maps and saves: a conversation "
                                 f"moved to it and back), got {kv_transfer_config.kv_role!r}")
    extra = dict(kv_transfer_config.kv_connector_extra_config or {})
    known = {"store": str, "mapper": str, "allow_not_ready": bool, "allow_uncertain": bool, "mapper_device": str, "min_prefix_tokens": int,
             "layerwise": bool, "mapped_prefix_reuse": str, "chunk_tokens": int, "capacity_bytes": int,
             "ttl_seconds": int, "lookup_timeout_ms": int, "load_timeout_ms": int, "store_timeout_ms": int,
             "breaker_failures": int, "breaker_seconds": int, "save_queue_bytes": int, "save_drain_seconds": int,
             "accept_weights": list, "save_replies": bool, "save_namespace": str, "load_namespace": str}
    for key, value in extra.items():
        if key not in known:
            raise CrossKVConfigError(f"{EXTRA}.{key}: unknown key; expected one of {', '.join(known)}")
        if not isinstance(value, known[key]) or (known[key] is int and isinstance(value, bool)):
            raise CrossKVConfigError(f"{EXTRA}.{key}: expected {known[key].__name__}, got {value!r}")
    if "store" not in extra:
        raise CrossKVConfigError(f"{EXTRA}.store: missing; a folder, shm:NAME for shared memory, or "
                                 "redis://HOST:PORT/NAMESPACE")
    if "accept_weights" in extra:
        bad = [w for w in extra["accept_weights"] if not (isinstance(w, str) and w.startswith("sha256:"))]
        if bad:
            raise CrossKVConfigError(f"{EXTRA}.accept_weights: expected weights fingerprints (\"sha256:...\", as a "
                                     f"mapper's manifest and the connector's log give them), got {bad[0]!r}")
        extra["accept_weights"] = tuple(extra["accept_weights"])
    s = Settings(**extra)
    for key in ("min_prefix_tokens", "chunk_tokens", "capacity_bytes", "ttl_seconds", "lookup_timeout_ms",
                "load_timeout_ms", "store_timeout_ms", "breaker_failures", "breaker_seconds", "save_queue_bytes",
                "save_drain_seconds"):
        if getattr(s, key) is not None and getattr(s, key) < 1:
            raise CrossKVConfigError(f"{EXTRA}.{key}: expected >= 1, got {getattr(s, key)}")
    if s.mapped_prefix_reuse not in MAPPED_REUSE:
        raise CrossKVConfigError(f"{EXTRA}.mapped_prefix_reuse: expected one of {', '.join(MAPPED_REUSE)}, got "
                                 f"{s.mapped_prefix_reuse!r}")
    if role == Role.BOTH and not (s.save_namespace and s.load_namespace and s.save_namespace != s.load_namespace):
        raise CrossKVConfigError(f"{EXTRA}.save_namespace: an engine that maps and saves (kv_both) keeps its own KV "
                                 f"apart from its mapper's source: expected save_namespace and load_namespace, "
                                 f"different, got {s.save_namespace!r} and {s.load_namespace!r}")
    if role.maps:
        if s.mapper is None:
            raise CrossKVConfigError(f"{EXTRA}.mapper: missing; an engine that maps (kv_consumer, kv_both) needs a "
                                     "crosskv-fit mapper folder (k<K>/)")
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
    """The engine model's KV shape and every RoPE parameter (all its KV heads, not one worker's), read from the config
    the engine runs (hf_overrides applied) by crosskv.kvspec, the reader crosskv-capture uses too. KvSpecError where
    crosskv cannot map the model (a dynamic RoPE, say)."""
    from ..kvspec import kv_spec_from_config

    return kv_spec_from_config(model_config.hf_text_config, f"the engine's model {model_config.model}")


def unmappable(hf_config, kv_cache_config=None) -> Optional[str]:
    """Why crosskv cannot map this engine's model at all, or None. A mapper is fitted for models whose every layer is
    full attention over the whole context, in one KV-cache group: sliding-window, chunked-local, Mamba or other
    non-attention layers, multi-head latent attention, or several cache groups are named here, and every request of
    such an engine re-prefills."""
    c = hf_config
    layer_types = list(getattr(c, "layer_types", None) or [])
    other = sorted({str(t) for t in layer_types if t != "full_attention"})
    if other:
        return (f"its layers are not all full attention (layer_types holds {', '.join(other)}); crosskv maps models "
                "whose every layer is full attention")
    if getattr(c, "sliding_window", None) and getattr(c, "use_sliding_window", True) is not False:
        return (f"it uses sliding-window attention (sliding_window {c.sliding_window}); crosskv maps models whose every "
                "layer attends to the whole context")
    if getattr(c, "attention_chunk_size", None):
        return f"it uses chunked local attention (attention_chunk_size {c.attention_chunk_size})"
    if getattr(c, "kv_lora_rank", None):
        return f"it uses multi-head latent attention (kv_lora_rank {c.kv_lora_rank}), whose cache is not per-head K and V"
    groups = list(getattr(kv_cache_config, "kv_cache_groups", None) or [])
    if len(groups) > 1:
        kinds = ", ".join(sorted({type(g.kv_cache_spec).__name__ for g in groups}))
        return f"the engine's KV cache has {len(groups)} groups ({kinds}); crosskv maps one group of full-attention layers"
    for g in groups:
        spec = g.kv_cache_spec
        name = type(spec).__name__
        if name != "FullAttentionSpec" or getattr(spec, "sliding_window", None) or getattr(
                spec, "attention_chunk_size", None):
            return (f"the engine caches its layers as {name}"
                    + (f" (sliding_window {spec.sliding_window})" if getattr(spec, "sliding_window", None) else "")
                    + (f" (attention_chunk_size {spec.attention_chunk_size})"
                       if getattr(spec, "attention_chunk_size", None) else "")
                    + "; crosskv maps full-attention layers only")
    return None


def tokenizer_fingerprint(model_config) -> Optional[str]:
    """SHA-256 of the model's tokenizer.json where it is a local file; None where unknown."""
    path = os.path.join(str(getattr(model_config, "tokenizer", "") or ""), "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, "rb") as f:
        return hashlib.sha256(f.read()).hexdigest()


def weights_fingerprint(model_config) -> Optional[str]:
    """The engine model's weights fingerprint (crosskv.fingerprint) where its weights are local files; None where
    unknown (a hub id not resolved to a folder)."""
    from ..fingerprint import weights_fingerprint as fingerprint

    return fingerprint(str(model_config.model))


def weights_mismatch(recorded: Optional[str], got: Optional[str], accepted: tuple, what: str) -> Optional[str]:
    """Why KV of weights `got` cannot stand for the mapper's `what` (recorded in its manifest), or None. Nothing is
    compared where the manifest recorded no fingerprint (a mapper fitted on shards written without one)."""
    if not recorded or got == recorded or got in accepted:
        return None
    if not got:
        return f"its {what}'s weights carry no fingerprint; the mapper was fitted on {recorded}"
    return (f"its {what}'s weights are {got}, the mapper was fitted on {recorded} (another model, or new weights "
            f"under the same path; a deliberate reuse is named in {EXTRA}.accept_weights)")


def spec_mismatch(mapper_spec: dict, engine: dict, side: str) -> Optional[str]:
    """Why a mapper's kv_spec (as the extension reports it, or as a stored prefix's header gives it) does not fit an
    engine's model, or None: the shape and every RoPE parameter (crosskv.kvspec)."""
    from ..kvspec import spec_mismatch as mismatch

    return mismatch(mapper_spec, engine, side)


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


VERDICT_CLASSES = ("likely", "uncertain", "not_ready")
_VERDICT_PREFIXES = (("LIKELY TO TRANSFER", "likely"), ("UNCERTAIN", "uncertain"), ("NOT READY", "not_ready"))


def mapper_verdict(mapper_dir: str) -> Optional[tuple[str, str]]:
    """(class, text) of the held-out verdict crosskv-fit wrote beside the mapper (eval-<k>.json), or None where it ran
    no eval. The class is `verdict_class` (likely, uncertain, not_ready); a file written before it had one is read by
    its text's first words. One that cannot be read, or whose class is unknown, stops the engine
    (CrossKVConfigError): a mapper that is not ready must not be served by accident."""
    folder = os.path.normpath(os.path.abspath(mapper_dir))
    path = os.path.join(os.path.dirname(folder), f"eval-{os.path.basename(folder)}.json")
    if not os.path.isfile(path):
        return None
    doc = _json_file(path, "the held-out verdict")
    text = str(doc.get("verdict", ""))
    cls = doc.get("verdict_class")
    if cls is None:
        cls = next((c for prefix, c in _VERDICT_PREFIXES if text.startswith(prefix)), None)
    if cls not in VERDICT_CLASSES:
        raise CrossKVConfigError(f"{path}: verdict_class: expected one of {', '.join(VERDICT_CLASSES)}, got "
                                 f"{doc.get('verdict_class', text[:40])!r}")
    return cls, text
