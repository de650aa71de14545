"""A mapper folder of random weights at any shape, for timing a transfer at a model's real shape without fitting one.
crosskv's own writer writes it (artifact/, through the extension: manifest.json with fit.synthetic, one
layer-NNN.safetensors per target layer), so it is the format a fit writes. The weights mean nothing; crosskv.Mapper
and crosskv-apply load it like a fit's.

    from synthetic_mapper import write_mapper
    write_mapper("/tmp/m", source_spec, target_spec, k=4)      # specs: crosskv kv_spec dicts (kv_spec() below)
"""
import json
import os

import numpy as np


def kv_spec(layers, kv_heads, head_dim, q_heads, theta, rope_type="default", **rope):
    """A kv_spec as crosskv's manifests hold it (docs/METHOD.md, The mapper); rope: factor, low_freq_factor, ... for llama3 / yarn."""
    r = dict(type=rope_type, theta=float(theta), rotary_dim=head_dim, convention="half", truncate=True)
    r.update({k: float(v) for k, v in rope.items()})
    return dict(n_layers=layers, n_kv_heads=kv_heads, head_dim=head_dim, n_q_heads=q_heads, rope=r)


def write_mapper(out, source, target, k, seed=0, source_model="synthetic-source", target_model="synthetic-target"):
    """Writes out/manifest.json and out/layer-NNN.safetensors: target layer l reads k source layers spread over the
    source (k = source layers: all of them), fp32 weights ~ N(0, 0.02^2 / k)."""
    from crosskv import _crosskv

    os.makedirs(out, exist_ok=True)
    Ls, Lt = source["n_layers"], target["n_layers"]
    F, G = source["n_kv_heads"] * source["head_dim"], target["n_kv_heads"] * target["head_dim"]
    rng = np.random.default_rng(seed)
    layers = []
    for l in range(Lt):
        sel = sorted({(j * Ls) // k + (l % max(1, Ls // k)) for j in range(k)}) if k < Ls else list(range(Ls))
        while len(sel) < k:  # spread picks that collided: the next free layers
            sel = sorted(set(sel) | {next(i for i in range(Ls) if i not in sel)})
        K = len(sel) * F
        w = [rng.standard_normal((K, G), dtype=np.float32) * np.float32(0.02 / np.sqrt(k)) for _ in range(2)]
        b = np.zeros(G, dtype=np.float32)
        layers.append((sel, w[0], b, w[1], b))
    _crosskv.write_synthetic_mapper(out, json.dumps(source), json.dumps(target), source_model, target_model, layers)
    return out
