#pragma once
// Compute backend: the interfaces of the few dense kernels the fit and the serving apply need, and nothing that only
// tests or benchmarks call (backends/checks.hpp). Pure: every host implementation (the reference) is
// backends/host/host_backend.cpp; CUDA's is backends/cuda/.
#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <memory>
#include <string>
#include <vector>

#include "core/dtype.hpp"
#include "core/error.hpp"

namespace crosskv {

class Rope;
struct LayerHeads;

// The kinds of compute backend a program may ask for (auto: CUDA where a GPU is, else the CPU).
enum class DeviceKind { auto_, cpu, cuda };

// The dense maths every backend implements first: fp32 products into sums, fp64 assembly, factorisations and solves.
class DenseMaths {
 public:
  virtual ~DenseMaths() = default;

  // C[m x n] += A^T B; A is row-major [rows x m] with leading dim lda, B [rows x n] (ldb), C row-major (ldc) in held
  // sums (Residency::HeldSums::at). fp32.
  virtual void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B,
                         int64_t ldb, float* C, int64_t ldc) = 0;
  // A batch of cross_acc calls of one shape and leading dims: C_i[m x n] += A_i^T B_i (every moment block of one block
  // of rows; a device backend runs them as one batched GEMM, which fills the device where one block does not). C_i
  // in held sums.
  struct CrossTerm {
    const float* A;
    const float* B;
    float* C;
  };
  virtual void cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms, int64_t lda,
                               int64_t ldb, int64_t ldc) = 0;
  // A batch of products of one shape: C_i = alpha op(A_i) op(B_i) + beta C_i for i < batch, X_i = X + i * stride_x
  // (a stride may be 0: one operand for the whole batch). fp32 row-major host arrays; op(A) [m x k], op(B) [k x n].
  // The held-out diagnostics' attention scores and outputs (strided-batched GEMM on a device).
  struct BatchedGemm {
    bool trans_a = false, trans_b = false;
    int64_t m = 0, n = 0, k = 0;
    float alpha = 1.0f, beta = 0.0f;
    const float* A = nullptr;
    int64_t lda = 0, stride_a = 0;
    const float* B = nullptr;
    int64_t ldb = 0, stride_b = 0;
    float* C = nullptr;
    int64_t ldc = 0, stride_c = 0;
    int64_t batch = 1;
  };
  virtual void gemm_batched(const BatchedGemm& g) = 0;
  // True when gemm_batched and symmetric_eigen may be called from several threads at once (a host backend, under
  // SingleThreadedBlas); a device backend takes its calls one at a time and fills the device with each.
  virtual bool concurrent_calls() const = 0;
  // Eigenvalues (ascending, into w[n]) and eigenvectors (the columns of A on return) of a symmetric row-major fp64
  // matrix A[n x n], upper triangle read (LAPACK dsyev / cuSOLVER syevd).
  virtual void symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) = 0;
  // Upper triangle (row-major, j >= i) of C[m x m] += A^T A, C in held sums. fp32.
  virtual void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) = 0;
  // Cxx + lambda*I of some source layers (Moments::cov_xx_terms): A[i*F + p, j*F + q] = g_ij(p, q) / N -
  // mean[i*F + p] * mean[j*F + q], g_ij an [F x F] fp32 block of sums read as stored, transposed, or symmetric from
  // its upper triangle.
  struct CovBlock {
    enum Read : int { as_is = 0, transposed = 1, upper = 2 };
    const float* p;
    int64_t ld;
    Read read;
  };
  struct CovTerms {
    int64_t nl = 0, F = 0;
    std::vector<CovBlock> blocks;  // [nl * nl]
    std::vector<double> mean;      // [nl * F]
    double inv_n = 0;
  };

  // A factored system, owned by its handle: in host memory for a host backend, device memory for a device one, and
  // released with the handle. Solves name the handle (no lookup by address; a backend holds as many as exist).
  struct SystemFactor {
    virtual ~SystemFactor() = default;
    int64_t n = 0;               // the system's order
    int64_t info = 0;            // 0, or the 1-based order of the first leading minor that is not positive definite
    std::vector<double> pivots;  // the factor's diagonal (the caller judges near-singular pivots from it)
  };
  using FactorPtr = std::unique_ptr<SystemFactor>;
  // A backend's own factor type T: `reuse` when it is one (its memory kept), else a new one; and a factor named in a
  // solve, which must be this backend's.
  template <class T>
  static std::unique_ptr<T> reuse_or_make(FactorPtr reuse) {
    if (auto* f = dynamic_cast<T*>(reuse.get())) {
      reuse.release();
      return std::unique_ptr<T>(f);
    }
    return std::make_unique<T>();
  }
  template <class T>
  static const T& own(const SystemFactor& f) {
    const auto* t = dynamic_cast<const T*>(&f);
    CROSSKV_ASSERT(t, "a factor of another backend");
    return *t;
  }
  // Cxx + lambda*I assembled where this backend factors it, and factored; diag[n] receives the system's diagonal. A
  // device backend uploads the fp32 blocks (half the bytes of the fp64 system) and keeps the factor there. `reuse`,
  // a factor of this backend no longer needed, lends its memory.
  virtual FactorPtr factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr reuse = nullptr) = 0;
  // A host system [n x n] (lower triangle read; A is left as it is) factored where this backend works.
  virtual FactorPtr factor_system(int64_t n, const double* A, int64_t lda, FactorPtr reuse = nullptr) = 0;
  // With the leading n x n block of a factor: (L L^T) X = B, or L X = B (transpose: L^T X = B). B row-major, host.
  virtual void solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) = 0;
  virtual void solve_triangular(const SystemFactor& f, int64_t n, bool transpose, int64_t nrhs, double* B,
                                int64_t ldb) = 0;
  virtual void triangular_solve(int64_t n, const double* L, int64_t lda, bool transpose, int64_t nrhs, double* B,
                                int64_t ldb) = 0;
};

