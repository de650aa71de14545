#include <cuda_fp16.h>

#include <algorithm>

#include "backends/cuda/kernels.hpp"
#include "backends/cuda/launch.hpp"

namespace crosskv::cuda {
namespace {

constexpr int kThreads = 256;

int blocks_for(int64_t n) {
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((n + kThreads - 1) / kThreads, 65535L * 16)));
}

__device__ __forceinline__ float load(const void* p, Dtype kind, int64_t i) {
  if (kind == Dtype::f32) return static_cast<const float*>(p)[i];
  const uint16_t h = static_cast<const uint16_t*>(p)[i];
  if (kind == Dtype::bf16) return __uint_as_float(static_cast<uint32_t>(h) << 16);
  return __half2float(__ushort_as_half(h));
}

__global__ void prepare_kernel(const void* in, Dtype kind, int64_t rows, int64_t cols, StripArgs s,
                               const float* shift, const float* row_scale, float* out) {
  const int64_t n = rows * cols;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / cols, c = i - t * cols;
    float x = load(in, kind, i);
    const int64_t layer = s.inv_freq ? c / s.layer_cols : 0;
    if (s.inv_freq && s.rotates[layer]) {
      const int j = static_cast<int>(c % s.head_dim);
      if (j < s.rotary_dim) {
        // Pairs (i, i + half) or (2i, 2i + 1); the first of a pair gets u c + v s, the second v c - u s: the
        // rotation undone (docs/METHOD.md, "RoPE: content space").
        const int half = s.rotary_dim / 2;
        bool first;
        int f;
        int64_t partner;
        if (s.interleaved) {
          first = (j & 1) == 0;
          f = j >> 1;
          partner = first ? i + 1 : i - 1;
        } else {
          first = j < half;
          f = first ? j : j - half;
          partner = first ? i + half : i - half;
        }
        const float p = load(in, kind, partner);
        double sd, cd;
        sincos(static_cast<double>(s.positions[t]) * s.inv_freq[layer * half + f], &sd, &cd);
        const float cs = static_cast<float>(cd), sn = static_cast<float>(sd), ia = s.inv_attention[layer];
        x = first ? __fmul_rn(__fadd_rn(__fmul_rn(x, cs), __fmul_rn(p, sn)), ia)
                  : __fmul_rn(__fsub_rn(__fmul_rn(x, cs), __fmul_rn(p, sn)), ia);
      }
    }
    if (shift) x = __fsub_rn(x, shift[c]);
    if (row_scale) x = __fmul_rn(x, row_scale[t]);
    out[i] = x;
  }
}

__global__ void gather_heads_kernel(const float* X, int64_t rows, int L, int H, int D, float* out) {
  const int64_t W = int64_t{L} * H * D, n = rows * W;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / W, r = i - t * W;
    const int64_t j = r % D, ha = r / D;  // ha = h*L + a
    const int64_t a = ha % L, h = ha / L;
    out[i] = X[t * W + (a * H + h) * D + j];
  }
}

// One thread per column over every row, in order: deterministic (no atomics), and coalesced across a warp.
constexpr int kStatsThreads = 128;
__global__ void column_stats_kernel(const float* X, int64_t rows, int64_t cols, int64_t ldx, const float* w,
                                    double* sum, double* sumsq) {
  const int64_t c = blockIdx.x * int64_t{blockDim.x} + threadIdx.x;
  if (c >= cols) return;
  double s = 0, q = 0;
  for (int64_t t = 0; t < rows; ++t) {
    const double x = X[t * ldx + c];
    s = w ? __dadd_rn(s, __dmul_rn(static_cast<double>(w[t]), x)) : s + x;  // the host's order, no FMA
    q += x * x;
  }
  sum[c] += s;
  if (sumsq) sumsq[c] += q;
}

