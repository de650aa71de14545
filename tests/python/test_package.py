"""The crosskv Python package (pip install .): Mapper.transfer against the numpy reference of apply
(tools/crosskv_apply.py) on a ridge and a ridge + residual-MLP mapper, numpy and torch alike; its refusals; and the
Hugging Face handoff: tiny random Qwen3 models (2 and 3 layers) captured with crosskv-capture, a mapper fitted on
them, the source's cache turned into the target's DynamicCache by crosskv.hf.transfer_cache, equal to what the
command line's crosskv-apply writes for the same tokens, and the target continuing the conversation with generate.

    python test_package.py WORKDIR CROSSKV_SYNTH CROSSKV_FIT CROSSKV_APPLY
"""
import os
import subprocess
import sys

import h5py
import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools"))
sys.path.insert(0, os.path.join(HERE, "..", "..", "tools", "capture"))
sys.path.insert(0, HERE)
import crosskv  # noqa: E402
import crosskv.hf  # noqa: E402
import crosskv_apply  # noqa: E402
import crosskv_capture as cap  # noqa: E402
from tiny_hf import byte_tokenizer  # noqa: E402

work, synth, fit, apply_bin = sys.argv[1:5]
os.makedirs(work, exist_ok=True)
os.chdir(work)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what)
    if not cond:
        failures.append(what)


# A serving node's package: the extension links none of the fitting side's libraries (pip install . builds the
# serving layers alone, with MPI, HDF5, yaml-cpp, spdlog and CLI11 hidden from CMake).
ext = crosskv._crosskv.__file__
linked = subprocess.run(["ldd", ext], capture_output=True, text=True).stdout
for lib in ("libmpi", "libhdf5", "libyaml-cpp", "libspdlog", "libfmt", "libopen-pal", "libsz"):
    check(lib not in linked, f"the extension does not link {lib} (ldd {os.path.basename(ext)})")
check("libopenblas" in linked, "the extension links OpenBLAS")

# The package says which BLAS kernels it runs (chosen at import, as the programs choose them).
check("OpenBLAS" in crosskv.blas and "kernels" in crosskv.blas, f"crosskv.blas names the library and kernels: {crosskv.blas}")


def run(*cmd):
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        print(r.stdout, r.stderr)
        raise SystemExit(f"{cmd[0]} failed")


# ---- Mapper.transfer against the numpy reference: ridge, ridge + MLP, and head-matched ridge.
run(synth, "--out", "syn", "--relation", "nonlinear", "--shards", "1", "--sequences", "4", "--seq-len", "128",
    "--source-layers", "3", "--target-layers", "4", "--source-heads", "2", "--target-heads", "2",
    "--source-head-dim", "16", "--target-head-dim", "16", "--source-rotary-dim", "16", "--target-rotary-dim", "16")
