// CUDA backend: fp32 moments with cuBLAS (sums resident on the device between blocks of rows, inputs copied once per
// block on a copy stream into one of two pinned/device buffer pairs), fp64 Cholesky with cuSOLVER's 64-bit API and
// triangular solves with cuBLAS. One backend per rank, on one device.
#include <algorithm>
#include <climits>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "core/rope.hpp"
#include "cuda/cuda_check.hpp"
#include "cuda/resources.hpp"
#include "cuda/kernels.hpp"

namespace crosskv {
namespace cuda {

void fail(const char* call, const std::string& status, const Where& w, const std::string& operands) {
  throw SystemError(std::string(call) + " failed on host " + host_name() + ", rank " + std::to_string(w.rank) +
                    ", device " + std::to_string(w.device) + (operands.empty() ? "" : " (" + operands + ")") + ": " +
                    status);
}

}  // namespace cuda

namespace {

using cuda::BlasHandle;
using cuda::DeviceArray;
using cuda::Event;
using cuda::SolverHandle;
using cuda::SolverParams;
using cuda::Stream;
using cuda::Where;
#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, where_, ops)

std::string dims(std::initializer_list<std::pair<const char*, int64_t>> d) {
  std::string s;
  for (const auto& [k, v] : d) s += (s.empty() ? "" : ", ") + std::string(k) + "=" + std::to_string(v);
  return s;
}

// A device allocation that grows on demand (contents are not kept when it grows).
template <class T>
class DeviceBuffer {
 public:
  T* get(size_t n, const Where& where_) {
    if (n > cap_) {
      release();
      CK(cudaMalloc(&p_, n * sizeof(T)), dims({{"bytes", static_cast<int64_t>(n * sizeof(T))}}));
      cap_ = n;
    }
    return p_;
  }
  void release() {
    if (p_) cudaFree(p_);
    p_ = nullptr;
    cap_ = 0;
  }
  DeviceBuffer() = default;
  DeviceBuffer(DeviceBuffer&& o) noexcept : p_(std::exchange(o.p_, nullptr)), cap_(std::exchange(o.cap_, 0)) {}
  DeviceBuffer& operator=(DeviceBuffer&& o) noexcept {
    std::swap(p_, o.p_);
    std::swap(cap_, o.cap_);
    return *this;
  }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  ~DeviceBuffer() { release(); }
  T* data() const { return p_; }

 private:
  T* p_ = nullptr;
  size_t cap_ = 0;
};

// A bump allocator over pinned host or device chunks, reset once per round of inputs. A round that outgrew it leaves
// several chunks; the next reset replaces them by one chunk of the total, so steady state is one allocation.
class Arena {
 public:
  Arena(bool pinned, const Where& where) : pinned_(pinned), where_(where) {}
  Arena(const Arena&) = delete;
  Arena& operator=(const Arena&) = delete;
  ~Arena() { release(); }
  void* alloc(size_t bytes) {
    bytes = (bytes + 255) / 256 * 256;
    if (chunks_.empty() || chunks_.back().used + bytes > chunks_.back().cap) {
      Chunk c;
      c.cap = std::max(bytes, chunks_.empty() ? size_t{64} << 20 : chunks_.back().cap);
      if (pinned_)
        CK(cudaMallocHost(&c.p, c.cap), dims({{"pinned bytes", static_cast<int64_t>(c.cap)}}));
      else
        CK(cudaMalloc(&c.p, c.cap), dims({{"device bytes", static_cast<int64_t>(c.cap)}}));
      chunks_.push_back(c);
    }
    Chunk& c = chunks_.back();
    void* p = static_cast<char*>(c.p) + c.used;
    c.used += bytes;
    return p;
  }
  // Only once nothing reads the memory any more.
  void reset() {
    if (chunks_.size() > 1) {
      size_t total = 0;
      for (const Chunk& c : chunks_) total += c.used;
      release();
      alloc(total);
    }
    if (!chunks_.empty()) chunks_.back().used = 0;
  }
  bool contains(const void* p, size_t bytes) const {
    for (const Chunk& c : chunks_)
      if (p >= c.p && static_cast<const char*>(p) + bytes <= static_cast<const char*>(c.p) + c.used) return true;
    return false;
  }

 private:
  struct Chunk {
    void* p = nullptr;
    size_t cap = 0, used = 0;
  };
  void release() {
    for (const Chunk& c : chunks_) pinned_ ? cudaFreeHost(c.p) : cudaFree(c.p);
    chunks_.clear();
  }
  bool pinned_;
  Where where_;
  std::vector<Chunk> chunks_;
};

class CudaBackend final : public ComputeBackend {
 public:
  // Streams, handles, events and buffers are owned (cuda/resources.hpp): a constructor that throws half-way leaks
  // none of them.
  CudaBackend(int device, int rank, bool tf32)
      : where_(select_device(device, rank)),
        compute_(where_),
        copy_(where_),
        blas_(where_),
        solver_(where_),
        params_(where_),
        slots_{Slot(where_), Slot(where_)},
        external_in_(where_),
        external_out_(where_),
        info_(1, where_) {
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, device), "");
    name_ = "cuda:" + std::to_string(device) + " (" + prop.name + (tf32 ? ", tf32" : "") + ")";
    CK(cublasSetStream(blas_, compute_), "");
    CK(cublasSetMathMode(blas_, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), "");
    CK(cusolverDnSetStream(solver_, compute_), "");
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(compute_);
    cudaStreamSynchronize(copy_);
    for (auto& [h, s] : sums_) cudaFree(s.dev);
    for (auto& [h, s] : dsums_) cudaFree(s.dev);
    for (auto& [h, s] : constants_) cudaFree(const_cast<float*>(s.dev));
  }

