"""The paper's way in plain numpy, as the baseline for bench/run_bench.sh: load the shards, strip RoPE, probe,
then for every k and every target layer a separate ridge fit (Gram of the selected layers, solve).
Usage: numpy_baseline.py SOURCE_STORE TARGET_STORE KS LAMBDA   (KS like 1,2,4,8,all). Prints one JSON line."""
import glob
import json
import sys
import time

import h5py
import numpy as np

sys.path.insert(0, __file__.rsplit("/", 2)[0] + "/tests/python")
from crosskv_read import strip_rope  # noqa: E402

t0 = time.time()
src_store, tgt_store, ks, lam = sys.argv[1], sys.argv[2], sys.argv[3].split(","), float(sys.argv[4])


def load(store):
    keys, values = [], []
    for path in sorted(glob.glob(f"{store}/*/*.h5")):
        with h5py.File(path, "r") as f:
            spec = json.loads(f.attrs["kv_spec"])
            k, v = f["keys"][...], f["values"][...]
            if f["keys"].attrs.get("dtype") == "bfloat16":
                k = (k.astype(np.uint32) << 16).view(np.float32)
                v = (v.astype(np.uint32) << 16).view(np.float32)
            keys.append(strip_rope(k, f["positions"][...], spec).astype(np.float32))
            values.append(v.astype(np.float32))
    k, v = np.concatenate(keys), np.concatenate(values)
    return spec, k.reshape(k.shape[0], k.shape[1], -1), v.reshape(v.shape[0], v.shape[1], -1)


sspec, sk, sv = load(src_store)
tspec, tk, tv = load(tgt_store)
t_load = time.time() - t0
N, Ls, F = sk.shape
Lt, G, H = tk.shape[1], tk.shape[2], tspec["n_kv_heads"]
Ds, Dt = F // H, G // H


def ridge(X, Y):
    xm, ym = X.mean(0), Y.mean(0)
    Xc, Yc = X - xm, Y - ym
    A = (Xc.T @ Xc).astype(np.float64) / len(X) + lam * np.eye(X.shape[1])
    W = np.linalg.solve(A, (Xc.T @ Yc).astype(np.float64) / len(X))
    return W, ym - xm @ W


def r2(X, Y, W, b):
    P = X @ W + b
    return 1 - ((Y - P) ** 2).sum() / ((Y - Y.mean(0)) ** 2).sum()


# Probe (Eq. 2): single-source, same-head fits.
t1 = time.time()
score = np.zeros((Ls, Lt))
for xs, ys in ((sk, tk), (sv, tv)):
    for a in range(Ls):
        for l in range(Lt):
            s = 0
            for h in range(H):
                X, Y = xs[:, a, h * Ds:(h + 1) * Ds], ys[:, l, h * Dt:(h + 1) * Dt]
                W, b = ridge(X, Y)
                s += r2(X, Y, W, b)
            score[a, l] += s / H / 2
t_probe = time.time() - t1

t2 = time.time()
for k in ks:
    kk = Ls if k == "all" else int(k)
    for l in range(Lt):
        sel = sorted(np.argsort(-score[:, l], kind="stable")[:kk])
        for xs, ys in ((sk, tk), (sv, tv)):
            X = np.concatenate([xs[:, a, :] for a in sel], axis=1)
            W, b = ridge(X, ys[:, l, :])
t_fit = time.time() - t2
print(json.dumps({"load_s": round(t_load, 2), "probe_s": round(t_probe, 2), "fit_s": round(t_fit, 2),
                  "total_s": round(time.time() - t0, 2), "tokens": int(N)}))
