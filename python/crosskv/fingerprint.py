"""A model's weights fingerprint: which weights made a KV cache. crosskv-capture records it in each shard, crosskv-fit
carries it into the mapper's manifest (for the source and the target), and the vLLM connector writes the source
engine's into every stored chunk and compares it on the target, so that KV of other weights (another model of the
same shape, or a fine-tune deployed under the same path) is never mapped.

It is SHA-256 over each weight file of the model's folder, in name order: its name, its size, a safetensors file's
whole header (names, dtypes, shapes, offsets), and a fixed sample of its bytes (SAMPLES windows of WINDOW bytes,
evenly spaced over the file, the last one ending at its end). Reading about 1 MiB a file, it takes milliseconds,
and any retraining, fine-tune or requantization changes it."""
from __future__ import annotations

import hashlib
import os
import struct
from typing import Optional

SAMPLES, WINDOW = 64, 16384
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")
PREFIX = "sha256:"


def weight_files(model: str) -> list[str]:
    """The model's weight files: a folder's safetensors files (or, where it has none, its other weight files), or
    the file itself (a GGUF). Empty where `model` is no local path (a hub id)."""
    if os.path.isfile(model):
        return [model]
    if not os.path.isdir(model):
        return []
    names = sorted(os.listdir(model))
    safetensors = [n for n in names if n.endswith(".safetensors")]
    chosen = safetensors or [n for n in names if n.endswith(WEIGHT_SUFFIXES) and not n.startswith("training_args")]
    return [os.path.join(model, n) for n in chosen]


def weights_fingerprint(model: str) -> Optional[str]:
    """"sha256:<hex>" of the model's weights (see the module's text); None where it has no local weight files."""
    files = weight_files(model)
    if not files:
        return None
    h = hashlib.sha256()
    for path in files:
        size = os.path.getsize(path)
        h.update(f"{os.path.basename(path)}\0{size}\0".encode())
        with open(path, "rb") as f:
            if path.endswith(".safetensors") and size >= 8:
                (n,) = struct.unpack("<Q", f.read(8))
                h.update(f.read(min(n, size - 8)))
            for i in range(SAMPLES):
                at = max(0, (size - WINDOW) * i // max(1, SAMPLES - 1))
                f.seek(at)
                h.update(f.read(WINDOW))
    return PREFIX + h.hexdigest()
