"""The vLLM test's family, in the capture environment: tiny random Qwen3 models (2 and 3 layers, 2 and 4 KV heads,
so that tensor parallelism 2 splits each into real ranges; head dim 32, the smallest vLLM's CPU attention takes) with a byte-level tokenizer, captured with crosskv-capture, fitted with
crosskv-fit (out/kall), a copy of that mapper with noise weights (out-noise/kall) and one whose held-out verdict is
NOT READY (out-notready/kall).

    python vllm_family.py WORKDIR CROSSKV_FIT
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import torch
from safetensors.numpy import load_file, save_file
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crosskv import capture as cap  # noqa: E402
from tiny_hf import byte_tokenizer  # noqa: E402

work, fit = sys.argv[1:3]
os.chdir(work)
COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=128, head_dim=32, max_position_embeddings=4096,
              rope_theta=1e6)
for name, layers, kv_heads in (("source", 2, 2), ("target", 3, 4)):
    torch.manual_seed({"source": 1, "target": 2}[name])
    Qwen3ForCausalLM(Qwen3Config(**COMMON, num_hidden_layers=layers, num_attention_heads=2 * kv_heads,
                                 num_key_value_heads=kv_heads)).eval().save_pretrained(f"model-{name}")
    byte_tokenizer().save_pretrained(f"model-{name}")
with open("text.txt", "w") as f:
    f.write(" ".join(f"turn {i}: the quick brown fox jumps over the lazy dog." for i in range(600)))
for name in ("source", "target"):
    assert cap.main(["--model", f"model-{name}", "--text", "text.txt", "--seq-len", "128", "--n-seq", "32",
                     "--out", f"kv-{name}/web"]) == 0, f"capture of {name}"
with open("fit.yaml", "w") as f:
    f.write("source: {store: kv-source}\ntarget: {store: kv-target}\nfit: {k: [all], probe: all_heads}\noutput: {dir: out}\n")
subprocess.run([fit, "fit.yaml"], check=True, capture_output=True)

# The control: the same mapper with noise weights (and the manifest's SHA-256s to match).
rng = np.random.default_rng(3)
shutil.rmtree("out-noise", ignore_errors=True)
shutil.copytree("out/kall", "out-noise/kall")
manifest = json.load(open("out-noise/kall/manifest.json"))
for layer in manifest["layers"]:
    path = os.path.join("out-noise/kall", layer["file"])
    t = load_file(path)
    save_file({k: (rng.standard_normal(v.shape) * v.std()).astype(v.dtype) for k, v in t.items()}, path)
    layer["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
json.dump(manifest, open("out-noise/kall/manifest.json", "w"), indent=2)

# A mapper whose held-out evaluation said NOT READY (eval-<k>.json beside it, as crosskv-fit writes it).
shutil.rmtree("out-notready", ignore_errors=True)
shutil.copytree("out/kall", "out-notready/kall")
json.dump({"verdict": "NOT READY: predicted recovered share 41.0% (24% to 59%; needs >= 80%: attention_cosine >= "
                      "0.853); attention-output cosine 0.668 (needs above the mean-only 0.388); held-out R2 k 0.610, "
                      "v 0.640 (needs >= 0.00)",
           "predicted_retention": {"share": 0.41, "low": 0.24, "high": 0.59, "min_retention": 0.8},
           "ok": False}, open("out-notready/eval-kall.json", "w"))
print("family ready: model-source, model-target, out/kall, out-noise/kall, out-notready/kall")
