// CUDA backend: fp32 moments with cuBLAS (sums resident on the device between blocks of rows, inputs copied once per
// block on a copy stream into one of two pinned/device buffer pairs), fp64 Cholesky with cuSOLVER's 64-bit API and
// triangular solves with cuBLAS. One backend per rank, on one device.
#include <algorithm>
#include <cstring>
#include <memory>
#include <unordered_map>
#include <vector>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "cuda/cuda_check.hpp"

namespace crosskv {
namespace cuda {

void fail(const char* call, const std::string& status, const Where& w, const std::string& operands) {
  throw SystemError(std::string(call) + " failed on host " + host_name() + ", rank " + std::to_string(w.rank) +
                    ", device " + std::to_string(w.device) + (operands.empty() ? "" : " (" + operands + ")") + ": " +
                    status);
}

}  // namespace cuda

namespace {

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
  ~DeviceBuffer() { release(); }

 private:
  T* p_ = nullptr;
  size_t cap_ = 0;
};

class CudaBackend final : public ComputeBackend {
 public:
  CudaBackend(int device, int rank, bool tf32) : where_{rank, device} {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess) n = 0;
    if (device < 0 || device >= n)
      throw UserError("runtime.device: cuda: no CUDA device " + std::to_string(device) + " on host " + host_name() +
                      " for rank " + std::to_string(rank) + " (" + std::to_string(n) + " present" +
                      (e != cudaSuccess ? std::string(", ") + cudaGetErrorString(e) : std::string()) + ")");
    CK(cudaSetDevice(device), dims({{"device", device}}));
    cudaDeviceProp prop{};
    CK(cudaGetDeviceProperties(&prop, device), "");
    name_ = "cuda:" + std::to_string(device) + " (" + prop.name + (tf32 ? ", tf32" : "") + ")";
    CK(cudaStreamCreateWithFlags(&compute_, cudaStreamNonBlocking), "");
    CK(cudaStreamCreateWithFlags(&copy_, cudaStreamNonBlocking), "");
    CK(cublasCreate(&blas_), "");
    CK(cublasSetStream(blas_, compute_), "");
    CK(cublasSetMathMode(blas_, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), "");
    CK(cusolverDnCreate(&solver_), "");
    CK(cusolverDnSetStream(solver_, compute_), "");
    CK(cusolverDnCreateParams(&params_), "");
    for (auto& s : slots_) {
      CK(cudaEventCreateWithFlags(&s.copied, cudaEventDisableTiming), "");
      CK(cudaEventCreateWithFlags(&s.used, cudaEventDisableTiming), "");
    }
    CK(cudaMalloc(&info_, sizeof(int)), "");
  }

  ~CudaBackend() override {
    cudaStreamSynchronize(compute_);
    cudaStreamSynchronize(copy_);
    for (auto& [h, s] : sums_) cudaFree(s.dev);
    for (auto& s : slots_) {
      if (s.pinned) cudaFreeHost(s.pinned);
      s.dev.release();
      cudaEventDestroy(s.copied);
      cudaEventDestroy(s.used);
    }
    cudaFree(info_);
    cusolverDnDestroyParams(params_);
    cusolverDnDestroy(solver_);
    cublasDestroy(blas_);
    cudaStreamDestroy(copy_);
    cudaStreamDestroy(compute_);
  }

  std::string name() const override { return name_; }

  void stage_inputs(std::initializer_list<HostSpan> spans) override {
    if (cur_ >= 0) CK(cudaEventRecord(slots_[cur_].used, compute_), "");
    cur_ = (cur_ + 1) % 2;
    Slot& s = slots_[cur_];
    // The block before the previous one used these buffers; wait until its products are done.
    CK(cudaEventSynchronize(s.used), "");
    size_t total = 0;
    for (const auto& sp : spans) total += static_cast<size_t>(sp.count);
    if (total > s.cap) {
      if (s.pinned) CK(cudaFreeHost(s.pinned), "");
      s.pinned = nullptr;
      CK(cudaMallocHost(&s.pinned, total * sizeof(float)), dims({{"bytes", static_cast<int64_t>(total * 4)}}));
      s.cap = total;
    }
    float* dev = s.dev.get(total, where_);
    s.spans.clear();
    size_t at = 0;
    for (const auto& sp : spans) {
      std::memcpy(s.pinned + at, sp.data, static_cast<size_t>(sp.count) * sizeof(float));
      s.spans.push_back({sp.data, sp.count, at});
      at += static_cast<size_t>(sp.count);
    }
    CK(cudaMemcpyAsync(dev, s.pinned, total * sizeof(float), cudaMemcpyHostToDevice, copy_),
       dims({{"bytes", static_cast<int64_t>(total * 4)}}));
    CK(cudaEventRecord(s.copied, copy_), "");
    CK(cudaStreamWaitEvent(compute_, s.copied, 0), "");
  }

