"""What both sides of the connector know about their engine: its role, the settings, the store, the model, and, on a
target, the mapper's identity and why no request can be mapped (if so)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from vllm.logger import init_logger

from ..kvspec import KvSpecError
from .config import EXTRA, CrossKVConfigError, Role, Settings, engine_spec, mapper_verdict, parse_settings, \
    read_mapper_manifest, spec_mismatch, tokenizer_fingerprint, unmappable, weights_fingerprint, weights_mismatch
from .store import PrefixStore, open_store

logger = init_logger("vllm.crosskv")

UNQUANTIZED = ("auto", "float32", "bfloat16", "float16", "half", "float", "bf16")
FP8 = ("fp8", "fp8_e4m3", "fp8_e5m2")


@dataclass(frozen=True)
class Refusal:
    """Why no request of this engine can be mapped (each falls back to re-prefill with it), and its class, as the
    outcomes and the metrics name it."""
    reason: str
    kind: str = "mapper"  # mapper | not_ready | uncertain | unmappable_model


@dataclass
class EngineContext:
    role: Role
    settings: Settings
    store: PrefixStore
    block_size: int
    engine: Optional[dict]  # the model's kv_spec, as config.engine_spec gives it (None: one crosskv cannot map)
    model_name: str
    model_dtype: object  # torch dtype of the model's activations (what the cache writer takes)
    cache_dtype: str
    tokenizer: Optional[str]
    prefix_caching: bool
    manifest: Optional[dict] = None  # target: crosskv.read_manifest's
    refusal: Optional[Refusal] = None  # why no request can be mapped (target, both)
    unmappable: Optional[str] = None  # why crosskv can neither map nor save this engine's model
    engine_id: Optional[str] = None  # vLLM's id of this engine (its scheduler and workers share it)
    weights: Optional[str] = None  # the engine model's weights fingerprint (crosskv.fingerprint)

    @property
    def source_spec(self) -> dict:
        return self.manifest["source"]

    @property
    def source_weights(self) -> Optional[str]:
        """The weights the mapper's source was fitted on (None: its manifest recorded none)."""
        return self.manifest.get("source_weights")


def verdict_refusal(verdict, settings: Settings) -> Optional[Refusal]:
    """The refusal where the mapper's held-out verdict (class, text) keeps it from serving: not_ready and uncertain
    are refused unless allow_not_ready / allow_uncertain says otherwise (then a warning is logged). None to serve."""
    cls, text = verdict or ("likely", "")
    allowed = {"not_ready": settings.allow_not_ready, "uncertain": settings.allow_uncertain}
    if cls not in allowed:
        return None
    if allowed[cls]:
        logger.warning("crosskv: the mapper's held-out verdict is %s (%s); served anyway (allow_%s)", cls, text, cls)
        return None
    return Refusal(f"the mapper's held-out verdict is {cls} ({text}); set {EXTRA}.allow_{cls} to serve it anyway", cls)


def engine_context(vllm_config, kv_cache_config=None) -> EngineContext:
    role, settings = parse_settings(vllm_config.kv_transfer_config)
    mc, cc = vllm_config.model_config, vllm_config.cache_config
    cache_dtype = str(cc.cache_dtype)
    if cache_dtype not in UNQUANTIZED + FP8:
        raise CrossKVConfigError(f"cache_config.cache_dtype: expected an unquantized cache or one of "
                                 f"{', '.join(FP8)}, got {cache_dtype!r}")
    pp = vllm_config.parallel_config.pipeline_parallel_size
    if pp != 1:
        raise CrossKVConfigError(f"parallel_config.pipeline_parallel_size: crosskv maps every layer on each worker; "
                                 f"expected 1, got {pp} (tensor parallelism is supported)")
    if settings.chunk_tokens % cc.block_size:
        raise CrossKVConfigError(f"{EXTRA}.chunk_tokens: expected a multiple of the engine's block size "
                                 f"{cc.block_size}, got {settings.chunk_tokens}")
    store = open_store(settings.store, settings.chunk_tokens, settings.capacity_bytes, settings.ttl_seconds,
                       settings.store_timeout_ms)
    try:
        spec, why_not = engine_spec(mc), unmappable(mc.hf_text_config, kv_cache_config)
    except KvSpecError as e:
        spec, why_not = None, str(e)
    ctx = EngineContext(role, settings, store, cc.block_size, spec, str(mc.model),
                        mc.dtype, cache_dtype, tokenizer_fingerprint(mc), bool(cc.enable_prefix_caching))
    ctx.engine_id = getattr(vllm_config.kv_transfer_config, "engine_id", None)
    ctx.weights = weights_fingerprint(mc)
    logger.info("crosskv: %s engine, model %s, weights %s", role.value, ctx.model_name, ctx.weights or "unknown (not local)")
    if why_not:
        ctx.unmappable = f"crosskv cannot map this engine's model: {why_not}"
    if role.maps:
        ctx.manifest = read_mapper_manifest(settings.mapper)
        ctx.refusal = target_refusal(ctx)
        if ctx.refusal:
            logger.warning("crosskv: every request re-prefills: %s", ctx.refusal.reason)
    if ctx.unmappable and role.saves:
        logger.warning("crosskv: no request's KV is saved: %s", ctx.unmappable)
    return ctx


def target_refusal(ctx: EngineContext) -> Optional[Refusal]:
    """Why no request of this target engine can be mapped: a model crosskv cannot map, a mapper fitted for another
    model, or a held-out verdict that keeps it from serving. None where requests can be mapped."""
    if ctx.unmappable:
        return Refusal(ctx.unmappable, "unmappable_model")
    st = ctx.settings
    why = spec_mismatch(ctx.manifest["target"], ctx.engine, "target") or weights_mismatch(
        ctx.manifest.get("target_weights"), ctx.weights, st.accept_weights, "model")
    if why:
        return Refusal(f"the mapper does not match this engine's model: {why}")
    return verdict_refusal(mapper_verdict(st.mapper), st)
