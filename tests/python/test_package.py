"""The crosskv Python package (pip install .) under pytest: Mapper.transfer against the numpy reference of apply
(tools/crosskv_apply.py) on ridge, ridge + residual-MLP and head-matched mappers, numpy and torch alike; its refusals;
and the Hugging Face handoff: tiny random Qwen3 models (2 and 3 layers) captured with crosskv-capture, a mapper fitted
on them, the source's cache turned into the target's DynamicCache by crosskv.hf.transfer_cache, equal to what the
command line's crosskv-apply writes for the same tokens, and the target continuing the conversation with generate.

    CROSSKV_SYNTH=build/crosskv-synth CROSSKV_FIT=build/crosskv-fit CROSSKV_APPLY=build/crosskv-apply \\
        .venv-capture/bin/python -m pytest tests/python/test_package.py [-k per_head]
"""
import concurrent.futures
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
sys.path.insert(0, HERE)
import crosskv  # noqa: E402
import crosskv.hf  # noqa: E402
import crosskv_apply  # noqa: E402
from crosskv import capture as cap  # noqa: E402
from tiny_hf import byte_tokenizer  # noqa: E402


def binary(name):
    path = os.environ.get(name)
    if not path:
        pytest.skip(f"{name} is not set (the test needs crosskv's programs)")
    return path


def run(*cmd):
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert r.returncode == 0, f"{cmd[0]} failed: {r.stdout[-1500:]}{r.stderr[-1500:]}"


# ---- a serving node's package
def test_the_extension_links_none_of_the_fitting_sides_libraries():
    """pip install . builds the serving layers alone, with MPI, HDF5, yaml-cpp, spdlog and CLI11 hidden from CMake."""
    linked = subprocess.run(["ldd", crosskv._crosskv.__file__], capture_output=True, text=True).stdout
    for lib in ("libmpi", "libhdf5", "libyaml-cpp", "libspdlog", "libfmt", "libopen-pal", "libsz"):
        assert lib not in linked, lib
    assert "libopenblas" in linked


def test_the_package_names_its_blas_kernels():
    assert "OpenBLAS" in crosskv.blas and "kernels" in crosskv.blas, crosskv.blas


# ---- Mapper.transfer against the numpy reference: ridge, ridge + MLP, and head-matched ridge
@pytest.fixture(scope="module")
def syn(tmp_path_factory):
    work = tmp_path_factory.mktemp("package")
    run(binary("CROSSKV_SYNTH"), "--out", work / "syn", "--relation", "nonlinear", "--shards", "1", "--sequences",
        "4", "--seq-len", "128", "--source-layers", "3", "--target-layers", "4", "--source-heads", "2",
        "--target-heads", "2", "--source-head-dim", "16", "--target-head-dim", "16", "--source-rotary-dim", "16",
        "--target-rotary-dim", "16")
    shard = work / "syn" / "source" / "web" / "shard-000.h5"
    with h5py.File(shard, "r") as f:
        return work, shard, f["keys"][()], f["values"][()], f["positions"][()]


class Fitted:
    def __init__(self, art, structure, shard, keys, values, pos):
        self.art, self.structure, self.keys, self.values, self.pos = str(art), structure, keys, values, pos
        self.want_k, self.want_v, _ = crosskv_apply.apply(self.art, str(shard))
        self.m = crosskv.Mapper(self.art)
        self.got_k, self.got_v = self.m.transfer(keys, values, pos)


@pytest.fixture(scope="module", params=["ridge", "mlp", "per_head"])  # per_head: weights [Ht, k*Ds, Dt]
def fitted(request, syn):
    work, shard, keys, values, pos = syn
    mapper = request.param
    kind, structure = ("ridge", "per_head") if mapper == "per_head" else (mapper, "cross_head")
    (work / f"{mapper}.yaml").write_text(
        f"source: {{store: {work}/syn/source}}\ntarget: {{store: {work}/syn/target}}\nfit: {{k: [2], mapper: {kind}, "
        f"structure: {structure}, mlp: {{hidden: 16, epochs: 2}}}}\noutput: {{dir: {work}/out-{mapper}}}\n")
    run(binary("CROSSKV_FIT"), work / f"{mapper}.yaml")
    art = work / f"out-{mapper}" / ("k2-per_head" if mapper == "per_head" else "k2")
    return Fitted(art, structure, shard, keys, values, pos)


def rel(a, b):
    return np.abs(a - b).max() / np.abs(b).max()


