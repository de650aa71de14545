"""crosskv: apply a fitted cross-model KV-cache mapper to a source model's cache.

    import crosskv
    m = crosskv.Mapper("out/k4")                      # a mapper folder written by crosskv-fit
    tk, tv = m.transfer(keys, values, positions)      # [tokens, Ls, Hs, Ds] -> [tokens, Lt, Ht, Dt]

numpy arrays and torch tensors go in and the same kind comes out. CPU float32 tensors are read without a copy. With
`Mapper(path, device="cuda")` the weights live on the GPU and CUDA tensors stay there: read and written in place
(DLPack), ordered on torch's current stream, never through the host. A batch of sequences is [batch, seq, L, H, D]
(or the tokens stacked, each with its own position). `crosskv.hf.transfer_cache` turns a Hugging Face source cache
into the target model's DynamicCache; `crosskv.vllm` is a vLLM KV connector that serves a mapper in a vLLM engine.
"""
import warnings

import numpy as np

from ._crosskv import MapperError, __version__, blas, blas_warning, cuda_compiled_in, read_manifest, _Mapper

if blas_warning:
    warnings.warn(f"crosskv: {blas_warning}", RuntimeWarning, stacklevel=2)

# `blas`: the BLAS library and the kernels it runs here (chosen at import to match the CPU unless OPENBLAS_CORETYPE is
# set); `blas_warning`: what is wrong with them and how to fix it, or "".
__all__ = ["Mapper", "MapperError", "__version__", "blas", "blas_warning", "cuda_compiled_in", "read_manifest"]


def _is_torch(x):
    return type(x).__module__.startswith("torch")


def _check_cache_type(name, x):
    if not (isinstance(x, np.ndarray) or _is_torch(x)):
        raise MapperError(f"{name}: expected a numpy array or a torch tensor, got {type(x).__name__}")


_MAX_POSITION = 2**31 - 1


def _check_positions(name, p):
    """Integers in [0, 2^31): anything else is refused before it is cast (a cast would wrap or overflow)."""
    if _is_torch(p):
        import torch

        integer = not (p.dtype.is_floating_point or p.dtype.is_complex or p.dtype == torch.bool)
        n = p.numel()
    else:
        integer, n = np.issubdtype(p.dtype, np.integer), p.size
    if not integer:
        raise MapperError(f"{name}: expected integer positions, got {p.dtype}")
    if n:
        lo, hi = int(p.min()), int(p.max())
        if lo < 0:
            raise MapperError(f"{name}: position {lo} is negative; positions must be >= 0")
        if hi > _MAX_POSITION:
            raise MapperError(f"{name}: position {hi} does not fit in 32 bits; positions must be < 2^31")


def _layer_range(layers):
    """(first, count) of a `layers` argument: None (every layer), a target layer, or a range with step 1."""
    if layers is None:
        return 0, -1
    if isinstance(layers, (int, np.integer)) and not isinstance(layers, bool):
        return int(layers), 1
    if isinstance(layers, range) and layers.step == 1 and len(layers) > 0:
        return layers.start, len(layers)
    raise MapperError(f"layers: expected a target layer or a non-empty range of them with step 1, got {layers!r}")


