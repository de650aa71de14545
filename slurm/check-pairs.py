"""Decides success from the artifacts, not from Slurm's job state: for every pair config listed (one path per line),
every k of its fit.k has k<K>/manifest.json, and every layer file matches its SHA-256.
Usage: python3 slurm/check-pairs.py PAIRS.txt      Exit 0 when all are complete, 1 otherwise."""
import hashlib
import json
import os
import sys

import yaml


def check(cfg_path):
    cfg = yaml.safe_load(open(cfg_path))
    out = cfg["output"]["dir"]
    if not os.path.isabs(out):
        out = os.path.join(os.path.dirname(os.path.abspath(cfg_path)), out)
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


bad = 0
for line in open(sys.argv[1]):
    cfg = line.strip()
    if not cfg:
        continue
    try:
        problem = check(cfg)
    except Exception as e:  # unreadable config or manifest
        problem = f"{type(e).__name__}: {e}"
    print(f"INCOMPLETE {cfg}: {problem}" if problem else f"OK {cfg}")
    bad |= problem is not None
sys.exit(1 if bad else 0)
