#pragma once
// Element-wise kernels of the CUDA backend (launchers; all asynchronous on `stream`). Each matches the host code it
// replaces (core/host_kernels.cpp, core/half.hpp); tests/cuda/test_cuda.cpp holds them to it.
#include <cuda_runtime.h>

#include <cstdint>
#include <tuple>

#include "core/dtype.hpp"

namespace crosskv::cuda {

// RoPE strip tables on the device, one per layer (a row is every layer's heads): inv_freq [layers x rotary/2] (fp64,
// as the host computes angles), inv_attention and rotates [layers], per-row positions.
struct StripArgs {
  const double* inv_freq = nullptr;  // null: no strip
  const float* inv_attention = nullptr;
  const uint8_t* rotates = nullptr;  // 0: the layer has no RoPE
  const int32_t* positions = nullptr;
  int64_t layer_cols = 0;  // heads x head_dim
  int head_dim = 0, rotary_dim = 0;
  bool interleaved = false;
};

// out[rows x cols] = (fp32(in) (RoPE stripped per head when strip.inv_freq) - shift[cols]) * row_scale[rows] (shift
// and row_scale may be null).
cudaError_t launch_prepare(const void* in, Dtype kind, int64_t rows, int64_t cols, const StripArgs& strip,
                           const float* shift, const float* row_scale, float* out, cudaStream_t stream);
// out[t, (h*L + a)*D + j] = X[t, (a*H + h)*D + j].
cudaError_t launch_gather_heads(const float* X, int64_t rows, int L, int H, int D, float* out, cudaStream_t stream);
// sum[c] += sum_t w[t] X[t*ldx + c] (w may be null: 1); sumsq[c] += sum_t X^2 when sumsq (fp64).
cudaError_t launch_column_stats(const float* X, int64_t rows, int64_t cols, int64_t ldx, const float* w, double* sum,
                                double* sumsq, cudaStream_t stream);
// fp32 -> bf16 / fp16 bits, round to nearest even, NaN quieted as on the host.
cudaError_t launch_to_half(const float* in, int64_t n, bool bf16, uint16_t* out, cudaStream_t stream);

// One [F x F] block of Cxx + lambda*I (ComputeBackend::factor_cov), as the host computes it (no fused multiply-add,
// so the bits match): a[p*lda + q] = g(p, q) * inv_n - mean_i[p] * mean_j[q] (+ lambda when p == q and diagonal), g
// read from `g` (ld F) as stored (read 0), transposed (1) or from its upper triangle (2); also written transposed to
// at (the block (j, i)) unless null.
cudaError_t launch_assemble_cov_block(const float* g, int read, int64_t F, const double* mean_i, const double* mean_j,
                                      double inv_n, double lambda, bool diagonal, double* a, double* at, int64_t lda,
                                      cudaStream_t stream);

// The serving apply's kernels (ServingKernels; each the host default's loop, bit for bit):
// Y[t*ldy + c] = b[c].
cudaError_t launch_broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy, cudaStream_t stream);
// out[(s*rows + t)*k*F + j*F + i] = X[t*ldx + layer[s*k + j]*F + i] for s < lists: `lists` selections of k layers
// each. The table travels in the kernel's parameters (no device table).
struct LayerList {
  static constexpr int kMax = 256;
  int lists = 0, k = 0;
  int layer[kMax] = {};
};
cudaError_t launch_gather_layers(const float* X, int64_t ldx, const LayerList& table, int64_t F, int64_t rows,
                                 float* out, cudaStream_t stream);
cudaError_t launch_relu(float* X, int64_t n, cudaStream_t stream);
// Y[t*ldy + c] += Z[t*n + c].
cudaError_t launch_add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy, cudaStream_t stream);
// RoPE on X [rows, heads, head_dim] in place (Rope::apply_block / strip_block): inv_freq [rotary/2] fp64 in the
// kernel's parameters, positions [rows] on the device; `factor` multiplies the rotated pair (the attention factor,
// or its inverse to strip).
struct RopeArgs {
  static constexpr int kMaxHalf = 256;
  double inv_freq[kMaxHalf] = {};
  const int32_t* positions = nullptr;
  int head_dim = 0, rotary_dim = 0;
  bool interleaved = false, strip = false;
  float factor = 1.0f;
};
cudaError_t launch_rope_rows(float* X, int64_t rows, int64_t heads, int64_t ld, const RopeArgs& a,
                             cudaStream_t stream);

// The device pointers these arguments carry (a launch's pointer arguments are checked by the host emulation, and
// these with them).
inline auto device_pointers(const StripArgs& a) {
  return std::tuple{a.inv_freq, a.inv_attention, a.rotates, a.positions};
}
inline auto device_pointers(const RopeArgs& a) { return std::tuple{a.positions}; }

}  // namespace crosskv::cuda
