// BLAS kernels that match the CPU: the decision on synthetic CPUs and OpenBLAS choices, and the in-process switch
// on this machine's OpenBLAS.
#include <cblas.h>
#include <gtest/gtest.h>

#include <cstdlib>
#include <random>
#include <vector>

#include "core/blas_kernels.hpp"

extern "C" char* openblas_get_corename(void) __attribute__((weak));

using namespace crosskv;

namespace {

CpuFeatures intel_avx512(bool bf16) {  // an Emerald Rapids Xeon: family 6, model 207
  CpuFeatures f;
  f.vendor = "GenuineIntel", f.family = 6, f.model = 207;
  f.avx = f.avx2 = f.fma = true;
  f.avx512f = f.avx512bw = f.avx512vl = f.avx512dq = f.avx512cd = true;
  f.avx512_bf16 = bf16;
  return f;
}
CpuFeatures avx2_only(const char* vendor) {
  CpuFeatures f;
  f.vendor = vendor, f.family = vendor == std::string("AuthenticAMD") ? 23 : 6, f.model = 49;
  f.avx = f.avx2 = f.fma = true;
  return f;
}
CpuFeatures amd_avx512() {  // Zen 4/5
  CpuFeatures f = intel_avx512(true);
  f.vendor = "AuthenticAMD", f.family = 26, f.model = 2;
  return f;
}

}  // namespace

TEST(BlasKernels, LevelsOfOpenBlasCores) {
  EXPECT_EQ(openblas_core_isa("Prescott"), Isa::sse3);
  EXPECT_EQ(openblas_core_isa("Nehalem"), Isa::sse3);
  EXPECT_EQ(openblas_core_isa("Sandybridge"), Isa::avx);
  EXPECT_EQ(openblas_core_isa("Haswell"), Isa::avx2);
  EXPECT_EQ(openblas_core_isa("Zen"), Isa::avx2);
  EXPECT_EQ(openblas_core_isa("SkylakeX"), Isa::avx512);
  EXPECT_EQ(openblas_core_isa("Cooperlake"), Isa::avx512);
  EXPECT_EQ(openblas_core_isa("SapphireRapids"), Isa::avx512);
  EXPECT_EQ(openblas_core_isa("ARMV8"), Isa::unknown);
  EXPECT_EQ(cpu_isa(intel_avx512(false)), Isa::avx512);
  EXPECT_EQ(cpu_isa(avx2_only("GenuineIntel")), Isa::avx2);
  CpuFeatures partial = intel_avx512(false);
  partial.avx512vl = false;  // AVX-512F without VL is not what OpenBLAS's SkylakeX kernels need
  EXPECT_EQ(cpu_isa(partial), Isa::avx2);
  EXPECT_EQ(cpu_isa(CpuFeatures{}), Isa::unknown);
}

TEST(BlasKernels, PrescottOnAnAvx512XeonIsReplaced) {
  const BlasCoreDecision d = decide_blas_core(intel_avx512(false), "Prescott", nullptr);
  EXPECT_EQ(d.request, "SkylakeX");
  EXPECT_EQ(d.target, Isa::avx512);
  EXPECT_EQ(decide_blas_core(intel_avx512(true), "Prescott", nullptr).request, "Cooperlake");  // AVX-512 BF16
  EXPECT_EQ(decide_blas_core(intel_avx512(false), "Haswell", nullptr).request, "SkylakeX");
  EXPECT_EQ(decide_blas_core(avx2_only("GenuineIntel"), "Nehalem", nullptr).request, "Haswell");
  EXPECT_EQ(decide_blas_core(avx2_only("AuthenticAMD"), "Prescott", nullptr).request, "Zen");
}

