"""Consumer check: re-write the calibration shards with h5py (as a user's capture script would), fit them
with crosskv-fit, then read the artifact with numpy and reproduce every layer's W and b from the shards. Plain numpy
and h5py, no crosskv package. Run by tests/python/consumer_check.sh (crosskv-fit and crosskv-synth in CROSSKV_FIT,
CROSSKV_SYNTH)."""
import glob
import json
import os
import subprocess

import h5py
import numpy as np
import pytest

from crosskv_read import read_mapper, strip_rope

LAMBDA = 0.01


@pytest.fixture(scope="module")
def fitted(tmp_path_factory):
    """Shards written by h5py (variable-length string attributes, bf16 stored as uint16 + a dtype attribute) and
    crosskv-fit's mapper of them (k = 2). Entered: the folder."""
    fit_bin, synth_bin = os.environ.get("CROSSKV_FIT"), os.environ.get("CROSSKV_SYNTH")
    if not (fit_bin and synth_bin):
        pytest.skip("needs CROSSKV_FIT and CROSSKV_SYNTH (tests/python/consumer_check.sh sets them)")
    os.chdir(tmp_path_factory.mktemp("consumer"))
    subprocess.run([synth_bin, "--out", "native", "--shards", "2", "--sequences", "3", "--seq-len", "128",
                "--source-layers", "5", "--source-heads", "2", "--source-head-dim", "16",
                "--target-layers", "6", "--target-heads", "2", "--target-head-dim", "16"],
                   check=True, stdout=subprocess.DEVNULL)
    for path in sorted(glob.glob("native/*/*/*.h5")):
        out = path.replace("native/", "h5py/", 1)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with h5py.File(path, "r") as src, h5py.File(out, "w") as dst:
            for a in ("crosskv_format", "model", "domain", "kv_spec"):
                v = src.attrs[a]
                dst.attrs[a] = v.decode() if isinstance(v, bytes) else str(v)
            dst.attrs["crosskv_format_version"] = 1
            for d in ("token_ids", "positions", "seq_offsets"):
                dst[d] = src[d][...]
            for d in ("keys", "values"):
                x = src[d][...].astype(np.float32)
                bf = ((x.view(np.uint32) + 0x7FFF + ((x.view(np.uint32) >> 16) & 1)) >> 16).astype(np.uint16)
                dst.create_dataset(d, data=bf, chunks=(64,) + x.shape[1:])
                dst[d].attrs["dtype"] = "bfloat16"
    with open("fit.yaml", "w") as f:
        f.write(f"source: {{store: h5py/source}}\ntarget: {{store: h5py/target}}\n"
                f"fit: {{k: [2], lambda: {LAMBDA}}}\noutput: {{dir: out}}\nruntime: {{block_tokens: 100}}\n")
    subprocess.run([fit_bin, "fit.yaml"], check=True, stdout=subprocess.DEVNULL)
    return read_mapper("out/k2")


def test_numpy_reads_the_manifest(fitted):
    manifest, _ = fitted
    assert manifest["format"] == "crosskv-mapper" and manifest["fit"]["k"] == 2


def load(side):
    keys, values = [], []
    for path in sorted(glob.glob(f"h5py/{side}/*/*.h5")):
        with h5py.File(path, "r") as f:
            spec = json.loads(f.attrs["kv_spec"])
            k = (f["keys"][...].astype(np.uint32) << 16).view(np.float32)
            v = (f["values"][...].astype(np.uint32) << 16).view(np.float32)
            p = f["positions"][...]
        keys.append(strip_rope(k, p, spec))
        values.append(v.astype(np.float64))
    k, v = np.concatenate(keys), np.concatenate(values)
    return k.reshape(k.shape[0], k.shape[1], -1), v.reshape(v.shape[0], v.shape[1], -1)


@pytest.mark.parametrize("kind", ["k", "v"])
def test_numpy_reproduces_every_layers_weights_and_bias_from_the_shards(fitted, kind):
    """The centred ridge in numpy (fp64) on the shards' bf16 values, RoPE stripped from keys."""
    manifest, layers = fitted
    (sk, sv), (tk, tv) = load("source"), load("target")
    xs, ys = (sk, tk) if kind == "k" else (sv, tv)
    worst = 0.0
    for entry, tensors in zip(manifest["layers"], layers):
        l, sel = entry["target_layer"], entry["source_layers"]
        X = np.concatenate([xs[:, a, :] for a in sel], axis=1)
        Y = ys[:, l, :]
        xm, ym = X.mean(0), Y.mean(0)
        Xc, Yc = X - xm, Y - ym
        n = X.shape[0]
        W = np.linalg.solve(Xc.T @ Xc / n + LAMBDA * np.eye(X.shape[1]), Xc.T @ Yc / n)
        b = ym - xm @ W
        for got, want in ((tensors[f"{kind}.weight"], W), (tensors[f"{kind}.bias"], b)):
            worst = max(worst, float(np.abs(got - want).max() / max(1.0, np.abs(want).max())))
    assert worst < 2e-3, f"max relative error {worst:.2e} over {len(layers)} layers"
