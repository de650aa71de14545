// The host emulation of CUDA (backends/cuda/emulation/) catches what a GPU would punish: each misuse is refused by name, a
// host read without its wait reads stale data, streams follow their events, and NCCL peers must agree on sizes.
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <gtest/gtest.h>
#include <nccl.h>

#include <cstdio>
#include <string>
#include <thread>
#include <vector>

#include "backends/cuda/emulation/device.hpp"
#include "backends/cuda/launch.hpp"

namespace {

__global__ void fill(float* x, int64_t n, float v) {
  for (int64_t i = blockIdx.x * int64_t{blockDim.x} + threadIdx.x; i < n; i += int64_t{gridDim.x} * blockDim.x)
    x[i] = v;
}

std::string message(cudaError_t e) { return cudaGetErrorString(e); }

class Emulation : public ::testing::Test {
 protected:
  void SetUp() override { ASSERT_EQ(cudaSetDevice(0), cudaSuccess); }
  // Each test states the misuses it commits; none may be left for the exit check.
  void expect_misuses(int n) { EXPECT_EQ(crosskv_cuda_emulation::take_misuses(), n); }
};

TEST_F(Emulation, AHostPointerPassedToAKernelIsRefusedByName) {
  std::vector<float> host(64);
  const cudaError_t e = crosskv::cuda::launch(fill, 1, 64, nullptr, host.data(), int64_t{64}, 1.0f);
  EXPECT_EQ(e, cudaErrorInvalidValue);
  const std::string m = message(e);
  EXPECT_NE(m.find("argument 0"), std::string::npos) << m;
  EXPECT_NE(m.find("where device memory is required"), std::string::npos) << m;
  EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);
  EXPECT_EQ(cudaGetLastError(), cudaSuccess);
  expect_misuses(1);
}

TEST_F(Emulation, ACopyPastItsAllocationIsRefusedWithTheOverrun) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 100), cudaSuccess);
  std::vector<char> host(104);
  const cudaError_t e = cudaMemcpyAsync(d, host.data(), 104, cudaMemcpyHostToDevice, nullptr);
  EXPECT_EQ(e, cudaErrorInvalidValue);
  EXPECT_NE(message(e).find("4 bytes past its end"), std::string::npos) << message(e);
  // The wrong direction: a host pointer named as the device side.
  const cudaError_t k = cudaMemcpyAsync(host.data(), d, 100, cudaMemcpyHostToDevice, nullptr);
  EXPECT_NE(message(k).find("dst: host memory"), std::string::npos) << message(k);
  EXPECT_EQ(cudaFree(d), cudaSuccess);
  expect_misuses(2);
}

TEST_F(Emulation, UseAfterFreeAndDoubleFreeAreRefused) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 256), cudaSuccess);
  ASSERT_EQ(cudaFree(d), cudaSuccess);
  std::vector<float> host(64);
  const cudaError_t e = cudaMemcpyAsync(host.data(), d, 256, cudaMemcpyDeviceToHost, nullptr);
  EXPECT_NE(message(e).find("after its cudaFree"), std::string::npos) << message(e);
  const cudaError_t f = cudaFree(d);
  EXPECT_NE(message(f).find("freed already"), std::string::npos) << message(f);
  expect_misuses(2);
}

TEST_F(Emulation, AHostReadWithoutItsWaitReadsStaleData) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 64 * sizeof(float)), cudaSuccess);
  cudaStream_t s;
  ASSERT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
  std::vector<float> host(64, 0.0f);
  ASSERT_EQ(crosskv::cuda::launch(fill, 1, 32, s, d, int64_t{64}, 7.0f), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), d, 64 * sizeof(float), cudaMemcpyDeviceToHost, s), cudaSuccess);
  EXPECT_EQ(host[63], 0.0f) << "the copy ran before anything waited for the stream";
  ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
  EXPECT_EQ(host[0], 7.0f);
  EXPECT_EQ(host[63], 7.0f);
  ASSERT_EQ(cudaStreamDestroy(s), cudaSuccess);
  ASSERT_EQ(cudaFree(d), cudaSuccess);
  expect_misuses(0);
}

