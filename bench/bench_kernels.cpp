// Moment accumulation against the machine's sgemm on the same shapes (Google Benchmark).
// Shapes from the environment: CROSSKV_BENCH_DIMS="Ls,Hs,Ds,Lt,Ht,Dt", CROSSKV_BENCH_BLOCK=rows.
#include <benchmark/benchmark.h>
#include <cblas.h>

#include <cstdlib>
#include <random>
#include <sstream>

#include "core/blas_kernels.hpp"
#include "backends/backends.hpp"
#include "backends/checks.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "fit/moments.hpp"

using namespace crosskv;

namespace {

PairDims dims() {
  PairDims d{12, 8, 64, 16, 8, 64};
  if (const char* e = std::getenv("CROSSKV_BENCH_DIMS")) {
    std::stringstream ss(e);
    char c;
    ss >> d.Ls >> c >> d.Hs >> c >> d.Ds >> c >> d.Lt >> c >> d.Ht >> c >> d.Dt;
  }
  return d;
}
int64_t block_rows() {
  const char* e = std::getenv("CROSSKV_BENCH_BLOCK");
  return e ? std::atoll(e) : 4096;
}

std::vector<float> random_block(int64_t n, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> nd(0, 1);
  std::vector<float> v(n);
  for (auto& x : v) x = nd(rng);
  return v;
}

// Baseline: one sgemm of the shape every moment block has, [B x F]^T [B x F], and the widest one the
// machine could do, [B x Ls*F]^T [B x Lt*G].
void BM_sgemm_block(benchmark::State& st) {
  const PairDims d = dims();
  const int64_t B = block_rows(), F = d.F(), G = d.G();
  auto A = random_block(B * F, 1), Bm = random_block(B * G, 2);
  std::vector<float> C(F * G);
  for (auto _ : st)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, F, G, B, 1.0f, A.data(), F, Bm.data(), G, 1.0f, C.data(), G);
  st.counters["flops"] = benchmark::Counter(2.0 * F * G * B * st.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_sgemm_block)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_sgemm_wide(benchmark::State& st) {
  const PairDims d = dims();
  const int64_t B = block_rows(), X = d.X(), Y = d.Y();
  auto A = random_block(B * X, 1), Bm = random_block(B * Y, 2);
  std::vector<float> C(X * Y);
  for (auto _ : st)
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, X, Y, B, 1.0f, A.data(), X, Bm.data(), Y, 1.0f, C.data(), Y);
  st.counters["flops"] = benchmark::Counter(2.0 * X * Y * B * st.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_sgemm_wide)->Unit(benchmark::kMillisecond)->UseRealTime();

// What crosskv-fit does per block and kind in a single-pass fit: shift, sums, every Gram and cross block.
void BM_accumulate_full(benchmark::State& st) {
  const PairDims d = dims();
  const int64_t B = block_rows();
  auto X0 = random_block(B * d.X(), 3), Y0 = random_block(B * d.Y(), 4);
  Moments m(d, std::vector<float>(d.X(), 0.1f), std::vector<float>(d.Y(), 0.1f));
  m.add_plan(MomentPlan::full(d, false));
  auto be = make_cpu_backend();
  std::vector<float> X, Y;
  for (auto _ : st) {
    st.PauseTiming();
    X = X0;
    Y = Y0;
    st.ResumeTiming();
    m.accumulate(*be, X.data(), Y.data(), B);
  }
  const double F = d.F(), G = d.G();
  const double per_block = d.Ls * F * (F + 1) * B + (d.Ls * (d.Ls - 1) / 2.0) * 2 * F * F * B + d.Ls * d.Lt * 2 * F * G * B;
  st.counters["flops"] = benchmark::Counter(per_block * st.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_accumulate_full)->Unit(benchmark::kMillisecond)->UseRealTime();

// The fp64 solve kernels at the largest nested size (8 source layers) and k = all.
std::vector<double> spd(int64_t n) {
  auto r = random_block(n * n, 5);
  std::vector<double> A(n * n);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) A[i * n + j] = (i == j ? n : 0.0) + 0.01 * (r[i * n + j] + r[j * n + i]);
  return A;
}

void BM_dpotrf(benchmark::State& st) {
  const int64_t n = st.range(0) * dims().F();
  const auto A0 = spd(n);
  auto be = make_cpu_backend();
  std::vector<double> A;
  for (auto _ : st) {
    st.PauseTiming();
    A = A0;
    st.ResumeTiming();
    checks(*be).cholesky(n, A.data(), n);
  }
  st.counters["flops"] = benchmark::Counter(n * n * (n / 3.0) * st.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_dpotrf)->Arg(8)->Arg(12)->Unit(benchmark::kMillisecond)->UseRealTime();

void BM_dtrsm(benchmark::State& st) {
  const int64_t n = st.range(0) * dims().F(), m = dims().G();
  auto L = spd(n);
  auto be = make_cpu_backend();
  checks(*be).cholesky(n, L.data(), n);
  const auto r = random_block(n * m, 6);
  std::vector<double> B0(r.begin(), r.end()), B;
  for (auto _ : st) {
    st.PauseTiming();
    B = B0;
    st.ResumeTiming();
    checks(*be).triangular_solve(n, L.data(), n, false, m, B.data(), m);
  }
  st.counters["flops"] = benchmark::Counter(double(n) * n * m * st.iterations(), benchmark::Counter::kIsRate);
}
BENCHMARK(BM_dtrsm)->Arg(8)->Arg(12)->Unit(benchmark::kMillisecond)->UseRealTime();

}  // namespace

int main(int argc, char** argv) {
  // The kernels every figure is taken with, chosen before any BLAS call (also in the benchmark's context).
  const std::string blas = crosskv::select_blas_kernels().summary();
  benchmark::AddCustomContext("blas", blas);
  benchmark::Initialize(&argc, argv);
  if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
  benchmark::RunSpecifiedBenchmarks();
  benchmark::Shutdown();
  return 0;
}
