#!/usr/bin/env python3
"""The fit's ridge solution recomputed in fp64 from the shards, in numpy alone: how far crosskv-fit's fp32 moments
(about a provisional shift) and fp32 artifact take each layer's solution from the exact one.

For each target layer and kind (keys, values) of a mapper, with the layers the fit picked and the λ it solved with
(manifest layers[].source_layers and lambda):

    X, Y      the calibration shards the manifest lists, keys taken out of RoPE (tools/crosskv_apply.py), in fp64
    W64       (Cxx + λ I)⁻¹ Cxy from fp64 centred covariances (divided by N), solved in fp64
    weights   ‖W − W64‖ / ‖W64‖ (Frobenius), W the artifact's
    outputs   ‖Xc (W − W64)‖ / ‖Xc W64‖ on the calibration tokens: what a user of the mapper sees
    kappa     the condition number of Cxx + λ I: the perturbation bound's amplifier

    python3 tools/fp64_fit.py --mapper out/k1 --source SOURCE_STORE --target TARGET_STORE [--json rows.json]

Uniform token weights and stride 1 only (others are refused by name); cross_head and per_head structures.
"""
import argparse
import json
import os
import sys

import h5py
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from crosskv_apply import load_mapper, read_kv, rotate  # noqa: E402

EPS32 = float(np.finfo(np.float32).eps)


def read_store(store, shards):
    """(content keys, values) [T, L, H*D] in fp64 over the listed shards of one store."""
    ks, vs = [], []
    for entry in shards:
        with h5py.File(os.path.join(store, entry["path"]), "r") as f:
            spec = json.loads(f.attrs["kv_spec"])
            k = rotate(read_kv(f, "keys"), f["positions"][()], spec, strip=True)
            v = read_kv(f, "values")
        n = entry.get("tokens_used", len(k))
        ks.append(k[:n].reshape(n, spec["n_layers"], -1))
        vs.append(v[:n].reshape(n, spec["n_layers"], -1))
    return np.concatenate(ks), np.concatenate(vs)


def systems(manifest, t, X, Y, src, layer, kind):
    """(features, targets, artifact weight) per system of one layer and kind: one, or one per head (per_head)."""
    w = t[f"{kind}.weight"].astype(np.float64)
    if manifest["fit"].get("structure", "cross_head") != "per_head":
        return [(X[:, src].reshape(len(X), -1), Y[:, layer], w)]
    hs = manifest["source"]["kv_spec"]["head_dim"]
    ht = manifest["target"]["kv_spec"]["head_dim"]
    return [(X[:, src, h * hs:(h + 1) * hs].reshape(len(X), -1), Y[:, layer, h * ht:(h + 1) * ht], w[h])
            for h in range(w.shape[0])]


def compare(x, y, w, lam):
    xc, yc = x - x.mean(0), y - y.mean(0)
    a = xc.T @ xc / len(x) + lam * np.eye(x.shape[1])
    w64 = np.linalg.solve(a, xc.T @ yc / len(x))
    d = w - w64
    return (float(np.linalg.norm(d) / np.linalg.norm(w64)),
            float(np.linalg.norm(xc @ d) / np.linalg.norm(xc @ w64)), float(np.linalg.cond(a)))


def read_pair(mapper_dir, source_store, target_store):
    """(manifest, layers, source (keys, values), target (keys, values)): a mapper and the calibration it read."""
    manifest, layers = load_mapper(mapper_dir)
    cal = manifest["calibration"]
    if cal.get("token_weighting", "uniform") != "uniform" or cal.get("token_stride", 1) != 1:
        raise ValueError(f"{mapper_dir}: calibration.token_weighting/token_stride: the oracle reads uniform weights "
                         f"and stride 1 only")
    return manifest, layers, read_store(source_store, cal["shards"]), read_store(target_store, cal["shards"])


def lambda_of(manifest, layer, kind):
    """The λ the fit solved target layer `layer`'s `kind` ("k" or "v") with."""
    entry = next(e for e in manifest["layers"] if e["target_layer"] == layer)
    lam = entry.get("lambda")
    return lam[{"k": "keys", "v": "values"}[kind]] if isinstance(lam, dict) else manifest["fit"]["lambda"]


def fp64_rows(pair):
    """One row per target layer and kind of read_pair's mapper: weights and outputs relative errors, kappa, λ."""
    manifest, layers, xs, ys = pair
    rows = []
    for layer, (src, t) in sorted(layers.items()):
        for i, kind in enumerate(("k", "v")):
            lam = lambda_of(manifest, layer, kind)
            errs = [compare(x, y, w, lam) for x, y, w in systems(manifest, t, xs[i], ys[i], src, layer, kind)]
            rows.append({"layer": layer, "kind": kind, "lambda": lam, "weights": max(e[0] for e in errs),
                         "outputs": max(e[1] for e in errs), "kappa": max(e[2] for e in errs)})
    return rows


def worst(rows, what="outputs"):
    return max(rows, key=lambda r: r[what])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mapper", required=True)
    p.add_argument("--source", required=True, help="the source store (the folder the fit's source.store names)")
    p.add_argument("--target", required=True)
    p.add_argument("--json", help="write the rows here")
    a = p.parse_args()
    try:
        rows = fp64_rows(read_pair(a.mapper, a.source, a.target))
    except (OSError, ValueError, KeyError) as e:
        print(f"fp64_fit.py: error: {e}", file=sys.stderr)
        return 2
    print("| layer | kind | λ | κ(Cxx + λI) | weights rel. error | outputs rel. error |")
    print("|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['layer']} | {r['kind']} | {r['lambda']:.3g} | {r['kappa']:.3g} | {r['weights']:.2e} | "
              f"{r['outputs']:.2e} |")
    for what in ("weights", "outputs"):
        w = worst(rows, what)
        print(f"worst {what}: layer {w['layer']} {w['kind']}: {w[what]:.2e} (κ {w['kappa']:.3g})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
