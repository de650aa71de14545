"""Reading crosskv artifacts and shards as a user would: numpy + h5py only, through the numpy reference of apply
(tools/crosskv_apply.py), so that one Python reader serves the tools and the checks."""
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "tools"))
from crosskv_apply import read_safetensors, rotate  # noqa: E402


def read_mapper(folder):
    with open(os.path.join(folder, "manifest.json")) as f:
        manifest = json.load(f)
    layers = [read_safetensors(os.path.join(folder, l["file"])) for l in manifest["layers"]]
    return manifest, layers


def strip_rope(keys, positions, spec):
    """keys [T, L, H, D] post-RoPE -> content space (every rope type and convention)."""
    return rotate(keys.astype("float64"), positions, spec, strip=True)
