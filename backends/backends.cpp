// The device policy every program shares, over whichever CUDA backend is built in (backends/cuda/, its emulation, the stub).
#include "backends/backends.hpp"

namespace crosskv {

int device_for_rank(DeviceKind kind, int local_rank) {
  if (kind == DeviceKind::cpu) return -1;
  const int n = cuda_device_count();
  if (kind == DeviceKind::cuda) return n > 0 ? local_rank % n : local_rank;
  return n > 0 ? local_rank % n : -1;
}

std::unique_ptr<ComputeBackend> make_backend(int device, int rank, bool tf32) {
  return device < 0 ? make_cpu_backend() : make_cuda_backend(device, rank, tf32);
}

}  // namespace crosskv
