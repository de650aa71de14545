// The emulated cuBLAS: argument checks as cuBLAS makes them, operands checked against their allocations at the call
// and again when the stream runs the product on OpenBLAS (column-major, as cuBLAS).
#include <cblas.h>

#include <cmath>
#include <set>
#include <vector>

#include "cublas_v2.h"
#include "backends/cuda/emulation/device.hpp"

struct cublasContext {
  uint64_t id = 0;
  bool live = true;
  cudaStream_t stream = nullptr;
  cublasMath_t mode = CUBLAS_DEFAULT_MATH;
};

namespace crosskv_cuda_emulation {
namespace {

std::mutex handle_mutex;
std::set<cublasContext*> handles;
uint64_t next_handle = 1;

std::string handle_error(cublasHandle_t h) {
  std::lock_guard<std::mutex> lock(handle_mutex);
  if (!handles.count(h)) return "handle was never made by cublasCreate";
  if (!h->live) return "handle #" + std::to_string(h->id) + " was destroyed";
  return "";
}

// Elements of a column-major [rows x cols] operand with leading dimension ld (0 when empty).
size_t extent(int64_t rows, int64_t cols, int64_t ld) {
  return rows <= 0 || cols <= 0 ? 0 : static_cast<size_t>((cols - 1) * ld + rows);
}
size_t batched_extent(int64_t rows, int64_t cols, int64_t ld, long long stride, int64_t batch) {
  const size_t one = extent(rows, cols, ld);
  return one == 0 || batch <= 0 ? 0 : static_cast<size_t>((batch - 1) * stride) + one;
}

// A call's checks in order; the first failure is the call's status.
struct BlasCall {
  std::string name;
  cublasStatus_t status = CUBLAS_STATUS_SUCCESS;
  bool failed() const { return status != CUBLAS_STATUS_SUCCESS; }
  void value(bool ok, const std::string& what) {
    if (!failed() && !ok) status = misuse(CUBLAS_STATUS_INVALID_VALUE, name + ": " + what);
  }
  template <class T>
  void device(const char* operand, const T* p, size_t elements) {
    if (failed()) return;
    const std::string e = check_device(p, elements * sizeof(T));
    if (!e.empty()) status = misuse(CUBLAS_STATUS_INVALID_VALUE, name + ": " + operand + ": " + e);
  }
  template <class T>
  void host_scalar(const char* operand, const T* p) {  // CUBLAS_POINTER_MODE_HOST
    if (failed()) return;
    const std::string e = check_host(p, sizeof(T));
    if (!e.empty()) status = misuse(CUBLAS_STATUS_INVALID_VALUE, name + ": " + operand + " (host pointer mode): " + e);
  }
  void handle(cublasHandle_t h) {
    const std::string e = handle_error(h);
    if (!e.empty()) status = misuse(CUBLAS_STATUS_NOT_INITIALIZED, name + ": " + e);
  }
};

bool op_ok(cublasOperation_t t) { return t == CUBLAS_OP_N || t == CUBLAS_OP_T || t == CUBLAS_OP_C; }
CBLAS_TRANSPOSE cb(cublasOperation_t t) { return t == CUBLAS_OP_N ? CblasNoTrans : CblasTrans; }

// TF32: the fp32 input rounded to 10 mantissa bits, to nearest (ties away from zero), as the tensor cores take it.
float to_tf32(float x) {
  if (!std::isfinite(x)) return x;
  uint32_t u;
  std::memcpy(&u, &x, 4);
  u = (u + 0x1000u) & 0xffffe000u;
  std::memcpy(&x, &u, 4);
  return x;
}
// A TF32 copy of column-major [rows x cols] at ld (same layout), or `p` itself in fp32 modes.
const float* maybe_tf32(bool tf32, const float* p, int64_t rows, int64_t cols, int64_t ld, std::vector<float>& buf) {
  if (!tf32 || extent(rows, cols, ld) == 0) return p;
  buf.assign(extent(rows, cols, ld), 0.0f);
  for (int64_t c = 0; c < cols; ++c)
    for (int64_t r = 0; r < rows; ++r) buf[c * ld + r] = to_tf32(p[c * ld + r]);
  return buf.data();
}

void sgemm(bool tf32, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, float alpha,
           const float* A, int64_t lda, const float* B, int64_t ldb, float beta, float* C, int64_t ldc) {
  std::vector<float> ba, bb;
  const bool na = ta == CUBLAS_OP_N, nb = tb == CUBLAS_OP_N;
  A = maybe_tf32(tf32, A, na ? m : k, na ? k : m, lda, ba);
  B = maybe_tf32(tf32, B, nb ? k : n, nb ? n : k, ldb, bb);
  cblas_sgemm(CblasColMajor, cb(ta), cb(tb), static_cast<blasint>(m), static_cast<blasint>(n), static_cast<blasint>(k),
              alpha, A, static_cast<blasint>(lda), B, static_cast<blasint>(ldb), beta, C, static_cast<blasint>(ldc));
}

// The call's work queued on its handle's stream, its device operands checked again and opened when it runs.
cublasStatus_t queue(BlasCall& c, cublasHandle_t h, Operands operands, std::function<void()> work) {
  if (c.failed()) return c.status;
  if (enqueue_on(h->stream, c.name, std::move(operands), [work = std::move(work)] { return work(), std::string(); }) !=
      cudaSuccess)
    return misuse(CUBLAS_STATUS_EXECUTION_FAILED, c.name + ": its stream was destroyed");
  return CUBLAS_STATUS_SUCCESS;
}

// The checks every gemm makes of its shape (cuBLAS's order: operations, sizes, leading dimensions).
void gemm_shape(BlasCall& c, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n, int64_t k, int64_t lda,
                int64_t ldb, int64_t ldc) {
  c.value(op_ok(ta) && op_ok(tb), "transa/transb is not a cublasOperation_t");
  c.value(m >= 0 && n >= 0 && k >= 0,
          "m, n or k negative (m " + std::to_string(m) + ", n " + std::to_string(n) + ", k " + std::to_string(k) + ")");
  const int64_t ra = ta == CUBLAS_OP_N ? m : k, rb = tb == CUBLAS_OP_N ? k : n;
  c.value(lda >= std::max<int64_t>(1, ra), "lda " + std::to_string(lda) + " < " +
                                               std::to_string(std::max<int64_t>(1, ra)) + " (rows of op(A)'s storage)");
  c.value(ldb >= std::max<int64_t>(1, rb), "ldb " + std::to_string(ldb) + " < " +
                                               std::to_string(std::max<int64_t>(1, rb)) + " (rows of op(B)'s storage)");
  c.value(ldc >= std::max<int64_t>(1, m),
          "ldc " + std::to_string(ldc) + " < " + std::to_string(std::max<int64_t>(1, m)));
}

std::string dims(int64_t m, int64_t n, int64_t k) {
  return "(m " + std::to_string(m) + ", n " + std::to_string(n) + ", k " + std::to_string(k) + ")";
}

}  // namespace
}  // namespace crosskv_cuda_emulation