for mapper in ("ridge", "mlp", "per_head"):  # per_head: head-matched ridge, weights [Ht, k*Ds, Dt]
    kind, structure = ("ridge", "per_head") if mapper == "per_head" else (mapper, "cross_head")
    with open(f"{mapper}.yaml", "w") as f:
        f.write(f"source: {{store: syn/source}}\ntarget: {{store: syn/target}}\nfit: {{k: [2], mapper: {kind}, "
                f"structure: {structure}, mlp: {{hidden: 16, epochs: 2}}}}\noutput: {{dir: out-{mapper}}}\n")
    art = f"out-{mapper}/k2" + ("-per_head" if mapper == "per_head" else "")
    run(fit, f"{mapper}.yaml")
    shard = "syn/source/web/shard-000.h5"
    want_k, want_v, _ = crosskv_apply.apply(art, shard)
    with h5py.File(shard, "r") as f:
        keys, values, pos = f["keys"][()], f["values"][()], f["positions"][()]
    m = crosskv.Mapper(art)
    check(m.structure == structure, f"{mapper}: Mapper.structure is {m.structure}")
    got_k, got_v = m.transfer(keys, values, pos)
    err = max(np.abs(got_k - want_k).max() / np.abs(want_k).max(), np.abs(got_v - want_v).max() / np.abs(want_v).max())
    check(got_k.shape == (keys.shape[0], 4, 2, 16) and err < 1e-5,
          f"{mapper}: Mapper.transfer equals the numpy reference (max rel. error {err:.1e})")
    tk, tv = m.transfer(torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(pos))
    check(isinstance(tk, torch.Tensor) and np.array_equal(tk.numpy(), got_k) and np.array_equal(tv.numpy(), got_v),
          f"{mapper}: torch tensors in, the same torch tensors out")
    shifted_k, _ = m.transfer(keys, values, pos, pos + 7)
    want_shift, _, _ = crosskv_apply.apply_arrays(*crosskv_apply.load_mapper(art), keys, values, pos,
                                                  pos + 7)
    check(np.abs(shifted_k - want_shift).max() / np.abs(want_shift).max() < 1e-5,
          f"{mapper}: target positions of their own (keys rotated there)")
    # The streamed mapper (one layer at a time) and the resident one (all layers in one call) agree bit for bit.
    sk, sv = crosskv.Mapper(art, resident=False).transfer(keys, values, pos)
    check(np.array_equal(sk, got_k) and np.array_equal(sv, got_v) and m.weight_bytes > 0,
          f"{mapper}: resident ({m.weight_bytes} bytes of weights) and streamed mappers give the same bits")
    # Layer by layer and in runs (what a serving stack maps while the model computes): those layers of the whole
    # call, bit for bit, resident and streamed, numpy and torch.
    streamed = crosskv.Mapper(art, resident=False)
    for layers in (0, 3, range(1, 3), range(0, 4)):
        sel = [layers] if isinstance(layers, int) else list(layers)
        for which, mm in (("resident", m), ("streamed", streamed)):
            lk, lv = mm.transfer(keys, values, pos, pos + 7, layers=layers)
            wk, wv = m.transfer(keys, values, pos, pos + 7)
            check(lk.shape == (keys.shape[0], len(sel), 2, 16) and np.array_equal(lk, wk[:, sel])
                  and np.array_equal(lv, wv[:, sel]), f"{mapper}: layers={layers!r} ({which}): those layers, the same bits")
        tk1, _ = m.transfer(torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(pos), layers=layers)
        check(np.array_equal(tk1.numpy(), got_k[:, sel]), f"{mapper}: layers={layers!r} with torch tensors")
    # A range of target heads (a tensor-parallel worker's): those heads of the whole mapping, numpy and torch.
    for heads in (range(0, 1), range(1, 2), range(0, 2)):
        hm = crosskv.Mapper(art, target_heads=heads)
        hk, hv = hm.transfer(keys, values, pos, pos + 7)
        wk, wv = m.transfer(keys, values, pos, pos + 7)
        err = max(np.abs(hk - wk[:, :, heads.start:heads.stop]).max(), np.abs(hv - wv[:, :, heads.start:heads.stop]).max())
        tk2, _ = hm.transfer(torch.from_numpy(keys), torch.from_numpy(values), torch.from_numpy(pos), layers=2)
        check(hm.heads == heads and hk.shape == (keys.shape[0], 4, len(heads), 16) and err < 1e-5 * np.abs(wk).max()
              and np.array_equal(tk2.numpy()[:, 0], hm.transfer(keys, values, pos)[0][:, 2]),
              f"{mapper}: target_heads={heads!r}: those heads of the whole mapping (max |diff| {err:.1e})")
    # A batch of sequences [batch, seq, L, H, D], positions [batch, seq] or [seq]: the stacked tokens' results.
    B = 4
    T = keys.shape[0] // B
    kb, vb = keys.reshape(B, T, 3, 2, 16), values.reshape(B, T, 3, 2, 16)
    bk, bv = m.transfer(kb, vb, pos.reshape(B, T))
    check(bk.shape == (B, T, 4, 2, 16) and np.array_equal(bk.reshape(got_k.shape), got_k)
          and np.array_equal(bv.reshape(got_v.shape), got_v), f"{mapper}: a batch [{B}, {T}, ...], positions [{B}, {T}]")
    seq_k, _ = m.transfer(kb, vb, np.arange(T))
    one_k, _ = m.transfer(keys[T:2 * T], values[T:2 * T], np.arange(T))
    err = np.abs(seq_k[1] - one_k).max() / np.abs(one_k).max()  # BLAS blocks rows of another count differently
    check(err < 2e-6, f"{mapper}: a batch with positions [seq], each sequence as if alone (rel. error {err:.1e})")
    # One mapper shared by threads (a threaded server): the calls run one at a time, each gets its own answer.
    import concurrent.futures
    cuts = [(i * 37) % keys.shape[0] + 1 for i in range(1, 25)]  # token counts that differ: scratch regrown
    alone = [m.transfer(keys[:n], values[:n], pos[:n]) for n in cuts]
    with concurrent.futures.ThreadPoolExecutor(4) as ex:
        shared = list(ex.map(lambda n: m.transfer(keys[:n], values[:n], pos[:n]), cuts * 4))
    check(all(np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1]) for a, b in zip(alone * 4, shared)),
          f"{mapper}: one mapper called from 4 threads at once gives each call the answer it gets alone")
    if torch.cuda.is_available() and crosskv.cuda_compiled_in:
        g = crosskv.Mapper(art, device="cuda")
        ck, cv = torch.from_numpy(keys).cuda(), torch.from_numpy(values).cuda()
        before = ck.clone()
        gk, gv = g.transfer(ck, cv, torch.from_numpy(pos).cuda())
        torch.cuda.synchronize()
        err = max((gk.cpu() - torch.from_numpy(got_k)).abs().max().item() / np.abs(got_k).max(),
                  (gv.cpu() - torch.from_numpy(got_v)).abs().max().item() / np.abs(got_v).max())
        check(gk.is_cuda and gv.is_cuda and torch.equal(ck, before) and err < 1e-4,
              f"{mapper}: CUDA tensors stay on the GPU ({g.backend}), the source cache untouched, the CPU's result "
              f"(max rel. error {err:.1e})")
        hk, _ = g.transfer(keys, values, pos)  # host arrays through the GPU mapper
        check(np.abs(hk - gk.cpu().numpy()).max() == 0, f"{mapper}: host arrays through the GPU mapper, the same bits")
        t32, _ = crosskv.Mapper(art, device="cuda", tf32=True).transfer(ck, cv, torch.from_numpy(pos).cuda())
        err = (t32.cpu() - torch.from_numpy(got_k)).abs().max().item() / np.abs(got_k).max()
        check(err < 1e-2, f"{mapper}: tf32 products within TF32's rounding (max rel. error {err:.1e})")
    else:
        print(f"skip {mapper}: CUDA tensors on a GPU mapper (no CUDA device, or the package was built without CUDA)")
