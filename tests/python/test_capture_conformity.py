"""Conformity with Hugging Face under pytest (no downloads): tiny randomly initialised models — Qwen3 (q/k norms),
Llama with llama3 rope scaling, Qwen3 with yarn — are captured with crosskv-capture; crosskv's C++ RoPE strip
(crosskv-strip) must recover the pre-RoPE keys and queries that a hook reads inside the HF attention (fp32: to 1e-5;
bf16 shards: to bf16 precision), and the shard's keys must be the model's own cache. Then --attention-weights against
HF's own attentions, the fit reading captured shards, and the refusals.

    CROSSKV_STRIP=build/crosskv-strip CROSSKV_FIT=build/crosskv-fit \\
        .venv-capture/bin/python -m pytest tests/python/test_capture_conformity.py [-k llama3]
"""
import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
from crosskv import capture as cap  # noqa: E402
from tiny_hf import byte_tokenizer  # noqa: E402

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
STRIDE = {"fp32": 1, "bf16": 2}


def binary(name):
    path = os.environ.get(name)
    if not path:
        pytest.skip(f"{name} is not set (the test needs crosskv's programs)")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = tmp_path_factory.mktemp("conformity")
    (w / "text.txt").write_text(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(400)))
    return w


class Captures:
    """The models saved once, each (model, dtype) captured once, on demand."""

    def __init__(self, work):
        self.work, self.models, self.stores = work, {}, {}

    def model(self, name):
        if name not in self.models:
            cls, cfg = MODELS[name]
            torch.manual_seed(1)
            m = cls(cfg).eval()
            path = str(self.work / f"model-{name}")
            m.save_pretrained(path)
            byte_tokenizer().save_pretrained(path)
            self.models[name] = (m, path)
        return self.models[name]

    def args(self, path, dtype, out, *extra):
        return ["--model", path, "--text", str(self.work / "text.txt"), "--seq-len", "96", "--n-seq", "3", "--stride",
                str(STRIDE[dtype]), "--dtype", dtype, "--out", str(out), "--batch", "2", *extra]

    def store(self, name, dtype):
        """The store of (name, dtype) with queries; its shard."""
        if (name, dtype) not in self.stores:
            _, path = self.model(name)
            out = self.work / f"store-{name}-{dtype}" / "web"
            assert cap.main(self.args(path, dtype, out, "--queries")) == 0
            self.stores[(name, dtype)] = out / "shard-000.h5"
        return self.stores[(name, dtype)]


@pytest.fixture(scope="module")
def captures(work):
    return Captures(work)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(MODELS))
def test_the_shard_is_the_models_own_cache_and_the_strip_hfs(captures, work, name, dtype):
    strip = binary("CROSSKV_STRIP")
    model, path = captures.model(name)
    shard = captures.store(name, dtype)
    before = os.stat(shard).st_mtime_ns
    assert cap.main(captures.args(path, dtype, shard.parent, "--queries")) == 0
    assert os.stat(shard).st_mtime_ns == before, "a rerun keeps complete shards"
    stripped = work / f"strip-{name}-{dtype}.h5"
    subprocess.run([strip, "--shard", str(shard), "--out", str(stripped)], check=True, capture_output=True)
    with h5py.File(shard, "r") as f, h5py.File(stripped, "r") as s:
        ids, pos = f["token_ids"][()], f["positions"][()]
        content_k, content_q = s["content_keys"][()], s["content_queries"][()]
        raw = f["keys"][()]
        assert all(f[d].fletcher32 for d in ("keys", "values", "queries", "token_ids", "positions"))
        if f["keys"].attrs.get("dtype") == "bfloat16":
            raw = (raw.astype(np.uint32) << 16).view(np.float32)
    # The hook inside HF attention, on the same tokens (full sequences; the shard keeps every stride-th).
    seqs = cap.pack(byte_tokenizer(), cap.read_documents(str(work / "text.txt")), 96, 3)
    _, _, _, calls = cap.capture_sequences(model, seqs, True, 1, "cpu", keep_calls=True)
    keep = np.arange(0, 96, STRIDE[dtype])
    assert np.array_equal(seqs[:, keep].reshape(-1), ids), "token_ids as packed"
    assert np.array_equal(np.tile(keep, 3), pos), "positions are the kept tokens' own"
    k_pre = torch.stack([c[1] for c in calls], 2).permute(0, 3, 2, 1, 4)[:, keep].reshape(content_k.shape)
    q_pre = torch.stack([c[0] for c in calls], 2).permute(0, 3, 2, 1, 4)[:, keep].reshape(content_q.shape)
    k_post = torch.stack([c[3] for c in calls], 2).permute(0, 3, 2, 1, 4)[:, keep].reshape(raw.shape)
    k_pre, q_pre, k_post = k_pre.double().numpy(), q_pre.double().numpy(), k_post.double().numpy()
    tol = 2e-5 if dtype == "fp32" else 2 ** -7
    assert np.abs(raw - k_post).max() / np.abs(k_post).max() <= tol, "stored keys are the model's post-RoPE cache"
    assert np.abs(content_k - k_pre).max() / np.abs(k_pre).max() <= tol, "the C++ strip recovers HF's pre-RoPE keys"
    assert np.abs(content_q - q_pre).max() / np.abs(q_pre).max() <= tol, "the C++ strip recovers HF's pre-RoPE queries"


def spec_of(shard):
    with h5py.File(shard, "r") as f:
        return json.loads(f.attrs["kv_spec"])


