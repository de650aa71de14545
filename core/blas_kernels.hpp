#pragma once
// BLAS kernels that match the CPU. OpenBLAS (DYNAMIC_ARCH) picks its kernels from a table of CPU models when it is
// loaded; Debian 12's 0.3.21 does not know every newer CPU and falls back to its SSE3 (Prescott) kernels on some, at
// a third of the speed. Before any BLAS call, select_blas_kernels() compares OpenBLAS's choice with the CPU's
// instruction set and, when the kernels are weaker than the CPU and OPENBLAS_CORETYPE is unset, has OpenBLAS choose
// again with the core that matches (its own OPENBLAS_CORETYPE mechanism, re-run in process). An OPENBLAS_CORETYPE
// that is set is always respected: some machines set it because other kernels are wrong or crash there.
#include <string>

namespace crosskv {

struct CpuFeatures {
  std::string vendor;  // "GenuineIntel", "AuthenticAMD", ... ("" when unknown or not x86)
  int family = 0, model = 0;
  bool avx = false, avx2 = false, fma = false;
  bool avx512f = false, avx512bw = false, avx512vl = false, avx512dq = false, avx512cd = false, avx512_bf16 = false;
};
CpuFeatures detect_cpu_features();

// Instruction-set levels of a CPU and of OpenBLAS's x86-64 kernels.
enum class Isa { unknown = 0, sse3 = 1, avx = 2, avx2 = 3, avx512 = 4 };
const char* isa_name(Isa isa);
Isa cpu_isa(const CpuFeatures& cpu);
Isa openblas_core_isa(const std::string& core);  // "Prescott" -> sse3, "Haswell" -> avx2, ...; unknown for others

// What to do about OpenBLAS's choice `picked` on `cpu`, given OPENBLAS_CORETYPE (`env`, null when unset).
struct BlasCoreDecision {
  std::string request;        // the OpenBLAS core to switch to, or "" to keep `picked`
  Isa target = Isa::unknown;  // the level this CPU should run (AMD: AVX2, see blas_kernels.cpp)
  bool mismatch = false;      // the kernels in use stay below `target` (warn, with the fix)
  std::string fix;            // the setting that would fix a mismatch
};
BlasCoreDecision decide_blas_core(const CpuFeatures& cpu, const std::string& picked, const char* env);

struct BlasKernels {
  std::string library;  // openblas_get_config(), or a note when the BLAS is not OpenBLAS
  std::string picked;   // OpenBLAS's own choice
  std::string core;     // the kernels in use
  std::string cpu;      // "AVX-512 CPU (GenuineIntel family 6 model 207)"
  bool from_env = false, switched = false;
  std::string warning;  // set when the kernels do not match the CPU: what and how to fix it
  // One line for the logs: library, kernels, and why.
  std::string summary() const;
};
// Has OpenBLAS select its kernels again as if OPENBLAS_CORETYPE were `core` (the environment is left as it was);
// returns the kernels now in use ("" when the BLAS is not a DYNAMIC_ARCH OpenBLAS). Only before or between BLAS calls.
std::string request_openblas_core(const std::string& core);
// Chooses the kernels once per process (later calls return the same); call before any BLAS call.
const BlasKernels& select_blas_kernels();

}  // namespace crosskv
