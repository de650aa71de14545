"""Reading crosskv artifacts and shards as a user would: numpy + h5py only."""
import json
import os
import struct

import numpy as np


def read_safetensors(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        raw = data[a:b]
        if t["dtype"] == "F32":
            arr = np.frombuffer(raw, dtype="<f4")
        elif t["dtype"] == "F16":
            arr = np.frombuffer(raw, dtype="<f2").astype(np.float32)
        elif t["dtype"] == "BF16":
            arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
        else:
            raise ValueError(f"{path}: unsupported dtype {t['dtype']}")
        out[name] = arr.reshape(t["shape"])
    return out


def read_mapper(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    layers = [read_safetensors(os.path.join(folder, l["file"])) for l in manifest["layers"]]
    return manifest, layers


def inv_freq(rope, head_dim):
    """Inverse frequencies for the default, linear and llama3 rope types (SPEC §2)."""
    r = rope.get("rotary_dim") or head_dim
    inv = 1.0 / rope["theta"] ** (np.arange(0, r, 2, dtype=np.float64) / r)
    if rope["type"] == "linear":
        inv = inv / rope["factor"]
    elif rope["type"] == "llama3":
        f, lo, hi, orig = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"], rope["original_max_position_embeddings"]
        wl = 2 * np.pi / inv
        s = (orig / wl - lo) / (hi - lo)
        smooth = (1 - s) * inv / f + s * inv
        inv = np.where(wl < orig / hi, inv, np.where(wl > orig / lo, inv / f, smooth))
    elif rope["type"] != "default":
        raise ValueError(f"this check implements default/linear/llama3, not {rope['type']}")
    return inv.astype(np.float32).astype(np.float64)  # HF keeps inv_freq in fp32


def strip_rope(keys, positions, spec):
    """keys [T, L, H, D] post-RoPE (half convention) -> content space."""
    rope, d = spec["rope"], spec["head_dim"]
    r = rope.get("rotary_dim") or d
    ang = positions.astype(np.float64)[:, None] * inv_freq(rope, d)[None, :]
    c = np.cos(ang)[:, None, None, :]
    s = np.sin(ang)[:, None, None, :]
    k = keys.astype(np.float64)
    x1, x2 = k[..., : r // 2], k[..., r // 2 : r]
    out = k.copy()
    out[..., : r // 2] = x1 * c + x2 * s
    out[..., r // 2 : r] = x2 * c - x1 * s
    return out
