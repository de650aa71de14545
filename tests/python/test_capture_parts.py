"""crosskv-capture at node scale, on tiny models made here (no downloads): parts, device_map, the checkpoint's dtype,
a kill in the middle of a part, and a disk without room.
- 2 parts (--part, and Slurm's array variables) give shards whose token_ids, positions, keys, values and queries equal
  a one-part capture's, byte for byte; --same-tokens-as pairs a part with the shards the other model has so far;
- --device auto loads through Hugging Face's device_map="auto" (accelerate) and captures what --device cpu does;
- a bf16 checkpoint captured without --model-dtype runs in bf16, and the shard records it;
- kill -9 in the middle of a part, then a rerun: the same bytes as an uninterrupted run, and no unfinished file left;
- a 2 MiB tmpfs: refused by name before anything is written; a disk that fills after the plan stops at the next
  shard's check, and one filled in the middle of a shard exits 2 with one line (HDF5 used to crash the process), the
  unfinished file removed either way;
- bad --part, --max-memory and --model-dtype refused with one line naming the flag.

    python test_capture_parts.py WORKDIR        (in the capture environment)
"""
import contextlib
import io
import os
import shutil
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = os.path.join(HERE, "..", "..", "tools", "capture", "crosskv_capture.py")
sys.path.insert(0, os.path.dirname(CAPTURE))
import crosskv_capture as cap  # noqa: E402
sys.path.insert(0, HERE)
from tiny_hf import byte_tokenizer  # noqa: E402

failures = []


def check(cond, what):
    print(("ok   " if cond else "FAIL ") + what, flush=True)
    if not cond:
        failures.append(what)


def run(args, env=None):
    """crosskv-capture in this process: (exit code, what it printed to stderr)."""
    err = io.StringIO()
    old = dict(os.environ)
    os.environ.update(env or {})
    try:
        with contextlib.redirect_stderr(err):
            rc = cap.main(args)
    finally:
        os.environ.clear()
        os.environ.update(old)
    return rc, err.getvalue()


DATASETS = ("token_ids", "positions", "keys", "values", "queries")


def same_store(a, b):
    """Whether two stores hold the same shard names with equal datasets; the first difference otherwise."""
    na, nb = sorted(os.listdir(a)), sorted(os.listdir(b))
    if na != nb:
        return f"shards {na} vs {nb}"
    for n in na:
        with h5py.File(os.path.join(a, n)) as x, h5py.File(os.path.join(b, n)) as y:
            for d in DATASETS:
                if not np.array_equal(x[d][()], y[d][()]) or x[d].dtype != y[d].dtype:
                    return f"{n}:{d}"
    return None


work = os.path.abspath(sys.argv[1])
shutil.rmtree(work, ignore_errors=True)
os.makedirs(work)
os.chdir(work)
torch.manual_seed(0)
config = Qwen3Config(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
                     num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
model = Qwen3ForCausalLM(config).eval()
model.save_pretrained("m32")
model.to(torch.bfloat16).save_pretrained("m16")
for m in ("m32", "m16"):
    byte_tokenizer().save_pretrained(m)
with open("text.txt", "w") as f:
    f.write(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(3000)))


def base(seq_len=64, n_seq=20):
    return ["--text", "text.txt", "--seq-len", str(seq_len), "--n-seq", str(n_seq), "--shard-seqs", "4", "--queries",
            "--stride", "2"]


BASE = base()

# ---- the checkpoint's dtype, one part, device_map="auto" (the default --device)
rc, log = run(["--model", "m16", *BASE, "--out", "one/web"])
with h5py.File("one/web/shard-000.h5") as f:
    recorded = f.attrs.get("model_dtype")
check(rc == 0 and recorded == "bfloat16" and "(bfloat16 on cpu)" in log,
      f"a bf16 checkpoint without --model-dtype runs in bf16 and the shard records it ({recorded})")
plan = [line for line in log.splitlines() if "plan:" in line]
# 3 layers x 16 dims x 2 bytes x (2 x 2 KV heads + 4 query heads) + a token id and a position
on_disk = sum(os.path.getsize(os.path.join("one/web", n)) for n in os.listdir("one/web"))
check(plan and "776 bytes a token" in plan[0] and "5 of 5 shards" in plan[0]
      and 20 * 32 * 776 <= on_disk <= 20 * 32 * 776 + 5 * (64 << 10),  # the check's allowance: 64 KiB a shard
      f"the plan line gives bytes a token and the store's size, {on_disk} bytes on disk for {20 * 32 * 776} planned: "
      f"{plan[0] if plan else log[-300:]}")
