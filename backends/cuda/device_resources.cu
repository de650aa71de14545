#include <cstring>

#include "core/comm.hpp"
#include "core/error.hpp"
#include "backends/cuda/device_resources.hpp"

namespace crosskv::cuda {

#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, where_, ops)

Where DeviceResources::select_device(int device, int rank) {
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

DeviceResources::DeviceResources(int device, int rank, bool tf32)
    : where_(select_device(device, rank)),
      external_in(where_),
      external_out(where_),
      compute_(where_),
      copy_(where_),
      blas_(where_),
      solver_(where_),
      params_(where_),
      info_(1, where_),
      slots_{Slot(where_), Slot(where_)} {
  cudaDeviceProp prop{};
  CK(cudaGetDeviceProperties(&prop, device), "");
  name_ = "cuda:" + std::to_string(device) + " (" + prop.name + (tf32 ? ", tf32" : "") + ")";
  CK(cublasSetStream(blas_, compute_), "");
  CK(cublasSetMathMode(blas_, tf32 ? CUBLAS_TF32_TENSOR_OP_MATH : CUBLAS_DEFAULT_MATH), "");
  CK(cusolverDnSetStream(solver_, compute_), "");
}

DeviceResources::~DeviceResources() {
  cudaStreamSynchronize(compute_);
  cudaStreamSynchronize(copy_);
}

void DeviceResources::make_current() const {
  CK(cudaSetDevice(where_.device), "device " + std::to_string(where_.device));
}

void DeviceResources::begin_round() {
  end_round();
  cur_ = (cur_ + 1) % 2;
  Slot& s = slots_[cur_];
  // The round before the previous one used these buffers; wait until its products are done.
  CK(cudaEventSynchronize(s.used), "");
  s.host.reset();
  s.dev.reset();
  s.spans.clear();
}

void DeviceResources::end_round() {
  if (cur_ >= 0) CK(cudaEventRecord(slots_[cur_].used, compute_), "");
}

void DeviceResources::stage(std::initializer_list<Residency::HostSpan> spans) {
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

const void* DeviceResources::operand(const void* p, size_t bytes) const {
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

void* DeviceResources::round_memory(size_t bytes) { return slots_[cur_].dev.alloc(bytes); }

const void* DeviceResources::upload(const void* host, size_t bytes) {
  Slot& s = slots_[cur_];
  void* pinned = s.host.alloc(bytes);
  void* dev = s.dev.alloc(bytes);
  std::memcpy(pinned, host, bytes);
  CK(cudaMemcpyAsync(dev, pinned, bytes, cudaMemcpyHostToDevice, compute_),
     dims({{"bytes", static_cast<int64_t>(bytes)}}));
  return dev;
}

}  // namespace crosskv::cuda