using namespace crosskv_cuda_emulation;

cublasStatus_t cublasCreate(cublasHandle_t* handle) {
  if (!handle) return misuse(CUBLAS_STATUS_INVALID_VALUE, "cublasCreate: a null result pointer");
  auto* h = new cublasContext;
  std::lock_guard<std::mutex> lock(handle_mutex);
  h->id = next_handle++;
  handles.insert(h);
  *handle = h;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasDestroy(cublasHandle_t handle) {
  BlasCall c{"cublasDestroy"};
  c.handle(handle);
  if (c.failed()) return c.status;
  std::lock_guard<std::mutex> lock(handle_mutex);
  handle->live = false;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t stream) {
  BlasCall c{"cublasSetStream"};
  c.handle(handle);
  if (c.failed()) return c.status;
  std::string why;
  if (!stream_of(stream, &why)) return misuse(CUBLAS_STATUS_INVALID_VALUE, "cublasSetStream: " + why);
  handle->stream = stream;
  return CUBLAS_STATUS_SUCCESS;
}
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
  BlasCall c{"cublasSetMathMode"};
  c.handle(handle);
  c.value(mode == CUBLAS_DEFAULT_MATH || mode == CUBLAS_TF32_TENSOR_OP_MATH || mode == CUBLAS_PEDANTIC_MATH,
          "not a cublasMath_t");
  if (c.failed()) return c.status;
  handle->mode = mode;
  return CUBLAS_STATUS_SUCCESS;
}
const char* cublasGetStatusName(cublasStatus_t s) {
  static thread_local std::string text;
  const char* name = "CUBLAS_STATUS_UNKNOWN";
  switch (s) {
    case CUBLAS_STATUS_SUCCESS:
      return "CUBLAS_STATUS_SUCCESS";
    case CUBLAS_STATUS_NOT_INITIALIZED:
      name = "CUBLAS_STATUS_NOT_INITIALIZED";
      break;
    case CUBLAS_STATUS_ALLOC_FAILED:
      name = "CUBLAS_STATUS_ALLOC_FAILED";
      break;
    case CUBLAS_STATUS_INVALID_VALUE:
      name = "CUBLAS_STATUS_INVALID_VALUE";
      break;
    case CUBLAS_STATUS_ARCH_MISMATCH:
      name = "CUBLAS_STATUS_ARCH_MISMATCH";
      break;
    case CUBLAS_STATUS_MAPPING_ERROR:
      name = "CUBLAS_STATUS_MAPPING_ERROR";
      break;
    case CUBLAS_STATUS_EXECUTION_FAILED:
      name = "CUBLAS_STATUS_EXECUTION_FAILED";
      break;
    case CUBLAS_STATUS_INTERNAL_ERROR:
      name = "CUBLAS_STATUS_INTERNAL_ERROR";
      break;
    case CUBLAS_STATUS_NOT_SUPPORTED:
      name = "CUBLAS_STATUS_NOT_SUPPORTED";
      break;
  }
  const char* m = last_message();
  text = m ? std::string(name) + ": " + m : name;
  return text.c_str();
}