def test_transfer_equals_the_numpy_reference(fitted):
    f = fitted
    assert f.m.structure == f.structure
    assert f.got_k.shape == (f.keys.shape[0], 4, 2, 16)
    assert max(rel(f.got_k, f.want_k), rel(f.got_v, f.want_v)) < 1e-5


def test_torch_tensors_in_the_same_torch_tensors_out(fitted):
    f = fitted
    tk, tv = f.m.transfer(torch.from_numpy(f.keys), torch.from_numpy(f.values), torch.from_numpy(f.pos))
    assert isinstance(tk, torch.Tensor) and np.array_equal(tk.numpy(), f.got_k) and np.array_equal(tv.numpy(), f.got_v)


def test_target_positions_of_their_own(fitted):
    f = fitted
    shifted_k, _ = f.m.transfer(f.keys, f.values, f.pos, f.pos + 7)
    want, _, _ = crosskv_apply.apply_arrays(*crosskv_apply.load_mapper(f.art), f.keys, f.values, f.pos, f.pos + 7)
    assert rel(shifted_k, want) < 1e-5


def test_resident_and_streamed_give_the_same_bits(fitted):
    f = fitted
    sk, sv = crosskv.Mapper(f.art, resident=False).transfer(f.keys, f.values, f.pos)
    assert np.array_equal(sk, f.got_k) and np.array_equal(sv, f.got_v) and f.m.weight_bytes > 0


@pytest.mark.parametrize("layers", [0, 3, range(1, 3), range(0, 4)], ids=["0", "3", "1-3", "0-4"])
def test_some_layers_are_those_layers_of_the_whole(fitted, layers):
    """What a serving stack maps while the model computes: resident and streamed, numpy and torch."""
    f = fitted
    sel = [layers] if isinstance(layers, int) else list(layers)
    wk, wv = f.m.transfer(f.keys, f.values, f.pos, f.pos + 7)
    for mm in (f.m, crosskv.Mapper(f.art, resident=False)):
        lk, lv = mm.transfer(f.keys, f.values, f.pos, f.pos + 7, layers=layers)
        assert lk.shape == (f.keys.shape[0], len(sel), 2, 16)
        assert np.array_equal(lk, wk[:, sel]) and np.array_equal(lv, wv[:, sel])
    tk1, _ = f.m.transfer(torch.from_numpy(f.keys), torch.from_numpy(f.values), torch.from_numpy(f.pos), layers=layers)
    assert np.array_equal(tk1.numpy(), f.got_k[:, sel])


@pytest.mark.parametrize("heads", [range(0, 1), range(1, 2), range(0, 2)], ids=["0", "1", "0-2"])
def test_a_workers_target_heads_are_those_heads_of_the_whole(fitted, heads):
    f = fitted
    hm = crosskv.Mapper(f.art, target_heads=heads)
    hk, hv = hm.transfer(f.keys, f.values, f.pos, f.pos + 7)
    wk, wv = f.m.transfer(f.keys, f.values, f.pos, f.pos + 7)
    err = max(np.abs(hk - wk[:, :, heads.start:heads.stop]).max(), np.abs(hv - wv[:, :, heads.start:heads.stop]).max())
    assert hm.heads == heads and hk.shape == (f.keys.shape[0], 4, len(heads), 16) and err < 1e-5 * np.abs(wk).max()
    tk2, _ = hm.transfer(torch.from_numpy(f.keys), torch.from_numpy(f.values), torch.from_numpy(f.pos), layers=2)
    assert np.array_equal(tk2.numpy()[:, 0], hm.transfer(f.keys, f.values, f.pos)[0][:, 2])


def test_a_batch_of_sequences(fitted):
    f = fitted
    B = 4
    T = f.keys.shape[0] // B
    kb, vb = f.keys.reshape(B, T, 3, 2, 16), f.values.reshape(B, T, 3, 2, 16)
    bk, bv = f.m.transfer(kb, vb, f.pos.reshape(B, T))
    assert bk.shape == (B, T, 4, 2, 16)
    assert np.array_equal(bk.reshape(f.got_k.shape), f.got_k) and np.array_equal(bv.reshape(f.got_v.shape), f.got_v)
    seq_k, _ = f.m.transfer(kb, vb, np.arange(T))  # positions [seq]: each sequence as if alone
    one_k, _ = f.m.transfer(f.keys[T:2 * T], f.values[T:2 * T], np.arange(T))
    assert rel(seq_k[1], one_k) < 2e-6  # BLAS blocks rows of another count differently