class Mapper:
    """A mapper folder (`k<K>/`) on `device` ("cpu", "cuda", "cuda:N"). resident=True (the default) keeps every layer's
    weights in the device's memory for the object's lifetime and maps all target layers in one call; resident=False
    reads one target layer at a time (for a mapper larger than memory). Every layer file's SHA-256 is checked when
    first read. tf32=True lets cuBLAS run the GPU's products on TF32 tensor cores (about 7x the fp32 rate on an
    H100, inputs rounded to 10-bit mantissas: relative errors near 1e-3 instead of 1e-6). target_heads (a range of
    target KV heads, step 1; resident only) keeps and maps those heads alone, as a tensor-parallel worker holds them:
    the outputs are then [..., Lt, len(target_heads), Dt], equal to those heads of the whole mapping."""

    def __init__(self, path, device="cpu", resident=True, verify=True, tf32=False, target_heads=None):
        self.device = device
        first, count = 0, -1
        if target_heads is not None:
            if not (isinstance(target_heads, range) and target_heads.step == 1 and len(target_heads) > 0):
                raise MapperError(f"target_heads: expected a non-empty range of target KV heads with step 1, got "
                                  f"{target_heads!r}")
            first, count = target_heads.start, len(target_heads)
        self._m = _Mapper(str(path), device, resident, verify, tf32, first, count)

    source = property(lambda self: self._m.source, doc="the source model's kv_spec (layers, heads, dims, rope)")
    target = property(lambda self: self._m.target, doc="the target model's kv_spec")
    source_model = property(lambda self: self._m.source_model)
    target_model = property(lambda self: self._m.target_model)
    k = property(lambda self: self._m.k, doc="source layers per target layer")
    structure = property(lambda self: self._m.structure,
                         doc="cross_head (each target head reads every source head) or per_head (head-matched)")
    source_layers = property(lambda self: self._m.source_layers, doc="per target layer, the source layers it reads")
    backend = property(lambda self: self._m.backend)
    heads = property(lambda self: range(*self._m.heads), doc="the target KV heads this mapper maps (all by default)")
    weight_bytes = property(lambda self: self._m.weight_bytes, doc="bytes of weights resident on the device")

    def transfer(self, keys, values, positions, target_positions=None, layers=None, check_finite=True):
        """keys, values: [tokens, Ls, Hs, Ds] or [batch, seq, Ls, Hs, Ds] as the source model caches them (keys
        post-RoPE at `positions`: [tokens], or [seq] or [batch, seq] for a batch). Returns the target's (keys, values)
        of the same leading shape with [Lt, Ht, Dt] last, keys post-RoPE at `target_positions` (default: the same
        positions). Tokens are independent: each is mapped at its own position. `layers` (a target layer, or a
        range of them with step 1) maps only those: the outputs then hold them alone, [..., len(layers), Ht, Dt],
        equal to those layers of a whole call (a serving stack maps layer by layer while the model computes).
        check_finite=False skips the NaN/infinity check of CUDA tensors (a reduction and a host wait on each call) for
        a caller that checked the same keys and values once already; host arrays are always checked."""
        s = self.source
        first, count = _layer_range(layers)
        _check_cache_type("keys", keys)
        _check_cache_type("values", values)
        if keys.ndim not in (4, 5):
            raise MapperError(f"keys: expected [tokens, {s['n_layers']}, {s['n_kv_heads']}, {s['head_dim']}] or "
                              f"[batch, seq, ...], got {tuple(keys.shape)}")
        lead = tuple(keys.shape[:-3])
        rows = 1
        for d in lead:
            rows *= int(d)
        if tuple(values.shape[:-3]) != lead:
            raise MapperError(f"values: expected the keys' leading shape {lead}, got {tuple(values.shape)}")

        def positions_of(p):
            if _is_torch(keys):
                import torch

                p = torch.as_tensor(p)
            else:
                p = np.asarray(p)
            batch_of_seq = len(lead) == 2 and tuple(p.shape) == lead[1:]
            if tuple(p.shape) != lead and not batch_of_seq:
                raise MapperError(f"positions: expected {list(lead)} (one per token)"
                                  f"{' or [seq]' if len(lead) == 2 else ''}, got {list(p.shape)}")
            if batch_of_seq:  # the same positions for every sequence of the batch
                p = p.expand(*lead) if _is_torch(keys) else np.broadcast_to(p, lead)
            return p.reshape(rows)

        src_pos = positions_of(positions)
        _check_positions("positions", src_pos)
        tgt_pos = src_pos
        if target_positions is not None:
            tgt_pos = positions_of(target_positions)
            _check_positions("target_positions", tgt_pos)
        k4 = keys.reshape(rows, *keys.shape[-3:])
        v4 = values.reshape(rows, *values.shape[-3:])
        if _is_torch(keys):
            out_k, out_v = self._transfer_torch(k4, v4, src_pos, tgt_pos, first, count, check_finite)
        else:
            out_k, out_v = self._m.transfer(np.ascontiguousarray(k4, dtype=np.float32),
                                            np.ascontiguousarray(v4, dtype=np.float32),
                                            np.ascontiguousarray(src_pos, dtype=np.int32),
                                            np.ascontiguousarray(tgt_pos, dtype=np.int32), first, count)
        return out_k.reshape(*lead, *out_k.shape[1:]), out_v.reshape(*lead, *out_v.shape[1:])

    def _transfer_torch(self, keys, values, src_pos, tgt_pos, first=0, count=-1, check_finite=True):
        import torch

        if keys.is_cuda and self._m.resident and self._m.backend.startswith("cuda"):
            # On the GPU throughout: float32 contiguous views (a copy only where the cache is another dtype or
            # layout), outputs allocated by torch on the same device, the work ordered on torch's stream.
            dev = keys.device
            f32 = lambda x: x.detach().to(dev, torch.float32).contiguous()
            i32 = lambda x: torch.as_tensor(x).to(dev, torch.int32).contiguous()
            k, v, p = f32(keys), f32(values), i32(src_pos)
            for name, x in (("keys", k), ("values", v)) if check_finite else ():  # a reduction each, then a wait
                if not bool(torch.isfinite(x).all()):
                    raise MapperError(f"{name}: holds NaN or infinity; a source cache must be finite "
                                      "(the request should re-prefill)")
            tp = p if tgt_pos is src_pos else i32(tgt_pos)
            t = self.target
            n = t["n_layers"] - first if count < 0 else count
            shape = (k.shape[0], n, len(self.heads), t["head_dim"])
            out_k = torch.empty(shape, dtype=torch.float32, device=dev)
            out_v = torch.empty(shape, dtype=torch.float32, device=dev)
            self._m.transfer_into(k, v, p, tp, out_k, out_v, torch.cuda.current_stream(dev).cuda_stream, first, count)
            return out_k, out_v
        # Host arrays: CPU float32 tensors without a copy; others through the host and back to their device.
        device = keys.device
        k = keys.detach().to("cpu", torch.float32).contiguous()
        v = values.detach().to("cpu", torch.float32).contiguous()
        p = torch.as_tensor(src_pos).to("cpu", torch.int32).contiguous()
        tp = p if tgt_pos is src_pos else torch.as_tensor(tgt_pos).to("cpu", torch.int32).contiguous()
        out_k, out_v = self._m.transfer(k, v, p, tp, first, count)
        return torch.from_numpy(out_k).to(device), torch.from_numpy(out_v).to(device)

    def __repr__(self):
        s, t = self.source, self.target
        return (f"crosskv.Mapper({self._m.path!r}: {self.source_model} [{s['n_layers']}x{s['n_kv_heads']}x"
                f"{s['head_dim']}] -> {self.target_model} [{t['n_layers']}x{t['n_kv_heads']}x{t['head_dim']}], "
                f"k={self.k}, {self.structure}, {self.backend})")
