"""planted_bugs.py BUILD_DIR WORK_DIR: proves that the host emulation of CUDA catches bugs in the CUDA backend.

Each mutant plants one bug in a copy of backends/cuda/ (one change), rebuilds only the emulated object it touches, relinks
test_cuda_emulated with it, and runs the test named for it, which must fail. The build's own commands are reused
(compile_commands.json, ninja -t commands), so a mutant costs one compile and one link. Exit 0 when every mutant
is caught; the table of mutants and the tests that caught them is printed either way.
"""
import json
import os
import re
import shutil
import subprocess
import sys

# (name, file under backends/cuda/, text, replacement, test that must fail[, the emulated object to rebuild when the file is
# a header])
MUTANTS = [
    ("wrong transpose in one cuBLAS call (cross_acc)", "dense_maths.cu",
     "cublasSgemm_64(res_.blas(), CUBLAS_OP_N, CUBLAS_OP_T, n, m, rows,",
     "cublasSgemm_64(res_.blas(), CUBLAS_OP_T, CUBLAS_OP_T, n, m, rows,",
     "Cuda.MomentsMatchTheCpuOverManyBlocks"),
    ("wrong leading dimension in one cuBLAS call (gemm_batched's C)", "dense_maths.cu",
     "dA, g.lda, g.stride_a, &g.beta, dC, g.ldc, g.stride_c, g.batch)",
     "dA, g.lda, g.stride_a, &g.beta, dC, g.n, g.stride_c, g.batch)",
     "Cuda.BatchedGemmOfEveryTransposeAndStrideMatchesTheCpu"),
    ("no stream synchronisation before the host reads a product (gemm_batched)", "dense_maths.cu",
     "CK(cudaMemcpyAsync(g.C, dC, nc * 4, cudaMemcpyDeviceToHost, res_.compute()), ops);\n  CK(cudaStreamSynchronize(res_.compute()), ops);",
     "CK(cudaMemcpyAsync(g.C, dC, nc * 4, cudaMemcpyDeviceToHost, res_.compute()), ops);",
     "Cuda.BatchedGemmOfEveryTransposeAndStrideMatchesTheCpu"),
    ("the compute stream no longer waits for the input copies (stage_inputs)", "device_resources.cu",
     'CK(cudaStreamWaitEvent(compute_, s.copied, 0), "");',
     "",
     "Cuda.MomentsMatchTheCpuOverManyBlocks"),
    ("the prepare kernel ignoring the token weights' row scale (fit.weighting: dataset)", "kernels.cu",
     "    if (row_scale) x = __fmul_rn(x, row_scale[t]);\n",
     "",
     "Cuda.PrepareMatchesTheHostForEveryDtypeAndRope"),
    ("the host's row weights passed to the column-stats kernel (fit.weighting: dataset)", "inputs.cu",
     "cuda::launch_column_stats(d_x, rows, cols, ldx, d_w,",
     "cuda::launch_column_stats(d_x, rows, cols, ldx, row_weight,",
     "Cuda.GatherHeadsAndColumnStatsMatchTheHost"),
    ("a host pointer passed to a kernel (column_stats)", "inputs.cu",
     "cuda::launch_column_stats(d_x, rows,",
     "cuda::launch_column_stats(X, rows,",
     "Cuda.GatherHeadsAndColumnStatsMatchTheHost"),
    ("a missing cudaFree (a growing device buffer never gives its memory back)", "resources.hpp",
     "if (p_) cudaFree(p_);\n    p_ = nullptr;\n    cap_ = 0;",
     "p_ = nullptr;\n    cap_ = 0;",
     "Cuda.BatchedGemmOfEveryTransposeAndStrideMatchesTheCpu", "device_resources.cpp"),
    ("an NCCL reduction summing the ranks in the wrong order", "nccl_comm.cu",
     "T s = parts[i];\n    for (int r = 1; r < ranks; ++r) s += parts[r * count + i];",
     "T s = parts[(ranks - 1) * count + i];\n    for (int r = ranks - 2; r >= 0; --r) s += parts[r * count + i];",
     "CudaNccl.CollectivesEqualTheHostCollectivesBitForBit"),
    ("a kernel reading one element past its row (gather_heads)", "kernels.cu",
     "out[i] = X[t * W + (a * H + h) * D + j];",
     "out[i] = X[t * W + (a * H + h) * D + j + 1];",
     "Cuda.GatherHeadsAndColumnStatsMatchTheHost"),
    ("the host reading a device result directly (cuSOLVER's info in potrf)", "dense_maths.cu",
     "CK(cudaMemcpyAsync(&info, res_.info(), sizeof(int), cudaMemcpyDeviceToHost, res_.compute()), ops);\n  CK(cudaStreamSynchronize(res_.compute()), ops);\n  CROSSKV_ASSERT(info >= 0",
     "CK(cudaStreamSynchronize(res_.compute()), ops);\n  info = *res_.info();\n  CROSSKV_ASSERT(info >= 0",
     "Cuda.CholeskyAndSolvesMatchTheCpu"),
    ("gemm_batched with beta 0 overwriting C between its outputs (the bug the emulation found)", "dense_maths.cu",
     "if (g.beta != 0.0f || !tiles)",
     "if (g.beta != 0.0f)",
     "Cuda.BatchedGemmOfEveryTransposeAndStrideMatchesTheCpu"),
    ("held sums that start from the device's fresh memory instead of zeros (DeviceSums::make)", "held_sums.hpp",
     "if (host_is_zero)\n      h->zero();\n    else",
     "if (!host_is_zero)",
     "Cuda.MomentsMatchTheCpuOverManyBlocks", "cuda_backend.cpp"),
]


