"""A model's KV spec (layers, KV heads, head dim, every RoPE parameter) read from its Hugging Face config, and two
specs compared on every parameter. The one reader: crosskv-capture writes it into the shards (and so into the
mapper's manifest), and crosskv.vllm reads the serving engine's model with it, so that both sides apply the same
rules. Pure Python (no extension, no torch): crosskv-capture loads this file directly.

    spec = kv_spec_from_config(AutoConfig.from_pretrained(path))
    why = spec_mismatch(mapper_target_spec, spec, "target")   # None, or one line naming the parameter
"""
from __future__ import annotations

import math
from typing import Optional

# The RoPE parameters a spec carries; every one is compared (None where the type does not use it).
ROPE_NUMBERS = ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings",
                "beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor")
ROPE_KEYS = ("type", "rotary_dim", "convention", "truncate") + ROPE_NUMBERS
SHAPE_KEYS = (("n_layers", "layers"), ("n_kv_heads", "KV heads"), ("head_dim", "head dim"))


class KvSpecError(ValueError):
    """A model config crosskv cannot map: one line naming the config and the key."""


def _rope_source(cfg) -> tuple[dict, Optional[float]]:
    """(the scaling parameters, theta) from a config of either transformers generation: rope_scaling (4.x) or
    rope_parameters (5.x, where theta lives inside it)."""
    scaling = dict(getattr(cfg, "rope_scaling", None) or {})
    params = dict(getattr(cfg, "rope_parameters", None) or {})
    if "full_attention" in params:  # transformers 5, one rope per layer type: the full-attention layers' is the default
        params = dict(params["full_attention"])
    if not scaling and params and params.get("rope_type", params.get("type", "default")) != "default":
        scaling = params
    theta = getattr(cfg, "rope_theta", None) or params.get("rope_theta") or scaling.get("rope_theta")
    return scaling, theta


def _rope(scaling: dict, theta, rotary: int, cfg, where: str) -> dict:
    """A rope object from a config's scaling parameters and theta."""
    get = lambda k, d=None: getattr(cfg, k, d)  # noqa: E731
    kind = scaling.get("rope_type", scaling.get("type", "default")) if scaling else "default"
    rope = {"type": kind, "theta": float(theta or 10000.0), "rotary_dim": rotary, "convention": "half",
            "factor": None, "low_freq_factor": None, "high_freq_factor": None,
            "original_max_position_embeddings": None, "beta_fast": None, "beta_slow": None,
            "mscale": None, "mscale_all_dim": None, "attention_factor": None, "truncate": True}
    if kind == "default":
        pass
    elif kind == "linear":
        rope["factor"] = float(scaling["factor"])
    elif kind == "llama3":
        for k in ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            if k not in scaling:
                raise KvSpecError(f"{where}: rope_scaling llama3 needs {k}")
            rope[k] = float(scaling[k])
    elif kind == "yarn":
        rope["factor"] = float(scaling["factor"])
        orig = scaling.get("original_max_position_embeddings")
        if orig is not None and get("max_position_embeddings") is not None and "rope_parameters" not in vars(cfg):
            # transformers 4.x's _compute_yarn_parameters: with original_max_position_embeddings in rope_scaling, the
            # factor it uses is max_position_embeddings / original_max_position_embeddings.
            rope["factor"] = float(get("max_position_embeddings")) / float(orig)
        elif orig is None:
            orig = get("max_position_embeddings")
        rope["original_max_position_embeddings"] = float(orig)
        for k in ("beta_fast", "beta_slow", "mscale", "mscale_all_dim", "attention_factor"):
            if scaling.get(k) is not None:
                rope[k] = float(scaling[k])
        if "truncate" in scaling:
            rope["truncate"] = bool(scaling["truncate"])
    elif kind == "dynamic":
        raise KvSpecError(f"{where}: rope_scaling 'dynamic' is not supported (its frequencies depend on the "
                          "sequence length, so a position-free mapper cannot be fitted)")
    else:
        raise KvSpecError(f"{where}: rope_scaling '{kind}' is not supported (crosskv handles default, linear, "
                          "llama3 and yarn)")
    return rope


ATTENTION = {"full_attention": "full", "sliding_attention": "sliding"}


