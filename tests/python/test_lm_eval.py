"""crosskv.lm_eval under pytest, offline: local lm-eval tasks (YAML + JSONL written here: multiple choice, rolling
log-likelihood, generation) on the tiny family of the vLLM tests (random Qwen3 models, byte tokenizer, a mapper from
crosskv-fit; vllm_engine.family_cache makes it once per build, for whichever test needs it first). The gold check:
mode=own equals lm-eval's own `hf` model on the target, request by request, and the metrics are identical. Then the
controls, the command line with lm-eval's own flags, and bad model_args by name.

    CROSSKV_FIT=build/crosskv-fit .venv-lmeval/bin/python -m pytest tests/python/test_lm_eval.py
"""
import functools
import glob
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
lm_eval = pytest.importorskip("lm_eval")
from lm_eval.tasks import TaskManager  # noqa: E402

import crosskv.lm_eval as ckv  # noqa: E402

TASKS = ["ckv_mc", "ckv_ppl", "ckv_gen"]


@pytest.fixture(scope="module")
def family(tmp_path_factory):
    fit = os.environ.get("CROSSKV_FIT")
    if not fit:
        pytest.skip("CROSSKV_FIT is not set (the family's mapper needs crosskv-fit)")
    from vllm_engine import family_cache  # the engine tests' family, made once per build for all of them

    work = tmp_path_factory.mktemp("family") / "f"
    shutil.copytree(family_cache(sys.executable, fit), work, symlinks=True)
    return work


@pytest.fixture(scope="module")
def tasks(tmp_path_factory):
    """Three local tasks over one JSONL: 4-way choice, rolling log-likelihood and generation."""
    d = tmp_path_factory.mktemp("tasks")
    rng = np.random.default_rng(5)
    words = ["fox", "dog", "cat", "owl", "elk", "bee", "ram", "yak"]
    with open(d / "data.jsonl", "w") as f:
        for i in range(12):
            w = [words[j] for j in rng.integers(0, 8, 6)]
            ctx = f"turn {i}: the {w[0]} met the {w[1]} and the {w[2]}. then the {w[3]}"
            f.write(json.dumps({"context": ctx, "choices": [f" saw the {w[k]}." for k in (4, 5, 0, 1)],
                                "label": 0, "text": ctx + " saw it.\n", "answer": w[4]}) + "\n")
    common = (f"dataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {d / 'data.jsonl'}\n"
              "test_split: test\n")
    (d / "ckv_mc.yaml").write_text(
        f"task: ckv_mc\n{common}output_type: multiple_choice\ndoc_to_text: '{{{{context}}}}'\n"
        "doc_to_choice: '{{choices}}'\ndoc_to_target: label\nmetric_list:\n  - metric: acc\n  - metric: acc_norm\n")
    (d / "ckv_ppl.yaml").write_text(
        f"task: ckv_ppl\n{common}output_type: loglikelihood_rolling\ndoc_to_text: ''\ndoc_to_target: '{{{{text}}}}'\n"
        "metric_list:\n  - metric: word_perplexity\n  - metric: bits_per_byte\n")
    (d / "ckv_gen.yaml").write_text(
        f"task: ckv_gen\n{common}output_type: generate_until\ndoc_to_text: '{{{{context}}}} saw the'\n"
        "doc_to_target: ' {{answer}}'\ngeneration_kwargs:\n  until: ['.', '\\n']\n  max_gen_toks: 6\n"
        "  do_sample: false\nmetric_list:\n  - metric: exact_match\n")
    return d


@functools.cache
def task_manager(tasks):
    """One index of the local tasks alone per folder: indexing lm-eval's thousands of built-in task files too takes
    about 13 s on 2 cores, and this module evaluates six times."""
    return TaskManager(include_path=str(tasks), include_defaults=False)


def run(model, model_args, tasks, names=TASKS, limit=None):
    return lm_eval.simple_evaluate(model=model, model_args=model_args, tasks=names, limit=limit, device="cpu",
                                   task_manager=task_manager(tasks), log_samples=True,
                                   random_seed=0, numpy_random_seed=0, torch_random_seed=0, fewshot_random_seed=0)


def responses(res, task):
    return [s["resps"] for s in sorted(res["samples"][task], key=lambda s: s["doc_id"])]