TEST(BlasKernels, AMatchingChoiceIsKept) {
  for (const char* core : {"SkylakeX", "Cooperlake", "SapphireRapids"}) {
    const BlasCoreDecision d = decide_blas_core(intel_avx512(false), core, nullptr);
    EXPECT_EQ(d.request, "") << core;
    EXPECT_FALSE(d.mismatch) << core;
  }
  EXPECT_EQ(decide_blas_core(avx2_only("GenuineIntel"), "Haswell", nullptr).request, "");
  // A core this code does not know (another architecture, a newer OpenBLAS) is left alone.
  EXPECT_EQ(decide_blas_core(intel_avx512(false), "Granite", nullptr).request, "");
  EXPECT_EQ(decide_blas_core(CpuFeatures{}, "Prescott", nullptr).request, "");
}

TEST(BlasKernels, AmdIsHeldAtAvx2AndNeverDowngraded) {
  EXPECT_EQ(decide_blas_core(amd_avx512(), "Zen", nullptr).request, "");
  EXPECT_EQ(decide_blas_core(amd_avx512(), "Haswell", nullptr).request, "");
  EXPECT_EQ(decide_blas_core(amd_avx512(), "Cooperlake", nullptr).request, "");  // OpenBLAS's own choice stays
  EXPECT_EQ(decide_blas_core(amd_avx512(), "Prescott", nullptr).request, "Zen");
}

TEST(BlasKernels, AnOpenblasCoretypeThatIsSetIsRespectedAndWarnedAbout) {
  const BlasCoreDecision d = decide_blas_core(intel_avx512(false), "Prescott", "Prescott");
  EXPECT_EQ(d.request, "");
  EXPECT_TRUE(d.mismatch);
  EXPECT_EQ(d.fix, "OPENBLAS_CORETYPE=SkylakeX");
  const BlasCoreDecision ok = decide_blas_core(amd_avx512(), "Haswell", "Haswell");  // this machine's setting
  EXPECT_EQ(ok.request, "");
  EXPECT_FALSE(ok.mismatch);
}

// The switch itself, on this machine's OpenBLAS: to AVX kernels (safe on every x86-64 CPU crosskv runs on), the same
// product, and back.
TEST(BlasKernels, OpenBlasSelectsAgainInProcess) {
  if (!openblas_get_corename) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  const std::string was = openblas_get_corename();
  if (openblas_core_isa(was) == Isa::unknown) GTEST_SKIP() << "OpenBLAS core " << was << " is not an x86-64 one";
  const CpuFeatures cpu = detect_cpu_features();
  if (!cpu.avx) GTEST_SKIP() << "this CPU has no AVX";
  const char* env_before = std::getenv("OPENBLAS_CORETYPE");
  const std::string env_was = env_before ? env_before : "";
  const int n = 64;
  std::mt19937 rng(3);
  std::normal_distribution<double> nd;
  std::vector<double> A(n * n), B(n * n), C0(n * n), C1(n * n);
  for (auto* v : {&A, &B})
    for (double& x : *v) x = nd(rng);
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, A.data(), n, B.data(), n, 0.0, C0.data(), n);
  EXPECT_EQ(request_openblas_core("Sandybridge"), "Sandybridge");
  EXPECT_EQ(std::string(openblas_get_corename()), "Sandybridge");
  const char* env_now = std::getenv("OPENBLAS_CORETYPE");
  EXPECT_EQ(env_now ? std::string(env_now) : "", env_was) << "the environment must be left as it was";
  cblas_dgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0, A.data(), n, B.data(), n, 0.0, C1.data(), n);
  for (int i = 0; i < n * n; ++i) ASSERT_NEAR(C0[i], C1[i], 1e-12 * n) << i;
  EXPECT_EQ(request_openblas_core(was), was);
}

TEST(BlasKernels, TheSummaryNamesTheLibraryAndTheKernels) {
  const BlasKernels& k = select_blas_kernels();
  if (!openblas_get_corename) GTEST_SKIP() << "the BLAS is not OpenBLAS";
  EXPECT_NE(k.summary().find("OpenBLAS"), std::string::npos) << k.summary();
  EXPECT_NE(k.summary().find("kernels " + k.core), std::string::npos) << k.summary();
  EXPECT_EQ(k.core, std::string(openblas_get_corename()));
}
