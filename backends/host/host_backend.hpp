#pragma once
// The host backend: every function of ComputeBackend on host memory, in one place. It is the CPU backend (OpenBLAS
// and LAPACK for the dense maths, loops for the rest) and the reference the CUDA backend is tested against. A test
// backend that behaves differently in one concern derives from it and overrides that concern.
#include <cstdint>
#include <string>
#include <vector>

#include "backends/checks.hpp"
#include "core/backend.hpp"

namespace crosskv {

class HostBackend : public ComputeBackend, public BackendChecks {
 public:
  std::string name() const override { return "cpu"; }

  // ---- Dense maths: OpenBLAS sgemm/ssyrk for products, LAPACK dpotrf/dsyev and BLAS dtrsm in fp64.
  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc) override;
  void cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms, int64_t lda,
                       int64_t ldb, int64_t ldc) override;
  void gemm_batched(const BatchedGemm& g) override;
  bool concurrent_calls() const override { return true; }
  void symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) override;
  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override;
  FactorPtr factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse = nullptr) override;
  FactorPtr factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse = nullptr) override;
  void solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) override;
  void solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override;

  // ---- Input preparation on the host.
  bool prepares_on_device() const override { return false; }
  const float* prepare(const StoredBlock& in, const Strip* strip, const float* shift, const float* row_scale,
                       std::vector<float>& host) override;
  const float* gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) override;
  void column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, const float* row_weight, double* sum,
                    double* sumsq) override;

  // ---- Residency: everything stays on the host; held sums are the host arrays, staging is ignored.
  HeldSumsPtr<float> hold_sums(float* p, int64_t count, bool host_is_zero) override;
  HeldSumsPtr<double> hold_sums(double* p, int64_t count, bool host_is_zero) override;
  void copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                 bool dst_on_device) override;
  void copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                 bool dst_on_device) override;
  void begin_inputs() override {}
  void stage_inputs(std::initializer_list<HostSpan> spans) override {}
  int64_t device_memory_free() const override { return -1; }

  // ---- Serving kernels: host memory is this backend's memory, and calls return when done.
  bool memory_on_device() const override { return false; }
  MemoryPtr allocate(int64_t bytes) override;
  void copy_from_host(const void* host, int64_t bytes, void* dst) override;
  void copy_to_host(const void* src, int64_t bytes, void* host) override;
  void copy_within(const void* src, int64_t bytes, void* dst) override;
  void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) override;
  void gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists, int64_t F, int64_t rows,
                     float* out) override;
  void relu(float* X, int64_t n) override;
  void add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) override;
  void rope_rows(const Rope& rope, const LayerHeads& layers, bool strip, float* X, int64_t rows,
                 const int32_t* positions) override;
  void serving_gemm(const BatchedGemm& g) override { gemm_batched(g); }
  void begin_after(void* stream) override {}
  void end_before(void* stream) override {}

  // ---- Checks (backends/checks.hpp): LAPACK dpotrf and BLAS dtrsm on host arrays; operands are host arrays.
  int64_t cholesky(int64_t n, double* A, int64_t lda) override;
  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override;
  void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override;
  void download(const float* operand, int64_t count, float* host) override;
  void to_half(const float* in, int64_t n, bool bf16, uint16_t* out) override;
  void synchronize() override {}
};

}  // namespace crosskv
