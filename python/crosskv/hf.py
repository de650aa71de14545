"""Hugging Face caches: a source model's cache in, the target model's DynamicCache out.

    from crosskv.hf import transfer_cache
    out = source_model(input_ids, use_cache=True)
    target_cache = transfer_cache(mapper, out.past_key_values)
    target_model.generate(input_ids=full_ids, past_key_values=target_cache, ...)

HF caches hold per layer keys and values [batch, kv_heads, seq, head_dim] (keys post-RoPE); positions default to
0..seq-1 for every sequence of the batch (a left-padded batch passes its own).
"""
import torch

from . import MapperError


def cache_layers(cache):
    """[(keys, values)] per layer of a DynamicCache (any transformers version) or a legacy tuple."""
    if hasattr(cache, "to_legacy_cache"):
        return list(cache.to_legacy_cache())
    if hasattr(cache, "layers"):
        return [(l.keys, l.values) for l in cache.layers]
    return list(cache)


def cache_only(model):
    """The keyword arguments of a forward pass whose cache is all that is read: the vocabulary's logits at the last
    position only, where the model takes it (transformers' logits_to_keep). A small model's LM head is most of its
    forward (Gemma 3 270M: 262,144 x 640); the cache is the same bytes."""
    import inspect

    return {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}


def transfer_cache(mapper, source_cache, positions=None, target_positions=None):
    """The target model's DynamicCache for the tokens of `source_cache`, mapped by `mapper` (a crosskv.Mapper).
    positions: [seq] or [batch, seq] (default 0..seq-1)."""
    from transformers import DynamicCache

    layers = cache_layers(source_cache)
    s, t = mapper.source, mapper.target
    if len(layers) != s["n_layers"]:
        raise MapperError(f"source cache: {len(layers)} layers, the mapper's source has {s['n_layers']}")
    k0 = layers[0][0]
    B, H, T, D = k0.shape
    if (H, D) != (s["n_kv_heads"], s["head_dim"]):
        raise MapperError(f"source cache: {H} KV heads of {D}, the mapper's source has "
                         f"{s['n_kv_heads']} of {s['head_dim']}")
    # [L, B, H, T, D] -> [B*T, L, H, D]: tokens are rows.
    keys = torch.stack([k for k, _ in layers]).permute(1, 3, 0, 2, 4).reshape(B * T, s["n_layers"], H, D)
    values = torch.stack([v for _, v in layers]).permute(1, 3, 0, 2, 4).reshape(B * T, s["n_layers"], H, D)

    def rows(p):
        p = torch.arange(T, dtype=torch.int32) if p is None else torch.as_tensor(p, dtype=torch.int32)
        return (p.expand(B, T) if p.dim() == 1 else p).reshape(B * T)

    src_pos = rows(positions)
    tgt_pos = src_pos if target_positions is None else rows(target_positions)
    tk, tv = mapper.transfer(keys, values, src_pos, tgt_pos)
    dtype = k0.dtype
    Lt, Ht, Dt = t["n_layers"], t["n_kv_heads"], t["head_dim"]
    tk = tk.reshape(B, T, Lt, Ht, Dt).permute(2, 0, 3, 1, 4).to(dtype)
    tv = tv.reshape(B, T, Lt, Ht, Dt).permute(2, 0, 3, 1, 4).to(dtype)
    cache = DynamicCache()
    for l in range(Lt):
        cache.update(tk[l].contiguous(), tv[l].contiguous(), l)
    return cache
