"""A mapper folder of random weights at any shape, in crosskv's artifact format (SPEC §6: manifest.json and one
layer-NNN.safetensors per target layer, each file's SHA-256 in the manifest), for timing a transfer at a model's
real shape without fitting one. The weights mean nothing; crosskv.Mapper and crosskv-apply load it like a fit's.

    from synthetic_mapper import write_mapper
    write_mapper("/tmp/m", source_spec, target_spec, k=4)      # specs: crosskv kv_spec dicts (kv_spec() below)
"""
import hashlib
import json
import os

import numpy as np
from safetensors.numpy import save_file


def kv_spec(layers, kv_heads, head_dim, q_heads, theta, rope_type="default", **rope):
    """A kv_spec as crosskv's manifests hold it (SPEC §1); rope: factor, low_freq_factor, ... for llama3 / yarn."""
    r = dict(type=rope_type, theta=float(theta), rotary_dim=head_dim, convention="half", truncate=True)
    r.update({k: float(v) for k, v in rope.items()})
    return dict(n_layers=layers, n_kv_heads=kv_heads, head_dim=head_dim, n_q_heads=q_heads, rope=r)


def write_mapper(out, source, target, k, seed=0, source_model="synthetic-source", target_model="synthetic-target"):
    """Writes out/manifest.json and out/layer-NNN.safetensors: target layer l reads k source layers spread over the
    source (k = source layers: all of them), fp32 weights ~ N(0, 0.02^2 / k)."""
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
        t = {}
        for kind in ("k", "v"):
            t[f"{kind}.weight"] = (rng.standard_normal((K, G), dtype=np.float32) * np.float32(0.02 / np.sqrt(k)))
            t[f"{kind}.bias"] = np.zeros(G, dtype=np.float32)
        name = f"layer-{l:03d}.safetensors"
        path = os.path.join(out, name)
        save_file(t, path)
        with open(path, "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        layers.append(dict(target_layer=l, source_layers=sel, file=name, sha256=sha))
    manifest = dict(format="crosskv-mapper", format_version=1,
                    source=dict(model=source_model, kv_spec=source), target=dict(model=target_model, kv_spec=target),
                    fit=dict(k=k, k_count=k, dtype="fp32", synthetic=True), layers=layers)
    with open(os.path.join(out, "manifest.json"), "w") as f:
        json.dump(manifest, f, indent=1)
    return out
