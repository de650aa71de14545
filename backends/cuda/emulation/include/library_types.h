#pragma once
// crosskv's CUDA emulation: the data types cuSOLVER's 64-bit API names.
enum cudaDataType { CUDA_R_32F = 0, CUDA_R_64F = 1, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
using cudaDataType_t = cudaDataType;