def args_of(family, mode):
    return f"source={family}/model-source,target={family}/model-target,mapper={family}/out/kall,mode={mode}"


@pytest.fixture(scope="module")
def gold(family, tasks):
    return run("hf", f"pretrained={family}/model-target,dtype=float32", tasks)


@pytest.fixture(scope="module")
def own(family, tasks):
    return run("crosskv", args_of(family, "own"), tasks)


def test_own_equals_lm_evals_hf_model_request_by_request(gold, own):
    for task in ("ckv_mc", "ckv_ppl"):
        want, got = responses(gold, task), responses(own, task)
        assert len(want) == len(got) == 12
        for w, g in zip(want, got):
            for wr, gr in zip(w, g):
                wl = wr[0][0] if isinstance(wr[0], (list, tuple)) else wr[0]
                gl = gr[0][0] if isinstance(gr[0], (list, tuple)) else gr[0]
                assert gl == pytest.approx(wl, rel=1e-5, abs=1e-4), (task, w, g)
    assert responses(gold, "ckv_gen") == responses(own, "ckv_gen")
    for task in TASKS:
        assert gold["results"][task] == pytest.approx(own["results"][task]) or {
            k: v for k, v in gold["results"][task].items() if k != "alias"} == {
            k: v for k, v in own["results"][task].items() if k != "alias"}


def test_the_controls_differ_from_own(family, tasks, own):
    ll = lambda res: [r[0][0] for rs in responses(res, "ckv_mc") for r in rs]  # noqa: E731
    base = ll(own)
    for mode in ("mapped", "wrong", "zero", "none"):
        got = ll(run("crosskv", args_of(family, mode), tasks, names=["ckv_mc"]))
        assert got != pytest.approx(base, abs=1e-6), mode


def test_wrong_reads_another_context_and_zero_is_zero(family):
    lm = ckv.CrossKVLM(**dict(a.split("=") for a in args_of(family, "wrong").split(",")))
    contexts = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]]
    assert lm._other(contexts, 0) == [5, 6, 7, 8] and lm._other(contexts, 2) != contexts[2]
    wrong = lm._cache([1, 2, 3], [5, 6, 7, 8])
    lm.mode = "mapped"
    mapped, other = lm._cache([1, 2, 3]), lm._cache([5, 6, 7])
    assert all(torch.equal(a[0], b[0]) for a, b in zip(wrong, other))
    assert not all(torch.equal(a[0], b[0]) for a, b in zip(wrong, mapped))
    lm.mode = "zero"
    assert all(not k.any() and not v.any() for k, v in lm._cache([1, 2, 3]))
    lm.mode = "none"
    assert lm._cache([1, 2, 3]) is None


def test_the_command_line_takes_lm_evals_flags(family, tasks, tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "crosskv.lm_eval", "--model_args", args_of(family, "mapped"),
                        "--tasks", "ckv_mc", "--include_path", str(tasks), "--output_path", str(out),
                        "--log_samples", "--limit", "4", "--batch_size", "1"], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    results = glob.glob(str(out / "**" / "results_*.json"), recursive=True)
    samples = glob.glob(str(out / "**" / "samples_ckv_mc_*.jsonl"), recursive=True)
    assert results and samples, os.listdir(out)
    doc = json.load(open(results[0]))
    assert "acc,none" in doc["results"]["ckv_mc"] and doc["config"]["model"] == "crosskv"
    assert len(open(samples[0]).read().splitlines()) == 4


@pytest.mark.parametrize("extra,why", [("mode=bogus", "mode=bogus: expected one of mapped, own, wrong, zero, none"),
                                       ("dtype=int8", "dtype=int8: expected float32"),
                                       ("colour=red", "unknown key(s) colour")])
def test_bad_model_args_are_refused_by_name(family, extra, why):
    kw = dict(a.split("=") for a in (args_of(family, "mapped") + "," + extra).split(","))
    with pytest.raises(ckv.CrossKVLMError, match=re.escape(why)):
        ckv.CrossKVLM(**kw)


def test_mapped_needs_a_mapper(family):
    with pytest.raises(ckv.CrossKVLMError, match="source and mapper: required for mode=mapped"):
        ckv.CrossKVLM(target=f"{family}/model-target")