def test_one_mapper_shared_by_threads(fitted):
    """A threaded server: the calls run one at a time, each gets the answer it gets alone."""
    f = fitted
    cuts = [(i * 37) % f.keys.shape[0] + 1 for i in range(1, 25)]  # token counts that differ: scratch regrown
    alone = [f.m.transfer(f.keys[:n], f.values[:n], f.pos[:n]) for n in cuts]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        shared = list(ex.map(lambda n: f.m.transfer(f.keys[:n], f.values[:n], f.pos[:n]), cuts * 4))
    assert all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(alone * 4, shared))


def test_cuda_tensors_stay_on_the_gpu(fitted):
    if not (torch.cuda.is_available() and crosskv.cuda_compiled_in):
        pytest.skip("no CUDA device, or the package was built without CUDA")
    f = fitted
    g = crosskv.Mapper(f.art, device="cuda")
    ck, cv = torch.from_numpy(f.keys).cuda(), torch.from_numpy(f.values).cuda()
    before = ck.clone()
    gk, gv = g.transfer(ck, cv, torch.from_numpy(f.pos).cuda())
    torch.cuda.synchronize()
    err = max((gk.cpu() - torch.from_numpy(f.got_k)).abs().max().item() / np.abs(f.got_k).max(),
              (gv.cpu() - torch.from_numpy(f.got_v)).abs().max().item() / np.abs(f.got_v).max())
    assert gk.is_cuda and gv.is_cuda and torch.equal(ck, before) and err < 1e-4
    hk, _ = g.transfer(f.keys, f.values, f.pos)  # host arrays through the GPU mapper
    assert np.abs(hk - gk.cpu().numpy()).max() == 0
    t32, _ = crosskv.Mapper(f.art, device="cuda", tf32=True).transfer(ck, cv, torch.from_numpy(f.pos).cuda())
    assert (t32.cpu() - torch.from_numpy(f.got_k)).abs().max().item() / np.abs(f.got_k).max() < 1e-2


# ---- bad input fails closed: refused by name, never mapped to wrong KV
@pytest.fixture(scope="module")
def ridge(syn):
    work, _, keys, values, pos = syn
    (work / "bad.yaml").write_text(f"source: {{store: {work}/syn/source}}\ntarget: {{store: {work}/syn/target}}\n"
                                   f"fit: {{k: [2]}}\noutput: {{dir: {work}/out-bad}}\n")
    run(binary("CROSSKV_FIT"), work / "bad.yaml")
    return str(work / "out-bad" / "k2"), keys, values, pos


def refusals(cases):
    """Every case's message, or why it was not refused as expected: all of them, so none hides another."""
    wrong = []
    for call, want in cases:
        try:
            call()
            wrong.append(f"not refused: {want}")
        except crosskv.MapperError as e:
            if want not in str(e):
                wrong.append(f"refused, but {e!s} does not say {want!r}")
    return wrong


def test_repr_and_properties(ridge):
    m = crosskv.Mapper(ridge[0], resident=False)
    assert "k=2" in repr(m) and m.k == 2 and len(m.source_layers) == 4


@pytest.mark.parametrize("resident", [False, True], ids=["streamed", "resident"])
def test_bad_values_and_arguments_are_refused_by_name(ridge, resident):
    art, keys, values, pos = ridge
    mapper = crosskv.Mapper(art, resident=resident)
    nan_keys = keys.copy()
    nan_keys[3, 1, 0, 5] = np.nan
    inf_values = values.copy()
    inf_values[7, 2, 1, 0] = -np.inf
    neg, big = pos.copy(), pos.astype(np.int64)
    neg[2] = -1
    big[0] = 2**31
    cases = ((lambda: mapper.transfer(nan_keys, values, pos), "keys: element 325 (token 3) is NaN"),
              (lambda: mapper.transfer(keys, inf_values, pos), "values: element 752 (token 7) is infinite"),
              (lambda: mapper.transfer(torch.from_numpy(nan_keys), torch.from_numpy(values), torch.from_numpy(pos)),
               "keys: element 325 (token 3) is NaN"),
              (lambda: mapper.transfer(keys, values, neg), "positions: position -1 is negative"),
              (lambda: mapper.transfer(keys, values, pos, neg), "target_positions: position -1 is negative"),
              (lambda: mapper.transfer(keys, values, big), "positions: position 2147483648 does not fit in 32 bits"),
              (lambda: mapper.transfer(keys, values, pos.astype(np.float32)),
               "positions: expected integer positions, got float32"),
              (lambda: mapper.transfer(keys.tolist(), values, pos),
               "keys: expected a numpy array or a torch tensor, got list"),
              (lambda: mapper.transfer(keys, values.tolist(), pos),
               "values: expected a numpy array or a torch tensor, got list"),
              (lambda: mapper.transfer(keys, values, pos, layers=4),
               "layers: expected a non-empty range of the target's layers [0, 4), got first 4, count 1"),
              (lambda: mapper.transfer(keys, values, pos, layers=-1),
               "layers: expected a non-empty range of the target's layers [0, 4), got first -1"),
              (lambda: mapper.transfer(keys, values, pos, layers=range(2, 6)),
               "layers: expected a non-empty range of the target's layers [0, 4), got first 2, count 4"),
              (lambda: mapper.transfer(keys, values, pos, layers=range(0, 4, 2)),
               "layers: expected a target layer or a non-empty range of them with step 1, got range(0, 4, 2)"),
              (lambda: mapper.transfer(keys, values, pos, layers=range(2, 2)),
               "layers: expected a target layer or a non-empty range of them with step 1, got range(2, 2)"),
              (lambda: mapper.transfer(keys, values, pos, layers=[0, 1]),
               "layers: expected a target layer or a non-empty range of them with step 1, got [0, 1]"),
              (lambda: mapper.transfer(keys, values, pos, layers=1.0),
               "layers: expected a target layer or a non-empty range of them with step 1, got 1.0"))
    assert not refusals(cases), refusals(cases)


