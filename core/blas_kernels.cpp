#include "core/blas_kernels.hpp"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif


// OpenBLAS's own entry points, absent from another BLAS (weak: null there). gotoblas_dynamic_quit/init re-run the
// DYNAMIC_ARCH selection, which reads OPENBLAS_CORETYPE, exactly as at load time.
extern "C" char* openblas_get_corename(void) __attribute__((weak));
extern "C" char* openblas_get_config(void) __attribute__((weak));
extern "C" void gotoblas_dynamic_init(void) __attribute__((weak));
extern "C" void gotoblas_dynamic_quit(void) __attribute__((weak));

namespace crosskv {

CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a = 0, b = 0, c = 0, d = 0;
  if (__get_cpuid(0, &a, &b, &c, &d)) {
    char v[13] = {};
    std::memcpy(v, &b, 4), std::memcpy(v + 4, &d, 4), std::memcpy(v + 8, &c, 4);
    f.vendor = v;
  }
  if (__get_cpuid(1, &a, &b, &c, &d)) {
    const int base_family = (a >> 8) & 0xf, base_model = (a >> 4) & 0xf;
    f.family = base_family == 0xf ? base_family + static_cast<int>((a >> 20) & 0xff) : base_family;
    f.model =
        base_family == 0x6 || base_family == 0xf ? base_model + static_cast<int>(((a >> 16) & 0xf) << 4) : base_model;
  }
  // libgcc's checks include the OS's support (XSAVE state) of the AVX and AVX-512 registers.
  __builtin_cpu_init();
  f.avx = __builtin_cpu_supports("avx");
  f.avx2 = __builtin_cpu_supports("avx2");
  f.fma = __builtin_cpu_supports("fma");
  f.avx512f = __builtin_cpu_supports("avx512f");
  f.avx512bw = __builtin_cpu_supports("avx512bw");
  f.avx512vl = __builtin_cpu_supports("avx512vl");
  f.avx512dq = __builtin_cpu_supports("avx512dq");
  f.avx512cd = __builtin_cpu_supports("avx512cd");
  f.avx512_bf16 = __builtin_cpu_supports("avx512bf16");
#endif
  return f;
}

const char* isa_name(Isa isa) {
  switch (isa) {
    case Isa::sse3:
      return "SSE3";
    case Isa::avx:
      return "AVX";
    case Isa::avx2:
      return "AVX2";
    case Isa::avx512:
      return "AVX-512";
    case Isa::unknown:
      break;
  }
  return "unknown";
}

Isa cpu_isa(const CpuFeatures& f) {
  if (f.avx512f && f.avx512bw && f.avx512vl && f.avx512dq && f.avx512cd) return Isa::avx512;
  if (f.avx2 && f.fma) return Isa::avx2;
  if (f.avx) return Isa::avx;
  return f.vendor.empty() ? Isa::unknown : Isa::sse3;
}

Isa openblas_core_isa(const std::string& core) {
  static const std::vector<std::pair<const char*, Isa>> table = {
      {"Katmai", Isa::sse3},       {"Coppermine", Isa::sse3},
      {"Northwood", Isa::sse3},    {"Prescott", Isa::sse3},
      {"Banias", Isa::sse3},       {"Atom", Isa::sse3},
      {"Core2", Isa::sse3},        {"Penryn", Isa::sse3},
      {"Dunnington", Isa::sse3},   {"Nehalem", Isa::sse3},
      {"Athlon", Isa::sse3},       {"Opteron", Isa::sse3},
      {"Opteron_SSE3", Isa::sse3}, {"Barcelona", Isa::sse3},
      {"Nano", Isa::sse3},         {"Bobcat", Isa::sse3},
      {"Sandybridge", Isa::avx},   {"Bulldozer", Isa::avx},
      {"Piledriver", Isa::avx},    {"Steamroller", Isa::avx},
      {"Excavator", Isa::avx2},    {"Haswell", Isa::avx2},
      {"Zen", Isa::avx2},          {"SkylakeX", Isa::avx512},
      {"Cooperlake", Isa::avx512}, {"SapphireRapids", Isa::avx512}};
  for (const auto& [name, isa] : table)
    if (core == name) return isa;
  return Isa::unknown;
}

