// cuda/cuda_backend.cu built as C++ against the host emulation of CUDA: the same source, not a copy.
#include "backends/cuda/cuda_backend.cu"