def test_bad_shapes_devices_and_folders_are_refused_by_name(ridge):
    art, keys, values, pos = ridge
    m = crosskv.Mapper(art, resident=False)
    cases = ((lambda: m.transfer(keys[:, :2], values, pos), "keys: expected shape [tokens, 3, 2, 16]"),
              (lambda: m.transfer(keys, values, pos[:5]), "positions: expected"),
              (lambda: m.transfer(keys[0], values[0], pos), "keys: expected [tokens, 3, 2, 16] or [batch, seq"),
              (lambda: m.transfer(keys.reshape(4, -1, 3, 2, 16), values, pos), "values: expected the keys' "
               "leading shape (4, 128)"),
              (lambda: m.transfer(keys.reshape(4, -1, 3, 2, 16), values.reshape(4, -1, 3, 2, 16), pos[:7]),
               "positions: expected [4, 128] (one per token) or [seq], got [7]"),
              (lambda: crosskv.Mapper(art, device="cuda:x"), "device: expected cpu, cuda or cuda:N"),
              (lambda: crosskv.Mapper(art, device="cuda:7"),
               "device: cuda:7: no such CUDA device here" if crosskv.cuda_compiled_in
               else "device: cuda:7: this crosskv package was built without CUDA"),
              (lambda: crosskv.Mapper("nonexistent"), "nonexistent/manifest.json"),
              (lambda: crosskv.Mapper(art, target_heads=range(1, 3)),
               "target_heads: expected a non-empty range of the target's KV heads [0, 2), got first 1, count 2"),
              (lambda: crosskv.Mapper(art, target_heads=[0]),
               "target_heads: expected a non-empty range of target KV heads with step 1, got [0]"),
              (lambda: crosskv.Mapper(art, resident=False, target_heads=range(1)),
               "target_heads: a subset of the target's heads needs a resident mapper"),
              (lambda: crosskv.read_manifest("nonexistent"), "nonexistent/manifest.json"),
              (lambda: crosskv.Mapper(art, device="tpu"), "device: expected cpu, cuda or cuda:N"),
              (lambda: crosskv.hf.transfer_cache(m, [(torch.zeros(1, 2, 5, 16),) * 2] * 2),
               "source cache: 2 layers, the mapper's source has 3"),
              (lambda: crosskv.hf.transfer_cache(m, [(torch.zeros(1, 1, 5, 16),) * 2] * 3),
               "source cache: 1 KV heads of 16, the mapper's source has 2 of 16"))
    assert not refusals(cases), refusals(cases)


