"""crosskv-capture at node scale, on tiny models made here (no downloads): parts, device_map, the checkpoint's dtype,
a kill in the middle of a part, and a disk without room.
- 2 parts (--part, and Slurm's array variables) give shards whose token_ids, positions, keys, values and queries equal
  a one-part capture's, byte for byte; --same-tokens-as pairs a part with the shards the other model has so far;
- --device auto loads through Hugging Face's device_map="auto" (accelerate) and captures what --device cpu does;
- a bf16 checkpoint captured without --model-dtype runs in bf16, and the shard records it;
- kill -9 in the middle of a part, then a rerun: the same bytes as an uninterrupted run, and no unfinished file left;
- a 2 MiB tmpfs: refused by name before anything is written; a disk that fills after the plan stops at the next
  shard's check, and one filled in the middle of a shard exits 2 with one line (HDF5 used to crash the process), the
  unfinished file removed either way (skipped where a tmpfs cannot be mounted: not root);
- bad --part, --max-memory and --model-dtype refused with one line naming the flag.
Run by tests/python/capture_parts.sh (the capture environment).
"""
import contextlib
import io
import os
import signal
import subprocess
import sys
import time

import h5py
import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from tiny_hf import byte_tokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
CAPTURE = [sys.executable, "-m", "crosskv.capture"]  # the console script crosskv-capture, in this environment
from crosskv import capture as cap  # noqa: E402

DATASETS = ("token_ids", "positions", "keys", "values", "queries")


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


def same_store(a, b):
    """None when two stores hold the same shard names with equal datasets; the first difference otherwise."""
    na, nb = sorted(os.listdir(a)), sorted(os.listdir(b))
    if na != nb:
        return f"shards {na} vs {nb}"
    for n in na:
        with h5py.File(os.path.join(a, n)) as x, h5py.File(os.path.join(b, n)) as y:
            for d in DATASETS:
                if not np.array_equal(x[d][()], y[d][()]) or x[d].dtype != y[d].dtype:
                    return f"{n}:{d}"
    return None


def base(seq_len=64, n_seq=20):
    return ["--text", "text.txt", "--seq-len", str(seq_len), "--n-seq", str(n_seq), "--shard-seqs", "4", "--queries",
            "--stride", "2"]


BASE = base()


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """A tiny Qwen3 saved in fp32 (m32) and bf16 (m16), a text; entered: the folder, where the captures go."""
    work = tmp_path_factory.mktemp("capture")
    os.chdir(work)
    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=257, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024)
    model = Qwen3ForCausalLM(config).eval()
    model.save_pretrained("m32")
    model.to(torch.bfloat16).save_pretrained("m16")
    for m in ("m32", "m16"):
        byte_tokenizer().save_pretrained(m)
    with open("text.txt", "w") as f:
        f.write(" ".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(3000)))
    return work


@pytest.fixture(scope="module")
def one_part(models):
    """The bf16 checkpoint, one part, device_map="auto" (the default --device): (exit code, log)."""
    return run(["--model", "m16", *BASE, "--out", "one/web"])


def test_a_bf16_checkpoint_runs_in_bf16_and_the_shard_records_it(one_part):
    rc, log = one_part
    with h5py.File("one/web/shard-000.h5") as f:
        assert rc == 0 and f.attrs.get("model_dtype") == "bfloat16" and "(bfloat16 on cpu)" in log


def test_the_plan_gives_bytes_a_token_and_the_store_comes_out_that_size(one_part):
    _, log = one_part
    plan = [line for line in log.splitlines() if "plan:" in line]
    # 3 layers x 16 dims x 2 bytes x (2 x 2 KV heads + 4 query heads) + a token id and a position
    assert plan and "776 bytes a token" in plan[0] and "5 of 5 shards" in plan[0], log[-300:]
    on_disk = sum(os.path.getsize(os.path.join("one/web", n)) for n in os.listdir("one/web"))
    assert 20 * 32 * 776 <= on_disk <= 20 * 32 * 776 + 5 * (64 << 10)  # the check's allowance: 64 KiB a shard
    assert all(w in log for w in ("tokens/s", "written", "ETA")), "the log shows tokens/s, bytes written and the ETA"


def test_device_auto_loads_through_device_map_and_captures_what_cpu_does(one_part):
    _, hf_model = cap.load("m16", "auto", "auto")
    assert getattr(hf_model, "hf_device_map", None) is not None and hf_model.dtype == torch.bfloat16
    rc, _ = run(["--model", "m16", *BASE, "--out", "cpu/web", "--device", "cpu"])
    assert rc == 0 and same_store("one/web", "cpu/web") is None


def test_model_dtype_float32_runs_a_bf16_checkpoint_in_fp32(models):
    rc, _ = run(["--model", "m16", *BASE, "--out", "f32/web", "--model-dtype", "float32"])
    with h5py.File("f32/web/shard-000.h5") as f:
        assert rc == 0 and f.attrs["model_dtype"] == "float32"


def test_two_parts_give_the_one_part_capture_byte_for_byte_and_resume(one_part):
    for i in (0, 1):
        rc, _ = run(["--model", "m16", *BASE, "--out", "parts/web", "--part", f"{i}/2"])
        assert rc == 0
    assert same_store("one/web", "parts/web") is None
    rc, log = run(["--model", "m16", *BASE, "--out", "parts/web", "--part", "0/2"])
    assert rc == 0 and "0 to write" in log, "a part whose shards exist writes nothing"


