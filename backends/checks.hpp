#pragma once
// What tests and benchmarks ask of a backend beyond the products' interfaces (core/backend.hpp): the kernels on host
// arrays that the factors are checked against, reads of operands the backend made, fp32 -> half on the backend, and
// a wait for timing. Every backend of backends/ implements it; the stages and the apply never see it.
#include <cstdint>

#include "core/backend.hpp"

namespace crosskv {

class BackendChecks {
 public:
  virtual ~BackendChecks() = default;
  // In-place lower Cholesky of a symmetric row-major fp64 matrix (lower triangle read): 0, or the first leading
  // minor that is not positive definite. Solves with the leading n x n block of a lower factor: (L L^T) X = B, or
  // L X = B (transpose: L^T X = B). B row-major, host.
  virtual int64_t cholesky(int64_t n, double* A, int64_t lda) = 0;
  virtual void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) = 0;
  virtual void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                                int64_t ldb) = 0;
  // Copies `count` values of an operand (or a staged host array) of the current round to `host`.
  virtual void download(const float* operand, int64_t count, float* host) = 0;
  // fp32 -> bf16 or fp16 bits (round to nearest even, NaN kept) on the backend.
  virtual void to_half(const float* in, int64_t n, bool bf16, uint16_t* out) = 0;
  // Waits until the backend has finished every call made so far (host backends return at once).
  virtual void synchronize() = 0;
};

// The checks of a backend made in backends/ (an assertion for any other).
inline BackendChecks& checks(ComputeBackend& be) {
  auto* c = dynamic_cast<BackendChecks*>(&be);
  CROSSKV_ASSERT(c, "backend " + be.name() + " has no BackendChecks");
  return *c;
}

}  // namespace crosskv
