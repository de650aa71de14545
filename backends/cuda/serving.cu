// The CUDA backend's ServingKernels: the serving apply on device memory, in order on the compute stream.
#include <algorithm>

#include "core/rope.hpp"
#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/kernels.hpp"

namespace crosskv::cuda {

#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, res_.where(), ops)
namespace {
// Memory of the serving apply, released once the backend's stream no longer reads it.
struct CudaMemory final : ServingKernels::Memory {
  cudaStream_t stream = nullptr;
  ~CudaMemory() override {
    if (!data) return;
    cudaStreamSynchronize(stream);  // no kernel of this backend reads it any more
    cudaFree(data);
  }
};
}  // namespace

CudaBackend::MemoryPtr CudaBackend::allocate(int64_t bytes) {
  res_.make_current();
  auto m = std::make_unique<CudaMemory>();
  m->stream = res_.compute();
  if (bytes > 0) CK(cudaMalloc(&m->data, static_cast<size_t>(bytes)), dims({{"bytes", bytes}}));
  m->bytes = bytes;
  return m;
}

void CudaBackend::copy_from_host(const void* host, int64_t bytes, void* dst) {
  if (bytes <= 0) return;
  res_.make_current();
  const std::string ops = dims({{"bytes", bytes}});
  CK(cudaMemcpyAsync(dst, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);  // pinned host memory is read late: the caller may reuse it now
}

void CudaBackend::copy_to_host(const void* src, int64_t bytes, void* host) {
  if (bytes <= 0) return;
  res_.make_current();
  const std::string ops = dims({{"bytes", bytes}});
  CK(cudaMemcpyAsync(host, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
}

void CudaBackend::copy_within(const void* src, int64_t bytes, void* dst) {
  if (bytes <= 0 || src == dst) return;
  res_.make_current();
  CK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, res_.compute()),
     dims({{"bytes", bytes}}));
}

void CudaBackend::broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  res_.make_current();
  CK(cuda::launch_broadcast_rows(b, n, rows, Y, ldy, res_.compute()), dims({{"n", n}, {"rows", rows}, {"ldy", ldy}}));
}

void CudaBackend::gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists, int64_t F,
                                int64_t rows, float* out) {
  if (lists.empty()) return;
  res_.make_current();
  const size_t k = lists[0].size();
  CROSSKV_ASSERT(lists.size() * k <= static_cast<size_t>(cuda::LayerList::kMax),
                 "CUDA gather_layers: " + std::to_string(lists.size()) + " selections of " + std::to_string(k) +
                     " layers (at most " + std::to_string(cuda::LayerList::kMax) + " in all)");
  cuda::LayerList table;
  table.lists = static_cast<int>(lists.size()), table.k = static_cast<int>(k);
  for (size_t s = 0; s < lists.size(); ++s) {
    CROSSKV_ASSERT(lists[s].size() == k, "CUDA gather_layers: selections of different sizes");
    std::copy(lists[s].begin(), lists[s].end(), table.layer + s * k);
  }
  CK(cuda::launch_gather_layers(X, ldx, table, F, rows, out, res_.compute()),
     dims({{"lists", table.lists}, {"k", table.k}, {"F", F}, {"rows", rows}, {"ldx", ldx}}));
}

void CudaBackend::relu(float* X, int64_t n) {
  res_.make_current();
  CK(cuda::launch_relu(X, n, res_.compute()), dims({{"n", n}}));
}

void CudaBackend::add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) {
  res_.make_current();
  CK(cuda::launch_add_rows(Z, n, rows, Y, ldy, res_.compute()), dims({{"n", n}, {"rows", rows}, {"ldy", ldy}}));
}

void CudaBackend::rope_rows(const Rope& rope, const LayerHeads& layers, bool strip, float* X, int64_t rows,
                            const int32_t* positions) {
  if (rows == 0) return;
  res_.make_current();
  const int64_t D = rope.head_dim(), ld = layers.count * layers.heads * D;
  for (const Rope::Run& run : rope.runs(layers)) {  // one launch per run of layers that rotate alike
    const RopeTable& r = *run.table;
    if (r.identity()) continue;
    cuda::RopeArgs a;
    CROSSKV_ASSERT(r.half() <= cuda::RopeArgs::kMaxHalf, "CUDA rope_rows: rotary_dim " +
                                                             std::to_string(r.rotary_dim()) + " over " +
                                                             std::to_string(2 * cuda::RopeArgs::kMaxHalf));
    std::copy(r.inv_freq().begin(), r.inv_freq().begin() + r.half(), a.inv_freq);
    a.positions = positions, a.head_dim = r.head_dim(), a.rotary_dim = r.rotary_dim();
    a.interleaved = r.convention() != RopeConvention::half, a.strip = strip;
    // The host's factors, rounded to fp32 as RopeTable::rotate_head rounds them.
    a.factor = strip ? static_cast<float>(1.0 / r.attention_factor()) : static_cast<float>(r.attention_factor());
    const int64_t heads = run.count * layers.heads;
    CK(cuda::launch_rope_rows(X + (run.first - layers.first) * layers.heads * D, rows, heads, ld, a, res_.compute()),
       dims({{"rows", rows}, {"first layer", run.first}, {"layers", run.count}, {"heads", heads}, {"ld", ld},
             {"head_dim", a.head_dim}, {"rotary_dim", a.rotary_dim}}));
  }
}

void CudaBackend::serving_gemm(const BatchedGemm& g) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  res_.make_current();
  // Row-major C = op(A) op(B) is column-major C' = op(B)' op(A)' (gemm_batched's call, on device operands).
  CK(cublasSgemmStridedBatched_64(res_.blas(), g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.n, g.m, g.k, &g.alpha, g.B, g.ldb,
                                  g.stride_b, g.A, g.lda, g.stride_a, &g.beta, g.C, g.ldc, g.stride_c, g.batch),
     dims({{"m", g.m}, {"n", g.n}, {"k", g.k}, {"batch", g.batch}, {"lda", g.lda}, {"ldb", g.ldb}, {"ldc", g.ldc}}));
}

void CudaBackend::begin_after(void* stream) {
  res_.make_current();
  CK(cudaEventRecord(res_.external_in, static_cast<cudaStream_t>(stream)), "begin_after");
  CK(cudaStreamWaitEvent(res_.compute(), res_.external_in, 0), "begin_after");
}

void CudaBackend::end_before(void* stream) {
  res_.make_current();
  CK(cudaEventRecord(res_.external_out, res_.compute()), "end_before");
  CK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), res_.external_out, 0), "end_before");
}

}  // namespace crosskv::cuda
