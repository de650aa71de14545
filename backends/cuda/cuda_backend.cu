// The CUDA backend's residency (sums resident on the device between blocks of rows, the input rounds) and
// the backend's factory. fp32 moments with cuBLAS, inputs copied once per block on a copy stream into
// one of two pinned/device buffer pairs, fp64 Cholesky with cuSOLVER's 64-bit API: see cuda_backend.hpp.
#include "backends/backends.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "backends/cuda/cuda_backend.hpp"

namespace crosskv {
namespace cuda {

void fail(const char* call, const std::string& status, const Where& w, const std::string& operands) {
  throw SystemError(std::string(call) + " failed on host " + host_name() + ", rank " + std::to_string(w.rank) +
                    ", device " + std::to_string(w.device) + (operands.empty() ? "" : " (" + operands + ")") + ": " +
                    status);
}

#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, res_.where(), ops)

CudaBackend::~CudaBackend() {
  cudaStreamSynchronize(res_.compute());
  cudaStreamSynchronize(res_.copy());
}

Residency::HeldSumsPtr<float> CudaBackend::hold_sums(float* p, int64_t count, bool host_is_zero) {
  return DeviceSums<float>::make(res_, p, count, host_is_zero);
}
Residency::HeldSumsPtr<double> CudaBackend::hold_sums(double* p, int64_t count, bool host_is_zero) {
  return DeviceSums<double>::make(res_, p, count, host_is_zero);
}
void CudaBackend::begin_inputs() { res_.begin_round(); }
void CudaBackend::stage_inputs(std::initializer_list<HostSpan> spans) { res_.stage(spans); }

int64_t CudaBackend::device_memory_free() const {
  size_t free = 0, total = 0;
  CK(cudaMemGetInfo(&free, &total), "");
  return static_cast<int64_t>(free);
}

void CudaBackend::synchronize() {
  CK(cudaStreamSynchronize(res_.copy()), "copy stream");
  CK(cudaStreamSynchronize(res_.compute()), "compute stream");
}

void CudaBackend::copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                            bool dst_on_device) {
  copy_current_sums(res_, pieces, off, len, dst, dst_on_device);
}
void CudaBackend::copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                            bool dst_on_device) {
  copy_current_sums(res_, pieces, off, len, dst, dst_on_device);
}


}  // namespace cuda

std::unique_ptr<ComputeBackend> make_cuda_backend(int device, int rank, bool tf32) {
  return std::make_unique<cuda::CudaBackend>(device, rank, tf32);
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
