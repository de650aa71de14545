// Built when CUDA is compiled out: the CUDA backend exists only as an explicit refusal.
#include "core/backend.hpp"
#include "core/error.hpp"

namespace crosskv {

std::unique_ptr<ComputeBackend> make_cuda_backend(int) {
  throw UserError("runtime.device: cuda was requested but crosskv was built without CUDA");
}
bool cuda_compiled_in() { return false; }
int cuda_device_count() { return 0; }

}  // namespace crosskv
