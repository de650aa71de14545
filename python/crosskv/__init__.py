"""crosskv: apply a fitted cross-model KV-cache mapper to a source model's cache.

    import crosskv
    m = crosskv.Mapper("out/k4")                      # a mapper folder written by crosskv-fit
    tk, tv = m.transfer(keys, values, positions)      # [tokens, Ls, Hs, Ds] -> [tokens, Lt, Ht, Dt]

numpy arrays and torch tensors go in (CPU tensors without a copy; others are copied to the host and the results
copied back to their device); the same kind comes out. `crosskv.hf.transfer_cache` turns a Hugging Face source
cache into the target model's DynamicCache.
"""
import numpy as np

from ._crosskv import MapperError, __version__, cuda_compiled_in, _Mapper

__all__ = ["Mapper", "MapperError", "__version__", "cuda_compiled_in"]


def _is_torch(x):
    return type(x).__module__.startswith("torch")


class Mapper:
    """A mapper folder (`k<K>/`): its weights resident for the object's lifetime (resident=False reads one target
    layer at a time), every layer file's SHA-256 checked when first read."""

    def __init__(self, path, device="cpu", resident=True, verify=True):
        self._m = _Mapper(str(path), device, resident, verify)

    source = property(lambda self: self._m.source, doc="the source model's kv_spec (layers, heads, dims, rope)")
    target = property(lambda self: self._m.target, doc="the target model's kv_spec")
    source_model = property(lambda self: self._m.source_model)
    target_model = property(lambda self: self._m.target_model)
    k = property(lambda self: self._m.k, doc="source layers per target layer")
    source_layers = property(lambda self: self._m.source_layers, doc="per target layer, the source layers it reads")
    backend = property(lambda self: self._m.backend)

    def transfer(self, keys, values, positions, target_positions=None):
        """keys, values: [tokens, Ls, Hs, Ds] as the source model caches them (keys post-RoPE at `positions`).
        Returns the target's (keys, values) [tokens, Lt, Ht, Dt], keys post-RoPE at `target_positions` (default:
        the same positions). Tokens are independent: a batch of sequences is their tokens stacked, each with its
        own position."""
        torch_in = _is_torch(keys)
        if torch_in:
            import torch

            device = keys.device
            k = keys.detach().to("cpu", torch.float32).contiguous()
            v = values.detach().to("cpu", torch.float32).contiguous()
            p = torch.as_tensor(positions).to("cpu", torch.int32).contiguous()
            tp = p if target_positions is None else torch.as_tensor(target_positions).to("cpu", torch.int32).contiguous()
        else:
            k = np.ascontiguousarray(keys, dtype=np.float32)
            v = np.ascontiguousarray(values, dtype=np.float32)
            p = np.ascontiguousarray(positions, dtype=np.int32)
            tp = p if target_positions is None else np.ascontiguousarray(target_positions, dtype=np.int32)
        out_k, out_v = self._m.transfer(k, v, p, tp)
        if torch_in:
            return torch.from_numpy(out_k).to(device), torch.from_numpy(out_v).to(device)
        return out_k, out_v

    def __repr__(self):
        s, t = self.source, self.target
        return (f"crosskv.Mapper({self._m.path!r}: {self.source_model} [{s['n_layers']}x{s['n_kv_heads']}x"
                f"{s['head_dim']}] -> {self.target_model} [{t['n_layers']}x{t['n_kv_heads']}x{t['head_dim']}], "
                f"k={self.k}, {self.backend})")