// Input preparation: stored values of a block to the moments' operands.
class InputPreparation {
 public:
  virtual ~InputPreparation() = default;
  // True when prepare() and gather_heads() make their results on the device (the host vectors are then left alone).
  virtual bool prepares_on_device() const = 0;

  // Stored values of one block as read from a shard, staged: [rows x cols] of bf16 / fp16 bits or fp32.
  struct StoredBlock {
    const void* data;
    Dtype dtype;
    int64_t rows, cols;
  };
  // RoPE to strip from keys (docs/METHOD.md, RoPE): `rope` per head of every row, at the row's position (a staged int32 array).
  struct Strip {
    const Rope* rope;
    const int32_t* positions;
  };
  // The moments' inputs from stored values in one pass (docs/METHOD.md, RoPE; The fit): fp32, RoPE stripped (strip may be null), minus
  // shift[cols], times row_scale[t] (a staged array, sqrt of the token weights; null: 1). Returns the operand: `host`
  // (resized, filled) on a host backend, device memory on a device one.
  virtual const float* prepare(const StoredBlock& in, const Strip* strip, const float* shift, const float* row_scale,
                               std::vector<float>& host) = 0;
  // Head-major copy of X [rows x L*H*D]: out[t, (h*L + a)*D + j] = X[t, a*H*D + h*D + j]. Returns the operand.
  virtual const float* gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) = 0;
  // sum[c] += sum_t r[t] X[t, c] (r = row_weight, a staged array; null: 1); sumsq[c] += sum_t X[t, c]^2 when sumsq
  // is given (fp64 held sums, like C).
  virtual void column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, const float* row_weight,
                            double* sum, double* sumsq) = 0;
};

// Residency: where sums and operands live (a host backend keeps everything on the host).
class Residency {
 public:
  virtual ~Residency() = default;