def test_llama3_scaling_is_in_the_kv_spec(captures):
    r = spec_of(captures.store("llama3", "fp32"))["rope"]
    assert r["type"] == "llama3" and r["factor"] == 8.0 and r["original_max_position_embeddings"] == 32.0


def test_yarn_carries_the_factor_transformers_uses(captures):
    # transformers uses max_position_embeddings / original_max_position_embeddings as the factor (1024 / 64).
    r = spec_of(captures.store("qwen3-yarn", "fp32"))["rope"]
    assert r["type"] == "yarn" and r["factor"] == 16.0


def test_the_fit_reads_captured_shards(captures, work):
    fit = binary("CROSSKV_FIT")
    src, tgt = captures.store("qwen3", "fp32").parent.parent, captures.store("llama3", "fp32").parent.parent
    (work / "fit.yaml").write_text(f"source: {{store: {src}}}\ntarget: {{store: {tgt}}}\nfit: {{k: [1]}}\n"
                                   f"output: {{dir: {work / 'out'}}}\n")
    r = subprocess.run([fit, str(work / "fit.yaml")], capture_output=True, text=True)
    assert r.returncode == 0 and (work / "out" / "k1" / "manifest.json").exists(), r.stderr[-2000:]


@pytest.mark.parametrize("stride", [1, 3])
def test_attention_weights_are_hfs_attention_mass(captures, work, stride):
    """w_j = mean over layers, query heads and queries i >= j of P[i, j], normalised to mean 1 per sequence over the
    kept positions (docs/FORMATS.md), against HF's own output_attentions."""
    _, path = captures.model("qwen3")
    out = work / f"store-aw{stride}" / "web"
    assert cap.main(["--model", path, "--text", str(work / "text.txt"), "--seq-len", "96", "--n-seq", "3", "--stride",
                     str(stride), "--dtype", "fp32", "--out", str(out), "--attention-weights", "--batch", "2"]) == 0
    plain = captures.store("qwen3", "fp32")
    with h5py.File(out / "shard-000.h5", "r") as f, h5py.File(plain, "r") as g:
        w = f["weights"][()]
        assert f["weights"].dtype == np.float32 and f["weights"].fletcher32 and w.shape == f["token_ids"].shape
        if stride == 1:  # the eager attention's keys are the default attention's
            assert np.abs(f["keys"][()] - g["keys"][()]).max() <= 1e-5 * np.abs(g["keys"][()]).max()
    eager = Qwen3ForCausalLM.from_pretrained(path, attn_implementation="eager").eval()
    seqs = cap.pack(byte_tokenizer(), cap.read_documents(str(work / "text.txt")), 96, 3)
    with torch.no_grad():
        att = eager(torch.as_tensor(seqs), output_attentions=True).attentions  # per layer [B, Hq, S, S]
    P = torch.stack(att).double().mean(dim=(0, 2))  # [B, S, S]: mean over layers and heads
    S = P.shape[-1]
    want = (P.sum(1) / torch.arange(S, 0, -1, dtype=torch.float64))[:, ::stride]  # mean over queries i >= j
    want = (want / want.mean(1, keepdim=True)).reshape(-1).numpy()
    assert np.abs(w - want).max() < 1e-5
    assert np.allclose(w.reshape(3, -1).mean(1), 1.0, atol=1e-5), "mean 1 in every sequence"


def test_the_fit_weighs_by_the_captured_attention(captures, work):
    fit = binary("CROSSKV_FIT")
    _, path = captures.model("qwen3")
    out = work / "store-awfit" / "web"
    assert cap.main(["--model", path, "--text", str(work / "text.txt"), "--seq-len", "96", "--n-seq", "3", "--dtype",
                     "fp32", "--out", str(out), "--attention-weights", "--batch", "2"]) == 0
    src = captures.store("qwen3", "fp32").parent.parent
    (work / "fit-aw.yaml").write_text(f"source: {{store: {src}}}\ntarget: {{store: {out.parent}}}\n"
                                      f"fit: {{k: [1], weighting: dataset}}\noutput: {{dir: {work / 'out-aw'}}}\n")
    r = subprocess.run([fit, str(work / "fit-aw.yaml")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]
    m = json.load(open(work / "out-aw" / "k1" / "manifest.json"))
    assert m["calibration"]["token_weighting"] == "dataset"


# ---- refusals, before any work, one line each
def test_a_different_tokenizer_is_refused_before_any_work(captures, work):
    _, path = captures.model("qwen3")
    torch.manual_seed(1)
    other = str(work / "model-other-tok")
    Qwen3ForCausalLM(Qwen3Config(**COMMON)).save_pretrained(other)
    byte_tokenizer(reverse=True).save_pretrained(other)
    out = work / "store-x" / "web"
    rc = cap.main(["--model", other, "--text", str(work / "text.txt"), "--seq-len", "96", "--n-seq", "3", "--out",
                   str(out), "--same-tokens-as", path])
    assert rc == 2 and not (out / "shard-000.h5").exists()


def test_the_same_tokenizer_as_a_stores_shards_passes(captures, work):
    _, path = captures.model("qwen3")
    rc = cap.main(["--model", path, "--text", str(work / "text.txt"), "--seq-len", "96", "--n-seq", "3", "--out",
                   str(work / "store-y" / "web"), "--same-tokens-as", str(captures.store("qwen3", "fp32").parent)])
    assert rc == 0


def test_dynamic_rope_scaling_is_refused():
    dyn = Qwen3Config(**COMMON, rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    with pytest.raises(cap.CaptureError, match="dynamic"):
        cap.kv_spec_from_config(dyn, "model-dyn")
