// cuda/kernels.cu built as C++ against the host emulation of CUDA: the same source, not a copy.
#include "backends/cuda/kernels.cu"