  // The device of this backend, checked and made current before any of its resources are made.
  static Where select_device(int device, int rank) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) n = 0;
    if (device < 0 || device >= n)
      throw UserError("runtime.device: cuda: no CUDA device " + std::to_string(device) + " on host " + host_name() +
                      " for rank " + std::to_string(rank) + " (" + std::to_string(n) + " present" +
                      (e != cudaSuccess ? std::string(", ") + cudaGetErrorString(e) : std::string()) + ")");
    const Where where{rank, device};
    CROSSKV_CUDA_CHECK(cudaSetDevice(device), where, "device " + std::to_string(device));
    return where;
  }

  std::string name() const override { return name_; }

  void keep_resident(float* p, int64_t count, bool host_is_zero) override {
    if (count <= 0 || find_resident(sums_, p, count)) return;
    float* dev = new_resident(sums_, p, count);
    const std::string ops = dims({{"elements", count}});
    if (host_is_zero)
      CK(cudaMemsetAsync(dev, 0, count * sizeof(float), compute_), ops);
    else
      CK(cudaMemcpyAsync(dev, p, count * sizeof(float), cudaMemcpyHostToDevice, compute_), ops);
  }

  void begin_inputs() override {
    if (cur_ >= 0) CK(cudaEventRecord(slots_[cur_].used, compute_), "");
    cur_ = (cur_ + 1) % 2;
    Slot& s = slots_[cur_];
    // The round before the previous one used these buffers; wait until its products are done.
    CK(cudaEventSynchronize(s.used), "");
    s.host.reset();
    s.dev.reset();
    s.spans.clear();
  }

  void stage_inputs(std::initializer_list<HostSpan> spans) override {
    CROSSKV_ASSERT(cur_ >= 0, "CUDA backend: stage_inputs before begin_inputs");
    Slot& s = slots_[cur_];
    for (const auto& sp : spans) {
      const size_t bytes = static_cast<size_t>(sp.bytes);
      void* pinned = s.host.alloc(bytes);
      void* dev = s.dev.alloc(bytes);
      std::memcpy(pinned, sp.data, bytes);
      CK(cudaMemcpyAsync(dev, pinned, bytes, cudaMemcpyHostToDevice, copy_), dims({{"bytes", sp.bytes}}));
      s.spans.push_back({static_cast<const char*>(sp.data), bytes, static_cast<char*>(dev)});
    }
    CK(cudaEventRecord(s.copied, copy_), "");
    CK(cudaStreamWaitEvent(compute_, s.copied, 0), "");
  }

  bool prepares_on_device() const override { return true; }

  int64_t device_memory_free() const override {
    size_t free = 0, total = 0;
    CK(cudaMemGetInfo(&free, &total), "");
    return static_cast<int64_t>(free);
  }

  const float* prepare(const StoredBlock& in, const Strip* strip, const float* shift,
                       std::vector<float>& host) override {
    const size_t elt = dtype_bytes(in.dtype), n = static_cast<size_t>(in.rows * in.cols);
    const std::string ops = dims({{"rows", in.rows}, {"cols", in.cols}, {"bytes per value", static_cast<int64_t>(elt)}});
    const void* d_in = operand(in.data, n * elt);
    float* out = static_cast<float*>(slots_[cur_].dev.alloc(n * 4));
    cuda::StripArgs sa;
    if (strip && !strip->rope->identity()) {
      const Rope& r = *strip->rope;
      CROSSKV_ASSERT(in.cols % r.head_dim() == 0, "prepare: row width is not a multiple of head_dim");
      sa.inv_freq = static_cast<const double*>(upload(r.inv_freq().data(), r.inv_freq().size() * sizeof(double)));
      sa.positions = static_cast<const int32_t*>(operand(strip->positions, static_cast<size_t>(in.rows) * 4));
      sa.head_dim = r.head_dim();
      sa.rotary_dim = r.rotary_dim();
      sa.interleaved = r.convention() == RopeConvention::interleaved;
      sa.inv_attention = static_cast<float>(1.0 / r.attention_factor());
    }
    const float* d_shift = shift ? static_cast<const float*>(upload(shift, static_cast<size_t>(in.cols) * 4)) : nullptr;
    CK(cuda::launch_prepare(d_in, in.dtype, in.rows, in.cols, sa, d_shift, out, compute_), "prepare kernel, " + ops);
    return out;
  }

  const float* gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) override {
    const size_t n = static_cast<size_t>(rows * L * H * D);
    const float* d_x = static_cast<const float*>(operand(X, n * 4));
    float* out = static_cast<float*>(slots_[cur_].dev.alloc(n * 4));
    CK(cuda::launch_gather_heads(d_x, rows, L, H, D, out, compute_),
       "gather_heads kernel, " + dims({{"rows", rows}, {"L", L}, {"H", H}, {"D", D}}));
    return out;
  }

  void column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, double* sum, double* sumsq) override {
    if (rows == 0 || cols == 0) return;
    const float* d_x = static_cast<const float*>(operand(X, static_cast<size_t>((rows - 1) * ldx + cols) * 4));
    double* d_sum = resident(sum, cols);
    double* d_sq = sumsq ? resident(sumsq, cols) : nullptr;
    CK(cuda::launch_column_stats(d_x, rows, cols, ldx, d_sum, d_sq, compute_),
       "column_stats kernel, " + dims({{"rows", rows}, {"cols", cols}, {"ldx", ldx}}));
  }

  void download(const float* p, int64_t count, float* host) override {
    const void* d = operand(p, static_cast<size_t>(count) * 4);
    CK(cudaMemcpyAsync(host, d, static_cast<size_t>(count) * 4, cudaMemcpyDeviceToHost, compute_),
       dims({{"elements", count}}));
    CK(cudaStreamSynchronize(compute_), dims({{"elements", count}}));
  }

  void to_half(const float* in, int64_t n, bool bf16, uint16_t* out) override {
    if (n == 0) return;
    const std::string ops = dims({{"n", n}});
    float* d = apply_.get(static_cast<size_t>(n) + static_cast<size_t>(n + 1) / 2, where_);
    uint16_t* d_out = reinterpret_cast<uint16_t*>(d + n);
    CK(cudaMemcpyAsync(d, in, static_cast<size_t>(n) * 4, cudaMemcpyHostToDevice, compute_), ops);
    CK(cuda::launch_to_half(d, n, bf16, d_out, compute_), "to_half kernel, " + ops);
    CK(cudaMemcpyAsync(out, d_out, static_cast<size_t>(n) * 2, cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }

  void synchronize() override {
    CK(cudaStreamSynchronize(copy_), "copy stream");
    CK(cudaStreamSynchronize(compute_), "compute stream");
  }

  void flush() override {
    if (cur_ >= 0) CK(cudaEventRecord(slots_[cur_].used, compute_), "");
    for (auto& [host, s] : sums_)
      CK(cudaMemcpyAsync(host, s.dev, s.count * sizeof(float), cudaMemcpyDeviceToHost, compute_),
         dims({{"elements", s.count}}));
    for (auto& [host, s] : dsums_)
      CK(cudaMemcpyAsync(host, s.dev, s.count * sizeof(double), cudaMemcpyDeviceToHost, compute_),
         dims({{"elements", s.count}}));
    CK(cudaStreamSynchronize(compute_), "");
    for (auto& [host, s] : sums_) CK(cudaFree(s.dev), "");
    for (auto& [host, s] : dsums_) CK(cudaFree(s.dev), "");
    sums_.clear();
    dsums_.clear();
  }

  void copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                 bool dst_on_device) override {
    copy_sums_in(sums_, pieces, off, len, dst, dst_on_device);
  }
  void copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                 bool dst_on_device) override {
    copy_sums_in(dsums_, pieces, off, len, dst, dst_on_device);
  }
  void zero_sums(float* p, int64_t count) override { zero_sums_in(sums_, p, count); }
  void zero_sums(double* p, int64_t count) override { zero_sums_in(dsums_, p, count); }
  void drop_resident() override {
    CK(cudaStreamSynchronize(compute_), "");
    for (auto& [host, s] : sums_) CK(cudaFree(s.dev), dims({{"elements", s.count}}));
    for (auto& [host, s] : dsums_) CK(cudaFree(s.dev), dims({{"elements", s.count}}));
    sums_.clear();
    dsums_.clear();
  }

  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc) override {
    if (rows == 0 || m == 0 || n == 0) return;
    const float* dA = static_cast<const float*>(operand(A, static_cast<size_t>((rows - 1) * lda + m) * 4));
    const float* dB = static_cast<const float*>(operand(B, static_cast<size_t>((rows - 1) * ldb + n) * 4));
    float* dC = resident(C, (m - 1) * ldc + n);
    const float one = 1.0f;
    // Row-major C[m x n] += A^T B is column-major C' [n x m] += B' A'^T.
    CK(cublasSgemm_64(blas_, CUBLAS_OP_N, CUBLAS_OP_T, n, m, rows, &one, dB, ldb, dA, lda, &one, dC, ldc),
       dims({{"m", m}, {"n", n}, {"rows", rows}, {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}}));
  }

  void cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms, int64_t lda,
                       int64_t ldb, int64_t ldc) override {
    if (terms.empty() || rows == 0 || m == 0 || n == 0) return;
    const std::string ops = dims({{"batch", static_cast<int64_t>(terms.size())}, {"m", m}, {"n", n}, {"rows", rows},
                                  {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}});
    CROSSKV_ASSERT(rows <= INT32_MAX && m <= INT32_MAX && n <= INT32_MAX && lda <= INT32_MAX && ldb <= INT32_MAX &&
                       ldc <= INT32_MAX && terms.size() <= INT32_MAX,
                   "cross_acc_batch: operands beyond 32-bit sizes (" + ops + ")");
    // Row-major C_i[m x n] += A_i^T B_i is column-major C_i' [n x m] += B_i' A_i'^T, as in cross_acc.
    std::vector<const float*> ptrs(3 * terms.size());
    const size_t nt = terms.size();
    for (size_t i = 0; i < nt; ++i) {
      ptrs[i] = static_cast<const float*>(operand(terms[i].B, static_cast<size_t>((rows - 1) * ldb + n) * 4));
      ptrs[nt + i] = static_cast<const float*>(operand(terms[i].A, static_cast<size_t>((rows - 1) * lda + m) * 4));
      ptrs[2 * nt + i] = resident(terms[i].C, (m - 1) * ldc + n);
    }
    const auto* d = static_cast<const float* const*>(upload(ptrs.data(), ptrs.size() * sizeof(float*)));
    const float one = 1.0f;
    CK(cublasSgemmBatched(blas_, CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n), static_cast<int>(m),
                          static_cast<int>(rows), &one, d, static_cast<int>(ldb), d + nt, static_cast<int>(lda), &one,
                          const_cast<float* const*>(d + 2 * nt), static_cast<int>(ldc), static_cast<int>(nt)),
       ops);
  }

  void keep_constant(const float* p, int64_t count) override {
    if (count <= 0 || find_constant(p, count)) return;
    auto next = constants_.upper_bound(p);
    CROSSKV_ASSERT(next == constants_.end() || p + count <= next->first,
                   "CUDA backend: a constant overlaps one already kept (" + dims({{"elements", count}}) + ")");
    float* dev = nullptr;
    CK(cudaMalloc(&dev, count * sizeof(float)), dims({{"constant elements", count}}));
    CK(cudaMemcpyAsync(dev, p, count * sizeof(float), cudaMemcpyHostToDevice, compute_), dims({{"elements", count}}));
    constants_.emplace(p, Sum<const float>{dev, count});
  }

  void forget_constant(const float* p) override {
    auto it = constants_.find(p);
    if (it == constants_.end()) return;
    CK(cudaStreamSynchronize(compute_), "forget_constant");
    CK(cudaFree(const_cast<float*>(it->second.dev)), "forget_constant");
    constants_.erase(it);
  }

  void matmul_acc(int64_t rows, int64_t k, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc) override {
    if (rows == 0 || k == 0 || n == 0) return;
    const std::string ops = dims({{"rows", rows}, {"k", k}, {"n", n}, {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}});
    const size_t na = static_cast<size_t>((rows - 1) * lda + k), nb = static_cast<size_t>((k - 1) * ldb + n),
                 nc = static_cast<size_t>((rows - 1) * ldc + n);
    const float* kept = find_constant(B, static_cast<int64_t>(nb));
    float* d = apply_.get(na + (kept ? 0 : nb) + nc, where_);
    float* dC = d + na + (kept ? 0 : nb);
    CK(cudaMemcpyAsync(d, A, na * 4, cudaMemcpyHostToDevice, compute_), ops);
    if (!kept) CK(cudaMemcpyAsync(d + na, B, nb * 4, cudaMemcpyHostToDevice, compute_), ops);
    CK(cudaMemcpyAsync(dC, C, nc * 4, cudaMemcpyHostToDevice, compute_), ops);
    const float one = 1.0f;
    // Row-major C = A B is column-major C' = B' A'.
    CK(cublasSgemm_64(blas_, CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, &one, kept ? kept : d + na, ldb, d, lda, &one, dC,
                      ldc),
       ops);
    CK(cudaMemcpyAsync(C, dC, nc * 4, cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }

  void gemm_batched(const BatchedGemm& g) override {
    if (g.m == 0 || g.n == 0 || g.batch == 0) return;
    const std::string ops = dims({{"m", g.m}, {"n", g.n}, {"k", g.k}, {"batch", g.batch}, {"lda", g.lda},
                                  {"ldb", g.ldb}, {"ldc", g.ldc}});
    // Extents of the host operands (a stride of 0 shares one matrix over the batch).
    auto extent = [&](int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
      return static_cast<size_t>((g.batch - 1) * stride + (rows - 1) * ld + cols);
    };
    const size_t na = g.k ? extent(g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.stride_a) : 0,
                 nb = g.k ? extent(g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.stride_b) : 0,
                 nc = extent(g.m, g.n, g.ldc, g.stride_c);
    float* d = apply_.get(na + nb + nc, where_);
    float *dA = d, *dB = d + na, *dC = d + na + nb;
    if (na) CK(cudaMemcpyAsync(dA, g.A, na * 4, cudaMemcpyHostToDevice, compute_), ops);
    if (nb) CK(cudaMemcpyAsync(dB, g.B, nb * 4, cudaMemcpyHostToDevice, compute_), ops);
    // C comes back whole (its extent): unless the batch's outputs tile it, what lies between them goes up first,
    // even when beta is 0, or the copy back overwrites it.
    const bool tiles = g.ldc == g.n && (g.batch == 1 || g.stride_c == g.m * g.n);
    if (g.beta != 0.0f || !tiles) CK(cudaMemcpyAsync(dC, g.C, nc * 4, cudaMemcpyHostToDevice, compute_), ops);
    // Row-major C = op(A) op(B) is column-major C' = op(B)' op(A)'.
    CK(cublasSgemmStridedBatched_64(blas_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    g.n, g.m, g.k, &g.alpha, dB, g.ldb, g.stride_b, dA, g.lda, g.stride_a, &g.beta, dC,
                                    g.ldc, g.stride_c, g.batch),
       ops);
    CK(cudaMemcpyAsync(g.C, dC, nc * 4, cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }

  // ---- ResidentKernels: the serving apply on device memory, in order on the compute stream.
  bool memory_on_device() const override { return true; }

  struct CudaMemory final : Memory {
    cudaStream_t stream = nullptr;
    ~CudaMemory() override {
      if (!data) return;
      cudaStreamSynchronize(stream);  // no kernel of this backend reads it any more
      cudaFree(data);
    }
  };
  MemoryPtr allocate(int64_t bytes) override {
    current();
    auto m = std::make_unique<CudaMemory>();
    m->stream = compute_;
    if (bytes > 0) CK(cudaMalloc(&m->data, static_cast<size_t>(bytes)), dims({{"bytes", bytes}}));
    m->bytes = bytes;
    return m;
  }
  void copy_from_host(const void* host, int64_t bytes, void* dst) override {
    if (bytes <= 0) return;
    current();
    const std::string ops = dims({{"bytes", bytes}});
    CK(cudaMemcpyAsync(dst, host, static_cast<size_t>(bytes), cudaMemcpyHostToDevice, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);  // pinned host memory is read late: the caller may reuse it now
  }
  void copy_to_host(const void* src, int64_t bytes, void* host) override {
    if (bytes <= 0) return;
    current();
    const std::string ops = dims({{"bytes", bytes}});
    CK(cudaMemcpyAsync(host, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }
  void copy_within(const void* src, int64_t bytes, void* dst) override {
    if (bytes <= 0 || src == dst) return;
    current();
    CK(cudaMemcpyAsync(dst, src, static_cast<size_t>(bytes), cudaMemcpyDeviceToDevice, compute_),
       dims({{"bytes", bytes}}));
  }
  void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) override {
    current();
    CK(cuda::launch_broadcast_rows(b, n, rows, Y, ldy, compute_), dims({{"n", n}, {"rows", rows}, {"ldy", ldy}}));
  }
  void gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists, int64_t F,
                     int64_t rows, float* out) override {
    if (lists.empty()) return;
    current();
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
    CK(cuda::launch_gather_layers(X, ldx, table, F, rows, out, compute_),
       dims({{"lists", table.lists}, {"k", table.k}, {"F", F}, {"rows", rows}, {"ldx", ldx}}));
  }
  void relu(float* X, int64_t n) override {
    current();
    CK(cuda::launch_relu(X, n, compute_), dims({{"n", n}}));
  }
  void add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) override {
    current();
    CK(cuda::launch_add_rows(Z, n, rows, Y, ldy, compute_), dims({{"n", n}, {"rows", rows}, {"ldy", ldy}}));
  }
  void rope_rows(const Rope& rope, bool strip, float* X, int64_t rows, int64_t heads,
                 const int32_t* positions) override {
    if (rope.identity() || rows == 0) return;
    current();
    cuda::RopeArgs a;
    CROSSKV_ASSERT(rope.half() <= cuda::RopeArgs::kMaxHalf, "CUDA rope_rows: rotary_dim " +
                                                                std::to_string(rope.rotary_dim()) + " over " +
                                                                std::to_string(2 * cuda::RopeArgs::kMaxHalf));
    std::copy(rope.inv_freq().begin(), rope.inv_freq().begin() + rope.half(), a.inv_freq);
    a.positions = positions, a.head_dim = rope.head_dim(), a.rotary_dim = rope.rotary_dim();
    a.interleaved = rope.convention() != RopeConvention::half, a.strip = strip;
    // The host's factors, rounded to fp32 as Rope::rotate_head rounds them.
    a.factor = strip ? static_cast<float>(1.0 / rope.attention_factor()) : static_cast<float>(rope.attention_factor());
    CK(cuda::launch_rope_rows(X, rows, heads, a, compute_),
       dims({{"rows", rows}, {"heads", heads}, {"head_dim", a.head_dim}, {"rotary_dim", a.rotary_dim}}));
  }
  void resident_gemm(const BatchedGemm& g) override {
    if (g.m == 0 || g.n == 0 || g.batch == 0) return;
    current();
    // Row-major C = op(A) op(B) is column-major C' = op(B)' op(A)' (gemm_batched's call, on device operands).
    CK(cublasSgemmStridedBatched_64(blas_, g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N, g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N,
                                    g.n, g.m, g.k, &g.alpha, g.B, g.ldb, g.stride_b, g.A, g.lda, g.stride_a, &g.beta,
                                    g.C, g.ldc, g.stride_c, g.batch),
       dims({{"m", g.m}, {"n", g.n}, {"k", g.k}, {"batch", g.batch}, {"lda", g.lda}, {"ldb", g.ldb}, {"ldc", g.ldc}}));
  }
  void begin_after(void* stream) override {
    current();
    CK(cudaEventRecord(external_in_, static_cast<cudaStream_t>(stream)), "begin_after");
    CK(cudaStreamWaitEvent(compute_, external_in_, 0), "begin_after");
  }
  void end_before(void* stream) override {
    current();
    CK(cudaEventRecord(external_out_, compute_), "end_before");
    CK(cudaStreamWaitEvent(static_cast<cudaStream_t>(stream), external_out_, 0), "end_before");
  }

  void symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) override {
    if (n == 0) return;
    const std::string ops = dims({{"n", n}, {"lda", lda}});
    const size_t count = static_cast<size_t>(n * n);
    double* dA = other_.get(count + static_cast<size_t>(n), where_);
    double* dW = dA + count;
    std::vector<double> packed(count);  // row-major upper = column-major lower, packed with leading dim n
    for (int64_t i = 0; i < n; ++i) std::copy_n(A + i * lda, n, packed.data() + i * n);
    CK(cudaMemcpyAsync(dA, packed.data(), count * sizeof(double), cudaMemcpyHostToDevice, compute_), ops);
    size_t dev_bytes = 0, host_bytes = 0;
    CK(cusolverDnXsyevd_bufferSize(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F,
                                   dA, n, CUDA_R_64F, dW, CUDA_R_64F, &dev_bytes, &host_bytes),
       ops);
    void* dws = work_.get(std::max<size_t>(dev_bytes, 1), where_);
    host_work_.resize(std::max<size_t>(host_bytes, 1));
    CK(cusolverDnXsyevd(solver_, params_, CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n, CUDA_R_64F, dA, n,
                        CUDA_R_64F, dW, CUDA_R_64F, dws, dev_bytes, host_work_.data(), host_bytes, info_),
       ops);
    int info = 0;
    CK(cudaMemcpyAsync(&info, info_, sizeof(int), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaMemcpyAsync(packed.data(), dA, count * sizeof(double), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaMemcpyAsync(w, dW, static_cast<size_t>(n) * sizeof(double), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
    CROSSKV_ASSERT(info == 0, "cusolverDnXsyevd failed: info " + std::to_string(info) + " (" + ops + ")");
    // Column-major eigenvectors (column i = vector i) are the rows of the row-major array: transpose into A.
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) A[j * lda + i] = packed[i * n + j];
  }

  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override {
    if (rows == 0 || m == 0) return;
    const float* dA = static_cast<const float*>(operand(A, static_cast<size_t>((rows - 1) * lda + m) * 4));
    float* dC = resident(C, (m - 1) * ldc + m);
    const float one = 1.0f;
    // Row-major upper triangle of A^T A = column-major lower triangle of A' A'^T.
    CK(cublasSsyrk_64(blas_, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, m, rows, &one, dA, lda, &one, dC, ldc),
       dims({{"m", m}, {"rows", rows}, {"lda", lda}, {"ldc", ldc}}));
  }

  // A factor in device memory, owned by its handle.
  struct CudaFactor final : SystemFactor {
    DeviceBuffer<double> dev;  // [n x n], lower, row-major (lda = n)
  };

  // The system is assembled on the device from the fp32 blocks (uploaded one at a time: half the bytes of the fp64
  // system) and factored there; only its diagonal and the factor's pivots come to the host.
  FactorPtr factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse) override {
    const int64_t F = t.F, nl = t.nl, n = nl * F;
    auto f = reuse_or_make<CudaFactor>(std::move(reuse));
    f->n = n;
    if (n == 0) return f;
    const std::string ops = dims({{"layers", nl}, {"F", F}});
    double* dA = f->dev.get(static_cast<size_t>(n * n), where_);
    double* dmean = mean_.get(static_cast<size_t>(n), where_);
    CK(cudaMemcpyAsync(dmean, t.mean.data(), n * sizeof(double), cudaMemcpyHostToDevice, compute_), ops);
    float* dg = block_.get(static_cast<size_t>(F * F), where_);
    for (int64_t i = 0; i < nl; ++i)
      for (int64_t j = i; j < nl; ++j) {
        const CovBlock& g = t.blocks[i * nl + j];
        // In stream order: the previous block's kernel is done with dg before this copy writes it.
        CK(cudaMemcpy2DAsync(dg, F * sizeof(float), g.p, g.ld * sizeof(float), F * sizeof(float), F,
                             cudaMemcpyHostToDevice, compute_),
           ops + ", block " + dims({{"i", i}, {"j", j}}));
        CK(cuda::launch_assemble_cov_block(dg, g.read, F, dmean + i * F, dmean + j * F, t.inv_n, lambda, i == j,
                                           dA + i * F * n + j * F, i == j ? nullptr : dA + j * F * n + i * F, n,
                                           compute_),
           "assemble_cov kernel, " + ops);
      }
    copy_diagonal(dA, n, n, diag, ops);
    factor_on_device(*f, ops);
    return f;
  }

  FactorPtr factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse) override {
    auto f = reuse_or_make<CudaFactor>(std::move(reuse));
    f->n = n;
    if (n == 0) return f;
    const std::string ops = dims({{"n", n}, {"lda", lda}});
    double* dA = f->dev.get(static_cast<size_t>(n * n), where_);
    CK(cudaMemcpy2DAsync(dA, n * sizeof(double), A, lda * sizeof(double), n * sizeof(double), n,
                         cudaMemcpyHostToDevice, compute_),
       ops);
    factor_on_device(*f, ops);
    return f;
  }

  void solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) override {
    CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
    solve_on_device(own<CudaFactor>(f).dev.data(), n, f.n, nrhs, B, ldb, {false, true});
  }
  void solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override {
    CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
    solve_on_device(own<CudaFactor>(f).dev.data(), n, f.n, nrhs, B, ldb, {transpose});
  }

  // The kernels on host arrays (reference checks): uploaded, computed, copied back.
  int64_t cholesky(int64_t n, double* A, int64_t lda) override {
    if (n == 0) return 0;
    const size_t count = static_cast<size_t>((n - 1) * lda + n);
    const std::string ops = dims({{"n", n}, {"lda", lda}});
    double* dA = other_.get(count, where_);
    CK(cudaMemcpyAsync(dA, A, count * sizeof(double), cudaMemcpyHostToDevice, compute_), ops);
    const int info = potrf(dA, n, lda, ops);
    CK(cudaMemcpyAsync(A, dA, count * sizeof(double), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
    return info;
  }

  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override {
    solve_on_device(upload_factor(n, L, lda), n, lda, nrhs, B, ldb, {false, true});
  }

  void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override {
    solve_on_device(upload_factor(n, L, lda), n, lda, nrhs, B, ldb, {transpose});
  }

 private:
  struct Span {
    const char* host;
    size_t bytes;
    char* dev;
  };
  struct Slot {
    explicit Slot(const Where& w) : host(true, w), dev(false, w), copied(w), used(w) {}
    Arena host, dev;  // pinned staging and device memory of this round's inputs and products
    std::vector<Span> spans;
    Event copied, used;
  };
  template <class T>
  struct Sum {
    T* dev;
    int64_t count;
  };

  // The device address of an operand of this round: a staged host array, or a product made on the device.
  const void* operand(const void* p, size_t bytes) {
    CROSSKV_ASSERT(cur_ >= 0, "CUDA backend: an operand was not staged (begin_inputs)");
    const Slot& s = slots_[cur_];
    const char* c = static_cast<const char*>(p);
    for (const Span& sp : s.spans)
      if (c >= sp.host && c + bytes <= sp.host + sp.bytes) return sp.dev + (c - sp.host);
    if (s.dev.contains(p, bytes)) return p;
    CROSSKV_ASSERT(false, "CUDA backend: an operand lies outside this round's inputs (" +
                              dims({{"bytes", static_cast<int64_t>(bytes)}}) + ")");
    return nullptr;
  }

  // A small host array copied to the device in stream order (shifts, frequency tables).
  const void* upload(const void* host, size_t bytes) {
    Slot& s = slots_[cur_];
    void* pinned = s.host.alloc(bytes);
    void* dev = s.dev.alloc(bytes);
    std::memcpy(pinned, host, bytes);
    CK(cudaMemcpyAsync(dev, pinned, bytes, cudaMemcpyHostToDevice, compute_), dims({{"bytes", static_cast<int64_t>(bytes)}}));
    return dev;
  }

  // Resident sums: host ranges and their device copies. A C argument may be any part of a range.
  template <class T>
  using Residents = std::map<T*, Sum<T>>;
  float* resident(float* host, int64_t count) { return resident_in(sums_, host, count); }
  double* resident(double* host, int64_t count) { return resident_in(dsums_, host, count); }
  // The entry of a map from host range starts to {dev, count} whose range holds p, or end().
  template <class Map, class P>
  static auto containing(Map& ranges, P* p) {
    auto it = ranges.upper_bound(p);
    if (it == ranges.begin()) return ranges.end();
    --it;
    return p < it->first + it->second.count ? it : ranges.end();
  }
  template <class T>
  T* find_resident(Residents<T>& sums, T* host, int64_t count) {
    auto it = containing(sums, host);
    if (it == sums.end()) return nullptr;
    CROSSKV_ASSERT(host + count <= it->first + it->second.count,
                   "CUDA backend: a sum reaches beyond its resident range (" + dims({{"elements", count}}) + ")");
    return it->second.dev + (host - it->first);
  }
  template <class T>
  T* new_resident(Residents<T>& sums, T* host, int64_t count) {
    auto next = sums.upper_bound(host);
    CROSSKV_ASSERT(next == sums.end() || host + count <= next->first,
                   "CUDA backend: a new resident range overlaps one already resident (" +
                       dims({{"elements", count}}) + ")");
    T* dev = nullptr;
    CK(cudaMalloc(&dev, count * sizeof(T)), dims({{"elements", count}, {"bytes", count * int64_t{sizeof(T)}}}));
    sums.emplace(host, Sum<T>{dev, count});
    return dev;
  }
  // The device copy of a kept constant holding host [p, p + count), or null.
  const float* find_constant(const float* p, int64_t count) const {
    auto it = containing(constants_, p);
    if (it == constants_.end()) return nullptr;
    return p + count <= it->first + it->second.count ? it->second.dev + (p - it->first) : nullptr;
  }
  template <class T>
  T* resident_in(Residents<T>& sums, T* host, int64_t count) {
    if (T* d = find_resident(sums, host, count)) return d;
    T* dev = new_resident(sums, host, count);
    CK(cudaMemcpyAsync(dev, host, count * sizeof(T), cudaMemcpyHostToDevice, compute_), dims({{"elements", count}}));
    return dev;
  }

  // Runs of sums to dst in stream order after the accumulations (device copies of resident ones, else the host's);
  // returns when they are done, so that another stream (a comm's) may read dst.
  template <class T>
  void copy_sums_in(Residents<T>& sums, const std::vector<SumPiece<T>>& pieces, int64_t off, int64_t len, T* dst,
                    bool dst_on_device) {
    const std::string ops = dims({{"offset", off}, {"elements", len}});
    for_each_sum_run(pieces, off, len, [&](const T* src, int64_t ld, int64_t rows, int64_t cols, int64_t flat) {
      const T* from = find_resident(sums, const_cast<T*>(src), (rows - 1) * ld + cols);
      T* to = dst + (flat - off);
      if (!from && !dst_on_device) {
        for (int64_t r = 0; r < rows; ++r) std::copy_n(src + r * ld, cols, to + r * cols);
        return;
      }
      CK(cudaMemcpy2DAsync(to, cols * sizeof(T), from ? from : src, ld * sizeof(T), cols * sizeof(T), rows,
                           cudaMemcpyDefault, compute_),
         ops + ", run " + dims({{"rows", rows}, {"cols", cols}, {"ld", ld}}));
    });
    CK(cudaStreamSynchronize(compute_), ops);
  }
  template <class T>
  void zero_sums_in(Residents<T>& sums, T* p, int64_t count) {
    if (count <= 0) return;
    if (T* d = find_resident(sums, p, count))
      CK(cudaMemsetAsync(d, 0, count * sizeof(T), compute_), dims({{"elements", count}}));
    else
      std::fill_n(p, count, T{0});
  }

  // This backend's device made current for the calling thread (a serving process may call from any thread).
  void current() { CK(cudaSetDevice(where_.device), "device " + std::to_string(where_.device)); }

  // The diagonal of device matrix dA (n values, lda + 1 apart) to host `out` (if given); waits for the stream.
  void copy_diagonal(const double* dA, int64_t n, int64_t lda, double* out, const std::string& ops) {
    if (out)
      CK(cudaMemcpy2DAsync(out, sizeof(double), dA, static_cast<size_t>(lda + 1) * sizeof(double), sizeof(double),
                           static_cast<size_t>(n), cudaMemcpyDeviceToHost, compute_),
         ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }
  // cusolverDnXpotrf in place on device matrix dA (row-major lower = column-major upper); returns LAPACK's info.
  int potrf(double* dA, int64_t n, int64_t lda, const std::string& ops) {
    size_t dev_bytes = 0, host_bytes = 0;
    CK(cusolverDnXpotrf_bufferSize(solver_, params_, CUBLAS_FILL_MODE_UPPER, n, CUDA_R_64F, dA, lda, CUDA_R_64F,
                                   &dev_bytes, &host_bytes),
       ops);
    void* dws = work_.get(std::max<size_t>(dev_bytes, 1), where_);
    host_work_.resize(std::max<size_t>(host_bytes, 1));
    CK(cusolverDnXpotrf(solver_, params_, CUBLAS_FILL_MODE_UPPER, n, CUDA_R_64F, dA, lda, CUDA_R_64F, dws, dev_bytes,
                        host_work_.data(), host_bytes, info_),
       ops);
    int info = 0;
    CK(cudaMemcpyAsync(&info, info_, sizeof(int), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
    CROSSKV_ASSERT(info >= 0, "cusolverDnXpotrf: illegal argument " + std::to_string(-info) + " (" + ops + ")");
    return info;
  }
  // Factors f's device system in place and copies its pivots to the host.
  void factor_on_device(CudaFactor& f, const std::string& ops) {
    double* dA = f.dev.data();
    f.info = potrf(dA, f.n, f.n, ops);
    f.pivots.resize(static_cast<size_t>(f.n));
    copy_diagonal(dA, f.n, f.n, f.pivots.data(), ops);
  }
  // A host factor's leading n x n block, uploaded for one solve.
  const double* upload_factor(int64_t n, const double* L, int64_t lda) {
    if (n == 0) return nullptr;
    const size_t count = static_cast<size_t>((n - 1) * lda + n);
    double* d = other_.get(count, where_);
    CK(cudaMemcpyAsync(d, L, count * sizeof(double), cudaMemcpyHostToDevice, compute_), dims({{"n", n}, {"lda", lda}}));
    return d;
  }

  // Triangular solves with the leading n x n block of device factor dL (leading dim lda), one per entry of
  // `transposes`, in order, on host B.
  void solve_on_device(const double* dL, int64_t n, int64_t lda, int64_t nrhs, double* B, int64_t ldb,
                       std::initializer_list<bool> transposes) {
    if (n == 0 || nrhs == 0) return;
    const std::string ops = dims({{"n", n}, {"lda", lda}, {"nrhs", nrhs}, {"ldb", ldb}});
    const size_t bcount = static_cast<size_t>((n - 1) * ldb + nrhs);
    double* dB = rhs_.get(bcount, where_);
    CK(cudaMemcpyAsync(dB, B, bcount * sizeof(double), cudaMemcpyHostToDevice, compute_), ops);
    const double one = 1.0;
    // Row-major L X = B is column-major X' U = B' with U = L' (upper): a right-side solve; L^T X = B uses U^T.
    for (bool t : transposes)
      CK(cublasDtrsm_64(blas_, CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_UPPER, t ? CUBLAS_OP_T : CUBLAS_OP_N,
                        CUBLAS_DIAG_NON_UNIT, nrhs, n, &one, dL, lda, dB, ldb),
         ops);
    CK(cudaMemcpyAsync(B, dB, bcount * sizeof(double), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }

  Where where_;
  std::string name_;
  Stream compute_, copy_;
  BlasHandle blas_;
  SolverHandle solver_;
  SolverParams params_;
  Slot slots_[2];
  Event external_in_, external_out_;  // ordering with a caller's stream (begin_after, end_before)
  int cur_ = -1;
  Residents<float> sums_;
  Residents<double> dsums_;
  std::map<const float*, Sum<const float>> constants_;  // kept read-only operands (keep_constant)
  DeviceBuffer<double> other_, rhs_, mean_;
  DeviceBuffer<float> block_;
  DeviceBuffer<float> apply_;
  DeviceBuffer<char> work_;
  std::vector<char> host_work_;
  DeviceArray<int> info_;
};

}  // namespace

std::unique_ptr<ComputeBackend> make_cuda_backend(int device, int rank, bool tf32) {
  return std::make_unique<CudaBackend>(device, rank, tf32);
}
bool cuda_compiled_in() { return true; }
int cuda_device_count() {
  int n = 0;
  return cudaGetDeviceCount(&n) == cudaSuccess ? n : 0;
}
CudaDeviceInfo cuda_device_info(int device) {
  CudaDeviceInfo info;
  cudaDeviceProp prop{};
  int previous = 0;
  size_t free = 0, total = 0;
  if (device < 0 || device >= cuda_device_count() || cudaGetDevice(&previous) != cudaSuccess ||
      cudaGetDeviceProperties(&prop, device) != cudaSuccess || cudaSetDevice(device) != cudaSuccess)
    return info;
  if (cudaMemGetInfo(&free, &total) == cudaSuccess) {
    info.free_bytes = static_cast<int64_t>(free);
    info.total_bytes = static_cast<int64_t>(total);
  }
  info.name = prop.name;
  cudaSetDevice(previous);
  return info;
}

}  // namespace crosskv
