"""crosskv.retention under pytest, on a tiny Hugging Face model trained here in seconds to copy (a sequence is X then X
again, so the prefix decides the continuation; no downloads): each control is what it says, an exact mapping scores a
content share of 1, a mapper that ignores its input 0, content-free caches stay near chance, and bad inputs are
refused by name.
With CROSSKV_FIT set, the same through crosskv-fit's own artifacts: a fitted near-identity pair (source = target),
and that artifact with its weights zeroed (the bias alone).

    .venv-capture/bin/python -m pytest tests/python/test_retention.py
"""
import hashlib
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from crosskv import retention as rt  # noqa: E402

B, S = 32, 24


def tiny(layers=2, kv_heads=2, seed=1):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(seed)
    return Qwen3ForCausalLM(Qwen3Config(vocab_size=257, hidden_size=64, intermediate_size=128, head_dim=32,
                                        num_hidden_layers=layers, num_attention_heads=2 * kv_heads,
                                        num_key_value_heads=kv_heads, max_position_embeddings=512,
                                        rope_theta=1e4)).eval()


def copies(rng, n):
    """n sequences of 2S tokens: S random tokens, then the same S again."""
    x = rng.integers(1, 256, (n, S))
    return np.concatenate([x, x], 1)


@pytest.fixture(scope="module")
def model():
    """Trained to copy (200 steps, ~4 s on 2 cores): given its prefix, the second half is certain."""
    torch.manual_seed(3)
    m = tiny(seed=3).train()
    rng = np.random.default_rng(0)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    for _ in range(200):
        x = torch.as_tensor(copies(rng, 32))
        loss = m(x, labels=x).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return m.eval()


@pytest.fixture(scope="module")
def ids():
    return copies(np.random.default_rng(7), B)


def identity(layers):
    return [(k.clone(), v.clone()) for k, v in layers]


def ignores_input(layers):
    """A bias-only mapper: the same cache whatever it is given (that of a fixed sequence of tokens)."""
    return [(torch.full_like(k, 0.5) + torch.arange(k.shape[2]).view(1, 1, -1, 1) * 0.01, torch.full_like(v, -0.25))
            for k, v in layers]