TEST_F(Emulation, AStreamWaitingForAnEventRunsTheWorkBeforeIt) {
  float* d = nullptr;
  ASSERT_EQ(cudaMalloc(&d, 16 * sizeof(float)), cudaSuccess);
  cudaStream_t a, b;
  cudaEvent_t ev;
  ASSERT_EQ(cudaStreamCreateWithFlags(&a, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaStreamCreateWithFlags(&b, cudaStreamNonBlocking), cudaSuccess);
  ASSERT_EQ(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming), cudaSuccess);
  std::vector<float> host(16, 0.0f);
  ASSERT_EQ(crosskv::cuda::launch(fill, 1, 16, a, d, int64_t{16}, 3.0f), cudaSuccess);
  ASSERT_EQ(cudaEventRecord(ev, a), cudaSuccess);
  ASSERT_EQ(crosskv::cuda::launch(fill, 1, 16, a, d, int64_t{16}, 5.0f), cudaSuccess);  // after the event
  ASSERT_EQ(cudaStreamWaitEvent(b, ev, 0), cudaSuccess);
  ASSERT_EQ(cudaMemcpyAsync(host.data(), d, 16 * sizeof(float), cudaMemcpyDeviceToHost, b), cudaSuccess);
  ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
  EXPECT_EQ(host[0], 3.0f) << "b read before or after what its event marks";
  ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
  ASSERT_EQ(cudaEventDestroy(ev), cudaSuccess);
  // Destroyed handles are refused.
  EXPECT_NE(message(cudaEventRecord(ev, a)).find("was destroyed"), std::string::npos);
  ASSERT_EQ(cudaStreamDestroy(a), cudaSuccess);
  EXPECT_NE(message(cudaStreamSynchronize(a)).find("was destroyed"), std::string::npos);
  ASSERT_EQ(cudaStreamDestroy(b), cudaSuccess);
  ASSERT_EQ(cudaFree(d), cudaSuccess);
  expect_misuses(2);
}

TEST_F(Emulation, CublasChecksItsArgumentsAndOperands) {
  cublasHandle_t h;
  ASSERT_EQ(cublasCreate(&h), CUBLAS_STATUS_SUCCESS);
  float *A, *B, *C;
  ASSERT_EQ(cudaMalloc(&A, 4 * 6 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&B, 6 * 5 * sizeof(float)), cudaSuccess);
  ASSERT_EQ(cudaMalloc(&C, 4 * 5 * sizeof(float)), cudaSuccess);
  const float one = 1.0f, zero = 0.0f;
  EXPECT_EQ(cublasSgemm_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 5, 6, &one, A, 4, B, 6, &zero, C, 4), CUBLAS_STATUS_SUCCESS);
  const cublasStatus_t lda = cublasSgemm_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 5, 6, &one, A, 3, B, 6, &zero, C, 4);
  EXPECT_EQ(lda, CUBLAS_STATUS_INVALID_VALUE);
  EXPECT_NE(std::string(cublasGetStatusName(lda)).find("lda 3 < 4"), std::string::npos);
  // op(A) = A^T reads A as [6 x 4] with lda 6: 6 * 4 values fit, a wider lda does not.
  const cublasStatus_t past = cublasSgemm_64(h, CUBLAS_OP_T, CUBLAS_OP_N, 4, 5, 6, &one, A, 8, B, 6, &zero, C, 4);
  EXPECT_NE(std::string(cublasGetStatusName(past)).find("A: "), std::string::npos);
  EXPECT_NE(std::string(cublasGetStatusName(past)).find("past its end"), std::string::npos);
  std::vector<float> host(4 * 5);
  const cublasStatus_t hostc =
      cublasSgemm_64(h, CUBLAS_OP_N, CUBLAS_OP_N, 4, 5, 6, &one, A, 4, B, 6, &zero, host.data(), 4);
  EXPECT_NE(std::string(cublasGetStatusName(hostc)).find("C: host memory"), std::string::npos);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  ASSERT_EQ(cublasDestroy(h), CUBLAS_STATUS_SUCCESS);
  EXPECT_EQ(cublasSetMathMode(h, CUBLAS_DEFAULT_MATH), CUBLAS_STATUS_NOT_INITIALIZED);
  for (float* p : {A, B, C}) ASSERT_EQ(cudaFree(p), cudaSuccess);
  expect_misuses(4);
}

