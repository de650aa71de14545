// Host implementations of the backend's input preparation: the CPU backend's, and the reference for device ones.
#include "core/backend.hpp"

#include <algorithm>
#include <cstring>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/memory.hpp"
#include "core/rope.hpp"

namespace crosskv {

const float* prepare_on_host(const ComputeBackend::StoredBlock& in, const ComputeBackend::Strip* strip,
                             const float* shift, std::vector<float>& host) {
  const int64_t cols = in.cols;
  if (strip) CROSSKV_ASSERT(cols % strip->rope->head_dim() == 0, "prepare: row width is not a multiple of head_dim");
  host.resize(static_cast<size_t>(in.rows * cols));
  for (int64_t t = 0; t < in.rows; ++t) {
    float* o = host.data() + t * cols;
    if (in.dtype == Dtype::f32) {
      std::copy_n(static_cast<const float*>(in.data) + t * cols, cols, o);
    } else {
      const uint16_t* r = static_cast<const uint16_t*>(in.data) + t * cols;
      if (in.dtype == Dtype::bf16)
        for (int64_t c = 0; c < cols; ++c) o[c] = bf16_to_float(r[c]);
      else
        for (int64_t c = 0; c < cols; ++c) o[c] = fp16_to_float(r[c]);
    }
    if (strip) strip->rope->strip_block(o, 1, cols / strip->rope->head_dim(), strip->positions + t);
    if (shift)
      for (int64_t c = 0; c < cols; ++c) o[c] -= shift[c];
  }
  return host.data();
}

const float* InputPreparation::prepare(const StoredBlock& in, const Strip* strip, const float* shift,
                                     std::vector<float>& host) {
  return prepare_on_host(in, strip, shift, host);
}

const float* InputPreparation::gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) {
  const int64_t W = int64_t{L} * H * D;
  host.resize(static_cast<size_t>(rows * W));
  for (int64_t t = 0; t < rows; ++t)
    for (int a = 0; a < L; ++a)
      for (int h = 0; h < H; ++h)
        std::copy_n(X + t * W + (int64_t{a} * H + h) * D, D, host.data() + t * W + (int64_t{h} * L + a) * D);
  return host.data();
}

void InputPreparation::column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, double* sum,
                                  double* sumsq) {
  for (int64_t t = 0; t < rows; ++t) {
    const float* x = X + t * ldx;
    for (int64_t c = 0; c < cols; ++c) sum[c] += x[c];
    if (sumsq)
      for (int64_t c = 0; c < cols; ++c) sumsq[c] += static_cast<double>(x[c]) * x[c];
  }
}

void DenseMaths::cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms,
                                     int64_t lda, int64_t ldb, int64_t ldc) {
  for (const CrossTerm& t : terms) cross_acc(rows, m, n, t.A, lda, t.B, ldb, t.C, ldc);
}

namespace {
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

// A host backend's held sums: the host array itself.
template <class T>
class HostSums final : public Residency::HeldSums<T> {
 public:
  HostSums(T* p, int64_t count) : Residency::HeldSums<T>(p, p, count) {}
};
}  // namespace

template <class T>
void Residency::HeldSums<T>::zero() {
  constexpr int64_t kPart = int64_t{1} << 22;  // a parallel region pays off from a few MB on
  T* p = held_;
  const int64_t count = count_;
#pragma omp parallel for schedule(static) if (count > 2 * kPart)
  for (int64_t at = 0; at < count; at += kPart) std::fill_n(p + at, std::min(kPart, count - at), T{0});
}
template class Residency::HeldSums<float>;
template class Residency::HeldSums<double>;

Residency::HeldSumsPtr<float> Residency::hold_sums(float* p, int64_t count, bool) {
  return std::make_unique<HostSums<float>>(p, count);
}
Residency::HeldSumsPtr<double> Residency::hold_sums(double* p, int64_t count, bool) {
  return std::make_unique<HostSums<double>>(p, count);
}

void Residency::copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                          bool dst_on_device) {
  copy_host_sums(pieces, off, len, dst, dst_on_device);
}
void Residency::copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                          bool dst_on_device) {
  copy_host_sums(pieces, off, len, dst, dst_on_device);
}

void assemble_cov_on_host(const ComputeBackend::CovTerms& t, double lambda, double* A, int64_t lda, double* diag) {
  const int64_t nl = t.nl, F = t.F;
  CROSSKV_ASSERT(static_cast<int64_t>(t.blocks.size()) == nl * nl && static_cast<int64_t>(t.mean.size()) == nl * F,
                 "assemble_cov: terms of the wrong size");
  using Read = ComputeBackend::CovBlock::Read;
#pragma omp parallel for schedule(dynamic) if (nl * nl * F * F > (int64_t{1} << 22))
  for (int64_t ij = 0; ij < nl * nl; ++ij) {
    const int64_t i = ij / nl, j = ij % nl;
    const ComputeBackend::CovBlock& g = t.blocks[ij];
    const double* mi = t.mean.data() + i * F;
    const double* mj = t.mean.data() + j * F;
    for (int64_t p = 0; p < F; ++p) {
      double* row = A + (i * F + p) * lda + j * F;
      for (int64_t q = 0; q < F; ++q) {
        const bool stored = g.read == Read::as_is || (g.read == Read::upper && p <= q);
        const float v = stored ? g.p[p * g.ld + q] : g.p[q * g.ld + p];
        row[q] = v * t.inv_n - mi[p] * mj[q];
      }
      if (i == j) row[p] += lambda;
    }
  }
  if (diag)
    for (int64_t i = 0; i < nl * F; ++i) diag[i] = A[i * lda + i];
}

