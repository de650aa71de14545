// The host kernels shared by the host backend and the layers above it (core/host_kernels.hpp).
#include "core/host_kernels.hpp"

#include <algorithm>

#include "core/error.hpp"
#include "core/half.hpp"
#include "core/rope.hpp"

namespace crosskv {

const float* prepare_on_host(const ComputeBackend::StoredBlock& in, const ComputeBackend::Strip* strip,
                             const float* shift, const float* row_scale, std::vector<float>& host) {
  const int64_t cols = in.cols;
  if (strip) {
    const LayerHeads all = strip->rope->all();
    CROSSKV_ASSERT(cols == all.count * all.heads * strip->rope->head_dim(),
                   "prepare: a stripped row is not every layer's heads");
  }
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
    if (strip) strip->rope->strip_block(o, 1, strip->rope->all(), strip->positions + t);
    if (shift)
      for (int64_t c = 0; c < cols; ++c) o[c] -= shift[c];
    if (row_scale)
      for (int64_t c = 0; c < cols; ++c) o[c] *= row_scale[t];
  }
  return host.data();
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