__global__ void to_half_kernel(const float* in, int64_t n, bool bf16, uint16_t* out) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x) {
    const float f = in[i];
    uint32_t u = __float_as_uint(f);
    if (bf16) {
      if ((u & 0x7fffffffu) > 0x7f800000u) {
        out[i] = static_cast<uint16_t>((u >> 16) | 0x40u);
      } else {
        u += 0x7fffu + ((u >> 16) & 1u);
        out[i] = static_cast<uint16_t>(u >> 16);
      }
    } else if ((u & 0x7fffffffu) > 0x7f800000u) {
      out[i] = static_cast<uint16_t>(0x7e00u | ((u >> 16) & 0x8000u));
    } else {
      out[i] = __half_as_ushort(__float2half_rn(f));
    }
  }
}

__global__ void assemble_cov_block_kernel(const float* __restrict__ g, int read, int64_t F,
                                          const double* __restrict__ mean_i, const double* __restrict__ mean_j,
                                          double inv_n, double lambda, bool diagonal, double* __restrict__ a,
                                          double* __restrict__ at, int64_t lda) {
  const int64_t n = F * F;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < n; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t p = e / F, q = e - p * F;
    const bool stored = read == 0 || (read == 2 && p <= q);
    const float v = stored ? g[p * F + q] : g[q * F + p];
    double x = __dsub_rn(__dmul_rn(static_cast<double>(v), inv_n), __dmul_rn(mean_i[p], mean_j[q]));
    if (diagonal && p == q) x = __dadd_rn(x, lambda);
    a[p * lda + q] = x;
    if (at) at[q * lda + p] = x;
  }
}

__global__ void broadcast_rows_kernel(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / n, c = i - t * n;
    Y[t * ldy + c] = b[c];
  }
}

__global__ void gather_layers_kernel(const float* X, int64_t ldx, const LayerList table, int64_t F, int64_t rows,
                                     float* out) {
  const int64_t K = table.k * F, per_list = rows * K, total = table.lists * per_list;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t s = e / per_list, r = e - s * per_list, t = r / K, c = r - t * K, j = c / F, f = c - j * F;
    out[e] = X[t * ldx + table.layer[s * table.k + j] * F + f];
  }
}

__global__ void relu_kernel(float* X, int64_t n) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    X[i] = X[i] > 0.0f ? X[i] : 0.0f;
}

__global__ void add_rows_kernel(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  const int64_t total = rows * n;
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < total; i += int64_t{gridDim.x} * blockDim.x) {
    const int64_t t = i / n, c = i - t * n;
    Y[t * ldy + c] = __fadd_rn(Y[t * ldy + c], Z[i]);
  }
}

// One thread per rotated pair of one head of one row; the pair is read, then both written (in place, no race).
__global__ void rope_rows_kernel(float* X, int64_t rows, int64_t heads, int64_t ld, const RopeArgs a) {
  const int half = a.rotary_dim / 2;
  const int64_t total = rows * heads * half;
  for (int64_t e = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; e < total; e += int64_t{gridDim.x} * blockDim.x) {
    const int64_t th = e / half, t = th / heads;
    const int i = static_cast<int>(e - th * half);
    float* x = X + t * ld + (th - t * heads) * a.head_dim;
    float* x1 = x + (a.interleaved ? 2 * i : i);
    float* x2 = x1 + (a.interleaved ? 1 : half);
    double sd, cd;
    sincos(static_cast<double>(a.positions[t]) * a.inv_freq[i], &sd, &cd);
    const float c = static_cast<float>(cd), s = static_cast<float>(sd), u = *x1, v = *x2;
    if (a.strip) {  // ((u c + v s) / a, (v c - u s) / a), as Rope::rotate_head<true>
      *x1 = __fmul_rn(__fadd_rn(__fmul_rn(u, c), __fmul_rn(v, s)), a.factor);
      *x2 = __fmul_rn(__fsub_rn(__fmul_rn(v, c), __fmul_rn(u, s)), a.factor);
    } else {  // (a (u c - v s), a (v c + u s))
      *x1 = __fmul_rn(a.factor, __fsub_rn(__fmul_rn(u, c), __fmul_rn(v, s)));
      *x2 = __fmul_rn(a.factor, __fadd_rn(__fmul_rn(v, c), __fmul_rn(u, s)));
    }
  }
}

}  // namespace

