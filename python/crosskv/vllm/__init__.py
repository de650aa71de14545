"""crosskv.vllm: serve crosskv mappers in vLLM through its V1 KV-connector interface.

The source model's engine saves each finished request's prefix KV into a store of chained chunks (shared between
requests; one part per tensor-parallel worker's KV heads; a folder, shm: or Redis); the target model's engine finds
the longest run of stored chunks from a new request's start, maps it with a crosskv.Mapper on each worker into exactly
the KV heads that worker holds, and writes the mapped K (target RoPE applied) and V into the blocks vLLM allocated,
through the attention backend's own cache writer (which quantizes for an fp8 cache). vLLM then computes only the tokens after the prefix. Anything wrong (mapper and model disagree,
the stored prefix is missing, incomplete, damaged or of another source model, the mapper's held-out verdict is
NOT READY, any failure on the worker's path) gives the request its re-prefill, never wrong KV, and never stops the
engine.

    # the source engine                                  # the target engine
    --kv-transfer-config '{"kv_connector": "CrossKVConnector", "kv_connector_module_path": "crosskv.vllm",
        "kv_role": "kv_producer",                         "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "shm:pair"}} "kv_connector_extra_config": {"store": "shm:pair",
                                                                                       "mapper": "out/k4"}}'

Each target request's outcome is logged and returned in its kv_transfer_params["crosskv"]: {"status": "applied",
"tokens": N, ...}, {"status": "fallback_reprefill", "reason": "...", "kind": "..."}, {"status":
"local_prefix_cache", "tokens": N} where the target's own prefix cache already held as much exact KV, or {"status":
"mapped_prefix_cache", "tokens": N} where it held mapped KV this request reused (mapped_prefix_reuse: namespace).

The modules: config (settings, the model's identity), store (the prefix store), layout (the paged cache, fp8, head
placement), metadata (the step's plans and outcomes), scheduler and worker (the connector's two sides), metrics.
"""
import importlib

# Each name resolves on first use (PEP 562): the store and the settings import without vLLM (about 20 s of imports),
# so a process that only reads or writes the store, such as a writer beside the engines, starts in a fraction of a
# second. vLLM finds the connector by getattr(crosskv.vllm, "CrossKVConnector"), which imports it.
_HOMES = {"CrossKVConnector": "connector", "CrossKVConfigError": "config", "Settings": "config",
          "parse_settings": "config", "HeadPlacement": "layout", "PagedLayout": "layout", "head_placement": "layout",
          "slots_of": "layout", "APPLIED": "metadata", "FALLBACK": "metadata", "LOCAL": "metadata",
          "MAPPED_CACHE": "metadata", "LoadPlan": "metadata", "ChunkRef": "store", "FolderStore": "store",
          "Match": "store", "PrefixError": "store", "PrefixStore": "store", "RedisStore": "store",
          "chunk_keys": "store", "open_store": "store", "LayerByLayer": "worker", "SourcePrefix": "worker"}
__all__ = list(_HOMES)


def __getattr__(name):
    if name not in _HOMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_HOMES[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_HOMES))
