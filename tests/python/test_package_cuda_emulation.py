"""The crosskv Python package's CUDA path on the host emulation of CUDA: the extension built against the emulated
backend (scripts/setup-python-package.sh puts it in build/python-emulated), on ridge and ridge + MLP mappers, with
numpy arrays and torch CPU tensors, resident and not, from threads; against the same mapper on the CPU. Not covered
here: CUDA tensors (DLPack in place, stream ordering), which need a GPU. Run by tests/python/package_cuda_emulation.sh
(one emulated device: CROSSKV_CUDA_EMULATION_DEVICES=1; crosskv-synth and crosskv-fit in CROSSKV_SYNTH, CROSSKV_FIT).
"""
import gc
import os
import subprocess
import threading

import numpy as np
import pytest
import torch

import crosskv

MAPPERS = ("out-ridge/k2", "out-ridge/kall", "out-mlp/k1")
T = 300


@pytest.fixture(scope="module")
def mappers(tmp_path_factory):
    """Two synthetic pairs fitted: ridge (k = 2, all) and ridge + MLP (k = 1). Entered: the mappers' folder."""
    synth, fit = os.environ.get("CROSSKV_SYNTH"), os.environ.get("CROSSKV_FIT")
    if not (synth and fit):
        pytest.skip("needs CROSSKV_SYNTH and CROSSKV_FIT (tests/python/package_cuda_emulation.sh sets them)")
    work = tmp_path_factory.mktemp("fits")
    os.chdir(work)
    small = ["--source-layers", "4", "--target-layers", "6", "--source-heads", "2", "--target-heads", "2",
             "--source-head-dim", "16", "--target-head-dim", "16", "--source-rotary-dim", "16",
             "--target-rotary-dim", "16", "--source-q-heads", "4", "--target-q-heads", "4"]
    subprocess.run([synth, "--out", "ridge", "--shards", "2", "--sequences", "2", "--seq-len", "128"] + small,
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run([synth, "--out", "mlp", "--relation", "nonlinear", "--shards", "2", "--sequences", "4",
                    "--seq-len", "128", "--seed", "31"] + small, check=True, stdout=subprocess.DEVNULL)
    open("ridge.yaml", "w").write("source: {store: ridge/source}\ntarget: {store: ridge/target}\nfit: {k: [2, all]}\n"
                                  "output: {dir: out-ridge}\n")
    open("mlp.yaml", "w").write("source: {store: mlp/source}\ntarget: {store: mlp/target}\nfit: {k: [1], lambda: "
                                "0.001, mapper: mlp, mlp: {hidden: 32, epochs: 3, batch_tokens: 256, "
                                "val_fraction: 0.25}}\noutput: {dir: out-mlp}\n")
    for cfg in ("ridge.yaml", "mlp.yaml"):
        subprocess.run([fit, cfg], check=True, stdout=subprocess.DEVNULL)
    yield work
    gc.collect()  # every backend gone before the emulation's exit check (device memory never freed fails the process)


@pytest.fixture(scope="module")
def cache():
    rng = np.random.default_rng(5)
    keys = rng.standard_normal((T, 4, 2, 16), dtype=np.float32)
    values = rng.standard_normal((T, 4, 2, 16), dtype=np.float32)
    return keys, values, np.arange(T, dtype=np.int32)


def assert_close(a, b, tol=1e-5):
    d = float(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64)).max() / max(1.0, np.abs(b).max()))
    assert d < tol, f"max relative difference {d:.2e}"


def test_the_emulated_package_has_cuda_compiled_in():
    assert crosskv.cuda_compiled_in


@pytest.mark.parametrize("resident", [True, False])
@pytest.mark.parametrize("mapper", MAPPERS)
def test_the_emulated_gpu_maps_as_the_cpu_does(mappers, cache, mapper, resident):
    keys, values, positions = cache
    ck, cv = crosskv.Mapper(mapper).transfer(keys, values, positions)
    gpu = crosskv.Mapper(mapper, device="cuda", resident=resident)
    gk, gv = gpu.transfer(keys, values, positions)
    assert_close(gk, ck)
    assert_close(gv, cv)
    tk, _ = gpu.transfer(torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(positions))
    assert isinstance(tk, torch.Tensor) and np.array_equal(tk.numpy(), gk), "torch CPU tensors in and out"
    bk, _ = gpu.transfer(keys.reshape(3, 100, 4, 2, 16), values.reshape(3, 100, 4, 2, 16), positions[:100])
    assert bk.shape == (3, 100, 6, 2, 16), "a batch [3, 100, ...] keeps its shape"
    for layers in (0, 5, range(2, 5)):  # layer by layer on the device: those layers of the whole call, bit for bit
        sel = [layers] if isinstance(layers, int) else list(layers)
        lk, lv = gpu.transfer(keys, values, positions, layers=layers)
        assert np.array_equal(lk, gk[:, sel]) and np.array_equal(lv, gv[:, sel]), f"layers={layers!r}"


def test_threads_sharing_one_emulated_gpu_mapper_each_get_their_own_answer(mappers, cache):
    keys, values, positions = cache
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
    assert all(np.array_equal(g, w) for g, w in zip(got, want))


def test_a_device_that_is_not_there_is_refused_by_name(mappers):
    with pytest.raises(crosskv.MapperError, match=r"device: cuda:3: no such CUDA device here \(1 present\)"):
        crosskv.Mapper("out-ridge/k2", device="cuda:3")


def test_a_source_cache_of_the_wrong_shape_is_refused_by_name(mappers, cache):
    keys, values, positions = cache
    gpu = crosskv.Mapper("out-ridge/k2", device="cuda")
    with pytest.raises(crosskv.MapperError, match="keys"):
        gpu.transfer(keys[:, :3], values, positions)