namespace {

// A factor in host memory: L [n x n], lower, row-major.
struct HostFactor final : DenseMaths::SystemFactor {
  BigVector<double> L;
};

// Factors f.L (its order f.n) in place with the backend's kernel; the pivots are its diagonal.
void factor_in_place(DenseMaths& be, HostFactor& f) {
  f.info = be.cholesky(f.n, f.L.data(), f.n);
  f.pivots.resize(static_cast<size_t>(f.n));
  for (int64_t i = 0; i < f.n; ++i) f.pivots[i] = f.L[i * f.n + i];
}

}  // namespace

DenseMaths::FactorPtr DenseMaths::factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse) {
  auto f = reuse_or_make<HostFactor>(std::move(reuse));
  f->n = t.nl * t.F;
  f->L.resize(static_cast<size_t>(f->n * f->n));
  assemble_cov_on_host(t, lambda, f->L.data(), f->n, diag);
  factor_in_place(*this, *f);
  return f;
}

DenseMaths::FactorPtr DenseMaths::factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse) {
  auto f = reuse_or_make<HostFactor>(std::move(reuse));
  f->n = n;
  f->L.resize(static_cast<size_t>(n * n));
  for (int64_t i = 0; i < n; ++i) std::copy_n(A + i * lda, n, f->L.data() + i * n);
  factor_in_place(*this, *f);
  return f;
}

void DenseMaths::solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) {
  CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
  cholesky_solve(n, own<HostFactor>(f).L.data(), f.n, nrhs, B, ldb);
}

void DenseMaths::solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                                  int64_t ldb) {
  CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
  triangular_solve(n, own<HostFactor>(f).L.data(), f.n, transpose, nrhs, B, ldb);
}

void InputPreparation::download(const float* operand, int64_t count, float* host) {
  std::copy_n(operand, count, host);
}

void InputPreparation::to_half(const float* in, int64_t n, bool bf16, uint16_t* out) { to_half_on_host(in, n, bf16, out); }

namespace {
struct HostMemory final : ServingKernels::Memory {
  std::vector<float> storage;  // float-aligned; any type up to float's alignment fits
};
}  // namespace

ServingKernels::MemoryPtr ServingKernels::allocate(int64_t bytes) {
  auto m = std::make_unique<HostMemory>();
  m->storage.resize(static_cast<size_t>((bytes + 3) / 4));
  m->data = m->storage.data(), m->bytes = bytes;
  return m;
}

void ServingKernels::copy_from_host(const void* host, int64_t bytes, void* dst) {
  if (bytes > 0 && host != dst) std::memcpy(dst, host, static_cast<size_t>(bytes));
}

void ServingKernels::copy_to_host(const void* src, int64_t bytes, void* host) {
  if (bytes > 0 && host != src) std::memcpy(host, src, static_cast<size_t>(bytes));
}

void ServingKernels::copy_within(const void* src, int64_t bytes, void* dst) {
  if (bytes > 0 && src != dst) std::memmove(dst, src, static_cast<size_t>(bytes));
}

void ServingKernels::broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  for (int64_t t = 0; t < rows; ++t) std::copy_n(b, n, Y + t * ldy);
}

void ServingKernels::gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists,
                                    int64_t F, int64_t rows, float* out) {
  for (const auto& layers : lists) {
    gather_layers_on_host(X, ldx, layers, F, rows, out);
    out += rows * static_cast<int64_t>(layers.size()) * F;
  }
}

void ServingKernels::relu(float* X, int64_t n) {
  for (int64_t i = 0; i < n; ++i) X[i] = X[i] > 0.0f ? X[i] : 0.0f;
}

void ServingKernels::add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < n; ++c) Y[t * ldy + c] += Z[t * n + c];
}

void ServingKernels::rope_rows(const Rope& rope, bool strip, float* X, int64_t rows, int64_t heads,
                                const int32_t* positions) {
  if (strip)
    rope.strip_block(X, rows, heads, positions);
  else
    rope.apply_block(X, rows, heads, positions);
}

void gather_layers_on_host(const float* X, int64_t ldx, const std::vector<int>& layers, int64_t F, int64_t rows,
                           float* out) {
  const int64_t K = static_cast<int64_t>(layers.size()) * F;
  for (int64_t t = 0; t < rows; ++t)
    for (size_t j = 0; j < layers.size(); ++j)
      std::copy_n(X + t * ldx + layers[j] * F, F, out + t * K + static_cast<int64_t>(j) * F);
}

void to_half_on_host(const float* in, int64_t n, bool bf16, uint16_t* out) {
#pragma omp parallel for schedule(static) if (n > (int64_t{1} << 20))
  for (int64_t i = 0; i < n; ++i) out[i] = bf16 ? float_to_bf16(in[i]) : float_to_fp16(in[i]);
}

}  // namespace crosskv
