#pragma once
// Kernel launches through the runtime's typed cudaLaunchKernelEx instead of <<<>>>, so that the same sources build
// with nvcc for a GPU and with a C++ compiler against the host emulation (cuda/emulation/).
#include <cuda_runtime.h>

#include <utility>

namespace crosskv::cuda {

template <class... P, class... A>
cudaError_t launch(void (*kernel)(P...), dim3 grid, dim3 block, cudaStream_t stream, A&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = 0;
  config.stream = stream;
  return cudaLaunchKernelEx(&config, kernel, std::forward<A>(args)...);
}

}  // namespace crosskv::cuda
