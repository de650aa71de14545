#pragma once
// Checked CUDA, cuBLAS, cuSOLVER and NCCL calls: a failure throws SystemError naming the call, host, rank, device,
// the operands and the library's status.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <cusolverDn.h>
#include <nccl.h>

#include <cstdint>
#include <initializer_list>
#include <string>
#include <utility>

namespace crosskv::cuda {

struct Where {
  int rank = 0;
  int device = 0;
};

[[noreturn]] void fail(const char* call, const std::string& status, const Where& w, const std::string& operands);

inline bool ok(cudaError_t e) { return e == cudaSuccess; }
inline bool ok(cublasStatus_t s) { return s == CUBLAS_STATUS_SUCCESS; }
inline bool ok(cusolverStatus_t s) { return s == CUSOLVER_STATUS_SUCCESS; }
inline bool ok(ncclResult_t r) { return r == ncclSuccess; }
inline std::string status_text(cudaError_t e) { return std::string(cudaGetErrorName(e)) + ": " + cudaGetErrorString(e); }
inline std::string status_text(cublasStatus_t s) { return cublasGetStatusName(s); }
inline std::string status_text(cusolverStatus_t s) { return "cusolverStatus " + std::to_string(static_cast<int>(s)); }
inline std::string status_text(ncclResult_t r) { return ncclGetErrorString(r); }

// "m=3, n=4": the operands of a failed call.
inline std::string dims(std::initializer_list<std::pair<const char*, int64_t>> d) {
  std::string s;
  for (const auto& [k, v] : d) s += (s.empty() ? "" : ", ") + std::string(k) + "=" + std::to_string(v);
  return s;
}

}  // namespace crosskv::cuda

// `ops` (a string expression naming the operands) is evaluated only on failure.
#define CROSSKV_CUDA_CHECK(expr, where, ops)                                                   \
  do {                                                                                         \
    auto status_ = (expr);                                                                     \
    if (!::crosskv::cuda::ok(status_)) ::crosskv::cuda::fail(#expr, ::crosskv::cuda::status_text(status_), where, ops); \
  } while (0)