def _layers(cfg, L: int, rope: dict, rotary: int, where: str) -> Optional[list]:
    """Each layer's attention (with its window) and RoPE where they differ from `rope` with full attention: Gemma 2/3
    and Qwen's layer_types, Gemma 3's local theta (rope_local_base_freq), transformers 5's rope_parameters per layer
    type, SmolLM3's no_rope_layers, Cohere 2's global layers without RoPE, Mistral's window on every layer. None where
    every layer is the default; KvSpecError for a layer crosskv cannot represent."""
    get = lambda k, d=None: getattr(cfg, k, d)  # noqa: E731
    if get("attention_chunk_size"):
        raise KvSpecError(f"{where}: attention_chunk_size {get('attention_chunk_size')} (chunked attention) is not "
                          "supported")
    types = get("layer_types")
    window = get("sliding_window")
    if types is None:
        uses = window is not None and get("use_sliding_window", True) is not False
        types = ["sliding_attention" if uses else "full_attention"] * L
    if len(types) != L:
        raise KvSpecError(f"{where}: layer_types has {len(types)} entries for {L} layers")
    unknown = sorted({t for t in types if t not in ATTENTION})
    if unknown:
        raise KvSpecError(f"{where}: layer_types {unknown[0]!r} is not supported (crosskv handles "
                          "full_attention and sliding_attention)")
    if "sliding_attention" in types and not (isinstance(window, int) and window > 0):
        raise KvSpecError(f"{where}: sliding_attention layers need a positive sliding_window, got {window!r}")
    by_type = {"full_attention": rope, "sliding_attention": rope}
    params = dict(get("rope_parameters", None) or {})
    if set(params) & set(ATTENTION):  # transformers 5: one rope per layer type
        for t in ATTENTION:
            if t in params:
                p = dict(params[t])
                by_type[t] = _rope(p, p.get("rope_theta"), rotary, cfg, f"{where} (rope_parameters.{t})")
    elif get("rope_local_base_freq") is not None:  # Gemma 3 (transformers 4): local layers, default RoPE
        by_type["sliding_attention"] = _rope({}, get("rope_local_base_freq"), rotary, cfg, where)
    none = {**rope, "type": "none"}
    uses_rope = list(get("no_rope_layers", None) or [1] * L)  # SmolLM3: 0 marks a layer without RoPE
    if len(uses_rope) != L:
        raise KvSpecError(f"{where}: no_rope_layers has {len(uses_rope)} entries for {L} layers")
    layers = []
    for t, uses in zip(types, uses_rope):
        r = by_type[t]
        if not uses or (get("model_type") == "cohere2" and t == "full_attention"):
            r = none
        layers.append({"attention": ATTENTION[t], "window": window if t == "sliding_attention" else None, "rope": r})
    default = {"attention": "full", "window": None, "rope": rope}
    return None if all(layer == default for layer in layers) else layers


