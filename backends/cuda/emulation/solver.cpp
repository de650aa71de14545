// The emulated cuSOLVER (64-bit API, fp64): LAPACK in stream order, `info` written to device memory.
#include <lapacke.h>

#include <set>

#include "backends/cuda/emulation/device.hpp"
#include "cusolverDn.h"

struct cusolverDnContext {
  uint64_t id = 0;
  bool live = true;
  cudaStream_t stream = nullptr;
};
struct cusolverDnParams {
  bool live = true;
};

namespace crosskv_cuda_emulation {
namespace {

std::mutex solver_mutex;
std::set<cusolverDnContext*> solvers;
std::set<cusolverDnParams*> param_sets;
uint64_t next_solver = 1;

struct SolverCall {
  std::string name;
  cusolverStatus_t status = CUSOLVER_STATUS_SUCCESS;
  bool failed() const { return status != CUSOLVER_STATUS_SUCCESS; }
  void fail(cusolverStatus_t s, const std::string& what) {
    if (!failed()) status = misuse(s, name + ": " + what);
  }
  void value(bool ok, const std::string& what) {
    if (!ok) fail(CUSOLVER_STATUS_INVALID_VALUE, what);
  }
  void device(const char* operand, const void* p, size_t bytes) {
    if (failed()) return;
    const std::string e = check_device(p, bytes);
    if (!e.empty()) fail(CUSOLVER_STATUS_INVALID_VALUE, std::string(operand) + ": " + e);
  }
  void handles(cusolverDnHandle_t h, cusolverDnParams_t p) {
    std::lock_guard<std::mutex> lock(solver_mutex);
    if (!solvers.count(h) || !h->live)
      status = misuse(CUSOLVER_STATUS_NOT_INITIALIZED, name + ": the handle was destroyed or never made");
    else if (!param_sets.count(p) || !p->live)
      status = misuse(CUSOLVER_STATUS_INVALID_VALUE, name + ": the params were destroyed or never made");
  }
  void fp64(cudaDataType a, cudaDataType compute) {
    if (!failed() && (a != CUDA_R_64F || compute != CUDA_R_64F))
      status = misuse(CUSOLVER_STATUS_NOT_SUPPORTED, name + ": the emulation supports CUDA_R_64F only");
  }
  void square(cublasFillMode_t uplo, int64_t n, int64_t lda) {
    value(uplo == CUBLAS_FILL_MODE_LOWER || uplo == CUBLAS_FILL_MODE_UPPER, "uplo is not lower or upper");
    value(n >= 0, "n negative");
    value(lda >= std::max<int64_t>(1, n), "lda " + std::to_string(lda) + " < max(1, n " + std::to_string(n) + ")");
  }
};

size_t square_bytes(int64_t n, int64_t lda) { return n <= 0 ? 0 : static_cast<size_t>((n - 1) * lda + n) * 8; }
size_t potrf_workspace(int64_t n) { return static_cast<size_t>(std::max<int64_t>(n, 1)) * 8; }
size_t syevd_workspace(int64_t n) { return static_cast<size_t>(std::max<int64_t>(n, 1)) * 16; }

// Queues `work` (returning LAPACK's info) and the write of info to device `info`, its device operands checked
// again and opened when it runs.
cusolverStatus_t queue(SolverCall& c, cusolverDnHandle_t h, Operands operands, int* info, std::function<int()> work) {
  if (c.failed()) return c.status;
  if (enqueue_on(h->stream, c.name, std::move(operands), [info, work = std::move(work)] {
        *info = work();
        return std::string();
      }) != cudaSuccess)
    return misuse(CUSOLVER_STATUS_EXECUTION_FAILED, c.name + ": its stream was destroyed");
  return CUSOLVER_STATUS_SUCCESS;
}

}  // namespace
}  // namespace crosskv_cuda_emulation

using namespace crosskv_cuda_emulation;