// The core to ask for at a level: AVX-512 as OpenBLAS's own fallback for unknown CPUs chooses it (Cooperlake where
// the CPU has AVX-512 BF16, else SkylakeX); AVX2 as Zen on AMD, Haswell elsewhere; AVX as Sandybridge. AMD CPUs are
// held at AVX2: OpenBLAS 0.3.21 predates AVX-512 on AMD (Zen 4), and its AVX-512 kernels were never chosen there.
BlasCoreDecision decide_blas_core(const CpuFeatures& cpu, const std::string& picked, const char* env) {
  BlasCoreDecision d;
  const bool amd = cpu.vendor == "AuthenticAMD" || cpu.vendor == "HygonGenuine";
  Isa level = cpu_isa(cpu);
  if (amd && level > Isa::avx2) level = Isa::avx2;
  d.target = level;
  std::string best;
  if (level == Isa::avx512)
    best = cpu.avx512_bf16 ? "Cooperlake" : "SkylakeX";
  else if (level == Isa::avx2)
    best = amd ? "Zen" : "Haswell";
  else if (level == Isa::avx)
    best = "Sandybridge";
  const Isa have = openblas_core_isa(picked);
  if (best.empty() || have == Isa::unknown || have >= level) return d;  // nothing better to ask for, or as good
  d.fix = "OPENBLAS_CORETYPE=" + best;
  if (env && *env) {
    d.mismatch = true;  // respected as set
    return d;
  }
  d.request = best;
  return d;
}

std::string request_openblas_core(const std::string& core) {
  if (!gotoblas_dynamic_init || !gotoblas_dynamic_quit || !openblas_get_corename) return "";
  // OpenBLAS reads OPENBLAS_CORETYPE as it selects; the variable is put back as it was afterwards.
  const char* was = std::getenv("OPENBLAS_CORETYPE");
  const std::string saved = was ? was : "";
  setenv("OPENBLAS_CORETYPE", core.c_str(), 1);
  gotoblas_dynamic_quit();
  gotoblas_dynamic_init();
  if (was)
    setenv("OPENBLAS_CORETYPE", saved.c_str(), 1);
  else
    unsetenv("OPENBLAS_CORETYPE");
  return openblas_get_corename();
}

namespace {

std::string describe_cpu(const CpuFeatures& f) {
  char b[128];
  std::snprintf(b, sizeof b, "%s CPU (%s family %d model %d)", isa_name(cpu_isa(f)),
                f.vendor.empty() ? "unknown vendor" : f.vendor.c_str(), f.family, f.model);
  return b;
}

BlasKernels choose() {
  BlasKernels k;
  const CpuFeatures cpu = detect_cpu_features();
  k.cpu = describe_cpu(cpu);
  if (!openblas_get_corename || !openblas_get_config) {
    k.library = "not OpenBLAS (its kernels are not known here)";
    return k;
  }
  k.library = openblas_get_config();
  k.picked = k.core = openblas_get_corename();
  const char* env = std::getenv("OPENBLAS_CORETYPE");
  k.from_env = env && *env;
  const BlasCoreDecision d = decide_blas_core(cpu, k.picked, env);
  if (!d.request.empty()) {
    const std::string now = request_openblas_core(d.request);
    if (!now.empty()) k.core = now;
    k.switched = k.core != k.picked;
  }
  if (openblas_core_isa(k.core) < d.target && openblas_core_isa(k.core) != Isa::unknown) {
    k.warning = std::string(isa_name(openblas_core_isa(k.core))) + " kernels (" + k.core + ") on an " + k.cpu +
                (k.from_env ? ", as OPENBLAS_CORETYPE sets them" : "") + ": BLAS runs several times slower; " +
                (k.from_env ? "unless it is set on purpose, set " + d.fix : "set " + d.fix);
  }
  return k;
}

}  // namespace

std::string BlasKernels::summary() const {
  if (picked.empty()) return "BLAS " + library;
  std::string s = "BLAS " + library + "; kernels " + core + " on an " + cpu;
  if (switched)
    s += " (chosen for this CPU; OpenBLAS picked " + picked + ")";
  else if (from_env)
    s += " (OPENBLAS_CORETYPE as set)";
  return s;
}

const BlasKernels& select_blas_kernels() {
  static const BlasKernels k = choose();
  return k;
}


}  // namespace crosskv
