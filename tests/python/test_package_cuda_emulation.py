"""The crosskv Python package's CUDA path on the host emulation of CUDA: the extension built against the emulated
backend (scripts/setup-python-package.sh puts it in build/python-emulated), on ridge and ridge + MLP mappers, with
numpy arrays and torch CPU tensors, resident and not, from threads; against the same mapper on the CPU. Not covered
here: CUDA tensors (DLPack in place, stream ordering), which need a GPU.

    python test_package_cuda_emulation.py WORKDIR CROSSKV_SYNTH CROSSKV_FIT
"""
import gc
import os
import subprocess
import sys
import threading

import numpy as np
import torch

import crosskv

work, synth, fit = sys.argv[1:4]
os.makedirs(work, exist_ok=True)
os.chdir(work)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


small = ["--source-layers", "4", "--target-layers", "6", "--source-heads", "2", "--target-heads", "2",
         "--source-head-dim", "16", "--target-head-dim", "16", "--source-rotary-dim", "16", "--target-rotary-dim", "16",
         "--source-q-heads", "4", "--target-q-heads", "4"]
subprocess.run([synth, "--out", "ridge", "--shards", "2", "--sequences", "2", "--seq-len", "128"] + small, check=True,
               stdout=subprocess.DEVNULL)
subprocess.run([synth, "--out", "mlp", "--relation", "nonlinear", "--shards", "2", "--sequences", "4", "--seq-len", "128",
                "--seed", "31"] + small, check=True, stdout=subprocess.DEVNULL)
with open("ridge.yaml", "w") as f:
    f.write("source: {store: ridge/source}\ntarget: {store: ridge/target}\nfit: {k: [2, all]}\noutput: {dir: out-ridge}\n")
with open("mlp.yaml", "w") as f:
    f.write("source: {store: mlp/source}\ntarget: {store: mlp/target}\nfit: {k: [1], lambda: 0.001, mapper: mlp, "
            "mlp: {hidden: 32, epochs: 3, batch_tokens: 256, val_fraction: 0.25}}\noutput: {dir: out-mlp}\n")
for cfg in ("ridge.yaml", "mlp.yaml"):
    subprocess.run([fit, cfg], check=True, stdout=subprocess.DEVNULL)

check(crosskv.cuda_compiled_in, "the emulated package has CUDA compiled in")
rng = np.random.default_rng(5)
T = 300
keys = rng.standard_normal((T, 4, 2, 16), dtype=np.float32)
values = rng.standard_normal((T, 4, 2, 16), dtype=np.float32)
positions = np.arange(T, dtype=np.int32)


def close(a, b, what, tol=1e-5):
    d = float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / max(1.0, np.abs(b).max()))
    check(d < tol, f"{what}: max relative difference {d:.2e}")


for mapper in ("out-ridge/k2", "out-ridge/kall", "out-mlp/k1"):
    cpu = crosskv.Mapper(mapper)
    ck, cv = cpu.transfer(keys, values, positions)
    for resident in (True, False):
        gpu = crosskv.Mapper(mapper, device="cuda", resident=resident)
        gk, gv = gpu.transfer(keys, values, positions)
        close(gk, ck, f"{mapper} on the emulated GPU (resident={resident}), keys")
        close(gv, cv, f"{mapper} on the emulated GPU (resident={resident}), values")
        tk, tv = gpu.transfer(torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(positions))
        check(isinstance(tk, torch.Tensor) and np.array_equal(tk.numpy(), gk), f"{mapper}: torch CPU tensors in and out")
        bk, bv = gpu.transfer(keys.reshape(3, 100, 4, 2, 16), values.reshape(3, 100, 4, 2, 16), positions[:100])
        check(bk.shape == (3, 100, 6, 2, 16), f"{mapper}: a batch [3, 100, ...] keeps its shape")
        for layers in (0, 5, range(2, 5)):  # layer by layer on the device: those layers of the whole call
            sel = [layers] if isinstance(layers, int) else list(layers)
            lk, lv = gpu.transfer(keys, values, positions, layers=layers)
            check(np.array_equal(lk, gk[:, sel]) and np.array_equal(lv, gv[:, sel]),
                  f"{mapper} (resident={resident}): layers={layers!r}, the same bits as the whole call")
        del gpu
    del cpu

# One mapper on the emulated GPU shared by threads: their calls take turns and each gets its own answer.
gpu = crosskv.Mapper("out-ridge/k2", device="cuda")
want = [gpu.transfer(keys[: 50 + 10 * i], values[: 50 + 10 * i], positions[: 50 + 10 * i])[0] for i in range(4)]
got = [None] * 4


def worker(i):
    for _ in range(5):
        got[i] = gpu.transfer(keys[: 50 + 10 * i], values[: 50 + 10 * i], positions[: 50 + 10 * i])[0]


threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
check(all(np.array_equal(g, w) for g, w in zip(got, want)), "4 threads on one emulated-GPU mapper get their own answers")

# Refusals by name: a device that is not there (CROSSKV_CUDA_EMULATION_DEVICES=1), bad input on a GPU mapper.
try:
    crosskv.Mapper("out-ridge/k2", device="cuda:3")
    check(False, "cuda:3 with one emulated device is refused")
except crosskv.MapperError as e:
    check("device: cuda:3: no such CUDA device here (1 present)" in str(e), f"cuda:3 refused by name: {e}")
try:
    gpu.transfer(keys[:, :3], values, positions)
    check(False, "a source cache of the wrong shape is refused")
except crosskv.MapperError as e:
    check("keys" in str(e), f"wrong shape refused by name: {e}")
del gpu
gc.collect()  # every backend gone before the emulation's exit check (device memory never freed fails the process)
print(f"{len(failures)} failed" if failures else "package on the emulated GPU: ok")
sys.exit(1 if failures else 0)
