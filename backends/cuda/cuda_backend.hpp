#pragma once
// The CUDA backend: the algorithms of ComputeBackend on one device, over the resources it owns (DeviceResources:
// streams, handles, staging, scratch); the sums it accumulates are held by typed handles (held_sums.hpp). One backend
// per rank. Its member functions live by concern: cuda_backend.cu (residency, the factory), inputs.cu (input
// preparation), dense_maths.cu (products, factors, solves, eigen-solver), serving.cu (ServingKernels for the serving
// apply).
#include <cstdint>
#include <string>
#include <vector>

#include "backends/checks.hpp"
#include "core/backend.hpp"
#include "backends/cuda/device_resources.hpp"
#include "backends/cuda/held_sums.hpp"

namespace crosskv::cuda {

class CudaBackend final : public ComputeBackend, public BackendChecks {
 public:
  CudaBackend(int device, int rank, bool tf32) : res_(device, rank, tf32) {}
  ~CudaBackend() override;
  std::string name() const override { return res_.name(); }

  // ---- Residency (cuda_backend.cu).
  HeldSumsPtr<float> hold_sums(float* p, int64_t count, bool host_is_zero) override;
  HeldSumsPtr<double> hold_sums(double* p, int64_t count, bool host_is_zero) override;
  void begin_inputs() override;
  void stage_inputs(std::initializer_list<HostSpan> spans) override;
  int64_t device_memory_free() const override;
  void copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                 bool dst_on_device) override;
  void copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                 bool dst_on_device) override;

  // ---- Input preparation (inputs.cu).
  bool prepares_on_device() const override { return true; }
  const float* prepare(const StoredBlock& in, const Strip* strip, const float* shift, const float* row_scale,
                       std::vector<float>& host) override;
  const float* gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) override;
  void column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, const float* row_weight, double* sum,
                    double* sumsq) override;

  // ---- Dense maths (dense_maths.cu). One call at a time: each fills the device.
  bool concurrent_calls() const override { return false; }
  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb, float* C,
                 int64_t ldc) override;
  void cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms, int64_t lda,
                       int64_t ldb, int64_t ldc) override;
  void gemm_batched(const BatchedGemm& g) override;
  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override;
  void symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) override;
  FactorPtr factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse) override;
  FactorPtr factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse) override;
  void solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) override;
  void solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override;

  // ---- The serving apply on device memory, in order on the compute stream (serving.cu).
  bool memory_on_device() const override { return true; }
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
  void serving_gemm(const BatchedGemm& g) override;
  void begin_after(void* stream) override;
  void end_before(void* stream) override;

  // ---- Checks (backends/checks.hpp): cuSOLVER and cuBLAS on host arrays, operand reads, the half kernel, a wait.
  int64_t cholesky(int64_t n, double* A, int64_t lda) override;
  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override;
  void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override;
  void download(const float* p, int64_t count, float* host) override;
  void to_half(const float* in, int64_t n, bool bf16, uint16_t* out) override;
  void synchronize() override;

 private:
  // A factor in device memory, owned by its handle.
  struct CudaFactor final : SystemFactor {
    DeviceBuffer<double> dev;  // [n x n], lower, row-major (lda = n)
  };
  // dense_maths.cu's helpers: cuSOLVER's potrf in place (returns LAPACK's info), a factor made on the device, a
  // host factor uploaded for one solve, triangular solves on host B, a device diagonal to the host.
  int potrf(double* dA, int64_t n, int64_t lda, const std::string& ops);
  void factor_on_device(CudaFactor& f, const std::string& ops);
  const double* upload_factor(int64_t n, const double* L, int64_t lda);
  void solve_on_device(const double* dL, int64_t n, int64_t lda, int64_t nrhs, double* B, int64_t ldb,
                       std::initializer_list<bool> transposes);
  void copy_diagonal(const double* dA, int64_t n, int64_t lda, double* out, const std::string& ops);

  DeviceResources res_;
};

}  // namespace crosskv::cuda
