// The host backend (host_backend.hpp): the reference implementation of every ComputeBackend function.
#include "backends/host/host_backend.hpp"

#include <cblas.h>
#include <lapacke.h>

#include <algorithm>
#include <memory>
#include <cstring>

#include "backends/backends.hpp"
#include "core/error.hpp"
#include "core/host_kernels.hpp"
#include "core/memory.hpp"
#include "core/rope.hpp"

namespace crosskv {

// ---- Dense maths.

void HostBackend::cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B,
                            int64_t ldb, float* C, int64_t ldc) {
  if (rows == 0 || m == 0 || n == 0) return;
  cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, m, n, rows, 1.0f, A, lda, B, ldb, 1.0f, C, ldc);
}

void HostBackend::cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms,
                                  int64_t lda, int64_t ldb, int64_t ldc) {
  for (const CrossTerm& t : terms) cross_acc(rows, m, n, t.A, lda, t.B, ldb, t.C, ldc);
}

void HostBackend::gemm_batched(const BatchedGemm& g) {
  if (g.m == 0 || g.n == 0) return;
  for (int64_t i = 0; i < g.batch; ++i)
    cblas_sgemm(CblasRowMajor, g.trans_a ? CblasTrans : CblasNoTrans, g.trans_b ? CblasTrans : CblasNoTrans, g.m, g.n,
                g.k, g.alpha, g.A + i * g.stride_a, g.lda, g.B + i * g.stride_b, g.ldb, g.beta, g.C + i * g.stride_c,
                g.ldc);
}

void HostBackend::symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) {
  if (n == 0) return;
  const lapack_int info = LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'V', 'U', n, A, lda, w);
  CROSSKV_ASSERT(info == 0, "dsyev failed: info " + std::to_string(info) + " (n=" + std::to_string(n) + ")");
}

void HostBackend::gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) {
  if (rows == 0 || m == 0) return;
  cblas_ssyrk(CblasRowMajor, CblasUpper, CblasTrans, m, rows, 1.0f, A, lda, 1.0f, C, ldc);
}

int64_t HostBackend::cholesky(int64_t n, double* A, int64_t lda) {
  if (n == 0) return 0;
  // A row-major lower factor is a column-major upper one: no LAPACKE transposition copies.
  lapack_int info = LAPACKE_dpotrf(LAPACK_COL_MAJOR, 'U', n, A, lda);
  CROSSKV_ASSERT(info >= 0, "dpotrf: illegal argument " + std::to_string(-info) + " (n=" + std::to_string(n) +
                                ", lda=" + std::to_string(lda) + ")");
  return info;
}

void HostBackend::cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) {
  triangular_solve(n, L, lda, false, nrhs, B, ldb);
  triangular_solve(n, L, lda, true, nrhs, B, ldb);
}

void HostBackend::triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                                   int64_t ldb) {
  if (n == 0 || nrhs == 0) return;
  cblas_dtrsm(CblasRowMajor, CblasLeft, CblasLower, transpose ? CblasTrans : CblasNoTrans, CblasNonUnit, n, nrhs, 1.0,
              L, lda, B, ldb);
}

namespace {

// A factor in host memory: L [n x n], lower, row-major.
struct HostFactor final : DenseMaths::SystemFactor {
  BigVector<double> L;
};

// Factors f.L (its order f.n) in place with the backend's kernel; the pivots are its diagonal.
void factor_in_place(BackendChecks& be, HostFactor& f) {
  f.info = be.cholesky(f.n, f.L.data(), f.n);
  f.pivots.resize(static_cast<size_t>(f.n));
  for (int64_t i = 0; i < f.n; ++i) f.pivots[i] = f.L[i * f.n + i];
}

}  // namespace

DenseMaths::FactorPtr HostBackend::factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse) {
  auto f = reuse_or_make<HostFactor>(std::move(reuse));
  f->n = t.nl * t.F;
  f->L.resize(static_cast<size_t>(f->n * f->n));
  assemble_cov_on_host(t, lambda, f->L.data(), f->n, diag);
  factor_in_place(*this, *f);
  return f;
}

DenseMaths::FactorPtr HostBackend::factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse) {
  auto f = reuse_or_make<HostFactor>(std::move(reuse));
  f->n = n;
  f->L.resize(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) std::copy_n(A + i * lda, n, f->L.data() + i * n);
  factor_in_place(*this, *f);
  return f;
}

void HostBackend::solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) {
  CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
  cholesky_solve(n, own<HostFactor>(f).L.data(), f.n, nrhs, B, ldb);
}

void HostBackend::solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                                   int64_t ldb) {
  CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
  triangular_solve(n, own<HostFactor>(f).L.data(), f.n, transpose, nrhs, B, ldb);
}

// ---- Input preparation.

const float* HostBackend::prepare(const StoredBlock& in, const Strip* strip, const float* shift,
                                  const float* row_scale, std::vector<float>& host) {
  return prepare_on_host(in, strip, shift, row_scale, host);
}

const float* HostBackend::gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) {
  const int64_t W = int64_t{L} * H * D;
  host.resize(static_cast<size_t>(rows * W));
  for (int64_t t = 0; t < rows; ++t)
    for (int a = 0; a < L; ++a)
      for (int h = 0; h < H; ++h)
        std::copy_n(X + t * W + (int64_t{a} * H + h) * D, D, host.data() + t * W + (int64_t{h} * L + a) * D);
  return host.data();
}

