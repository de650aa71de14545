#pragma once
// Owning CUDA, cuBLAS, cuSOLVER and NCCL handles and device allocations: made (checked) in their constructor and
// released in their destructor, so that a constructor throwing half-way leaks nothing. Move-only; each converts to
// its raw handle for the library calls.
#include <utility>

#include "cuda/cuda_check.hpp"

namespace crosskv::cuda {

template <class H, class Traits>
class Owned {
 public:
  Owned() = default;
  explicit Owned(const Where& w) { Traits::create(&h_, w); }
  static Owned adopt(H h) {
    Owned o;
    o.h_ = h;
    return o;
  }
  ~Owned() { reset(); }
  Owned(Owned&& o) noexcept : h_(std::exchange(o.h_, H{})) {}
  Owned& operator=(Owned&& o) noexcept {
    if (this != &o) {
      reset();
      h_ = std::exchange(o.h_, H{});
    }
    return *this;
  }
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  operator H() const { return h_; }
  void reset() {
    if (h_) Traits::destroy(h_);
    h_ = H{};
  }

 private:
  H h_{};
};

struct StreamTraits {
  static void create(cudaStream_t* s, const Where& w) {
    CROSSKV_CUDA_CHECK(cudaStreamCreateWithFlags(s, cudaStreamNonBlocking), w, "");
  }
  static void destroy(cudaStream_t s) {
    cudaStreamSynchronize(s);
    cudaStreamDestroy(s);
  }
};
struct EventTraits {
  static void create(cudaEvent_t* e, const Where& w) {
    CROSSKV_CUDA_CHECK(cudaEventCreateWithFlags(e, cudaEventDisableTiming), w, "");
  }
  static void destroy(cudaEvent_t e) { cudaEventDestroy(e); }
};
struct BlasTraits {
  static void create(cublasHandle_t* h, const Where& w) { CROSSKV_CUDA_CHECK(cublasCreate(h), w, ""); }
  static void destroy(cublasHandle_t h) { cublasDestroy(h); }
};
struct SolverTraits {
  static void create(cusolverDnHandle_t* h, const Where& w) { CROSSKV_CUDA_CHECK(cusolverDnCreate(h), w, ""); }
  static void destroy(cusolverDnHandle_t h) { cusolverDnDestroy(h); }
};
struct SolverParamsTraits {
  static void create(cusolverDnParams_t* p, const Where& w) { CROSSKV_CUDA_CHECK(cusolverDnCreateParams(p), w, ""); }
  static void destroy(cusolverDnParams_t p) { cusolverDnDestroyParams(p); }
};
struct NcclTraits {  // made by ncclCommInitRank: adopt() it
  static void destroy(ncclComm_t c) { ncclCommDestroy(c); }
};

using Stream = Owned<cudaStream_t, StreamTraits>;
using Event = Owned<cudaEvent_t, EventTraits>;
using BlasHandle = Owned<cublasHandle_t, BlasTraits>;
using SolverHandle = Owned<cusolverDnHandle_t, SolverTraits>;
using SolverParams = Owned<cusolverDnParams_t, SolverParamsTraits>;
using NcclHandle = Owned<ncclComm_t, NcclTraits>;

// n values of device memory.
template <class T>
class DeviceArray {
 public:
  DeviceArray(size_t n, const Where& w) {
    CROSSKV_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T)), w, "bytes " + std::to_string(n * sizeof(T)));
  }
  ~DeviceArray() {
    if (p_) cudaFree(p_);
  }
  DeviceArray(DeviceArray&& o) noexcept : p_(std::exchange(o.p_, nullptr)) {}
  DeviceArray& operator=(DeviceArray&& o) noexcept {
    std::swap(p_, o.p_);
    return *this;
  }
  DeviceArray(const DeviceArray&) = delete;
  DeviceArray& operator=(const DeviceArray&) = delete;
  operator T*() const { return p_; }

 private:
  T* p_ = nullptr;
};

}  // namespace crosskv::cuda