  // Where the operands live. Sums that calls add into (the C of cross_acc, gram_acc and cross_acc_batch, and
  // column_stats' sums) are held by typed handles (HeldSums) that own their copy where this backend accumulates:
  // device memory for a device backend, the host array itself for a host one. Calls name that copy (at()); nothing
  // is looked up by host address. A handle writes its copy back to the host array (to_host) or is dropped.
  // Inputs come in rounds (one block of rows): begin_inputs() starts one; stage_inputs() names host arrays that the
  // round's calls read (a device backend copies each once, asynchronously, into one of two buffer sets); prepare()
  // and gather_heads() return operands made by the backend (a device backend makes them on the device). Operands
  // are named in calls until the next begin_inputs(). Host backends ignore staging.
  struct HostSpan {
    const void* data;
    int64_t bytes;
  };
  static HostSpan floats(const float* p, int64_t count) { return {p, count * 4}; }
  // Host sums [host, host + count) held where this backend accumulates them, for as long as the handle lives. Calls
  // are ordered on the backend's stream; a device handle's destructor waits for them.
  template <class T>
  class HeldSums {
   public:
    virtual ~HeldSums() = default;
    HeldSums(const HeldSums&) = delete;
    HeldSums& operator=(const HeldSums&) = delete;
    // The held copy of host element `host_element` (which lies in the held range), for a call's C argument.
    T* at(const T* host_element) const {
      CROSSKV_ASSERT(host_element >= host_ && host_element < host_ + count_, "a sum outside its held range");
      return held_ + (host_element - host_);
    }
    T* host() const { return host_; }
    const T* held() const { return held_; }
    int64_t count() const { return count_; }
    bool on_device() const { return held_ != host_; }
    // The held copy to the host array; returns when it is there.
    virtual void to_host() = 0;
    // Zero where the sums are current (the held copy; a device's host array is left as it is).
    virtual void zero() = 0;

   protected:
    HeldSums(T* host, T* held, int64_t count) : host_(host), held_(held), count_(count) {}

   private:
    T* host_;
    T* held_;
    int64_t count_;
  };
  template <class T>
  using HeldSumsPtr = std::unique_ptr<HeldSums<T>>;
  // Holds host sums [p, p + count): a device backend copies them up (or zeroes its copy when `host_is_zero`, the
  // caller's promise); a host backend's handle is the host array.
  virtual HeldSumsPtr<float> hold_sums(float* p, int64_t count, bool host_is_zero) = 0;
  virtual HeldSumsPtr<double> hold_sums(double* p, int64_t count, bool host_is_zero) = 0;
  // A round's reduction reads the sums where they are current (no write-back, no packed host copy): a SumPiece is a
  // [rows x cols] part of host sums `host` (leading dim ld) at `at` in a flat order of the pieces, current in
  // `held` (a HeldSums' copy laid out like the host part; null: current on the host). copy_sums copies flat values
  // [off, off + len) to dst, which is this backend's device memory when dst_on_device (a device comm's buffer), else
  // host memory.
  template <class T>
  struct SumPiece {
    T* host;
    int64_t rows, cols, ld, at;
    const T* held = nullptr;
    const T* current() const { return held ? held : host; }
  };
  virtual void copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                         bool dst_on_device) = 0;
  virtual void copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                         bool dst_on_device) = 0;
  virtual void begin_inputs() = 0;
  virtual void stage_inputs(std::initializer_list<HostSpan> spans) = 0;
  // Free memory of the device, in bytes, or -1 for a host backend (no limit beyond the host's).
  virtual int64_t device_memory_free() const = 0;
};

// Kernels on the backend's own memory, for serving (serve/serving_mapper): weights, caches and scratch all stay where the
// backend computes (host memory for a host backend, device memory for a device one), and calls are ordered on the
// backend's stream (asynchronous on a device until copy_to_host).
class ServingKernels {
 public:
  virtual ~ServingKernels() = default;
  // True when the memory below is device memory (a host array must be copied in, not named).
  virtual bool memory_on_device() const = 0;
  // Memory of this backend, owned by its handle (released with it; a device backend first waits for its stream).
  // Fresh memory holds anything (a device's does): callers write before they read.
  struct Memory {
    virtual ~Memory() = default;
    void* data = nullptr;
    int64_t bytes = 0;
    template <class T>
    T* as() const {
      return static_cast<T*>(data);
    }
  };
  using MemoryPtr = std::unique_ptr<Memory>;
  virtual MemoryPtr allocate(int64_t bytes) = 0;
  // Host -> backend memory (the host array may change once the call returns), and back (returns when it is there).
  virtual void copy_from_host(const void* host, int64_t bytes, void* dst) = 0;
  virtual void copy_to_host(const void* src, int64_t bytes, void* host) = 0;
  // Within this backend's memory.
  virtual void copy_within(const void* src, int64_t bytes, void* dst) = 0;
  // Y[t*ldy + c] = b[c] for t < rows, c < n.
  virtual void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) = 0;
  // The selected layers' columns side by side, for several selections of k layers each (one per target layer):
  // out[(s*rows + t)*k*F + j*F + i] = X[t*ldx + lists[s][j]*F + i].
  virtual void gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists, int64_t F,
                             int64_t rows, float* out) = 0;
  // X[i] = max(X[i], 0) for i < n.
  virtual void relu(float* X, int64_t n) = 0;
  // Y[t*ldy + c] += Z[t*n + c].
  virtual void add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) = 0;
  // RoPE applied to (strip: stripped from) X [rows, layers.count, layers.heads, head_dim] in place, each layer
  // with its own rotation, row t at positions[t] (int32, this backend's memory); bit-for-bit the host's
  // Rope::apply_block / strip_block.
  virtual void rope_rows(const Rope& rope, const LayerHeads& layers, bool strip, float* X, int64_t rows,
                         const int32_t* positions) = 0;
  // C = alpha op(A) op(B) + beta C on this backend's memory (gemm_batched's operands, but resident).
  virtual void serving_gemm(const DenseMaths::BatchedGemm& g) = 0;
  // Ordering with a caller's device stream (a cudaStream_t as void*, 0 for the legacy default one): work issued
  // after begin_after(s) starts once what s holds now is done; end_before(s) makes s wait for the work so far.
  // Host backends: no-ops (their calls return when done).
  virtual void begin_after(void* stream) = 0;
  virtual void end_before(void* stream) = 0;
};

