// The CUDA backend's input preparation: stored values to the moments' operands, on the device (one fused kernel
// for conversion, RoPE strip and shift), in the current round's memory.
#include "core/rope.hpp"
#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/kernels.hpp"

namespace crosskv::cuda {

#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, res_.where(), ops)

const float* CudaBackend::prepare(const StoredBlock& in, const Strip* strip, const float* shift,
                                  const float* row_scale, std::vector<float>& host) {
  const size_t elt = dtype_bytes(in.dtype), n = static_cast<size_t>(in.rows * in.cols);
  const std::string ops = dims({{"rows", in.rows}, {"cols", in.cols}, {"bytes per value", static_cast<int64_t>(elt)}});
  const void* d_in = res_.operand(in.data, n * elt);
  float* out = static_cast<float*>(res_.round_memory(n * 4));
  cuda::StripArgs sa;
  if (strip && !strip->rope->identity()) {
    const Rope& r = *strip->rope;
    const LayerHeads all = r.all();
    CROSSKV_ASSERT(in.cols == all.count * all.heads * r.head_dim(), "prepare: a stripped row is not every layer's heads");
    // Every layer's table (layers share rotary_dim and convention: parse_kv_spec refuses others).
    const RopeTable& first = r.layer(0);
    const int half = first.half();
    std::vector<double> freq(static_cast<size_t>(all.count) * half, 0.0);
    std::vector<float> inv_attention(all.count, 1.0f);
    std::vector<uint8_t> rotates(all.count, 0);
    for (int l = 0; l < all.count; ++l) {
      const RopeTable& t = r.layer(l);
      CROSSKV_ASSERT(t.rotary_dim() == first.rotary_dim() && t.convention() == first.convention(),
                     "prepare: layers differ in rotary_dim or convention");
      if (t.identity()) continue;
      std::copy(t.inv_freq().begin(), t.inv_freq().end(), freq.begin() + static_cast<int64_t>(l) * half);
      inv_attention[l] = static_cast<float>(1.0 / t.attention_factor());
      rotates[l] = 1;
    }
    sa.inv_freq = static_cast<const double*>(res_.upload(freq.data(), freq.size() * sizeof(double)));
    sa.inv_attention = static_cast<const float*>(res_.upload(inv_attention.data(), inv_attention.size() * 4));
    sa.rotates = static_cast<const uint8_t*>(res_.upload(rotates.data(), rotates.size()));
    sa.positions = static_cast<const int32_t*>(res_.operand(strip->positions, static_cast<size_t>(in.rows) * 4));
    sa.layer_cols = all.heads * r.head_dim();
    sa.head_dim = r.head_dim();
    sa.rotary_dim = first.rotary_dim();
    sa.interleaved = first.convention() == RopeConvention::interleaved;
  }
  const float* d_shift =
      shift ? static_cast<const float*>(res_.upload(shift, static_cast<size_t>(in.cols) * 4)) : nullptr;
  const float* d_scale =
      row_scale ? static_cast<const float*>(res_.operand(row_scale, static_cast<size_t>(in.rows) * 4)) : nullptr;
  CK(cuda::launch_prepare(d_in, in.dtype, in.rows, in.cols, sa, d_shift, d_scale, out, res_.compute()),
     "prepare kernel, " + ops);
  return out;
}

const float* CudaBackend::gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) {
  const size_t n = static_cast<size_t>(rows * L * H * D);
  const float* d_x = static_cast<const float*>(res_.operand(X, n * 4));
  float* out = static_cast<float*>(res_.round_memory(n * 4));
  CK(cuda::launch_gather_heads(d_x, rows, L, H, D, out, res_.compute()),
     "gather_heads kernel, " + dims({{"rows", rows}, {"L", L}, {"H", H}, {"D", D}}));
  return out;
}

void CudaBackend::column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, const float* row_weight,
                               double* sum, double* sumsq) {
  if (rows == 0 || cols == 0) return;
  const float* d_x = static_cast<const float*>(res_.operand(X, static_cast<size_t>((rows - 1) * ldx + cols) * 4));
  const float* d_w =
      row_weight ? static_cast<const float*>(res_.operand(row_weight, static_cast<size_t>(rows) * 4)) : nullptr;
  CK(cuda::launch_column_stats(d_x, rows, cols, ldx, d_w, sum, sumsq, res_.compute()),
     "column_stats kernel, " + dims({{"rows", rows}, {"cols", cols}, {"ldx", ldx}}));
}

void CudaBackend::download(const float* p, int64_t count, float* host) {
  const void* d = res_.operand(p, static_cast<size_t>(count) * 4);
  CK(cudaMemcpyAsync(host, d, static_cast<size_t>(count) * 4, cudaMemcpyDeviceToHost, res_.compute()),
     dims({{"elements", count}}));
  CK(cudaStreamSynchronize(res_.compute()), dims({{"elements", count}}));
}

void CudaBackend::to_half(const float* in, int64_t n, bool bf16, uint16_t* out) {
  if (n == 0) return;
  const std::string ops = dims({{"n", n}});
  float* d = res_.apply.get(static_cast<size_t>(n) + static_cast<size_t>(n + 1) / 2, res_.where());
  uint16_t* d_out = reinterpret_cast<uint16_t*>(d + n);
  CK(cudaMemcpyAsync(d, in, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice, res_.compute()), ops);
  CK(cuda::launch_to_half(d, n, bf16, d_out, res_.compute()), "to_half kernel, " + ops);
  CK(cudaMemcpyAsync(out, d_out, static_cast<size_t>(n) * 2, cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
}

}  // namespace crosskv::cuda
