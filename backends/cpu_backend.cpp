// CPU backend: OpenBLAS sgemm/ssyrk for moments, LAPACK dpotrf and BLAS dtrsm for fp64 solves.
#include <cblas.h>
#include <lapacke.h>

#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/error.hpp"

namespace crosskv {
namespace {

class CpuBackend final : public ComputeBackend {
 public:
  std::string name() const override { return "cpu"; }

  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc) override {
    if (rows == 0 || m == 0 || n == 0) return;
    cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, rows, 1.0f, A, lda, B, ldb, 1.0f, C, ldc);
  }

  void matmul_acc(int64_t rows, int64_t k, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc) override {
    if (rows == 0 || k == 0 || n == 0) return;
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, n, k, 1.0f, A, lda, B, ldb, 1.0f, C, ldc);
  }

  void gemm_batched(const BatchedGemm& g) override {
    if (g.m == 0 || g.n == 0) return;
    for (int64_t i = 0; i < g.batch; ++i)
      cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, g.m,
                  g.n, g.k, g.alpha, g.A + i * g.stride_a, g.lda, g.B + i * g.stride_b, g.ldb, g.beta,
                  g.C + i * g.stride_c, g.ldc);
  }

  bool concurrent_calls() const override { return true; }

  void symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) override {
    if (n == 0) return;
    const lapack_int info = LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'V', 'U', n, A, lda, w);
    CROSSKV_ASSERT(info == 0, "dsyev failed: info " + std::to_string(info) + " (n=" + std::to_string(n) + ")");
  }

  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override {
    if (rows == 0 || m == 0) return;
    cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, m, rows, 1.0f, A, lda, 1.0f, C, ldc);
  }

  int64_t cholesky(int64_t n, double* A, int64_t lda) override {
    if (n == 0) return 0;
    // A row-major lower factor is a column-major upper one: no LAPACKE transposition copies.
    lapack_int info = LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', n, A, lda);
    CROSSKV_ASSERT(info >= 0, "dpotrf: illegal argument " + std::to_string(-info) + " (n=" + std::to_string(n) +
                                  ", lda=" + std::to_string(lda) + ")");
    return info;
  }

  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override {
    triangular_solve(n, L, lda, false, nrhs, B, ldb);
    triangular_solve(n, L, lda, true, nrhs, B, ldb);
  }

  void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override {
    if (n == 0 || nrhs == 0) return;
    cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, transpose ? CblasTrans : CblasNoTrans, CblasNonUnit, n, nrhs,
                1.0, L, lda, B, ldb);
  }
};

}  // namespace

std::unique_ptr<ComputeBackend> make_cpu_backend() { return std::make_unique<CpuBackend>(); }

}  // namespace crosskv