TEST_F(Emulation, TheDeviceHasTheConfiguredCapacity) {
  size_t free0 = 0, total = 0;
  ASSERT_EQ(cudaMemGetInfo(&free0, &total), cudaSuccess);
  EXPECT_EQ(total, size_t{16} << 30);  // CROSSKV_CUDA_EMULATION_MEMORY's default
  void* p = nullptr;
  ASSERT_EQ(cudaMalloc(&p, 1 << 20), cudaSuccess);
  size_t free1 = 0;
  ASSERT_EQ(cudaMemGetInfo(&free1, &total), cudaSuccess);
  EXPECT_EQ(free0 - free1, size_t{1} << 20);
  void* q = nullptr;
  const cudaError_t e = cudaMalloc(&q, size_t{17} << 30);
  EXPECT_EQ(e, cudaErrorMemoryAllocation);
  EXPECT_NE(message(e).find("bytes free"), std::string::npos) << message(e);
  ASSERT_EQ(cudaFree(p), cudaSuccess);
  int n = 0;
  ASSERT_EQ(cudaGetDeviceCount(&n), cudaSuccess);
  EXPECT_GE(n, 2);  // CROSSKV_CUDA_EMULATION_DEVICES
  EXPECT_EQ(cudaSetDevice(n), cudaErrorInvalidDevice);
  expect_misuses(0);
}

TEST_F(Emulation, AKernelWritingPastItsAllocationDiesNamingIt) {
  EXPECT_DEATH(
      {
        float* d = nullptr;
        cudaMalloc(&d, 10 * sizeof(float));
        crosskv::cuda::launch(fill, 1, 32, nullptr, d, int64_t{11 + 1024}, 1.0f);
        cudaDeviceSynchronize();
      },
      "SIGSEGV.*past the end of allocation");
}

TEST_F(Emulation, TheHostTouchingDeviceMemoryDiesNamingIt) {
  EXPECT_DEATH(
      {
        float* d = nullptr;
        cudaMalloc(&d, 64 * sizeof(float));
        crosskv::cuda::launch(fill, 1, 64, nullptr, d, int64_t{64}, 2.0f);
        cudaDeviceSynchronize();
        std::printf("%f\n", d[3]);  // a device pointer dereferenced on the host
      },
      "SIGSEGV.*the host touched device memory, allocation #[0-9]+ \\(256 bytes, device 0\\) at offset 12");
}

TEST_F(Emulation, AProcessEndingWithDeviceMemoryAllocatedFails) {
  EXPECT_EXIT(
      {
        void* p = nullptr;
        cudaMalloc(&p, 4096);
        std::exit(0);
      },
      ::testing::ExitedWithCode(86), "never freed at exit");
}

TEST_F(Emulation, NcclPeersMustAgreeOnSizes) {
  ncclUniqueId id;
  ASSERT_EQ(ncclGetUniqueId(&id), ncclSuccess);
  std::string errors[2];
  auto rank = [&](int r) {
    cudaSetDevice(r);
    ncclComm_t comm;
    if (ncclCommInitRank(&comm, 2, id, r) != ncclSuccess) return void(errors[r] = "init failed");
    float* d = nullptr;
    cudaMalloc(&d, 16 * sizeof(float));
    const ncclResult_t q =
        r == 0 ? ncclSend(d, 10, ncclFloat32, 1, comm, nullptr) : ncclRecv(d, 8, ncclFloat32, 0, comm, nullptr);
    if (q != ncclSuccess) errors[r] = "enqueue failed";
    const cudaError_t e = cudaDeviceSynchronize();
    if (e != cudaSuccess) errors[r] = cudaGetErrorString(e);
    ncclCommDestroy(comm);
    cudaFree(d);
  };
  std::thread t0(rank, 0), t1(rank, 1);
  t0.join();
  t1.join();
  EXPECT_NE(errors[1].find("ncclSend of 40 bytes met an ncclRecv of 32 bytes"), std::string::npos) << errors[1];
  crosskv_cuda_emulation::take_misuses();
}

}  // namespace
