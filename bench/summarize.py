"""summarize.py OUT_DIR: the ratios of bench/run_bench.sh from its JSON files and fit log."""
import json
import re
import sys

out = sys.argv[1]
kernels = {}
for b in json.load(open(f"{out}/kernels.json"))["benchmarks"]:
    if b.get("aggregate_name") in (None, "median"):
        kernels[b["run_name"].split("/")[0]] = b["flops"] / 1e9
acc, blk, wide = kernels["BM_accumulate_full"], kernels["BM_sgemm_block"], kernels["BM_sgemm_wide"]
st = json.load(open(f"{out}/stream.json"))
fit = json.load(open(f"{out}/fit.json"))
npy = json.load(open(f"{out}/numpy.json"))
log = re.sub(r"\x1b\[[0-9;]*m", "", open(f"{out}/fit.log").read())
stages = {n: t for n, t in re.findall(r"\]\s+(\S+)\s+(\S+(?: s)?)\s+[\d.]+%", log)}
lines = [
    f"tokens: {npy['tokens']}, source 12x8x64 -> target 16x8x64, bf16 shards, k sweep 1,2,4,8,all",
    f"(a) moment accumulation {acc:.1f} GFLOP/s; OpenBLAS sgemm on the same block shape {blk:.1f} GFLOP/s "
    f"-> {100 * acc / blk:.0f}%; on the widest shape [{wide:.1f} GFLOP/s] -> {100 * acc / wide:.0f}%",
    f"(b) crosskv-fit {fit['wall_s']:.1f} s (stages {stages}); numpy {npy['total_s']:.1f} s "
    f"(load+strip {npy['load_s']} s, probe {npy['probe_s']} s, fits {npy['fit_s']} s) "
    f"-> crosskv {npy['total_s'] / fit['wall_s']:.1f}x faster",
    f"(c) streaming read (read + bf16->fp32 + RoPE strip + finiteness check, no moments): "
    f"{st['tokens_per_s']:.0f} tokens/s, {st['fp32_mb_per_s']:.0f} MB/s as fp32 "
    f"({st['fp32_mb_per_s'] / 2:.0f} MB/s of bf16 read from disk)",
]
open(f"{out}/summary.txt", "w").write("\n".join(lines) + "\n")
print("\n".join(lines))
