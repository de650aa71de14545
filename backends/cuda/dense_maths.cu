// The CUDA backend's dense maths: fp32 moment products with cuBLAS into the held sums, products of host arrays,
// fp64 systems assembled and factored on the device (cuSOLVER's 64-bit API), solves with cuBLAS, the eigen-solver.
#include <algorithm>
#include <climits>

#include "backends/cuda/cuda_backend.hpp"
#include "backends/cuda/kernels.hpp"

namespace crosskv::cuda {

#define CK(expr, ops) CROSSKV_CUDA_CHECK(expr, res_.where(), ops)

void CudaBackend::cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B,
                            int64_t ldb, float* C, int64_t ldc) {
  if (rows == 0 || m == 0 || n == 0) return;
  const float* dA = static_cast<const float*>(res_.operand(A, static_cast<size_t>((rows - 1) * lda + m) * 4));
  const float* dB = static_cast<const float*>(res_.operand(B, static_cast<size_t>((rows - 1) * ldb + n) * 4));
  const float one = 1.0f;
  // Row-major C[m x n] += A^T B is column-major C' [n x m] += B' A'^T.
  CK(cublasSgemm_64(res_.blas(), CUBLAS_OP_N, CUBLAS_OP_T, n, m, rows, &one, dB, ldb, dA, lda, &one, C, ldc),
     dims({{"m", m}, {"n", n}, {"rows", rows}, {"lda", lda}, {"ldb", ldb}, {"ldc", ldc}}));
}

void CudaBackend::cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms, int64_t lda,
                                  int64_t ldb, int64_t ldc) {
  if (terms.empty() || rows == 0 || m == 0 || n == 0) return;
  const std::string ops = dims({{"batch", static_cast<int64_t>(terms.size())},
                                {"m", m},
                                {"n", n},
                                {"rows", rows},
                                {"lda", lda},
                                {"ldb", ldb},
                                {"ldc", ldc}});
  CROSSKV_ASSERT(rows <= INT32_MAX && m <= INT32_MAX && n <= INT32_MAX && lda <= INT32_MAX && ldb <= INT32_MAX &&
                     ldc <= INT32_MAX && terms.size() <= INT32_MAX,
                 "cross_acc_batch: operands beyond 32-bit sizes (" + ops + ")");
  // Row-major C_i[m x n] += A_i^T B_i is column-major C_i' [n x m] += B_i' A_i'^T, as in cross_acc.
  std::vector<const float*> ptrs(3 * terms.size());
  const size_t nt = terms.size();
  for (size_t i = 0; i < nt; ++i) {
    ptrs[i] = static_cast<const float*>(res_.operand(terms[i].B, static_cast<size_t>((rows - 1) * ldb + n) * 4));
    ptrs[nt + i] = static_cast<const float*>(res_.operand(terms[i].A, static_cast<size_t>((rows - 1) * lda + m) * 4));
    ptrs[2 * nt + i] = terms[i].C;  // held sums: device memory
  }
  const auto* d = static_cast<const float* const*>(res_.upload(ptrs.data(), ptrs.size() * sizeof(float*)));
  const float one = 1.0f;
  CK(cublasSgemmBatched(res_.blas(), CUBLAS_OP_N, CUBLAS_OP_T, static_cast<int>(n), static_cast<int>(m),
                        static_cast<int>(rows), &one, d, static_cast<int>(ldb), d + nt, static_cast<int>(lda), &one,
                        const_cast<float* const*>(d + 2 * nt), static_cast<int>(ldc), static_cast<int>(nt)),
     ops);
}