m = crosskv.Mapper("out-ridge/k2", resident=False)
check("k=2" in repr(m) and m.k == 2 and len(m.source_layers) == 4, f"repr and properties: {m!r}")
def expect_refused(call, want):
    try:
        call()
        check(False, f"refused: {want}")
    except crosskv.MapperError as e:
        check(want in str(e), f"refused with a MapperError naming it: {e}")


# Bad input fails closed: refused by name, never mapped to wrong KV; the same with the weights resident.
nan_keys = keys.copy()
nan_keys[3, 1, 0, 5] = np.nan
inf_values = values.copy()
inf_values[7, 2, 1, 0] = -np.inf
neg, big = pos.copy(), pos.astype(np.int64)
neg[2] = -1
big[0] = 2**31
resident = crosskv.Mapper("out-ridge/k2")
for mapper in (m, resident):
    for call, want in ((lambda: mapper.transfer(nan_keys, values, pos), "keys: element 325 (token 3) is NaN"),
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
                        "layers: expected a target layer or a non-empty range of them with step 1, got 1.0")):
        expect_refused(call, want)
for call, want in ((lambda: m.transfer(keys[:, :2], values, pos), "keys: expected shape [tokens, 3, 2, 16]"),
                   (lambda: m.transfer(keys, values, pos[:5]), "positions: expected"),
                   (lambda: m.transfer(keys[0], values[0], pos), "keys: expected [tokens, 3, 2, 16] or [batch, seq"),
                   (lambda: m.transfer(keys.reshape(4, -1, 3, 2, 16), values, pos), "values: expected the keys' "
                    "leading shape (4, 128)"),
                   (lambda: m.transfer(keys.reshape(4, -1, 3, 2, 16), values.reshape(4, -1, 3, 2, 16), pos[:7]),
                    "positions: expected [4, 128] (one per token) or [seq], got [7]"),
                   (lambda: crosskv.Mapper("out-ridge/k2", device="cuda:x"), "device: expected cpu, cuda or cuda:N"),
                   (lambda: crosskv.Mapper("out-ridge/k2", device="cuda:7"),
                    "device: cuda:7: no such CUDA device here" if crosskv.cuda_compiled_in
                    else "device: cuda:7: this crosskv package was built without CUDA"),
                   (lambda: crosskv.Mapper("nonexistent"), "nonexistent/manifest.json"),
                   (lambda: crosskv.Mapper("out-ridge/k2", target_heads=range(1, 3)),
                    "target_heads: expected a non-empty range of the target's KV heads [0, 2), got first 1, count 2"),
                   (lambda: crosskv.Mapper("out-ridge/k2", target_heads=[0]),
                    "target_heads: expected a non-empty range of target KV heads with step 1, got [0]"),
                   (lambda: crosskv.Mapper("out-ridge/k2", resident=False, target_heads=range(1)),
                    "target_heads: a subset of the target's heads needs a resident mapper"),
                   (lambda: crosskv.read_manifest("nonexistent"), "nonexistent/manifest.json"),
                   (lambda: crosskv.Mapper("out-ridge/k2", device="tpu"), "device: expected cpu, cuda or cuda:N"),
                   (lambda: crosskv.hf.transfer_cache(m, [(torch.zeros(1, 2, 5, 16),) * 2] * 2),
                    "source cache: 2 layers, the mapper's source has 3"),
                   (lambda: crosskv.hf.transfer_cache(m, [(torch.zeros(1, 1, 5, 16),) * 2] * 3),
                    "source cache: 1 KV heads of 16, the mapper's source has 2 of 16")):
    expect_refused(call, want)

