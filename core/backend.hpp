#pragma once
// Compute backend: the few dense kernels the fit needs. CPU (BLAS/LAPACK) is the reference; CUDA lives in cuda/.
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>

namespace crosskv {

class ComputeBackend {
 public:
  virtual ~ComputeBackend() = default;
  virtual std::string name() const = 0;

  // Where the operands live. A device backend keeps every sum passed as C resident on the device from its first
  // use until flush(), which makes the host copies current and drops the residency: call flush() before reading,
  // packing or changing sums on the host. stage_inputs() names the host arrays that hold the coming calls' A and B
  // operands (one block of rows), so a device backend copies each once, asynchronously, into one of two buffers.
  // Host backends ignore both.
  struct HostSpan {
    const float* data;
    int64_t count;
  };
  virtual void stage_inputs(std::initializer_list<HostSpan> spans) {}
  virtual void flush() {}

  // C[m x n] += A^T B; A is row-major [rows x m] with leading dim lda, B [rows x n] (ldb), C row-major (ldc). fp32.
  virtual void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B,
                         int64_t ldb, float* C, int64_t ldc) = 0;
  // C[rows x n] += A[rows x k] B[k x n], all row-major host arrays (applying a mapper; no residency). fp32.
  virtual void matmul_acc(int64_t rows, int64_t k, int64_t n, const float* A, int64_t lda, const float* B,
                          int64_t ldb, float* C, int64_t ldc) = 0;
  // Upper triangle (row-major, j >= i) of C[m x m] += A^T A. fp32.
  virtual void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) = 0;
  // In-place lower Cholesky of a symmetric row-major fp64 matrix (lower triangle read). Returns 0, or the
  // 1-based order of the leading minor that is not positive definite.
  virtual int64_t cholesky(int64_t n, double* A, int64_t lda) = 0;
  // Solves (L L^T) X = B in place, L from cholesky() (a leading n x n block of it may be used). B row-major.
  virtual void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) = 0;
  // Solves L X = B (transpose: L^T X = B) in place with the leading n x n block of a lower factor.
  virtual void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                                int64_t ldb) = 0;
};

std::unique_ptr<ComputeBackend> make_cpu_backend();
// Defined in cuda/: the CUDA backend on `device` (rank `rank` names it in messages; tf32 lets cuBLAS use TF32
// tensor cores for the fp32 moments), or a stub that throws "built without CUDA".
std::unique_ptr<ComputeBackend> make_cuda_backend(int device, int rank = 0, bool tf32 = false);
bool cuda_compiled_in();
bool nccl_compiled_in();
int cuda_device_count();  // 0 when built without CUDA or no device present

}  // namespace crosskv
