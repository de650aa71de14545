// Built when CUDA is compiled out: the CUDA backend exists only as an explicit refusal.
#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"

namespace crosskv {

std::unique_ptr<ComputeBackend> make_cuda_backend(int, int, bool) {
  throw UserError("runtime.device: cuda was requested but crosskv was built without CUDA");
}
bool cuda_compiled_in() { return false; }
bool nccl_compiled_in() { return false; }
int cuda_device_count() { return 0; }
CudaDeviceInfo cuda_device_info(int) { return {}; }

}  // namespace crosskv

namespace crosskv {

std::unique_ptr<Comm> make_nccl_comm(std::unique_ptr<Comm>, int) {
  throw UserError("NCCL collectives were requested but crosskv was built without CUDA");
}

}  // namespace crosskv