def main():
    build, work = os.path.abspath(sys.argv[1]), os.path.abspath(sys.argv[2])
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    shutil.rmtree(work, ignore_errors=True)
    os.makedirs(work)
    commands = json.load(open(os.path.join(build, "compile_commands.json")))
    link = subprocess.run(["ninja", "-C", build, "-t", "commands", "test_cuda_emulated"], check=True,
                          capture_output=True, text=True).stdout.strip().splitlines()[-1]
    archive = "libcrosskv_backends_emulated.a"
    assert f" {archive} " in link, "the link command does not name " + archive
    caught = 0
    rows = []
    for i, (name, file, old, new, test, *rebuild) in enumerate(MUTANTS):
        m = os.path.join(work, f"mutant-{i}")
        shutil.copytree(os.path.join(root, "backends", "cuda"), os.path.join(m, "src", "backends", "cuda"))
        path = os.path.join(m, "src", "backends", "cuda", file)
        text = open(path).read()
        assert text.count(old) == 1, f"mutant {i} ({name}): the text to change occurs {text.count(old)} times in {file}"
        open(path, "w").write(text.replace(old, new))
        wrapper = rebuild[0] if rebuild else file.replace(".cu", ".cpp")
        entry = next(e for e in commands if e["file"].endswith("cuda/emulation/" + wrapper))
        obj = os.path.join(m, wrapper + ".o")
        cmd = entry["command"]
        cmd = re.sub(r" -o \S+", " -o " + obj, cmd)
        cmd = cmd.replace(entry["file"], os.path.join(m, "src", "backends", "cuda", "emulation", wrapper))
        compiler, rest = cmd.split(" ", 1)
        cmd = f"{compiler} -I{os.path.join(m, 'src')} {rest}"
        subprocess.run(cmd, shell=True, check=True, cwd=entry["directory"], capture_output=True)
        lib = os.path.join(m, archive)
        shutil.copy(os.path.join(build, archive), lib)
        subprocess.run(["ar", "r", lib, obj], check=True, cwd=m, capture_output=True)
        exe = os.path.join(m, "test_cuda_emulated")
        mlink = link.replace(f" {archive} ", f" {lib} ").replace(" -o tests/test_cuda_emulated ", f" -o {exe} ")
        subprocess.run(mlink, shell=True, check=True, cwd=build)
        env = dict(os.environ, CROSSKV_CUDA_EMULATION_DEVICES="4")
        r = subprocess.run([exe, f"--gtest_filter={test}"], env=env, capture_output=True, text=True, timeout=300)
        out = r.stdout + r.stderr
        failed_test = f"[  FAILED  ] {test}" in out
        how = ("test failed" if failed_test else "") + (", " if failed_test and r.returncode == 86 else "")
        how += "emulation exit 86" if r.returncode == 86 else ""
        if r.returncode < 0:
            how = f"killed by signal {-r.returncode}"
        ok = r.returncode != 0 and "[  PASSED  ] 1 test" not in out or failed_test
        if ok and not how:
            how = f"exit {r.returncode}"
        caught += ok
        first = next((l for l in out.splitlines() if "misuse:" in l or "SIGSEGV" in l), "") or \
            next((l for l in out.splitlines() if "Failure" in l), "")
        rows.append((name, test, how if ok else "NOT CAUGHT", first.strip()[:140]))
        shutil.rmtree(os.path.join(m, "src"))
    for name, test, how, first in rows:
        print(f"- {name}\n    {test}: {how}\n    {first}")
    print(f"planted bugs: {caught} of {len(MUTANTS)} caught")
    return 0 if caught == len(MUTANTS) else 1


if __name__ == "__main__":
    sys.exit(main())
