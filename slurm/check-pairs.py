"""Decides success from the files, not from Slurm's job state, for every pair config listed (one per line; the
first word of a line, so a CAPTURES.txt of submit-pairs.sh works too):
- by default, the fit: every k of its fit.k has k<K>/manifest.json, and every layer file matches its SHA-256;
- with --stores, the captures: the source and target stores hold the same shards (by relative path), each pair with
  the same token_ids and positions, at least one.
Usage: python3 slurm/check-pairs.py [--stores] PAIRS.txt      Exit 0 when all are complete, 1 otherwise."""
import hashlib
import json
import os
import sys

import yaml


def resolve(cfg_path, path):
    return path if os.path.isabs(path) else os.path.join(os.path.dirname(os.path.abspath(cfg_path)), path)


def check_fit(cfg_path):
    cfg = yaml.safe_load(open(cfg_path))
    out = resolve(cfg_path, cfg["output"]["dir"])
    ks = (cfg.get("fit") or {}).get("k", [1, 2, 4, 8, "all"])
    for k in ks if isinstance(ks, list) else [ks]:
        folder = os.path.join(out, f"k{k}")
        manifest = os.path.join(folder, "manifest.json")
        if not os.path.isfile(manifest):
            return f"no manifest in {folder}"
        for layer in json.load(open(manifest))["layers"]:
            with open(os.path.join(folder, layer["file"]), "rb") as f:
                if hashlib.sha256(f.read()).hexdigest() != layer["sha256"]:
                    return f"{folder}/{layer['file']} does not verify"
    return None


def shards(store):
    return sorted(os.path.relpath(os.path.join(d, f), store) for d, _, fs in os.walk(store) for f in fs
                  if f.endswith(".h5"))


def check_stores(cfg_path):
    import h5py
    import numpy as np

    cfg = yaml.safe_load(open(cfg_path))
    src, tgt = (resolve(cfg_path, cfg[side]["store"]) for side in ("source", "target"))
    a, b = shards(src), shards(tgt)
    if not a:
        return f"no shards in {src}"
    if a != b:
        only = sorted(set(a) ^ set(b))
        return f"the stores do not pair up: {only[0]} is in {src if only[0] in a else tgt} only ({len(only)} unpaired)"
    for rel in a:
        with h5py.File(os.path.join(src, rel), "r") as x, h5py.File(os.path.join(tgt, rel), "r") as y:
            for d in ("token_ids", "positions"):
                if not np.array_equal(x[d][()], y[d][()]):
                    return f"{rel}: the source's and the target's {d} differ"
    return None


args = sys.argv[1:]
stores = "--stores" in args
args = [a for a in args if a != "--stores"]
if len(args) != 1:
    sys.exit("usage: check-pairs.py [--stores] PAIRS.txt")
bad = 0
for line in open(args[0]):
    words = line.split()
    if not words:
        continue
    cfg = words[0]
    try:
        problem = check_stores(cfg) if stores else check_fit(cfg)
    except Exception as e:  # unreadable config, manifest or shard
        problem = f"{type(e).__name__}: {e}"
    print(f"INCOMPLETE {cfg}: {problem}" if problem else f"OK {cfg}")
    bad |= problem is not None
sys.exit(1 if bad else 0)