cublasStatus_t cublasSgemm_64(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int64_t m, int64_t n,
                              int64_t k, const float* alpha, const float* A, int64_t lda, const float* B, int64_t ldb,
                              const float* beta, float* C, int64_t ldc) {
  BlasCall c{"cublasSgemm_64" + dims(m, n, k)};
  c.handle(handle);
  gemm_shape(c, ta, tb, m, n, k, lda, ldb, ldc);
  c.host_scalar("alpha", alpha);
  c.host_scalar("beta", beta);
  if (c.failed()) return c.status;
  const bool na = ta == CUBLAS_OP_N, nb = tb == CUBLAS_OP_N;
  const size_t ea = k ? extent(na ? m : k, na ? k : m, lda) : 0, eb = k ? extent(nb ? k : n, nb ? n : k, ldb) : 0,
               ec = extent(m, n, ldc);
  c.device("A", A, ea);
  c.device("B", B, eb);
  c.device("C", C, ec);
  const bool tf32 = handle->mode == CUBLAS_TF32_TENSOR_OP_MATH;
  const float al = *alpha, be = *beta;
  return queue(c, handle, {{A, ea * 4}, {B, eb * 4}, {C, ec * 4}},
               [=] { sgemm(tf32, ta, tb, m, n, k, al, A, lda, B, ldb, be, C, ldc); });
}

cublasStatus_t cublasSgemmStridedBatched_64(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb,
                                            int64_t m, int64_t n, int64_t k, const float* alpha, const float* A,
                                            int64_t lda, long long sa, const float* B, int64_t ldb, long long sb,
                                            const float* beta, float* C, int64_t ldc, long long sc, int64_t batch) {
  BlasCall c{"cublasSgemmStridedBatched_64" + dims(m, n, k) + "[batch " + std::to_string(batch) + "]"};
  c.handle(handle);
  gemm_shape(c, ta, tb, m, n, k, lda, ldb, ldc);
  c.value(batch >= 0, "batchCount negative");
  c.value(sa >= 0 && sb >= 0 && sc >= 0, "a negative stride");
  c.host_scalar("alpha", alpha);
  c.host_scalar("beta", beta);
  if (c.failed()) return c.status;
  const bool na = ta == CUBLAS_OP_N, nb = tb == CUBLAS_OP_N;
  const size_t ea = k ? batched_extent(na ? m : k, na ? k : m, lda, sa, batch) : 0,
               eb = k ? batched_extent(nb ? k : n, nb ? n : k, ldb, sb, batch) : 0,
               ec = batched_extent(m, n, ldc, sc, batch);
  c.device("A", A, ea);
  c.device("B", B, eb);
  c.device("C", C, ec);
  // Overlapping outputs of a batch race on a GPU: they must be stacked, or side by side within ldc.
  c.value(batch <= 1 || sc >= static_cast<long long>(extent(m, n, ldc)) || (sc >= m && (batch - 1) * sc + m <= ldc),
          "strideC " + std::to_string(sc) + " makes the batch's outputs overlap");
  const bool tf32 = handle->mode == CUBLAS_TF32_TENSOR_OP_MATH;
  const float al = *alpha, be = *beta;
  return queue(c, handle, {{A, ea * 4}, {B, eb * 4}, {C, ec * 4}}, [=] {
    for (int64_t i = 0; i < batch; ++i)
      sgemm(tf32, ta, tb, m, n, k, al, A + i * sa, lda, B + i * sb, ldb, be, C + i * sc, ldc);
  });
}