void CudaBackend::gemm_batched(const BatchedGemm& g) {
  if (g.m == 0 || g.n == 0 || g.batch == 0) return;
  const std::string ops =
      dims({{"m", g.m}, {"n", g.n}, {"k", g.k}, {"batch", g.batch}, {"lda", g.lda}, {"ldb", g.ldb}, {"ldc", g.ldc}});
  // Extents of the host operands (a stride of 0 shares one matrix over the batch).
  auto extent = [&](int64_t rows, int64_t cols, int64_t ld, int64_t stride) {
    return static_cast<size_t>((g.batch - 1) * stride + (rows - 1) * ld + cols);
  };
  const size_t na = g.k ? extent(g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.stride_a) : 0,
               nb = g.k ? extent(g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.stride_b) : 0,
               nc = extent(g.m, g.n, g.ldc, g.stride_c);
  float* d = res_.apply.get(na + nb + nc, res_.where());
  float *dA = d, *dB = d + na, *dC = d + na + nb;
  if (na) CK(cudaMemcpyAsync(dA, g.A, na * 4, cudaMemcpyHostToDevice, res_.compute()), ops);
  if (nb) CK(cudaMemcpyAsync(dB, g.B, nb * 4, cudaMemcpyHostToDevice, res_.compute()), ops);
  // C comes back whole (its extent): unless the batch's outputs tile it, what lies between them goes up first,
  // even when beta is 0, or the copy back overwrites it.
  const bool tiles = g.ldc == g.n && (g.batch == 1 || g.stride_c == g.m * g.n);
  if (g.beta != 0.0f || !tiles) CK(cudaMemcpyAsync(dC, g.C, nc * 4, cudaMemcpyHostToDevice, res_.compute()), ops);
  // Row-major C = op(A) op(B) is column-major C' = op(B)' op(A)'.
  CK(cublasSgemmStridedBatched_64(res_.blas(), g.trans_b ? CUBLAS_OP_T : CUBLAS_OP_N,
                                  g.trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, g.n, g.m, g.k, &g.alpha, dB, g.ldb, g.stride_b,
                                  dA, g.lda, g.stride_a, &g.beta, dC, g.ldc, g.stride_c, g.batch),
     ops);
  CK(cudaMemcpyAsync(g.C, dC, nc * 4, cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
}

void CudaBackend::gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) {
  if (rows == 0 || m == 0) return;
  const float* dA = static_cast<const float*>(res_.operand(A, static_cast<size_t>((rows - 1) * lda + m) * 4));
  const float one = 1.0f;
  // Row-major upper triangle of A^T A = column-major lower triangle of A' A'^T.
  CK(cublasSsyrk_64(res_.blas(), CUBLAS_FILL_MODE_LOWER, CUBLAS_OP_N, m, rows, &one, dA, lda, &one, C, ldc),
     dims({{"m", m}, {"rows", rows}, {"lda", lda}, {"ldc", ldc}}));
}

void CudaBackend::symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) {
  if (n == 0) return;
  const std::string ops = dims({{"n", n}, {"lda", lda}});
  const size_t count = static_cast<size_t>(n * n);
  double* dA = res_.other.get(count + static_cast<size_t>(n), res_.where());
  double* dW = dA + count;
  std::vector<double> packed(count);  // row-major upper = column-major lower, packed with leading dim n
  for (int64_t i = 0; i < n; ++i) std::copy_n(A + i * lda, n, packed.data() + i * n);
  CK(cudaMemcpyAsync(dA, packed.data(), count * sizeof(double), cudaMemcpyHostToDevice, res_.compute()), ops);
  size_t dev_bytes = 0, host_bytes = 0;
  CK(cusolverDnXsyevd_bufferSize(res_.solver(), res_.solver_params(), CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER,
                                 n, CUDA_R_64F, dA, n, CUDA_R_64F, dW, CUDA_R_64F, &dev_bytes, &host_bytes),
     ops);
  void* dws = res_.work.get(std::max<size_t>(dev_bytes, 1), res_.where());
  res_.host_work.resize(std::max<size_t>(host_bytes, 1));
  CK(cusolverDnXsyevd(res_.solver(), res_.solver_params(), CUSOLVER_EIG_MODE_VECTOR, CUBLAS_FILL_MODE_LOWER, n,
                      CUDA_R_64F, dA, n, CUDA_R_64F, dW, CUDA_R_64F, dws, dev_bytes, res_.host_work.data(), host_bytes,
                      res_.info()),
     ops);
  int info = 0;
  CK(cudaMemcpyAsync(&info, res_.info(), sizeof(int), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaMemcpyAsync(packed.data(), dA, count * sizeof(double), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaMemcpyAsync(w, dW, static_cast<size_t>(n) * sizeof(double), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
  CROSSKV_ASSERT(info == 0, "cusolverDnXsyevd failed: info " + std::to_string(info) + " (" + ops + ")");
  // Column-major eigenvectors (column i = vector i) are the rows of the row-major array: transpose into A.
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) A[j * lda + i] = packed[i * n + j];
}

// The system is assembled on the device from the fp32 blocks (uploaded one at a time: half the bytes of the fp64
// system) and factored there; only its diagonal and the factor's pivots come to the host.
CudaBackend::FactorPtr CudaBackend::factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse) {
  const int64_t F = t.F, nl = t.nl, n = nl * F;
  auto f = reuse_or_make<CudaFactor>(std::move(reuse));
  f->n = n;
  if (n == 0) return f;
  const std::string ops = dims({{"layers", nl}, {"F", F}});
  double* dA = f->dev.get(static_cast<size_t>(n * n), res_.where());
  double* dmean = res_.mean.get(static_cast<size_t>(n), res_.where());
  CK(cudaMemcpyAsync(dmean, t.mean.data(), n * sizeof(double), cudaMemcpyHostToDevice, res_.compute()), ops);
  float* dg = res_.block.get(static_cast<size_t>(F * F), res_.where());
  for (int64_t i = 0; i < nl; ++i)
    for (int64_t j = i; j < nl; ++j) {
      const CovBlock& g = t.blocks[i * nl + j];
      // In stream order: the previous block's kernel is done with dg before this copy writes it.
      CK(cudaMemcpy2DAsync(dg, F * sizeof(float), g.p, g.ld * sizeof(float), F * sizeof(float), F,
                           cudaMemcpyHostToDevice, res_.compute()),
         ops + ", block " + dims({{"i", i}, {"j", j}}));
      CK(cuda::launch_assemble_cov_block(dg, g.read, F, dmean + i * F, dmean + j * F, t.inv_n, lambda, i == j,
                                         dA + i * F * n + j * F, i == j ? nullptr : dA + j * F * n + i * F, n,
                                         res_.compute()),
         "assemble_cov kernel, " + ops);
    }
  copy_diagonal(dA, n, n, diag, ops);
  factor_on_device(*f, ops);
  return f;
}

CudaBackend::FactorPtr CudaBackend::factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse) {
  auto f = reuse_or_make<CudaFactor>(std::move(reuse));
  f->n = n;
  if (n == 0) return f;
  const std::string ops = dims({{"n", n}, {"lda", lda}});
  double* dA = f->dev.get(static_cast<size_t>(n * n), res_.where());
  CK(cudaMemcpy2DAsync(dA, n * sizeof(double), A, lda * sizeof(double), n * sizeof(double), n, cudaMemcpyHostToDevice,
                       res_.compute()),
     ops);
  factor_on_device(*f, ops);
  return f;
}

void CudaBackend::solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) {
  CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
  solve_on_device(own<CudaFactor>(f).dev.data(), n, f.n, nrhs, B, ldb, {false, true});
}