def kv_spec_from_config(cfg, where: str = "model config") -> dict:
    """The kv_spec of a Hugging Face text config (a PretrainedConfig, or anything with its attributes):
    {n_layers, n_kv_heads, head_dim, n_q_heads, rope: {type, theta, rotary_dim, convention, factor, ...}}, and
    `layers` (each layer's attention, window and rope) where they are not all full attention with `rope`.
    KvSpecError for what crosskv cannot map (a dynamic or unknown RoPE, an odd rotary dim, chunked attention)."""
    get = lambda k, d=None: getattr(cfg, k, d)  # noqa: E731
    L, Hq = get("num_hidden_layers"), get("num_attention_heads")
    if L is None or Hq is None:
        raise KvSpecError(f"{where}: not a decoder config (num_hidden_layers/num_attention_heads missing)")
    H = get("num_key_value_heads") or Hq
    D = get("head_dim") or (get("hidden_size") // Hq)
    scaling, theta = _rope_source(cfg)
    partial = get("partial_rotary_factor", None) or scaling.get("partial_rotary_factor") or 1.0
    rotary = int(D * partial)
    if rotary % 2 or rotary <= 0:
        raise KvSpecError(f"{where}: partial_rotary_factor {partial} gives an odd rotary dim {rotary}")
    rope = _rope(scaling, theta, rotary, cfg, where)
    spec = {"n_layers": int(L), "n_kv_heads": int(H), "head_dim": int(D), "n_q_heads": int(Hq), "rope": rope}
    layers = _layers(cfg, int(L), rope, rotary, where)
    if layers:
        spec["layers"] = layers
    scale = _query_scale(get, int(D), where)
    if scale is not None:
        spec["query_scale"] = scale
    return spec


def _query_scale(get, head_dim: int, where: str) -> Optional[float]:
    """The attention's score scale where the model's is not 1/sqrt(head_dim): Gemma's query_pre_attn_scalar,
    Granite's attention_multiplier; None where it is the default."""
    if get("query_pre_attn_scalar") is not None:
        q = float(get("query_pre_attn_scalar"))
        scale = q ** -0.5 if q > 0 else q
    elif get("attention_multiplier") is not None:
        scale = float(get("attention_multiplier"))
    else:
        return None
    if not (math.isfinite(scale) and scale > 0):
        raise KvSpecError(f"{where}: the attention's score scale {scale} is not a positive number")
    return None if math.isclose(scale * math.sqrt(head_dim), 1.0, rel_tol=1e-12) else scale


def normal_rope(rope: dict) -> dict:
    """A spec's rope with every key present (absent ones as a spec written without them means them)."""
    out = {"type": "default", "theta": 10000.0, "rotary_dim": None, "convention": "half", "truncate": True,
           **{k: None for k in ROPE_NUMBERS if k != "theta"}}
    out.update({k: v for k, v in (rope or {}).items() if k in ROPE_KEYS})
    return out


def _same_number(a, b) -> bool:
    if a is None or b is None:
        return a is None and b is None
    a, b = float(a), float(b)
    return a == b or math.isclose(a, b, rel_tol=1e-9, abs_tol=0.0)


def rope_mismatch(want: dict, got: dict, head_dim: Optional[int] = None) -> Optional[str]:
    """The first RoPE parameter on which `got` differs from `want` ('theta 1e6 against 5e5'), or None."""
    a, b = normal_rope(want), normal_rope(got)
    if head_dim:  # a rotary dim left out means the whole head
        a["rotary_dim"] = a["rotary_dim"] or head_dim
        b["rotary_dim"] = b["rotary_dim"] or head_dim
    for key in ("type", "rotary_dim", "convention", "truncate"):
        if a[key] != b[key] and not (key == "rotary_dim" and _same_number(a[key], b[key])):
            return f"RoPE {key} {a[key]!r}, the model's {b[key]!r}"
    for key in ROPE_NUMBERS:
        if not _same_number(a[key], b[key]):
            return f"RoPE {key} {a[key]}, the model's {b[key]}"
    return None


def rope_of(spec: dict) -> dict:
    """A spec's RoPE: its `rope` object, or, for a spec that carries only the flat rope_type and rope_theta (an
    older reader's), those two."""
    if spec.get("rope"):
        return spec["rope"]
    return {"type": spec.get("rope_type", "default"), "theta": spec.get("rope_theta")}


def spec_mismatch(want: dict, got: dict, side: str) -> Optional[str]:
    """Why a spec `got` (an engine's model, or a stored prefix's source) is not the mapper's `side` spec `want`, or
    None: the shape, then every RoPE parameter."""
    for key, what in SHAPE_KEYS:
        if int(want[key]) != int(got[key]):
            return f"the mapper's {side} has {want[key]} {what}, the model has {got[key]}"
    why = rope_mismatch(rope_of(want), rope_of(got), int(want["head_dim"]))
    if why:
        return f"the mapper's {side} has {why}"
    for layer, (a, b) in enumerate(zip(layers_of(want), layers_of(got))):
        for key in ("attention", "window"):
            if a[key] != b[key]:
                return f"the mapper's {side} has layer {layer} {key} {a[key]!r}, the model's {b[key]!r}"
        why = rope_mismatch(a["rope"], b["rope"], int(want["head_dim"]))
        if why:
            return f"the mapper's {side} has layer {layer} {why}"
    return None


def layers_of(spec: dict) -> list:
    """Every layer's {attention, window, rope}: the spec's `layers`, or full attention with its rope."""
    if spec.get("layers"):
        return [{"attention": x.get("attention", "full"), "window": x.get("window"), "rope": x.get("rope") or
                 rope_of(spec)} for x in spec["layers"]]
    return [{"attention": "full", "window": None, "rope": rope_of(spec)}] * int(spec["n_layers"])
