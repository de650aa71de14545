#!/usr/bin/env python3
"""Reference implementation of applying a crosskv mapper, in numpy + h5py alone (docs/METHOD.md, RoPE and docs/FORMATS.md, Calibration shards; Mapper artifact).

For users outside C++, and as an independent check of crosskv-apply: reads the artifact folder and a source shard,
strips the source RoPE, maps each target layer (Y = X W + b over the selected source layers), applies the target
RoPE, and writes the target keys and values to an .npz (keys [T, L, H, D] post target-RoPE, values, positions).

    python3 tools/crosskv_apply.py --mapper out/k4 --source src.h5 --out mapped.npz
"""
import argparse
import json
import os
import struct
import sys

import h5py
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


def yarn_get_mscale(scale, mscale):
    return 1.0 if scale <= 1 else 0.1 * mscale * np.log(scale) + 1.0


def rope_params(rope, d):
    """(inv_freq fp64 rounded through fp32 as Hugging Face stores it, attention factor, rotary dim), per rope type."""
    r = rope.get("rotary_dim") or d
    kind = rope["type"]
    if kind == "none":
        return None, 1.0, r
    theta = rope["theta"]
    base = 1.0 / theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
    att = 1.0
    if kind == "default":
        inv = base
    elif kind == "linear":
        inv = base / rope["factor"]
    elif kind == "llama3":
        f, lo, hi, orig = (rope[k] for k in ("factor", "low_freq_factor", "high_freq_factor",
                                              "original_max_position_embeddings"))
        wl = 2 * np.pi / base
        s = (orig / wl - lo) / (hi - lo)
        smooth = (1 - s) * base / f + s * base
        inv = np.where(wl < orig / hi, base, np.where(wl > orig / lo, base / f, smooth))
    elif kind == "yarn":
        f, orig = rope["factor"], rope["original_max_position_embeddings"]
        beta_fast = rope.get("beta_fast") or 32.0
        beta_slow = rope.get("beta_slow") or 1.0
        if rope.get("attention_factor") is not None:
            att = rope["attention_factor"]
        elif rope.get("mscale") and rope.get("mscale_all_dim"):
            att = yarn_get_mscale(f, rope["mscale"]) / yarn_get_mscale(f, rope["mscale_all_dim"])
        else:
            att = yarn_get_mscale(f, 1.0)
        cdim = lambda rot: (r * np.log(orig / (rot * 2 * np.pi))) / (2 * np.log(theta))
        low, high = cdim(beta_fast), cdim(beta_slow)
        if rope.get("truncate", True):
            low, high = np.floor(low), np.ceil(high)
        low, high = max(low, 0.0), min(high, r - 1.0)
        if low == high:
            high += 0.001
        pos_freq = theta ** (np.arange(0, r, 2, dtype=np.float64) / r)
        ramp = np.clip((np.arange(r // 2, dtype=np.float64) - low) / (high - low), 0, 1)
        inv = (1.0 / (f * pos_freq)) * ramp + (1.0 / pos_freq) * (1 - ramp)
    else:
        raise ValueError(f"unsupported rope type {kind}")
    return inv.astype(np.float32).astype(np.float64), att, r


def layer_ropes(spec):
    """Each layer's rope: kv_spec.layers[l].rope where the spec lists layers (docs/FORMATS.md), else kv_spec.rope."""
    return [e.get("rope", spec["rope"]) for e in spec["layers"]] if spec.get("layers") else \
        [spec["rope"]] * spec["n_layers"]


def rotate(x, positions, spec, strip):
    """x [T, L, H, D] (float64) rotated by each layer's RoPE (apply) or back (strip)."""
    out = x.copy()
    for l, rope in enumerate(layer_ropes(spec)):
        out[:, l] = rotate_layer(x[:, l], positions, rope, spec["head_dim"], strip)
    return out


def rotate_layer(x, positions, rope, d, strip):
    """x [T, H, D] rotated by one rope, half or interleaved pairs."""
    inv, att, r = rope_params(rope, d)
    if inv is None:
        return x
    ang = positions.astype(np.float64)[:, None] * inv[None, :]
    c = np.cos(ang).astype(np.float32).astype(np.float64)[:, None, :]
    s = np.sin(ang).astype(np.float32).astype(np.float64)[:, None, :]
    out = x.copy()
    if rope.get("convention", "half") == "half":
        i1, i2 = np.arange(r // 2), np.arange(r // 2) + r // 2
    else:
        i1, i2 = np.arange(0, r, 2), np.arange(1, r, 2)
    u, v = x[..., i1], x[..., i2]
    if strip:
        out[..., i1] = (u * c + v * s) / att
        out[..., i2] = (v * c - u * s) / att
    else:
        out[..., i1] = att * (u * c - v * s)
        out[..., i2] = att * (v * c + u * s)
    return out


def read_kv(f, name):
    d = f[name]
    a = d[()]
    if d.attrs.get("dtype") in ("bfloat16", b"bfloat16"):
        a = (a.astype(np.uint32) << 16).view(np.float32)
    return a.astype(np.float64)


def load_mapper(mapper_dir):
    with open(os.path.join(mapper_dir, "manifest.json")) as f:
        manifest = json.load(f)
    if manifest.get("format") != "crosskv-mapper" or manifest.get("format_version") != 1:
        raise ValueError(f"{mapper_dir}: not a crosskv-mapper version 1 artifact")
    layers = {e["target_layer"]: (e["source_layers"], read_safetensors(os.path.join(mapper_dir, e["file"])))
              for e in manifest["layers"]}
    return manifest, layers


def residual_mlp(t, kind, x):
    """A layer's residual MLP where it keeps one: relu(relu(x W1 + b1) W2 + b2) W3 + b3, else 0."""
    p = kind + ".mlp."
    if p + "w1" not in t:
        return 0.0
    w = {n: t[p + n].astype(np.float64) for n in ("w1", "b1", "w2", "b2", "w3", "b3")}
    h1 = np.maximum(x @ w["w1"] + w["b1"], 0.0)
    h2 = np.maximum(h1 @ w["w2"] + w["b2"], 0.0)
    return h2 @ w["w3"] + w["b3"]


def apply_arrays(manifest, layers, keys, values, positions, target_positions=None):
    """Source cache (keys post-RoPE) [T, Ls, Hs, Ds] -> target cache [T, Lt, Ht, Dt] (keys post target-RoPE)."""
    src_spec, tgt_spec = manifest["source"]["kv_spec"], manifest["target"]["kv_spec"]
    tpos = positions if target_positions is None else target_positions
    T = keys.shape[0]
    X = rotate(keys.astype(np.float64), positions, src_spec, strip=True).reshape(T, src_spec["n_layers"], -1)
    V = values.astype(np.float64).reshape(T, src_spec["n_layers"], -1)
    Lt, Ht, Dt = tgt_spec["n_layers"], tgt_spec["n_kv_heads"], tgt_spec["head_dim"]
    out_k = np.zeros((T, Lt, Ht * Dt))
    out_v = np.zeros((T, Lt, Ht * Dt))
    per_head = manifest["fit"].get("structure", "cross_head") == "per_head"
    Ds = src_spec["head_dim"]
    for l, (src, t) in layers.items():
        if per_head:  # target head h from source head h of the selected layers: weight [Ht, k*Ds, Dt]
            for h in range(Ht):
                xk = X[:, src, h * Ds:(h + 1) * Ds].reshape(T, -1)
                xv = V[:, src, h * Ds:(h + 1) * Ds].reshape(T, -1)
                cols = slice(h * Dt, (h + 1) * Dt)
                out_k[:, l, cols] = xk @ t["k.weight"][h].astype(np.float64) + t["k.bias"][cols]
                out_v[:, l, cols] = xv @ t["v.weight"][h].astype(np.float64) + t["v.bias"][cols]
            continue
        xk, xv = X[:, src, :].reshape(T, -1), V[:, src, :].reshape(T, -1)
        out_k[:, l] = xk @ t["k.weight"].astype(np.float64) + t["k.bias"] + residual_mlp(t, "k", xk)
        out_v[:, l] = xv @ t["v.weight"].astype(np.float64) + t["v.bias"] + residual_mlp(t, "v", xv)
    out_k = rotate(out_k.reshape(T, Lt, Ht, Dt), tpos, tgt_spec, strip=False)
    return out_k, out_v.reshape(T, Lt, Ht, Dt), tpos


def apply(mapper_dir, source_path, target_positions=None):
    manifest, layers = load_mapper(mapper_dir)
    src_spec = manifest["source"]["kv_spec"]
    with h5py.File(source_path, "r") as f:
        spec = json.loads(f.attrs["kv_spec"])
        for key in ("n_layers", "n_kv_heads", "head_dim"):
            if spec[key] != src_spec[key]:
                raise ValueError(f"{source_path}: kv_spec.{key} {spec[key]} differs from the mapper's {src_spec[key]}")
        keys, values = read_kv(f, "keys"), read_kv(f, "values")
        positions = f["positions"][()]
    return apply_arrays(manifest, layers, keys, values, positions, target_positions)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mapper", required=True)
    p.add_argument("--source", required=True)
    p.add_argument("--out", required=True, help="output .npz with keys, values, positions")
    a = p.parse_args()
    try:
        k, v, pos = apply(a.mapper, a.source)
    except (OSError, ValueError, KeyError) as e:
        print(f"crosskv_apply.py: error: {e}", file=sys.stderr)
        return 2
    np.savez(a.out, keys=k.astype(np.float32), values=v.astype(np.float32), positions=pos)
    return 0


if __name__ == "__main__":
    sys.exit(main())