void HostBackend::column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, const float* row_weight,
                               double* sum, double* sumsq) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* x = X + t * ldx;
    if (row_weight) {
      const double r = row_weight[t];
      for (int64_t c = 0; c < cols; ++c) sum[c] += r * x[c];
    } else {
      for (int64_t c = 0; c < cols; ++c) sum[c] += x[c];
    }
    if (sumsq)
      for (int64_t c = 0; c < cols; ++c) sumsq[c] += static_cast<double>(x[c]) * x[c];
  }
}

void HostBackend::download(const float* operand, int64_t count, float* host) { std::copy_n(operand, count, host); }

void HostBackend::to_half(const float* in, int64_t n, bool bf16, uint16_t* out) { to_half_on_host(in, n, bf16, out); }

// ---- Residency.

namespace {

// Zeroes [p, p + count) in parallel parts.
template <class T>
void zero_host_sums(T* p, int64_t count) {
  constexpr int64_t kPart = int64_t{1} << 22;  // a parallel region pays off from a few MB on
#pragma omp parallel for schedule(static) if (count > 2 * kPart)
  for (int64_t at = 0; at < count; at += kPart) std::fill_n(p + at, std::min(kPart, count - at), T{0});
}

// A host backend's held sums: the host array itself.
template <class T>
class HostSums final : public Residency::HeldSums<T> {
 public:
  HostSums(T* p, int64_t count) : Residency::HeldSums<T>(p, p, count) {}
  void to_host() override {}
  void zero() override { zero_host_sums(this->host(), this->count()); }
};

template <class T>
void copy_host_sums(const std::vector<ComputeBackend::SumPiece<T>>& pieces, int64_t off, int64_t len, T* dst,
                    bool dst_on_device) {
  CROSSKV_ASSERT(!dst_on_device, "copy_sums: a host backend was given device memory");
  for_each_sum_run(pieces, off, len,
                   [dst, off](const ComputeBackend::SumPiece<T>& q, int64_t e, int64_t rows, int64_t cols,
                              int64_t flat) {
                     for (int64_t r = 0; r < rows; ++r)
                       std::copy_n(q.current() + e + r * q.ld, cols, dst + (flat - off) + r * cols);
                   });
}

}  // namespace

Residency::HeldSumsPtr<float> HostBackend::hold_sums(float* p, int64_t count, bool) {
  return std::make_unique<HostSums<float>>(p, count);
}
Residency::HeldSumsPtr<double> HostBackend::hold_sums(double* p, int64_t count, bool) {
  return std::make_unique<HostSums<double>>(p, count);
}

void HostBackend::copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                            bool dst_on_device) {
  copy_host_sums(pieces, off, len, dst, dst_on_device);
}
void HostBackend::copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                            bool dst_on_device) {
  copy_host_sums(pieces, off, len, dst, dst_on_device);
}

// ---- Serving kernels.

namespace {
struct HostMemory final : ServingKernels::Memory {
  std::unique_ptr<float[]> storage;  // float-aligned (any type up to float's alignment fits); not zeroed, as a
                                     // device's fresh memory is not: every user writes before it reads
};
}  // namespace

ServingKernels::MemoryPtr HostBackend::allocate(int64_t bytes) {
  auto m = std::make_unique<HostMemory>();
  m->storage.reset(new float[static_cast<size_t>((bytes + 3) / 4)]);
  m->data = m->storage.get(), m->bytes = bytes;
  return m;
}

void HostBackend::copy_from_host(const void* host, int64_t bytes, void* dst) {
  if (bytes > 0 && host != dst) std::memcpy(dst, host, static_cast<size_t>(bytes));
}

void HostBackend::copy_to_host(const void* src, int64_t bytes, void* host) {
  if (bytes > 0 && host != src) std::memcpy(host, src, static_cast<size_t>(bytes));
}

void HostBackend::copy_within(const void* src, int64_t bytes, void* dst) {
  if (bytes > 0 && src != dst) std::memmove(dst, src, static_cast<size_t>(bytes));
}

void HostBackend::broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  for (int64_t t = 0; t < rows; ++t) std::copy_n(b, n, Y + t * ldy);
}

void HostBackend::gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists, int64_t F,
                                int64_t rows, float* out) {
  for (const auto& layers : lists) {
    gather_layers_on_host(X, ldx, layers, F, rows, out);
    out += rows * static_cast<int64_t>(layers.size()) * F;
  }
}

void HostBackend::relu(float* X, int64_t n) {
  for (int64_t i = 0; i < n; ++i) X[i] = X[i] > 0.0f ? X[i] : 0.0f;
}

void HostBackend::add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < n; ++c) Y[t * ldy + c] += Z[t * n + c];
}

void HostBackend::rope_rows(const Rope& rope, const LayerHeads& layers, bool strip, float* X, int64_t rows,
                            const int32_t* positions) {
  if (strip)
    rope.strip_block(X, rows, layers, positions);
  else
    rope.apply_block(X, rows, layers, positions);
}

std::unique_ptr<ComputeBackend> make_cpu_backend() { return std::make_unique<HostBackend>(); }

}  // namespace crosskv
