"""The engine's paged KV cache as the connector reads and writes it: where each slot's K and V sit (learnt from the
attention backend's own writer), how the writer quantizes (fp8 caches), and which of the model's KV heads this
tensor-parallel worker holds."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

FP8_FORMATS = (torch.float8_e4m3fn, torch.float8_e5m2)
_SENTINEL_BYTE = 0xBC  # negative in both fp8 formats (e4m3fn -1.5, e5m2 -1.0): marks an element nothing wrote


def slots_of(block_ids, block_size: int, first: int, end: int) -> torch.Tensor:
    t = torch.arange(first, end, dtype=torch.int64)
    return torch.as_tensor(block_ids, dtype=torch.int64)[t // block_size] * block_size + t % block_size


@dataclass(frozen=True)
class HeadPlacement:
    """The model's KV heads [first, first + count) that this worker holds, and which replica of them it is (vLLM
    replicates KV heads when the tensor-parallel size exceeds their number: replica 0 saves them)."""
    first: int
    count: int
    replica: int
    total: int
    rank: int = 0  # the worker's tensor-parallel rank

    @property
    def heads(self) -> range:
        return range(self.first, self.first + self.count)


def head_placement(total: int, per_worker: int, tp_rank: int, tp_size: int) -> HeadPlacement:
    """Where vLLM puts KV heads: `per_worker` of them (the engine's attention layer's num_kv_heads) on each of
    `tp_size` workers; with replicas = per_worker * tp_size / total copies of each, worker r holds shard
    r // replicas (QKVParallelLinear's rule). ValueError where the engine's numbers are not such a placement."""
    split = per_worker * tp_size == total  # tp_size <= total: each worker its own heads
    replicated = per_worker == 1 and tp_size > total and tp_size % total == 0  # each head on tp_size / total workers
    if not (split or replicated) or not 0 <= tp_rank < tp_size:
        raise ValueError(f"vLLM reports {per_worker} KV heads on each of {tp_size} workers of a model with {total}: "
                         "not a placement the connector knows")
    replicas = per_worker * tp_size // total
    first = (tp_rank // replicas) * per_worker
    return HeadPlacement(first, per_worker, tp_rank % replicas, total, tp_rank)


def _stride_order(t: torch.Tensor) -> list[int]:
    """The dimensions of t from outermost to innermost in memory."""
    return sorted(range(t.ndim), key=lambda d: (-t.stride(d), -d))


def _like(t: torch.Tensor, shape: list[int], fill) -> torch.Tensor:
    """A tensor of `shape` filled with `fill`, laid out in memory in t's dimension order (an HND cache's scratch is
    HND too), so that a writer that follows the strides writes it as it writes t."""
    order = _stride_order(t)
    physical = torch.full([shape[d] for d in order], fill, dtype=torch.uint8 if isinstance(fill, int) else t.dtype,
                          device=t.device)
    if isinstance(fill, int):
        physical = physical.view(t.dtype)
    return physical.permute(*[order.index(d) for d in range(t.ndim)])


def storage_view(t: torch.Tensor) -> torch.Tensor:
    """t's elements as one flat view over the memory they span (no copy, whatever t's strides: an HND cache is a
    permuted view of its buffer)."""
    if any(s < 0 for s in t.stride()):
        raise ValueError(f"a cache with negative strides {t.stride()}")
    span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
    return t.as_strided((span,), (1,), t.storage_offset())


def layer_scales(layer) -> tuple[float, float]:
    """The layer's K and V cache scales (1.0 for an unquantized cache)."""
    def get(name):
        v = getattr(layer, f"_{name}_scale_float", None)
        if v is None:
            v = getattr(layer, f"_{name}_scale", 1.0)
        return float(v.item() if torch.is_tensor(v) else v)
    return get("k"), get("v")


class PagedLayout:
    """Where each slot's K and V sit in one attention layer's paged cache, learnt from the backend's own writer
    (impl.do_kv_cache_update) on a scratch cache of three blocks: the writer is fed codes, one digit at a time, and
    where each code lands is where that (slot, head, dim) lives. A writer that stores values as given is read back
    exactly; one that quantizes to fp8 (uint8 or float8 caches) is fed digits that fp8 holds exactly (0..7, times the
    layer's scale), and the format it wrote (e4m3 or e5m2) is the one whose decoding gives the codes back. Any
    memory order works (NHD, FlashInfer's HND view, the packed K|V of FlashAttention and the CPU backend): the scratch
    is laid out like the cache, and offsets come from the cache's own strides. Anything else is refused
    (ValueError)."""

    def __init__(self, attn_layer, kv_cache: torch.Tensor, num_blocks: int, block_size: int, heads: int, dim: int,
                 input_dtype: Optional[torch.dtype] = None):
        block_dims = [d for d, n in enumerate(kv_cache.shape) if n == num_blocks]
        if len(block_dims) != 1:
            raise ValueError(f"cannot find the block dimension of a {tuple(kv_cache.shape)} cache of {num_blocks} "
                             "blocks")
        bd = block_dims[0]
        shape = list(kv_cache.shape)
        shape[bd] = 3
        self.quantized = kv_cache.dtype == torch.uint8 or kv_cache.dtype in FP8_FORMATS
        self.input_dtype = input_dtype or (torch.float32 if self.quantized else kv_cache.dtype)
        scales = layer_scales(attn_layer) if self.quantized else (1.0, 1.0)
        nslots = 3 * block_size
        count = nslots * heads * dim
        base, digits = (8 if self.quantized else 128), 1
        while base**digits < 2 * count:
            digits += 1
        slots = torch.arange(nslots, dtype=torch.int64, device=kv_cache.device)
        k_codes = torch.arange(count, dtype=torch.int64).reshape(nslots, heads, dim)
        written = []
        for i in range(digits):
            scratch = _like(kv_cache, shape, _SENTINEL_BYTE if self.quantized else -1.0)
            digit = lambda c, s: (((c // base**i) % base).to(torch.float64) * s).to(self.input_dtype).to(
                kv_cache.device)
            attn_layer.impl.do_kv_cache_update(attn_layer, digit(k_codes, scales[0]), digit(k_codes + count, scales[1]),
                                               scratch, slots)
            written.append(scratch.reshape(-1).cpu())
        self.format, where, code = None, None, None
        for fmt in (FP8_FORMATS if self.quantized else (None,)):
            got = self._decode_codes(written, fmt, base, 2 * count)
            if got is not None:
                self.format, (where, code) = fmt, got
                break
        if code is None:
            raise ValueError("the cache writer does not store values as given, nor as fp8 (e4m3 or e5m2) with the "
                             "layer's scales" if self.quantized else
                             "the cache writer does not store values as given (a quantized cache?)")
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
        if torch.unique(per_block[:, 0]).numel() != per_block[:, 0].numel():
            raise ValueError(f"the cache's strides {kv_cache.stride()} put two elements at one address")
        self.offsets = per_block[:, 0].to(kv_cache.device)  # [K|V, slot in block, head, dim]
        self.cache_dtype = kv_cache.dtype
        self.block_stride, self.block_size = int(strides[bd]), block_size

    @staticmethod
    def _decode_codes(written, fmt, base, n):
        """(where, code) of the n written elements, decoded as `fmt` (None: as given); None where they do not
        decode to each code exactly once."""
        as_float = lambda x: (x.view(torch.uint8).view(fmt) if fmt is not None else x).to(torch.float64)
        first = as_float(written[0])
        where = torch.nonzero(first >= 0).flatten()
        if where.numel() != n:
            return None
        code = torch.zeros(n, dtype=torch.int64)
        for i, w in enumerate(written):
            d = as_float(w)[where]
            r = d.round()
            if not (torch.equal(r, d) and bool(((r >= 0) & (r < base)).all())):
                return None
            code += r.to(torch.int64) * base**i
        if not torch.equal(torch.sort(code).values, torch.arange(n)):
            return None
        return where, code

    @property
    def stored_dtype(self) -> str:
        """What the cache holds, by the store's name for it: float32, bfloat16, float16, float8_e4m3fn, float8_e5m2."""
        return str(self.format if self.format is not None else self.cache_dtype).replace("torch.", "")

    def read_raw(self, kv_cache: torch.Tensor, slots: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V [tokens, heads, dim] of the given slots exactly as the cache holds them (an fp8 cache's as bytes,
        uint8), on the cache's device."""
        slots = slots.to(kv_cache.device)
        at = (slots // self.block_size * self.block_stride)[:, None, None] + self.offsets[:, slots % self.block_size]
        flat = storage_view(kv_cache)
        if self.format is not None:
            flat = flat.view(torch.uint8)
        return flat[at[0]], flat[at[1]]

    def read(self, kv_cache: torch.Tensor, slots: torch.Tensor, scales=(1.0, 1.0)) -> tuple[torch.Tensor,
                                                                                            torch.Tensor]:
        """K and V [tokens, heads, dim] of the given slots: as stored, or, for an fp8 cache, decoded to real values
        with the layer's scales (float32)."""
        slots = slots.to(kv_cache.device)
        at = (slots // self.block_size * self.block_stride)[:, None, None] + self.offsets[:, slots % self.block_size]
        flat = storage_view(kv_cache)
        k, v = flat[at[0]], flat[at[1]]
        if self.format is not None:
            k = k.view(torch.uint8).view(self.format).to(torch.float32) * scales[0]
            v = v.view(torch.uint8).view(self.format).to(torch.float32) * scales[1]
        return k, v