cusolverStatus_t cusolverDnCreate(cusolverDnHandle_t* handle) {
  auto* h = new cusolverDnContext;
  std::lock_guard<std::mutex> lock(solver_mutex);
  h->id = next_solver++;
  solvers.insert(h);
  *handle = h;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDestroy(cusolverDnHandle_t handle) {
  std::lock_guard<std::mutex> lock(solver_mutex);
  if (!solvers.count(handle) || !handle->live)
    return misuse(CUSOLVER_STATUS_NOT_INITIALIZED, "cusolverDnDestroy: the handle was destroyed or never made");
  handle->live = false;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnSetStream(cusolverDnHandle_t handle, cudaStream_t stream) {
  std::string why;
  if (!stream_of(stream, &why)) return misuse(CUSOLVER_STATUS_INVALID_VALUE, "cusolverDnSetStream: " + why);
  std::lock_guard<std::mutex> lock(solver_mutex);
  if (!solvers.count(handle) || !handle->live)
    return misuse(CUSOLVER_STATUS_NOT_INITIALIZED, "cusolverDnSetStream: the handle was destroyed or never made");
  handle->stream = stream;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnCreateParams(cusolverDnParams_t* params) {
  auto* p = new cusolverDnParams;
  std::lock_guard<std::mutex> lock(solver_mutex);
  param_sets.insert(p);
  *params = p;
  return CUSOLVER_STATUS_SUCCESS;
}
cusolverStatus_t cusolverDnDestroyParams(cusolverDnParams_t params) {
  std::lock_guard<std::mutex> lock(solver_mutex);
  if (!param_sets.count(params) || !params->live)
    return misuse(CUSOLVER_STATUS_INVALID_VALUE, "cusolverDnDestroyParams: destroyed or never made");
  params->live = false;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXpotrf_bufferSize(cusolverDnHandle_t handle, cusolverDnParams_t params,
                                             cublasFillMode_t uplo, int64_t n, cudaDataType dataTypeA, const void* A,
                                             int64_t lda, cudaDataType computeType, size_t* dev_bytes,
                                             size_t* host_bytes) {
  SolverCall c{"cusolverDnXpotrf_bufferSize(n " + std::to_string(n) + ")"};
  c.handles(handle, params);
  c.fp64(dataTypeA, computeType);
  c.square(uplo, n, lda);
  if (c.failed()) return c.status;
  *dev_bytes = potrf_workspace(n);
  *host_bytes = 0;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXpotrf(cusolverDnHandle_t handle, cusolverDnParams_t params, cublasFillMode_t uplo,
                                  int64_t n, cudaDataType dataTypeA, void* A, int64_t lda, cudaDataType computeType,
                                  void* dws, size_t dev_bytes, void* hws, size_t host_bytes, int* info) {
  SolverCall c{"cusolverDnXpotrf(n " + std::to_string(n) + ", lda " + std::to_string(lda) + ")"};
  c.handles(handle, params);
  c.fp64(dataTypeA, computeType);
  c.square(uplo, n, lda);
  c.value(dev_bytes >= potrf_workspace(n), "workspaceInBytesOnDevice " + std::to_string(dev_bytes) + " < " +
                                               std::to_string(potrf_workspace(n)) + " (cusolverDnXpotrf_bufferSize)");
  c.device("A", A, square_bytes(n, lda));
  c.device("bufferOnDevice", dws, dev_bytes);
  c.device("info", info, sizeof(int));
  auto* a = static_cast<double*>(A);
  const char ul = uplo == CUBLAS_FILL_MODE_LOWER ? 'L' : 'U';
  return queue(c, handle, {{A, square_bytes(n, lda)}, {dws, dev_bytes}, {info, sizeof(int)}}, info,
               [=] { return n == 0 ? 0 : static_cast<int>(LAPACKE_dpotrf_work(LAPACK_COL_MAJOR, ul, n, a, lda)); });
}

cusolverStatus_t cusolverDnXsyevd_bufferSize(cusolverDnHandle_t handle, cusolverDnParams_t params,
                                             cusolverEigMode_t jobz, cublasFillMode_t uplo, int64_t n,
                                             cudaDataType dataTypeA, const void* A, int64_t lda, cudaDataType dataTypeW,
                                             const void* W, cudaDataType computeType, size_t* dev_bytes,
                                             size_t* host_bytes) {
  SolverCall c{"cusolverDnXsyevd_bufferSize(n " + std::to_string(n) + ")"};
  c.handles(handle, params);
  c.fp64(dataTypeA, computeType);
  c.fp64(dataTypeW, computeType);
  c.square(uplo, n, lda);
  if (c.failed()) return c.status;
  *dev_bytes = syevd_workspace(n);
  *host_bytes = 0;
  return CUSOLVER_STATUS_SUCCESS;
}

cusolverStatus_t cusolverDnXsyevd(cusolverDnHandle_t handle, cusolverDnParams_t params, cusolverEigMode_t jobz,
                                  cublasFillMode_t uplo, int64_t n, cudaDataType dataTypeA, void* A, int64_t lda,
                                  cudaDataType dataTypeW, void* W, cudaDataType computeType, void* dws,
                                  size_t dev_bytes, void* hws, size_t host_bytes, int* info) {
  SolverCall c{"cusolverDnXsyevd(n " + std::to_string(n) + ", lda " + std::to_string(lda) + ")"};
  c.handles(handle, params);
  c.fp64(dataTypeA, computeType);
  c.fp64(dataTypeW, computeType);
  c.value(jobz == CUSOLVER_EIG_MODE_VECTOR || jobz == CUSOLVER_EIG_MODE_NOVECTOR, "jobz is not a cusolverEigMode_t");
  c.square(uplo, n, lda);
  c.value(dev_bytes >= syevd_workspace(n), "workspaceInBytesOnDevice " + std::to_string(dev_bytes) + " < " +
                                               std::to_string(syevd_workspace(n)) + " (cusolverDnXsyevd_bufferSize)");
  c.device("A", A, square_bytes(n, lda));
  c.device("W", W, static_cast<size_t>(std::max<int64_t>(n, 0)) * 8);
  c.device("bufferOnDevice", dws, dev_bytes);
  c.device("info", info, sizeof(int));
  auto* a = static_cast<double*>(A);
  auto* w = static_cast<double*>(W);
  const char ul = uplo == CUBLAS_FILL_MODE_LOWER ? 'L' : 'U', jz = jobz == CUSOLVER_EIG_MODE_VECTOR ? 'V' : 'N';
  return queue(c, handle,
               {{A, square_bytes(n, lda)},
                {W, static_cast<size_t>(std::max<int64_t>(n, 0)) * 8},
                {dws, dev_bytes},
                {info, sizeof(int)}},
               info,
               [=] { return n == 0 ? 0 : static_cast<int>(LAPACKE_dsyevd(LAPACK_COL_MAJOR, jz, ul, n, a, lda, w)); });
}