cudaError_t launch_broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy,
                                  cudaStream_t stream) {
  if (rows * n == 0) return cudaSuccess;
  return launch(broadcast_rows_kernel, blocks_for(rows * n), kThreads, stream, b, n, rows, Y, ldy);
}

cudaError_t launch_gather_layers(const float* X, int64_t ldx, const LayerList& table, int64_t F, int64_t rows,
                                 float* out, cudaStream_t stream) {
  const int64_t total = int64_t{table.lists} * rows * table.k * F;
  if (total == 0) return cudaSuccess;
  return launch(gather_layers_kernel, blocks_for(total), kThreads, stream, X, ldx, table, F, rows, out);
}

cudaError_t launch_relu(float* X, int64_t n, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch(relu_kernel, blocks_for(n), kThreads, stream, X, n);
}

cudaError_t launch_add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy, cudaStream_t stream) {
  if (rows * n == 0) return cudaSuccess;
  return launch(add_rows_kernel, blocks_for(rows * n), kThreads, stream, Z, n, rows, Y, ldy);
}

cudaError_t launch_rope_rows(float* X, int64_t rows, int64_t heads, int64_t ld, const RopeArgs& a,
                             cudaStream_t stream) {
  const int64_t total = rows * heads * (a.rotary_dim / 2);
  if (total == 0) return cudaSuccess;
  return launch(rope_rows_kernel, blocks_for(total), kThreads, stream, X, rows, heads, ld, a);
}

cudaError_t launch_assemble_cov_block(const float* g, int read, int64_t F, const double* mean_i, const double* mean_j,
                                      double inv_n, double lambda, bool diagonal, double* a, double* at, int64_t lda,
                                      cudaStream_t stream) {
  if (F == 0) return cudaSuccess;
  return launch(assemble_cov_block_kernel, blocks_for(F * F), kThreads, stream, g, read, F, mean_i, mean_j, inv_n,
                lambda, diagonal, a, at, lda);
}

cudaError_t launch_prepare(const void* in, Dtype kind, int64_t rows, int64_t cols, const StripArgs& strip,
                           const float* shift, const float* row_scale, float* out, cudaStream_t stream) {
  if (rows * cols == 0) return cudaSuccess;
  return launch(prepare_kernel, blocks_for(rows * cols), kThreads, stream, in, kind, rows, cols, strip, shift,
                row_scale, out);
}

cudaError_t launch_gather_heads(const float* X, int64_t rows, int L, int H, int D, float* out, cudaStream_t stream) {
  const int64_t n = rows * L * H * D;
  if (n == 0) return cudaSuccess;
  return launch(gather_heads_kernel, blocks_for(n), kThreads, stream, X, rows, L, H, D, out);
}

cudaError_t launch_column_stats(const float* X, int64_t rows, int64_t cols, int64_t ldx, const float* w, double* sum,
                                double* sumsq, cudaStream_t stream) {
  if (rows == 0 || cols == 0) return cudaSuccess;
  const unsigned grid = static_cast<unsigned>((cols + kStatsThreads - 1) / kStatsThreads);
  return launch(column_stats_kernel, grid, kStatsThreads, stream, X, rows, cols, ldx, w, sum, sumsq);
}

cudaError_t launch_to_half(const float* in, int64_t n, bool bf16, uint16_t* out, cudaStream_t stream) {
  if (n == 0) return cudaSuccess;
  return launch(to_half_kernel, blocks_for(n), kThreads, stream, in, n, bf16, out);
}

}  // namespace crosskv::cuda
