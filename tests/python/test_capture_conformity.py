"""Conformity with Hugging Face (no downloads): tiny randomly initialised models — Qwen3 (q/k norms), Llama with
llama3 rope scaling, Qwen3 with yarn — are captured with crosskv-capture; crosskv's C++ RoPE strip (crosskv-strip)
must recover the pre-RoPE keys and queries that a hook reads inside the HF attention (fp32: to 1e-5; bf16 shards:
to bf16 precision), and the shard's keys must be the model's own cache.

    python test_capture_conformity.py WORKDIR CROSSKV_STRIP CROSSKV_FIT
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "capture"))
import crosskv_capture as cap  # noqa: E402
sys.path.insert(0, HERE)
from tiny_hf import byte_tokenizer  # noqa: E402

work, strip_bin, fit_bin = sys.argv[1], sys.argv[2], sys.argv[3]
os.makedirs(work, exist_ok=True)
os.chdir(work)


COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
MODELS = {
    "qwen3": (Qwen3ForCausalLM, Qwen3Config(**COMMON, rope_theta=1e6)),
    "llama3": (LlamaForCausalLM, LlamaConfig(**COMMON, rope_theta=5e5, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32})),
    "qwen3-yarn": (Qwen3ForCausalLM, Qwen3Config(**COMMON, rope_theta=1e6, rope_scaling={
        "rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64})),
}
with open("text.txt", "w") as f:
    f.write(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


for name, (cls, cfg) in MODELS.items():
    torch.manual_seed(1)
    model = cls(cfg).eval()
    path = f"model-{name}"
    model.save_pretrained(path)
    byte_tokenizer().save_pretrained(path)
    for dtype, stride in (("fp32", 1), ("bf16", 2)):
        out = f"store-{name}-{dtype}/web"
        rc = cap.main(["--model", path, "--text", "text.txt", "--seq-len", "96", "--n-seq", "3", "--stride",
                       str(stride), "--dtype", dtype, "--out", out, "--queries", "--batch", "2"])
        check(rc == 0, f"{name} {dtype}: capture")
        shard = f"{out}/shard-000.h5"
        before = os.stat(shard).st_mtime_ns
        rc = cap.main(["--model", path, "--text", "text.txt", "--seq-len", "96", "--n-seq", "3", "--stride",
                       str(stride), "--dtype", dtype, "--out", out, "--queries", "--batch", "2"])
        check(rc == 0 and os.stat(shard).st_mtime_ns == before, f"{name} {dtype}: a rerun keeps complete shards")
        subprocess.run([strip_bin, "--shard", shard, "--out", f"strip-{name}-{dtype}.h5"], check=True)
        with h5py.File(shard, "r") as f, h5py.File(f"strip-{name}-{dtype}.h5", "r") as s:
            spec = json.loads(f.attrs["kv_spec"])
            ids = f["token_ids"][()]
            pos = f["positions"][()]
            content_k, content_q = s["content_keys"][()], s["content_queries"][()]
            raw = f["keys"][()]
            checksummed = all(f[d].fletcher32 for d in ("keys", "values", "queries", "token_ids", "positions"))
            if f["keys"].attrs.get("dtype") == "bfloat16":
                raw = (raw.astype(np.uint32) << 16).view(np.float32)
        # The hook inside HF attention, on the same tokens (full sequences; the shard keeps every stride-th).
        seqs = cap.pack(byte_tokenizer(), cap.read_documents("text.txt"), 96, 3)
        _, _, _, calls = cap.capture_sequences(model, seqs, True, 1, "cpu", keep_calls=True)
        keep = np.arange(0, 96, stride)
        check(checksummed, f"{name} {dtype}: every dataset carries a Fletcher-32 checksum")
        check(np.array_equal(seqs[:, keep].reshape(-1), ids), f"{name} {dtype}: token_ids as packed")
        check(np.array_equal(np.tile(keep, 3), pos), f"{name} {dtype}: positions are the kept tokens' own")
        k_pre = torch.stack([c[1] for c in calls], 2).permute(0, 3, 2, 1, 4)[:, keep].reshape(content_k.shape)
        q_pre = torch.stack([c[0] for c in calls], 2).permute(0, 3, 2, 1, 4)[:, keep].reshape(content_q.shape)
        k_post = torch.stack([c[3] for c in calls], 2).permute(0, 3, 2, 1, 4)[:, keep].reshape(raw.shape)
        k_pre, q_pre, k_post = k_pre.double().numpy(), q_pre.double().numpy(), k_post.double().numpy()
        scale = np.abs(k_pre).max()
        tol = 2e-5 if dtype == "fp32" else 2 ** -7
        dk = np.abs(content_k - k_pre).max() / scale
        dq = np.abs(content_q - q_pre).max() / np.abs(q_pre).max()
        dc = np.abs(raw - k_post).max() / np.abs(k_post).max()
        check(dc <= tol, f"{name} {dtype}: stored keys are the model's post-RoPE cache (rel. diff {dc:.1e})")
        check(dk <= tol, f"{name} {dtype}: C++ strip recovers HF's pre-RoPE keys (rel. diff {dk:.1e} <= {tol:.0e})")
        check(dq <= tol, f"{name} {dtype}: C++ strip recovers HF's pre-RoPE queries (rel. diff {dq:.1e})")
    if name == "llama3":
        r = spec["rope"]
        check(r["type"] == "llama3" and r["factor"] == 8.0 and r["original_max_position_embeddings"] == 32.0,
              "llama3: kv_spec carries the rope scaling")
    if name == "qwen3-yarn":
        # transformers uses max_position_embeddings / original_max_position_embeddings as the factor (1024 / 64).
        check(spec["rope"]["type"] == "yarn" and spec["rope"]["factor"] == 16.0,
              f"yarn: kv_spec carries the factor transformers uses ({spec['rope']['factor']})")

# The fit reads captured shards: two captures of one model as source and target.
with open("fit.yaml", "w") as f:
    f.write("source: {store: store-qwen3-fp32}\ntarget: {store: store-llama3-fp32}\nfit: {k: [1]}\n"
            "output: {dir: out}\n")
r = subprocess.run([fit_bin, "fit.yaml"], capture_output=True, text=True)
check(r.returncode == 0 and os.path.exists("out/k1/manifest.json"), "crosskv-fit reads captured shards: " +
      (r.stderr.strip().splitlines() or ["ok"])[-1])

# --attention-weights (docs/FORMATS.md): w_j = mean over layers, query heads and queries i >= j of P[i, j], normalised
# to mean 1 per sequence over the kept positions; checked against HF's own output_attentions, computed here
# independently, and read by the fit with fit.weighting: dataset.
for stride in (1, 3):
    out = f"store-aw{stride}/web"
    rc = cap.main(["--model", "model-qwen3", "--text", "text.txt", "--seq-len", "96", "--n-seq", "3", "--stride",
                   str(stride), "--dtype", "fp32", "--out", out, "--attention-weights", "--batch", "2"])
    check(rc == 0, f"--attention-weights, stride {stride}: capture")
    with h5py.File(f"{out}/shard-000.h5", "r") as f, h5py.File("store-qwen3-fp32/web/shard-000.h5", "r") as g:
        w = f["weights"][()]
        same_kv = stride > 1 or np.abs(f["keys"][()] - g["keys"][()]).max() <= 1e-5 * np.abs(g["keys"][()]).max()
        check(f["weights"].dtype == np.float32 and f["weights"].fletcher32 and w.shape == f["token_ids"].shape,
              f"stride {stride}: 'weights' is float32 [T], checksummed")
    check(same_kv, "the eager attention's keys are the default attention's (fp32)")
    eager = Qwen3ForCausalLM.from_pretrained("model-qwen3", attn_implementation="eager").eval()
    seqs = cap.pack(byte_tokenizer(), cap.read_documents("text.txt"), 96, 3)
    with torch.no_grad():
        att = eager(torch.as_tensor(seqs), output_attentions=True).attentions  # per layer [B, Hq, S, S]
    P = torch.stack(att).double().mean(dim=(0, 2))  # [B, S, S]: mean over layers and heads
    S = P.shape[-1]
    want = (P.sum(1) / torch.arange(S, 0, -1, dtype=torch.float64))[:, ::stride]  # mean over queries i >= j
    want = (want / want.mean(1, keepdim=True)).reshape(-1).numpy()
    d = np.abs(w - want).max()
    check(d < 1e-5, f"stride {stride}: the weights are HF's attention mass as docs/FORMATS.md defines it "
                    f"(max diff {d:.1e})")
    check(np.allclose(w.reshape(3, -1).mean(1), 1.0, atol=1e-5), f"stride {stride}: mean 1 in every sequence")
if os.path.isdir("store-aw1"):
    with open("fit-aw.yaml", "w") as f:
        f.write("source: {store: store-qwen3-fp32}\ntarget: {store: store-aw1}\n"
                "fit: {k: [1], weighting: dataset}\noutput: {dir: out-aw}\n")
    r = subprocess.run([fit_bin, "fit-aw.yaml"], capture_output=True, text=True)
    m = json.load(open("out-aw/k1/manifest.json")) if r.returncode == 0 else {}
    check(m.get("calibration", {}).get("token_weighting") == "dataset",
          "crosskv-fit fits with the captured attention weights: " + (r.stderr.strip().splitlines() or ["ok"])[-1])

# Refusals, before any work, one line each.
torch.manual_seed(1)
Qwen3ForCausalLM(Qwen3Config(**COMMON)).save_pretrained("model-other-tok")
byte_tokenizer(reverse=True).save_pretrained("model-other-tok")
rc = cap.main(["--model", "model-other-tok", "--text", "text.txt", "--seq-len", "96", "--n-seq", "3", "--out",
               "store-x/web", "--same-tokens-as", "model-qwen3"])
check(rc == 2 and not os.path.exists("store-x/web/shard-000.h5"), "different tokenizers are refused before any work")
rc = cap.main(["--model", "model-qwen3", "--text", "text.txt", "--seq-len", "96", "--n-seq", "3", "--out",
               "store-y/web", "--same-tokens-as", "store-qwen3-fp32/web"])
check(rc == 0, "the same tokenizer as an existing store's shards passes the check")
dyn = Qwen3Config(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
try:
    cap.kv_spec_from_config(dyn, "model-dyn")
    check(False, "dynamic rope scaling is refused")
except cap.CaptureError as e:
    check("dynamic" in str(e), f"dynamic rope scaling is refused: {e}")
if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("capture conformity OK")