# ---- Hugging Face: a source model's cache handed to a larger target model.
COMMON = dict(vocab_size=257, hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=1024, rope_theta=1e6)
models = {}
for name, layers in (("source", 2), ("target", 3)):
    torch.manual_seed({"source": 1, "target": 2}[name])
    models[name] = Qwen3ForCausalLM(Qwen3Config(**COMMON, num_hidden_layers=layers)).eval()
    models[name].save_pretrained(f"model-{name}")
    byte_tokenizer().save_pretrained(f"model-{name}")
with open("text.txt", "w") as f:
    f.write(" ".join(f"turn {i}: the quick brown fox jumps over the lazy dog." for i in range(300)))
for name in ("source", "target"):
    rc = cap.main(["--model", f"model-{name}", "--text", "text.txt", "--seq-len", "64", "--n-seq", "16",
                   "--out", f"kv-{name}/web"])
    check(rc == 0, f"capture of the {name} model")
with open("hf.yaml", "w") as f:
    f.write("source: {store: kv-source}\ntarget: {store: kv-target}\nfit: {k: [all]}\noutput: {dir: out-hf}\n")
run(fit, "hf.yaml")
m = crosskv.Mapper("out-hf/kall")
tok = byte_tokenizer()
prompt = tok("turn 7: the quick brown fox", return_tensors="pt").input_ids
with torch.no_grad():
    answered = models["source"].generate(prompt, max_new_tokens=8, do_sample=False)  # the source answers a turn
    src_out = models["source"](answered, use_cache=True)