# ---- Hugging Face: a source model's cache handed to a larger target model
@pytest.fixture(scope="module")
def hf(tmp_path_factory):
    work = tmp_path_factory.mktemp("hf")
    common = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=1024, rope_theta=1e6)
    models = {}
    for name, layers in (("source", 2), ("target", 3)):
        torch.manual_seed({"source": 1, "target": 2}[name])
        models[name] = Qwen3ForCausalLM(Qwen3Config(**common, num_hidden_layers=layers)).eval()
        models[name].save_pretrained(work / f"model-{name}")
        byte_tokenizer().save_pretrained(work / f"model-{name}")
    (work / "text.txt").write_text(" ".join(f"turn {i}: the quick brown fox jumps over the lazy dog." for i in range(300)))
    for name in ("source", "target"):
        assert cap.main(["--model", str(work / f"model-{name}"), "--text", str(work / "text.txt"), "--seq-len", "64",
                         "--n-seq", "16", "--out", str(work / f"kv-{name}" / "web")]) == 0
    (work / "hf.yaml").write_text(f"source: {{store: {work}/kv-source}}\ntarget: {{store: {work}/kv-target}}\n"
                                  f"fit: {{k: [all]}}\noutput: {{dir: {work}/out-hf}}\n")
    run(binary("CROSSKV_FIT"), work / "hf.yaml")
    m = crosskv.Mapper(str(work / "out-hf" / "kall"))
    prompt = byte_tokenizer()("turn 7: the quick brown fox", return_tensors="pt").input_ids
    with torch.no_grad():
        answered = models["source"].generate(prompt, max_new_tokens=8, do_sample=False)  # the source answers a turn
        src_out = models["source"](answered, use_cache=True)
    return work, models, m, answered, src_out


def test_transfer_cache_gives_the_targets_dynamic_cache(hf):
    _, _, m, answered, src_out = hf
    layers = crosskv.hf.cache_layers(crosskv.hf.transfer_cache(m, src_out.past_key_values))
    assert len(layers) == 3 and tuple(layers[0][0].shape) == (1, 2, answered.shape[1], 16)


def test_transfer_cache_equals_crosskv_apply_on_the_same_tokens(hf):
    work, _, m, answered, src_out = hf
    layers = crosskv.hf.cache_layers(crosskv.hf.transfer_cache(m, src_out.past_key_values))
    with h5py.File(work / "turn.h5", "w") as f:
        seq_ids = answered[0].numpy().astype(np.int32)
        src_layers = crosskv.hf.cache_layers(src_out.past_key_values)
        f["keys"] = torch.stack([k[0] for k, _ in src_layers]).permute(2, 0, 1, 3).numpy()
        f["values"] = torch.stack([v[0] for _, v in src_layers]).permute(2, 0, 1, 3).numpy()
        with h5py.File(work / "kv-source" / "web" / "shard-000.h5", "r") as s:
            for a in s.attrs:
                f.attrs[a] = s.attrs[a]
        f["token_ids"] = seq_ids
        f["positions"] = np.arange(len(seq_ids), dtype=np.int32)
        f["seq_offsets"] = np.array([0, len(seq_ids)], dtype=np.int64)
    run(binary("CROSSKV_APPLY"), "--mapper", work / "out-hf" / "kall", "--source", work / "turn.h5", "--out",
        work / "turn-mapped.h5")
    with h5py.File(work / "turn-mapped.h5", "r") as f:
        cli_k = f["keys"][()]
    hf_k = torch.stack([k[0] for k, _ in layers]).permute(2, 0, 1, 3).numpy()
    assert rel(hf_k, cli_k) < 1e-6


def test_the_target_continues_from_the_transferred_cache(hf):
    """generate feeds only the uncached last token; the cache is attended to."""
    _, models, m, answered, _ = hf
    cache = crosskv.hf.transfer_cache(m, models["source"](answered[:, :-1], use_cache=True).past_key_values)
    with torch.no_grad():
        cont = models["target"].generate(answered, past_key_values=cache, max_new_tokens=6, do_sample=False)
        with_cache = models["target"](answered[:, -1:], past_key_values=crosskv.hf.transfer_cache(
            m, models["source"](answered[:, :-1], use_cache=True).past_key_values)).logits[0, -1]
        alone = models["target"](answered[:, -1:]).logits[0, -1]
    assert not torch.allclose(with_cache, alone)
    assert cont.shape[1] == answered.shape[1] + 6 and torch.equal(cont[:, :answered.shape[1]], answered)


def test_the_handoff_example_runs(hf):
    work = hf[0]
    r = subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "examples", "handoff.py"), "--source",
                        str(work / "model-source"), "--target", str(work / "model-target"), "--mapper",
                        str(work / "out-hf" / "kall"), "--prompt", "turn 3: the quick", "--answer-tokens", "6",
                        "--continue-tokens", "5"], capture_output=True, text=True)
    lines = r.stdout.splitlines()
    assert r.returncode == 0 and any(l.startswith("target after crosskv transfer (") for l in lines), r.stderr[-1500:]
    assert any(l.startswith("greedy tokens that agree: ") for l in lines)
