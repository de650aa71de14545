#pragma once
// What every program does the same way: its backend, one per rank on the GPU its node index names (CPU otherwise),
// from the same policy (backends/backends.hpp: device_for_rank, make_backend). Exit codes: run_tool (core/error.hpp),
// and crosskv-fit's own for a requeue and a solve failure.
#include <memory>
#include <string>

#include "backends/backends.hpp"
#include "runtime/mpi.hpp"

namespace crosskv {

// "cpu" or "cuda" (a program's --device, already checked by its parser).
inline DeviceKind device_kind(const std::string& name) { return name == "cuda" ? DeviceKind::cuda : DeviceKind::cpu; }

// This rank's backend: the device its index on the node picks for `kind` (auto: CUDA where a GPU is).
inline std::unique_ptr<ComputeBackend> backend_for_this_rank(DeviceKind kind, int rank, bool tf32) {
  return make_backend(device_for_rank(kind, mpi_local_rank()), rank, tf32);
}

}  // namespace crosskv