cublasStatus_t cublasSgemmBatched(cublasHandle_t handle, cublasOperation_t ta, cublasOperation_t tb, int m, int n,
                                  int k, const float* alpha, const float* const Aarray[], int lda,
                                  const float* const Barray[], int ldb, const float* beta, float* const Carray[],
                                  int ldc, int batch) {
  BlasCall c{"cublasSgemmBatched" + dims(m, n, k) + "[batch " + std::to_string(batch) + "]"};
  c.handle(handle);
  gemm_shape(c, ta, tb, m, n, k, lda, ldb, ldc);
  c.value(batch >= 0, "batchCount negative");
  c.host_scalar("alpha", alpha);
  c.host_scalar("beta", beta);
  if (c.failed()) return c.status;
  const size_t nb = static_cast<size_t>(batch);
  c.device("Aarray", Aarray, nb);
  c.device("Barray", Barray, nb);
  c.device("Carray", Carray, nb);
  if (c.failed()) return c.status;
  const bool tf32 = handle->mode == CUBLAS_TF32_TENSOR_OP_MATH;
  const float al = *alpha, be = *beta;
  const bool na = ta == CUBLAS_OP_N, nbt = tb == CUBLAS_OP_N;
  const size_t ea = k ? extent(na ? m : k, na ? k : m, lda) : 0, eb = k ? extent(nbt ? k : n, nbt ? n : k, ldb) : 0,
               ec = extent(m, n, ldc);
  const std::string name = c.name;
  // The pointer arrays are device memory, filled in stream order: their entries are checked when the stream runs.
  auto op = [=]() -> std::string {
    const DeviceAccess arrays({Aarray, Barray, Carray});
    for (const auto& [arr, bytes] :
         {std::pair<const void*, size_t>{Aarray, nb * 8}, {Barray, nb * 8}, {Carray, nb * 8}}) {
      const std::string e = check_device(arr, bytes);
      if (!e.empty()) {
        note_misuse(name + ": " + e);
        return name + ": " + e;
      }
    }
    for (size_t i = 0; i < nb; ++i) {
      for (const auto& [what, p, bytes] : {std::tuple<const char*, const void*, size_t>{"A", Aarray[i], ea * 4},
                                           {"B", Barray[i], eb * 4},
                                           {"C", Carray[i], ec * 4}}) {
        const std::string e = check_device(p, bytes);
        if (!e.empty()) {
          const std::string m2 = name + " when the stream ran it: " + what + "array[" + std::to_string(i) + "]: " + e;
          note_misuse(m2);
          return m2;
        }
      }
    }
    std::vector<const void*> matrices;
    for (size_t i = 0; i < nb; ++i) matrices.insert(matrices.end(), {Aarray[i], Barray[i], Carray[i]});
    const DeviceAccess access(matrices);
    for (size_t i = 0; i < nb; ++i)
      sgemm(tf32, ta, tb, m, n, k, al, Aarray[i], lda, Barray[i], ldb, be, Carray[i], ldc);
    return "";
  };
  if (enqueue(handle->stream, name, std::move(op)) != cudaSuccess)
    return misuse(CUBLAS_STATUS_EXECUTION_FAILED, name + ": its stream was destroyed");
  return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSsyrk_64(cublasHandle_t handle, cublasFillMode_t uplo, cublasOperation_t trans, int64_t n,
                              int64_t k, const float* alpha, const float* A, int64_t lda, const float* beta, float* C,
                              int64_t ldc) {
  BlasCall c{"cublasSsyrk_64(n " + std::to_string(n) + ", k " + std::to_string(k) + ")"};
  c.handle(handle);
  c.value(uplo == CUBLAS_FILL_MODE_LOWER || uplo == CUBLAS_FILL_MODE_UPPER, "uplo is not lower or upper");
  c.value(trans == CUBLAS_OP_N || trans == CUBLAS_OP_T, "trans is not N or T");
  c.value(n >= 0 && k >= 0, "n or k negative");
  const int64_t ra = trans == CUBLAS_OP_N ? n : k;
  c.value(lda >= std::max<int64_t>(1, ra),
          "lda " + std::to_string(lda) + " < " + std::to_string(std::max<int64_t>(1, ra)));
  c.value(ldc >= std::max<int64_t>(1, n),
          "ldc " + std::to_string(ldc) + " < " + std::to_string(std::max<int64_t>(1, n)));
  c.host_scalar("alpha", alpha);
  c.host_scalar("beta", beta);
  if (c.failed()) return c.status;
  const size_t ea = k ? extent(ra, trans == CUBLAS_OP_N ? k : n, lda) : 0, ec = extent(n, n, ldc);
  c.device("A", A, ea);
  c.device("C", C, ec);
  const bool tf32 = handle->mode == CUBLAS_TF32_TENSOR_OP_MATH;
  const float al = *alpha, be = *beta;
  return queue(c, handle, {{A, ea * 4}, {C, ec * 4}}, [=] {
    std::vector<float> buf;
    const float* a = maybe_tf32(tf32, A, ra, trans == CUBLAS_OP_N ? k : n, lda, buf);
    cblas_ssyrk(CblasColMajor, uplo == CUBLAS_FILL_MODE_LOWER ? CblasLower : CblasUpper,
                trans == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, static_cast<blasint>(n), static_cast<blasint>(k), al,
                a, static_cast<blasint>(lda), be, C, static_cast<blasint>(ldc));
  });
}

cublasStatus_t cublasDtrsm_64(cublasHandle_t handle, cublasSideMode_t side, cublasFillMode_t uplo,
                              cublasOperation_t trans, cublasDiagType_t diag, int64_t m, int64_t n, const double* alpha,
                              const double* A, int64_t lda, double* B, int64_t ldb) {
  BlasCall c{"cublasDtrsm_64(m " + std::to_string(m) + ", n " + std::to_string(n) + ")"};
  c.handle(handle);
  c.value(side == CUBLAS_SIDE_LEFT || side == CUBLAS_SIDE_RIGHT, "side is not left or right");
  c.value(uplo == CUBLAS_FILL_MODE_LOWER || uplo == CUBLAS_FILL_MODE_UPPER, "uplo is not lower or upper");
  c.value(op_ok(trans), "trans is not a cublasOperation_t");
  c.value(diag == CUBLAS_DIAG_UNIT || diag == CUBLAS_DIAG_NON_UNIT, "diag is not unit or non-unit");
  c.value(m >= 0 && n >= 0, "m or n negative");
  const int64_t na = side == CUBLAS_SIDE_LEFT ? m : n;
  c.value(lda >= std::max<int64_t>(1, na),
          "lda " + std::to_string(lda) + " < " + std::to_string(std::max<int64_t>(1, na)));
  c.value(ldb >= std::max<int64_t>(1, m),
          "ldb " + std::to_string(ldb) + " < " + std::to_string(std::max<int64_t>(1, m)));
  c.host_scalar("alpha", alpha);
  if (c.failed()) return c.status;
  const size_t ea = extent(na, na, lda), eb = extent(m, n, ldb);
  c.device("A", A, ea);
  c.device("B", B, eb);
  const double al = *alpha;
  return queue(c, handle, {{A, ea * 8}, {B, eb * 8}}, [=] {
    cblas_dtrsm(CblasColMajor, side == CUBLAS_SIDE_LEFT ? CblasLeft : CblasRight,
                uplo == CUBLAS_FILL_MODE_LOWER ? CblasLower : CblasUpper,
                trans == CUBLAS_OP_N ? CblasNoTrans : CblasTrans, diag == CUBLAS_DIAG_UNIT ? CblasUnit : CblasNonUnit,
                static_cast<blasint>(m), static_cast<blasint>(n), al, A, static_cast<blasint>(lda), B,
                static_cast<blasint>(ldb));
  });
}