// A compute backend: the concerns together. The host backend (backends/host/) is the reference; CUDA's is
// backends/cuda/. A test backend that changes one concern derives from the host one.
class ComputeBackend : public DenseMaths, public InputPreparation, public Residency, public ServingKernels {
 public:
  ~ComputeBackend() override = default;
  virtual std::string name() const = 0;
};

// The flat size of pieces laid back to back: the end of the last one.
template <class T>
int64_t flat_size(const std::vector<ComputeBackend::SumPiece<T>>& pieces) {
  return pieces.empty() ? 0 : pieces.back().at + pieces.back().rows * pieces.back().cols;
}

// The parts of `pieces` (sorted by `at`, back to back) that fall in flat values [off, off + len), as 2-D runs:
// fn(q, e, rows, cols, flat) copies rows x cols values of piece q from element e of its storage (leading dim q.ld;
// e = row * ld + col) to flat positions flat.. (row-major, no gaps). A piece cut by the range gives at most three
// runs (its partial first row, whole rows, partial last row).
template <class T, class Fn>
void for_each_sum_run(const std::vector<ComputeBackend::SumPiece<T>>& pieces, int64_t off, int64_t len, Fn fn) {
  const int64_t end = off + len;
  auto it = std::upper_bound(pieces.begin(), pieces.end(), off,
                             [](int64_t v, const ComputeBackend::SumPiece<T>& q) { return v < q.at; });
  if (it != pieces.begin()) --it;
  for (; it != pieces.end() && it->at < end; ++it) {
    const auto& q = *it;
    if (q.rows * q.cols == 0) continue;
    int64_t s = std::max(off, q.at) - q.at;                          // first element of the piece in the range
    const int64_t e = std::min(end, q.at + q.rows * q.cols) - q.at;  // one past the last
    if (s >= e) continue;
    if (s % q.cols != 0) {  // a partial first row
      const int64_t n = std::min(e, (s / q.cols + 1) * q.cols) - s;
      fn(q, (s / q.cols) * q.ld + s % q.cols, int64_t{1}, n, q.at + s);
      s += n;
    }
    if (e - s >= q.cols) {  // whole rows
      const int64_t rows = (e - s) / q.cols;
      fn(q, (s / q.cols) * q.ld, rows, q.cols, q.at + s);
      s += rows * q.cols;
    }
    if (s < e) fn(q, (s / q.cols) * q.ld, int64_t{1}, e - s, q.at + s);  // a partial last row
  }
}

// The inverse of a host copy_sums: flat values [off, off + len) from src into the pieces' host arrays.
template <class T>
void place_sums(const std::vector<ComputeBackend::SumPiece<T>>& pieces, int64_t off, int64_t len, const T* src) {
  for_each_sum_run(pieces, off, len,
                   [src, off](const ComputeBackend::SumPiece<T>& q, int64_t e, int64_t rows, int64_t cols,
                              int64_t flat) {
                     for (int64_t r = 0; r < rows; ++r)
                       std::copy_n(src + (flat - off) + r * cols, cols, q.host + e + r * q.ld);
                   });
}

}  // namespace crosskv