check(all(w in log for w in ("tokens/s", "written", "ETA")), "the log shows tokens/s, bytes written and the ETA")
_, hf_model = cap.load("m16", "auto", "auto")
check(getattr(hf_model, "hf_device_map", None) is not None and hf_model.dtype == torch.bfloat16,
      f"--device auto loads through device_map='auto' ({hf_model.hf_device_map})")
rc, _ = run(["--model", "m16", *BASE, "--out", "cpu/web", "--device", "cpu"])
check(rc == 0 and same_store("one/web", "cpu/web") is None, "--device auto captures what --device cpu does")
rc, _ = run(["--model", "m16", *BASE, "--out", "f32/web", "--model-dtype", "float32"])
with h5py.File("f32/web/shard-000.h5") as f:
    check(rc == 0 and f.attrs["model_dtype"] == "float32", "--model-dtype float32 runs a bf16 checkpoint in fp32")

# ---- 2 parts = 1 part, by --part and by Slurm's array variables
for i in (0, 1):
    rc, log = run(["--model", "m16", *BASE, "--out", "parts/web", "--part", f"{i}/2"])
check(rc == 0 and same_store("one/web", "parts/web") is None,
      f"2 parts (--part) give the one-part capture's shards, byte for byte ({same_store('one/web', 'parts/web')})")
for i in (1, 0):  # in either order
    rc, log = run(["--model", "m16", *BASE, "--out", "slurm/web"],
                  env={"SLURM_ARRAY_TASK_ID": str(10 + i), "SLURM_ARRAY_TASK_MIN": "10", "SLURM_ARRAY_TASK_COUNT": "2"})
    if i == 1:
        check(sorted(os.listdir("slurm/web")) == ["shard-001.h5", "shard-003.h5"] and "SLURM_ARRAY_TASK_ID" in log,
              f"Slurm's array task 1 of 2 captures shards 1 and 3 ({sorted(os.listdir('slurm/web'))})")
check(same_store("one/web", "slurm/web") is None, "2 Slurm array tasks give the one-part capture's shards")
rc, log = run(["--model", "m16", *BASE, "--out", "parts/web", "--part", "0/2"])
check(rc == 0 and "0 to write" in log, "a part whose shards exist writes nothing (resumable)")

# ---- --same-tokens-as across parts: the target's part 1 against the source's shards so far (part 0's only)
run(["--model", "m32", *BASE, "--out", "src/web", "--part", "0/2"])
rc, log = run(["--model", "m16", *BASE, "--out", "tgt/web", "--part", "1/2", "--same-tokens-as", "src/web"])
check(rc == 0, f"--same-tokens-as a store of another part's shards pairs by name ({log.strip()[-150:]})")
rc, log = run(["--model", "m16", *base(seq_len=48), "--out", "tgt48/web", "--part", "1/2", "--same-tokens-as", "src/web"])
check(rc == 2 and "--same-tokens-as src/web: shard-000.h5's token_ids differ" in log,
      f"--same-tokens-as refuses shards of other tokens: {log.strip().splitlines()[-1]}")

# ---- kill -9 in the middle of a part, then a rerun: the same bytes as the uninterrupted part
args = [sys.executable, CAPTURE, "--model", "m32", *base(256, 128), "--out", "killed/web", "--part", "1/2",
        "--batch", "1"]
p = subprocess.Popen(args, stderr=subprocess.DEVNULL)
t0, mid = time.time(), False
while time.time() - t0 < 120 and p.poll() is None and not mid:
    names = os.listdir("killed/web") if os.path.isdir("killed/web") else []
    mid = any(n.endswith(".h5") for n in names) and any(".tmp-" in n for n in names)  # a shard done, one in hand
    time.sleep(0.002)
p.send_signal(signal.SIGKILL)
p.wait()
left = sorted(os.listdir("killed/web"))
check(p.returncode == -signal.SIGKILL and mid and len([n for n in left if n.endswith(".h5")]) < 16,
      f"killed in the middle of a shard of the part ({left[-2:]})")
