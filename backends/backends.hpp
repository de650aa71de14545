#pragma once
// The backends layer: the host backend (host/, the reference), and the CUDA backend and NCCL collectives (cuda/,
// or a stub that refuses them by name when compiled out). Only programs and tests choose a backend; the stages see
// the interfaces (core/backend.hpp, core/comm.hpp).
#include <cstdint>
#include <memory>
#include <string>

#include "core/backend.hpp"
#include "core/comm.hpp"

namespace crosskv {

std::unique_ptr<ComputeBackend> make_cpu_backend();
// The CUDA backend on `device` (rank `rank` names it in messages; tf32 lets cuBLAS use TF32 tensor cores for the
// fp32 moments), or the stub's error "built without CUDA".
std::unique_ptr<ComputeBackend> make_cuda_backend(int device, int rank = 0, bool tf32 = false);
bool cuda_compiled_in();
bool nccl_compiled_in();
int cuda_device_count();  // 0 when built without CUDA or no device present
// Free memory on `device` in bytes, and its name (-1 and "" when built without CUDA or no such device).
struct CudaDeviceInfo {
  std::string name;
  int64_t free_bytes = -1, total_bytes = -1;
};
CudaDeviceInfo cuda_device_info(int device);
// The one policy every program uses: the device of a rank whose index on its node is `local_rank` (-1: the CPU).
// cuda: the node's GPUs in turn (local_rank mod GPUs; local_rank itself when there is none, which the backend then
// refuses by name); auto: the same when a GPU is present, else the CPU.
int device_for_rank(DeviceKind kind, int local_rank);
// The backend of `device` (-1: the CPU) for rank `rank`.
std::unique_ptr<ComputeBackend> make_backend(int device, int rank, bool tf32);
// NCCL collectives on `device`, bootstrapped (unique id), barriers and votes through `host`; or the stub's error
// "built without NCCL".
std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm> host, int device);

}  // namespace crosskv