cache = crosskv.hf.transfer_cache(m, src_out.past_key_values)
layers = crosskv.hf.cache_layers(cache)
check(len(layers) == 3 and tuple(layers[0][0].shape) == (1, 2, answered.shape[1], 16),
      f"transfer_cache: a DynamicCache of the target's 3 layers, {tuple(layers[0][0].shape)}")
# The same tokens through the command line: crosskv-apply writes what the helper returns.
with h5py.File("turn.h5", "w") as f:
    seq_ids = answered[0].numpy().astype(np.int32)
    src_layers = crosskv.hf.cache_layers(src_out.past_key_values)
    f["keys"] = torch.stack([k[0] for k, _ in src_layers]).permute(2, 0, 1, 3).numpy()
    f["values"] = torch.stack([v[0] for _, v in src_layers]).permute(2, 0, 1, 3).numpy()
    with h5py.File("kv-source/web/shard-000.h5", "r") as s:
        for a in s.attrs:
            f.attrs[a] = s.attrs[a]
    f["token_ids"] = seq_ids
    f["positions"] = np.arange(len(seq_ids), dtype=np.int32)
    f["seq_offsets"] = np.array([0, len(seq_ids)], dtype=np.int64)
try:
    run(apply_bin, "--mapper", "out-hf/kall", "--source", "turn.h5", "--out", "turn-mapped.h5")
    with h5py.File("turn-mapped.h5", "r") as f:
        cli_k = f["keys"][()]
    hf_k = torch.stack([k[0] for k, _ in layers]).permute(2, 0, 1, 3).numpy()
    err = np.abs(hf_k - cli_k).max() / np.abs(cli_k).max()
    check(err < 1e-6, f"transfer_cache's keys are crosskv-apply's for the same tokens (max rel. error {err:.1e})")
except SystemExit as e:
    check(False, f"crosskv-apply of the turn: {e}")
# The target continues the conversation from the transferred cache: generate feeds only the uncached last token.
cache = crosskv.hf.transfer_cache(m, models["source"](answered[:, :-1], use_cache=True).past_key_values)
with torch.no_grad():
    cont = models["target"].generate(answered, past_key_values=cache, max_new_tokens=6, do_sample=False)
with torch.no_grad():
    with_cache = models["target"](answered[:, -1:], past_key_values=crosskv.hf.transfer_cache(
        m, models["source"](answered[:, :-1], use_cache=True).past_key_values)).logits[0, -1]
    alone = models["target"](answered[:, -1:]).logits[0, -1]
check(not torch.allclose(with_cache, alone), "the transferred cache is attended to (logits differ from no prefix)")
check(cont.shape[1] == answered.shape[1] + 6 and torch.equal(cont[:, :answered.shape[1]], answered),
      f"the target continues from the transferred cache with generate: {tok.decode(cont[0, answered.shape[1]:])!r}")
# The handoff example as a user runs it, on these models.
r = subprocess.run([sys.executable, os.path.join(HERE, "..", "..", "examples", "handoff.py"), "--source", "model-source",
                    "--target", "model-target", "--mapper", "out-hf/kall", "--prompt", "turn 3: the quick",
                    "--answer-tokens", "6", "--continue-tokens", "5"], capture_output=True, text=True)
lines = r.stdout.splitlines()
check(r.returncode == 0 and any(l.startswith("target after crosskv transfer (") for l in lines)
      and any(l.startswith("greedy tokens that agree: ") for l in lines),
      "examples/handoff.py runs: " + (lines[-1] if lines else r.stderr.strip()[-300:]))
if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("package OK")
