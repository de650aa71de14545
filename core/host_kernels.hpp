#pragma once
// The host kernels that the layers above the backends call directly, as well as the host backend
// (backends/host/host_backend.cpp, which is built on them): assembling a system, preparing stored values, fp32 to
// half bits, gathering layers. Host arrays; thread-safe.
#include <cstdint>
#include <vector>

#include "core/backend.hpp"

namespace crosskv {

// Cxx + lambda*I on the host (all of A): host factors' (factor_cov) and Moments::cov_xx's.
void assemble_cov_on_host(const ComputeBackend::CovTerms& t, double lambda, double* A, int64_t lda, double* diag);

// prepare() on the host: the CPU backend's, the reference for device backends, and what a reader thread runs when
// the backend prepares on the host (it is thread-safe).
const float* prepare_on_host(const ComputeBackend::StoredBlock& in, const ComputeBackend::Strip* strip,
                             const float* shift, const float* row_scale, std::vector<float>& host);

// fp32 -> bf16 or fp16 bits on the host, in parallel (the CPU backend's to_half, and export's: the bits of the
// device's conversion).
void to_half_on_host(const float* in, int64_t n, bool bf16, uint16_t* out);
// The selected layers' columns of X [rows x ldx] side by side: out [rows x layers*F] (Transfer's gather, and the
// host's gather_layers).
void gather_layers_on_host(const float* X, int64_t ldx, const std::vector<int>& layers, int64_t F, int64_t rows,
                           float* out);

}  // namespace crosskv