def test_slurm_array_tasks_give_the_one_part_capture_in_either_order(one_part):
    for i in (1, 0):
        rc, log = run(["--model", "m16", *BASE, "--out", "slurm/web"],
                      env={"SLURM_ARRAY_TASK_ID": str(10 + i), "SLURM_ARRAY_TASK_MIN": "10",
                           "SLURM_ARRAY_TASK_COUNT": "2"})
        if i == 1:
            assert sorted(os.listdir("slurm/web")) == ["shard-001.h5", "shard-003.h5"] and "SLURM_ARRAY_TASK_ID" in log
    assert same_store("one/web", "slurm/web") is None


def test_same_tokens_as_pairs_a_part_with_the_other_models_shards_so_far(models):
    run(["--model", "m32", *BASE, "--out", "src/web", "--part", "0/2"])
    rc, log = run(["--model", "m16", *BASE, "--out", "tgt/web", "--part", "1/2", "--same-tokens-as", "src/web"])
    assert rc == 0, log.strip()[-150:]
    rc, log = run(["--model", "m16", *base(seq_len=48), "--out", "tgt48/web", "--part", "1/2", "--same-tokens-as",
                   "src/web"])
    assert rc == 2 and "--same-tokens-as src/web: shard-000.h5's token_ids differ" in log


def test_a_rerun_after_kill_9_mid_shard_gives_the_uninterrupted_bytes(models):
    args = [*CAPTURE, "--model", "m32", *base(256, 128), "--out", "killed/web", "--part", "1/2",
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
    assert p.returncode == -signal.SIGKILL and mid and len([n for n in left if n.endswith(".h5")]) < 16, left[-2:]
    r = subprocess.run(args, capture_output=True, text=True)
    rc, _ = run(["--model", "m32", *base(256, 128), "--out", "whole/web", "--part", "1/2"])
    assert r.returncode == 0 and rc == 0
    assert not any(".tmp-" in n for n in os.listdir("killed/web")), "no unfinished file left"
    assert same_store("whole/web", "killed/web") is None


@pytest.fixture
def tmpfs(models):
    """A 2 MiB tmpfs, mounted for the test (skipped where it cannot be: not root)."""
    path = os.path.join(models, "tmpfs")
    os.makedirs(path, exist_ok=True)
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", path], capture_output=True).returncode != 0:
        pytest.skip("a 2 MiB tmpfs could not be mounted here (not root?)")
    yield path
    subprocess.run(["umount", path])


def last_line(log):
    return log.strip().splitlines()[-1] if log.strip() else ""


def test_a_disk_without_room_is_refused_by_name_before_anything_is_written(tmpfs):
    rc, log = run(["--model", "m32", *base(n_seq=400), "--out", os.path.join(tmpfs, "web")])
    line = last_line(log)
    assert rc == 2 and f"--out {tmpfs}/web: not enough disk" in line and "is free" in line, line
    assert os.listdir(os.path.join(tmpfs, "web")) == []


def test_a_disk_that_fills_after_the_plan_stops_at_the_next_shards_check(tmpfs, monkeypatch):
    """A plan told of room that is not there: the next shard's own check stops it, in one line, before HDF5 meets the
    full disk; the shards before it are kept."""
    real_usage, calls = cap.shutil.disk_usage, []

    def lying_once(path):
        calls.append(path)
        return real_usage(path)._replace(free=1 << 40) if len(calls) == 1 else real_usage(path)

    monkeypatch.setattr(cap.shutil, "disk_usage", lying_once)
    rc, log = run(["--model", "m32", *base(n_seq=400), "--out", os.path.join(tmpfs, "web")])
    line, left = last_line(log), os.listdir(os.path.join(tmpfs, "web"))
    assert rc == 2 and f"--out {tmpfs}/web: not enough disk left for shard-" in line and "shards remain" in line, line
    assert left and not any(".tmp-" in n for n in left)


def test_a_disk_filled_in_the_middle_of_a_shard_exits_2_in_one_line(tmpfs):
    """Every check told of room: HDF5 meets the full disk; one line, exit 2, the unfinished file removed, no crash."""
    lie = ("import sys, shutil; from crosskv import capture as cap; "
           "real = shutil.disk_usage; cap.shutil.disk_usage = lambda p: real(p)._replace(free=1 << 40); "
           "sys.exit(cap.main(sys.argv[1:]))")
    r = subprocess.run([sys.executable, "-c", lie, "--model", "m32", *base(n_seq=400),
                        "--out", os.path.join(tmpfs, "web")], capture_output=True, text=True)
    line = last_line(r.stderr)
    assert r.returncode == 2 and f"--out {tmpfs}/web: the disk filled while writing shard-" in line, line
    assert not any(".tmp-" in n for n in os.listdir(os.path.join(tmpfs, "web")))


@pytest.mark.parametrize("extra,want", [
    (["--part", "2/2"], "--part 2/2: expected I/N with 0 <= I < N"),
    (["--part", "one"], "--part one: expected I/N"),
    (["--max-memory", "0:1GiB"], "--max-memory 0:1GiB: expected DEVICE=SIZE items"),
    (["--max-memory", "cpu=1GiB", "--device", "cpu"], "--max-memory: only with --device auto"),
    (["--model-dtype", "float13"], "--model-dtype float13: expected auto")])
def test_a_bad_flag_is_refused_in_one_line_naming_it(models, extra, want):
    rc, log = run(["--model", "m32", *BASE, "--out", "bad/web", *extra])
    line = last_line(log)
    assert rc == 2 and line.startswith("crosskv-capture: error: ") and want in line, line
