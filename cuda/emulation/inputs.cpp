// cuda/inputs.cu built as C++ against the host emulation (CROSSKV_CUDA_EMULATION): the same source, not a copy.
#include "cuda/inputs.cu"