void CudaBackend::solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                                   int64_t ldb) {
  CROSSKV_ASSERT(n <= f.n, "a solve with more rows than its factor");
  solve_on_device(own<CudaFactor>(f).dev.data(), n, f.n, nrhs, B, ldb, {transpose});
}

// The kernels on host arrays (reference checks): uploaded, computed, copied back.
int64_t CudaBackend::cholesky(int64_t n, double* A, int64_t lda) {
  if (n == 0) return 0;
  const size_t count = static_cast<size_t>((n - 1) * lda + n);
  const std::string ops = dims({{"n", n}, {"lda", lda}});
  double* dA = res_.other.get(count, res_.where());
  CK(cudaMemcpyAsync(dA, A, count * sizeof(double), cudaMemcpyHostToDevice, res_.compute()), ops);
  const int info = potrf(dA, n, lda, ops);
  CK(cudaMemcpyAsync(A, dA, count * sizeof(double), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
  return info;
}

void CudaBackend::cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) {
  solve_on_device(upload_factor(n, L, lda), n, lda, nrhs, B, ldb, {false, true});
}

void CudaBackend::triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                                   int64_t ldb) {
  solve_on_device(upload_factor(n, L, lda), n, lda, nrhs, B, ldb, {transpose});
}

// cusolverDnXpotrf in place on device matrix dA (row-major lower = column-major upper); returns LAPACK's info.
int CudaBackend::potrf(double* dA, int64_t n, int64_t lda, const std::string& ops) {
  size_t dev_bytes = 0, host_bytes = 0;
  CK(cusolverDnXpotrf_bufferSize(res_.solver(), res_.solver_params(), CUBLAS_FILL_MODE_UPPER, n, CUDA_R_64F, dA, lda,
                                 CUDA_R_64F, &dev_bytes, &host_bytes),
     ops);
  void* dws = res_.work.get(std::max<size_t>(dev_bytes, 1), res_.where());
  res_.host_work.resize(std::max<size_t>(host_bytes, 1));
  CK(cusolverDnXpotrf(res_.solver(), res_.solver_params(), CUBLAS_FILL_MODE_UPPER, n, CUDA_R_64F, dA, lda, CUDA_R_64F,
                      dws, dev_bytes, res_.host_work.data(), host_bytes, res_.info()),
     ops);
  int info = 0;
  CK(cudaMemcpyAsync(&info, res_.info(), sizeof(int), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
  CROSSKV_ASSERT(info >= 0, "cusolverDnXpotrf: illegal argument " + std::to_string(-info) + " (" + ops + ")");
  return info;
}

// Factors f's device system in place and copies its pivots to the host.
void CudaBackend::factor_on_device(CudaFactor& f, const std::string& ops) {
  double* dA = f.dev.data();
  f.info = potrf(dA, f.n, f.n, ops);
  f.pivots.resize(static_cast<size_t>(f.n));
  copy_diagonal(dA, f.n, f.n, f.pivots.data(), ops);
}

// A host factor's leading n x n block, uploaded for one solve.
const double* CudaBackend::upload_factor(int64_t n, const double* L, int64_t lda) {
  if (n == 0) return nullptr;
  const size_t count = static_cast<size_t>((n - 1) * lda + n);
  double* d = res_.other.get(count, res_.where());
  CK(cudaMemcpyAsync(d, L, count * sizeof(double), cudaMemcpyHostToDevice, res_.compute()),
     dims({{"n", n}, {"lda", lda}}));
  return d;
}

// Triangular solves with the leading n x n block of device factor dL (leading dim lda), one per entry of
// `transposes`, in order, on host B.
void CudaBackend::solve_on_device(const double* dL, int64_t n, int64_t lda, int64_t nrhs, double* B, int64_t ldb,
                                  std::initializer_list<bool> transposes) {
  if (n == 0 || nrhs == 0) return;
  const std::string ops = dims({{"n", n}, {"lda", lda}, {"nrhs", nrhs}, {"ldb", ldb}});
  const size_t bcount = static_cast<size_t>((n - 1) * ldb + nrhs);
  double* dB = res_.rhs.get(bcount, res_.where());
  CK(cudaMemcpyAsync(dB, B, bcount * sizeof(double), cudaMemcpyHostToDevice, res_.compute()), ops);
  const double one = 1.0;
  // Row-major L X = B is column-major X' U = B' with U = L' (upper): a right-side solve; L^T X = B uses U^T.
  for (bool t : transposes)
    CK(cublasDtrsm_64(res_.blas(), CUBLAS_SIDE_RIGHT, CUBLAS_FILL_MODE_UPPER, t ? CUBLAS_OP_T : CUBLAS_OP_N,
                      CUBLAS_DIAG_NON_UNIT, nrhs, n, &one, dL, lda, dB, ldb),
       ops);
  CK(cudaMemcpyAsync(B, dB, bcount * sizeof(double), cudaMemcpyDeviceToHost, res_.compute()), ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
}

// The diagonal of device matrix dA (n values, lda + 1 apart) to host `out` (if given); waits for the stream.
void CudaBackend::copy_diagonal(const double* dA, int64_t n, int64_t lda, double* out, const std::string& ops) {
  if (out)
    CK(cudaMemcpy2DAsync(out, sizeof(double), dA, static_cast<size_t>(lda + 1) * sizeof(double), sizeof(double),
                         static_cast<size_t>(n), cudaMemcpyDeviceToHost, res_.compute()),
       ops);
  CK(cudaStreamSynchronize(res_.compute()), ops);
}

}  // namespace crosskv::cuda
