#pragma once
// Owning CUDA, cuBLAS, cuSOLVER and NCCL handles and device allocations: made (checked) in their constructor and
// released in their destructor, so that a constructor throwing half-way leaks nothing. Move-only; each converts to
// its raw handle for the library calls. Then the growing buffer and the per-round arena built on them.
#include <algorithm>
#include <utility>
#include <vector>

#include "backends/cuda/cuda_check.hpp"

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

// A device allocation that grows on demand (contents are not kept when it grows).
template <class T>
class DeviceBuffer {
 public:
  T* get(size_t n, const Where& where) {
    if (n > cap_) {
      release();
      CROSSKV_CUDA_CHECK(cudaMalloc(&p_, n * sizeof(T)), where, dims({{"bytes", static_cast<int64_t>(n * sizeof(T))}}));
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
// several chunks, each of what it was asked for; the next reset replaces them by one chunk of the total, so steady
// state is one allocation of exactly what a round uses (what the plan's device-memory budget counts).
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
      c.cap = bytes;
      if (pinned_)
        CROSSKV_CUDA_CHECK(cudaMallocHost(&c.p, c.cap), where_, dims({{"pinned bytes", static_cast<int64_t>(c.cap)}}));
      else
        CROSSKV_CUDA_CHECK(cudaMalloc(&c.p, c.cap), where_, dims({{"device bytes", static_cast<int64_t>(c.cap)}}));
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

}  // namespace crosskv::cuda