def test_each_control_is_what_it_says(model, ids):
    own = rt.prefill(model, ids[:, :S - 1])
    mapped = identity(own)
    wrong = rt.map_cache(identity, rt.prefill(model, np.roll(ids, -(B // 2), 0)[:, :S - 1]))
    c = rt.control_caches(own, mapped, wrong)
    assert set(c) == set(rt.CONDITIONS)
    assert c["none"] is None
    for l, (k, v) in enumerate(c["wrong_sequence"]):  # sequence i holds sequence i + B/2's cache
        assert torch.equal(k[0], own[l][0][B // 2]) and torch.equal(v[3], own[l][1][(3 + B // 2) % B])
        assert not torch.equal(k[0], own[l][0][0])
    for l, (k, v) in enumerate(c["own_wrong_sequence"]):
        assert torch.equal(k[1], own[l][0][1 + B // 2])
    assert all(not k.any() and not v.any() for k, v in c["zero"])
    for (k, v), (mk, mv) in zip(c["random"], mapped):
        assert abs(k.mean() - mk.mean()) < 0.05 * mk.std() and abs(k.std() / mk.std() - 1) < 0.05
        assert abs(v.std() / mv.std() - 1) < 0.05 and not torch.equal(k, mk)
    for (k, _), (mk, _) in zip(c["mean_only"], mapped):
        assert torch.equal(k[0], k[B - 1]) and torch.allclose(k[0], mk.mean(0), atol=1e-6)


def test_an_exact_mapping_keeps_everything(model, ids):
    r = rt.measure(model, model, identity, ids, S, resamples=200)
    assert r.content_share.value == pytest.approx(1, abs=1e-9)
    assert r.share.value == pytest.approx(1, abs=1e-9)
    assert r.content_share_of("wrong_sequence") == pytest.approx(0, abs=1e-9)
    assert r.content_share_of("own") == 1 and r.content_share_of("own_wrong_sequence") == 0
    for t in rt.TASKS:
        assert r.accuracy[t]["mapped"] == r.accuracy[t]["own"]
    assert r.accuracy["choice"]["none"] == pytest.approx(r.chance)  # every candidate ties: chance exactly
    assert r.counts["choice"] and r.accuracy["choice"]["own"] > 0.9  # the copy model: the task is far above chance
    for c in ("zero", "random", "mean_only", "none"):  # caches without this context's content stay near chance
        assert r.accuracy["choice"][c] < r.chance + 0.25, (c, rt.table(r))
    for c in ("wrong_sequence", "own_wrong_sequence"):  # a cache of the wrong text does worse than none
        assert r.nll[c].mean() > r.nll["none"].mean()
    j = r.to_json()
    assert set(j["perplexity"]) == set(rt.CONDITIONS) and j["content_share"][0] == pytest.approx(1)
    text = rt.table(r)
    assert "wrong sequence" in text and "content-specific share 1.000" in text


def test_a_mapper_that_ignores_its_input_gains_no_content(model, ids):
    r = rt.measure(model, model, ignores_input, ids, S, resamples=200)
    assert r.content_share.value == 0 and r.content_share.low == 0 and r.content_share.high == 0
    for t in rt.TASKS:
        assert r.accuracy[t]["mapped"] == r.accuracy[t]["wrong_sequence"]


def test_a_planted_swap_is_caught(model, ids):
    """A mapper that hands each sequence another's cache: the wrong-sequence control then looks right, and the
    content share goes negative: the figure cannot be passed by a cache of the wrong text."""
    swap = lambda layers: rt.roll(identity(layers), 1)  # noqa: E731
    r = rt.measure(model, model, swap, ids, S, resamples=200)
    assert r.content_share.value < 0.5


def test_the_nll_figures_alone_equal_the_full_measures(model, ids):
    """tasks=() leaves out the choice and recall passes: the NLL, content share and share are the full measure's."""
    full = rt.measure(model, model, swap_half, ids, S, resamples=200)
    alone = rt.measure(model, model, swap_half, ids, S, resamples=200, tasks=())
    for c in rt.CONDITIONS:
        assert np.array_equal(alone.nll[c], full.nll[c]), c
    assert alone.content_share == full.content_share and alone.share == full.share
    assert not alone.accuracy and not alone.task_retention and "not measured" in rt.table(alone)
    assert set(alone.to_json()["accuracy"]) == set()
    recall = rt.measure(model, model, swap_half, ids, S, resamples=200, tasks=("recall",))
    assert set(recall.accuracy) == {"recall"} and recall.accuracy["recall"] == full.accuracy["recall"]


def swap_half(layers):
    """The identity on the first half of the sequences, another sequence's cache on the second: a content share
    strictly between 0 and 1."""
    out = identity(layers)
    for k, v in out:
        k[B // 2:] = torch.roll(k[B // 2:], 1, 0)
        v[B // 2:] = torch.roll(v[B // 2:], 1, 0)
    return out


def test_an_unknown_task_is_refused_by_name(model, ids):
    with pytest.raises(ValueError, match=r"tasks: expected some of \('choice', 'recall'\), got \['choise'\]"):
        rt.measure(model, model, identity, ids, S, tasks=("choise",))


@pytest.mark.parametrize("shape,prefix,why", [((4, 48), 24, "at least 8 sequences"),
                                              ((16, 40), 24, "of >= 48 tokens")])
def test_bad_inputs_are_refused_by_name(model, shape, prefix, why):
    with pytest.raises(ValueError, match=why):
        rt.measure(model, model, identity, np.ones(shape, np.int64), prefix)


def test_span_longer_than_the_prefix_is_refused(model, ids):
    with pytest.raises(ValueError, match="span_tokens 30"):
        rt.measure(model, model, identity, ids, S, span_tokens=30)


# ---- through crosskv-fit's artifacts (needs CROSSKV_FIT): a near-identity pair and its bias alone.
@pytest.fixture(scope="module")
def fitted(tmp_path_factory, model):
    fit = os.environ.get("CROSSKV_FIT")
    if not fit:
        pytest.skip("CROSSKV_FIT is not set (the fitted-artifact cases need crosskv-fit)")
    from crosskv import capture as cap
    from safetensors.numpy import load_file, save_file
    from tiny_hf import byte_tokenizer

    work = tmp_path_factory.mktemp("fitted")
    m = model
    m.save_pretrained(work / "model")
    byte_tokenizer().save_pretrained(work / "model")
    (work / "text.txt").write_text(" ".join(f"line {i}: {np.random.default_rng(i).integers(0, 1e6)} apples, "
                                            f"{i * 7 % 13} pears." for i in range(900)))
    for side in ("source", "target"):
        assert cap.main(["--model", str(work / "model"), "--text", str(work / "text.txt"), "--seq-len", "64",
                         "--dtype", "fp32", "--n-seq", "48", "--out", str(work / f"kv-{side}" / "cal")]) == 0
    (work / "fit.yaml").write_text(f"source: {{store: {work}/kv-source}}\ntarget: {{store: {work}/kv-target}}\n"
                                   f"fit: {{k: [all], lambda: 1.0e-3}}\noutput: {{dir: {work}/out}}\n")
    subprocess.run([fit, str(work / "fit.yaml")], check=True, capture_output=True)
    bias = work / "bias" / "kall"
    shutil.copytree(work / "out" / "kall", bias)
    manifest = json.load(open(bias / "manifest.json"))
    for layer in manifest["layers"]:
        path = bias / layer["file"]
        t = load_file(path)
        save_file({n: (np.zeros_like(x) if n.endswith(".weight") else x) for n, x in t.items()}, path)
        layer["sha256"] = hashlib.sha256(open(path, "rb").read()).hexdigest()
    json.dump(manifest, open(bias / "manifest.json", "w"), indent=2)
    return m, work


def test_a_fitted_identity_pair_keeps_the_content(fitted, ids):
    import crosskv

    m, work = fitted
    r = rt.measure(m, m, crosskv.Mapper(str(work / "out" / "kall")), ids, S, resamples=200)
    assert r.content_share.value == pytest.approx(1, abs=0.05), rt.table(r)
    assert r.content_share_of("wrong_sequence") == pytest.approx(0, abs=0.05)


def test_the_fitted_bias_alone_gains_no_content(fitted, ids):
    import crosskv

    m, work = fitted
    r = rt.measure(m, m, crosskv.Mapper(str(work / "bias" / "kall")), ids, S, resamples=200)
    assert r.content_share.value == pytest.approx(0, abs=1e-6), rt.table(r)