  void flush() override {
    if (cur_ >= 0) CK(cudaEventRecord(slots_[cur_].used, compute_), "");
    for (auto& [host, s] : sums_)
      CK(cudaMemcpyAsync(host, s.dev, s.count * sizeof(float), cudaMemcpyDeviceToHost, compute_),
         dims({{"elements", s.count}}));
    CK(cudaStreamSynchronize(compute_), "");
    for (auto& [host, s] : sums_) CK(cudaFree(s.dev), "");
    sums_.clear();
  }

  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc) override {
    if (rows == 0 || m == 0 || n == 0) return;
    const float* dA = staged(A, (rows - 1) * lda + m);
    const float* dB = staged(B, (rows - 1) * ldb + n);
    float* dC = resident(C, (m - 1) * ldc + n);
    const float one = 1.0f;
    // Row-major C[m x n] += A^T B is column-major C' [n x m] += B' A'^T.
    CK(cublasSgemm_64(blas_, CUBLAS_OP_N, CUBLAS_OP_T, n, m, rows, &one, dB, ldb, dA, lda, &one, dC, ldc),
       dims({{"m", m}, {"n", n}, {"rows", rows}, {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}}));
  }

  void matmul_acc(int64_t rows, int64_t k, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc) override {
    if (rows == 0 || k == 0 || n == 0) return;
    const std::string ops = dims({{"rows", rows}, {"k", k}, {"n", n}, {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}});
    const size_t na = static_cast<size_t>((rows - 1) * lda + k), nb = static_cast<size_t>((k - 1) * ldb + n),
                 nc = static_cast<size_t>((rows - 1) * ldc + n);
    float* d = apply_.get(na + nb + nc, where_);
    CK(cudaMemcpyAsync(d, A, na * 4, cudaMemcpyHostToDevice, compute_), ops);
    CK(cudaMemcpyAsync(d + na, B, nb * 4, cudaMemcpyHostToDevice, compute_), ops);
    CK(cudaMemcpyAsync(d + na + nb, C, nc * 4, cudaMemcpyHostToDevice, compute_), ops);
    const float one = 1.0f;
    // Row-major C = A B is column-major C' = B' A'.
    CK(cublasSgemm_64(blas_, CUBLAS_OP_N, CUBLAS_OP_N, n, rows, k, &one, d + na, ldb, d, lda, &one, d + na + nb, ldc),
       ops);
    CK(cudaMemcpyAsync(C, d + na + nb, nc * 4, cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
  }

  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override {
    if (rows == 0 || m == 0) return;
    const float* dA = staged(A, (rows - 1) * lda + m);
    float* dC = resident(C, (m - 1) * ldc + m);
    const float one = 1.0f;
    // Row-major upper triangle of A^T A = column-major lower triangle of A' A'^T.
    CK(cublasSsyrk_64(blas_, CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, m, rows, &one, dA, lda, &one, dC, ldc),
       dims({{"m", m}, {"rows", rows}, {"lda", lda}, {"ldc", ldc}}));
  }

  int64_t cholesky(int64_t n, double* A, int64_t lda) override {
    if (n == 0) return 0;
    const size_t count = static_cast<size_t>((n - 1) * lda + n);
    // Factors stay on the device for the solves that follow: the last few, most recent first.
    forget_factor(A);
    if (factors_.size() == kFactorsKept) factors_.pop_back();
    factors_.insert(factors_.begin(), std::make_unique<DeviceFactor>());
    DeviceFactor& f = *factors_.front();
    double* dA = f.dev.get(count, where_);
    const std::string ops = dims({{"n", n}, {"lda", lda}});
    CK(cudaMemcpyAsync(dA, A, count * sizeof(double), cudaMemcpyHostToDevice, compute_), ops);
    size_t dev_bytes = 0, host_bytes = 0;
    // Row-major lower = column-major upper.
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
    CK(cudaMemcpyAsync(A, dA, count * sizeof(double), cudaMemcpyDeviceToHost, compute_), ops);
    CK(cudaStreamSynchronize(compute_), ops);
    CROSSKV_ASSERT(info >= 0, "cusolverDnXpotrf: illegal argument " + std::to_string(-info) + " (" + ops + ")");
    f.host = A;
    f.n = n;
    f.lda = lda;
    f.diag = diag_sum(A, n, lda);
    return info;
  }

  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override {
    solve(n, L, lda, nrhs, B, ldb, {false, true});
  }

  void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                        int64_t ldb) override {
    solve(n, L, lda, nrhs, B, ldb, {transpose});
  }

 private:
  struct Span {
    const float* host;
    int64_t count;
    size_t offset;
  };
  struct Slot {
    float* pinned = nullptr;
    size_t cap = 0;
    DeviceBuffer<float> dev;
    std::vector<Span> spans;
    cudaEvent_t copied{}, used{};
  };
  struct Sum {
    float* dev;
    int64_t count;
  };

  const float* staged(const float* host, int64_t extent) {
    CROSSKV_ASSERT(cur_ >= 0, "CUDA backend: an operand was not staged (stage_inputs)");
    Slot& s = slots_[cur_];
    float* dev = s.dev.get(0, where_);
    for (const Span& sp : s.spans)
      if (host >= sp.host && host + extent <= sp.host + sp.count) return dev + sp.offset + (host - sp.host);
    CROSSKV_ASSERT(false, "CUDA backend: an operand lies outside the staged inputs");
    return nullptr;
  }

  float* resident(float* host, int64_t count) {
    auto it = sums_.find(host);
    if (it != sums_.end()) {
      CROSSKV_ASSERT(it->second.count >= count, "CUDA backend: a resident sum grew");
      return it->second.dev;
    }
    float* dev = nullptr;
    CK(cudaMalloc(&dev, count * sizeof(float)), dims({{"elements", count}}));
    CK(cudaMemcpyAsync(dev, host, count * sizeof(float), cudaMemcpyHostToDevice, compute_), dims({{"elements", count}}));
    sums_.emplace(host, Sum{dev, count});
    return dev;
  }

  // A factor computed here and still on the device, for the host array it was copied back to. The weighted sum of
  // its diagonal guards against that host memory having been reused for another matrix.
  struct DeviceFactor {
    const double* host = nullptr;
    int64_t n = 0, lda = 0;
    double diag = 0;
    DeviceBuffer<double> dev;
  };
  static constexpr size_t kFactorsKept = 4;  // k = all and one target layer's, for keys and values
  void forget_factor(const double* host) {
    factors_.erase(std::remove_if(factors_.begin(), factors_.end(), [&](const auto& f) { return f->host == host; }),
                   factors_.end());
  }

  static double diag_sum(const double* A, int64_t n, int64_t lda) {
    double s = 0;
    for (int64_t i = 0; i < n; ++i) s += A[i * lda + i] * static_cast<double>(i + 1);
    return s;
  }

  // Triangular solves with the leading n x n block of L, one per entry of `transposes`, in order.
  void solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb,
             std::initializer_list<bool> transposes) {
    if (n == 0 || nrhs == 0) return;
    const std::string ops = dims({{"n", n}, {"lda", lda}, {"nrhs", nrhs}, {"ldb", ldb}});
    const double* dL = nullptr;
    for (auto& f : factors_)
      if (L == f->host && lda == f->lda && n <= f->n && diag_sum(L, f->n, lda) == f->diag) dL = f->dev.get(0, where_);
    if (!dL) {
      const size_t count = static_cast<size_t>((n - 1) * lda + n);
      double* d = other_.get(count, where_);
      CK(cudaMemcpyAsync(d, L, count * sizeof(double), cudaMemcpyHostToDevice, compute_), ops);
      dL = d;
    }
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
  cudaStream_t compute_{}, copy_{};
  cublasHandle_t blas_{};
  cusolverDnHandle_t solver_{};
  cusolverDnParams_t params_{};
  Slot slots_[2];
  int cur_ = -1;
  std::unordered_map<float*, Sum> sums_;
  std::vector<std::unique_ptr<DeviceFactor>> factors_;
  DeviceBuffer<double> other_, rhs_;
  DeviceBuffer<float> apply_;
  DeviceBuffer<char> work_;
  std::vector<char> host_work_;
  int* info_ = nullptr;
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

}  // namespace crosskv