r = subprocess.run(args, capture_output=True, text=True)
rc, _ = run(["--model", "m32", *base(256, 128), "--out", "whole/web", "--part", "1/2"])
check(r.returncode == 0 and not any(".tmp-" in n for n in os.listdir("killed/web"))
      and same_store("whole/web", "killed/web") is None,
      f"a rerun after kill -9 gives the uninterrupted run's bytes, no unfinished file left "
      f"({same_store('whole/web', 'killed/web')})")

# ---- a disk without room: refused by name before anything is written
tmpfs = os.path.join(work, "tmpfs")
os.makedirs(tmpfs)
mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", tmpfs], capture_output=True).returncode == 0
if mounted:
    try:
        rc, log = run(["--model", "m32", *base(n_seq=400), "--out", os.path.join(tmpfs, "web")])
        line = log.strip().splitlines()[-1]
        check(rc == 2 and f"--out {tmpfs}/web: not enough disk" in line and "is free" in line
              and os.listdir(os.path.join(tmpfs, "web")) == [],
              f"a 2 MiB tmpfs is refused before anything is written: {line}")
        # A disk that fills after the plan (here: a plan told of room that is not there): the next shard's own
        # check stops it, in one line, before HDF5 meets the full disk; the shards before it are kept.
        real_usage, calls = cap.shutil.disk_usage, []

        def lying_once(path):
            calls.append(path)
            return real_usage(path)._replace(free=1 << 40) if len(calls) == 1 else real_usage(path)

        cap.shutil.disk_usage = lying_once
        try:
            rc, log = run(["--model", "m32", *base(n_seq=400), "--out", os.path.join(tmpfs, "web")])
        finally:
            cap.shutil.disk_usage = real_usage
        line = log.strip().splitlines()[-1]
        left = os.listdir(os.path.join(tmpfs, "web"))
        check(rc == 2 and f"--out {tmpfs}/web: not enough disk left for shard-" in line and "shards remain" in line
              and left and not any(".tmp-" in n for n in left),
              f"a disk that fills after the plan: the next shard's check stops it ({len(left)} shards kept): {line}")
        # The disk filled by another writer in the middle of a shard (here: every check told of room): HDF5 meets
        # it; one line, exit 2, the unfinished file removed, and no crash.
        shutil.rmtree(os.path.join(tmpfs, "web"))
        lie = ("import sys, shutil; sys.path.insert(0, sys.argv[1]); import crosskv_capture as cap; "
               "real = shutil.disk_usage; cap.shutil.disk_usage = lambda p: real(p)._replace(free=1 << 40); "
               "sys.exit(cap.main(sys.argv[2:]))")
        r = subprocess.run([sys.executable, "-c", lie, os.path.dirname(CAPTURE), "--model", "m32", *base(n_seq=400),
                            "--out", os.path.join(tmpfs, "web")], capture_output=True, text=True)
        line = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
        left = os.listdir(os.path.join(tmpfs, "web"))
        check(r.returncode == 2 and f"--out {tmpfs}/web: the disk filled while writing shard-" in line
              and not any(".tmp-" in n for n in left),
              f"a disk filled in the middle of a shard: exit {r.returncode}, one line, no unfinished file: {line}")
    finally:
        subprocess.run(["umount", tmpfs])
else:
    print("SKIPPED (in part): a 2 MiB tmpfs could not be mounted here (not root?); the disk check is not tested")

# ---- bad flags, one line each
for extra, want in ((["--part", "2/2"], "--part 2/2: expected I/N with 0 <= I < N"),
                    (["--part", "one"], "--part one: expected I/N"),
                    (["--max-memory", "0:1GiB"], "--max-memory 0:1GiB: expected DEVICE=SIZE items"),
                    (["--max-memory", "cpu=1GiB", "--device", "cpu"], "--max-memory: only with --device auto"),
                    (["--model-dtype", "float13"], "--model-dtype float13: expected auto")):
    rc, log = run(["--model", "m32", *BASE, "--out", "bad/web", *extra])
    line = log.strip().splitlines()[-1] if log.strip() else ""
    check(rc == 2 and line.startswith("crosskv-capture: error: ") and want in line, f"refused: {line}")

if failures:
    print(f"{len(failures)} check(s) failed")
    sys.exit(1)
print("capture parts OK")
