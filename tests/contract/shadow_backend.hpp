#pragma once
// The ShadowBackend: the host backend made to keep a device backend's contract, so that the pipeline's use of the
// CUDA backend's rules is tested without a GPU (the DeviceContract.* tests in tests/cuda/test_cuda.cpp).
#include <gtest/gtest.h>

#include <algorithm>
#include <deque>
#include <initializer_list>
#include <limits>
#include <map>
#include <memory>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "backends/backends.hpp"
#include "backends/host/host_backend.hpp"
#include "core/host_kernels.hpp"

namespace crosskv::test {

// A host backend that behaves like a device one: operands must have been staged in the current round (they are read
// from private copies) or made by prepare()/gather_heads() (which leave the host vectors alone), and held sums live in
// shadow copies (their host arrays poisoned) until written back. A fit through it equals a CPU fit only if the
// pipeline keeps the CUDA backend's contract; this checks it without a GPU. What it does not change (the serving
// kernels' arithmetic, to_half, download) is the host backend's.
class ShadowBackend final : public HostBackend {
 public:
  std::string name() const override { return "shadow"; }
  // Calls one at a time, as a device takes them.
  bool concurrent_calls() const override { return false; }
  void begin_inputs() override {
    rounds_.emplace_front();
    if (rounds_.size() > 2) rounds_.pop_back();
  }
  void stage_inputs(std::initializer_list<HostSpan> spans) override {
    if (rounds_.empty()) ADD_FAILURE() << "stage_inputs before begin_inputs";
    for (const auto& s : spans) {
      const char* p = static_cast<const char*>(s.data);
      rounds_.front().staged.push_back({p, std::vector<char>(p, p + s.bytes)});
    }
  }
  bool prepares_on_device() const override { return true; }
  const float* prepare(const StoredBlock& in, const Strip* strip, const float* shift, const float* row_scale,
                       std::vector<float>& host) override {
    StoredBlock copy = in;
    copy.data = operand(in.data, in.rows * in.cols * dtype_bytes(in.dtype));
    Strip st{};
    if (strip) st = {strip->rope, static_cast<const int32_t*>(operand(strip->positions, in.rows * 4))};
    std::vector<float>& out = product();
    const float* scale = row_scale ? static_cast<const float*>(operand(row_scale, in.rows * 4)) : nullptr;
    prepare_on_host(copy, strip ? &st : nullptr, shift, scale, out);
    return out.data();
  }
  const float* gather_heads(int64_t rows, int L, int H, int D, const float* X, std::vector<float>& host) override {
    const float* x = static_cast<const float*>(operand(X, rows * L * H * D * 4));
    std::vector<float>& out = product();
    return cpu_->gather_heads(rows, L, H, D, x, out);
  }
  void column_stats(int64_t rows, int64_t cols, const float* X, int64_t ldx, const float* row_weight, double* sum,
                    double* sumsq) override {
    const float* x = static_cast<const float*>(operand(X, ((rows - 1) * ldx + cols) * 4));
    const float* w = row_weight ? static_cast<const float*>(operand(row_weight, rows * 4)) : nullptr;
    cpu_->column_stats(rows, cols, x, ldx, w, held_copy(sum, cols), sumsq ? held_copy(sumsq, cols) : nullptr);
  }
  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc) override {
    cpu_->cross_acc(rows, m, n, staged(A, (rows - 1) * lda + m), lda, staged(B, (rows - 1) * ldb + n), ldb,
                    held_copy(C, (m - 1) * ldc + n), ldc);
  }
  void cross_acc_batch(int64_t rows, int64_t m, int64_t n, const std::vector<CrossTerm>& terms, int64_t lda,
                       int64_t ldb, int64_t ldc) override {
    for (const CrossTerm& t : terms) cross_acc(rows, m, n, t.A, lda, t.B, ldb, t.C, ldc);
  }
  // Host arrays in and out, as the device backend takes them: the host's kernels.
  void gemm_batched(const BatchedGemm& g) override { cpu_->gemm_batched(g); }
  void symmetric_eigen(int64_t n, double* A, int64_t lda, double* w) override { cpu_->symmetric_eigen(n, A, lda, w); }
  int64_t free_bytes = -1;  // what device_memory_free() reports (-1: a host backend)
  int64_t device_memory_free() const override { return free_bytes; }
  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override {
    cpu_->gram_acc(rows, m, staged(A, (rows - 1) * lda + m), lda, held_copy(C, (m - 1) * ldc + m), ldc);
  }
  // Factors are the device's: each wraps a factor of the CPU backend that only this backend's solves can reach
  // (a solve with another backend's factor is an assertion there). Systems are assembled "on the device".
  struct ShadowFactor final : SystemFactor {
    FactorPtr inner;
  };
  FactorPtr wrap(FactorPtr inner) {
    auto f = std::make_unique<ShadowFactor>();
    f->n = inner->n;
    f->info = inner->info;
    f->pivots = inner->pivots;
    f->inner = std::move(inner);
    return f;
  }
  static const SystemFactor& inner(const SystemFactor& f) {
    const auto* s = dynamic_cast<const ShadowFactor*>(&f);
    if (!s) ADD_FAILURE() << "a solve with a factor this backend did not make";
    return *s->inner;
  }
  FactorPtr factor_cov(const CovTerms& t, double lambda, double* diag, FactorPtr) override {
    ++assembled;
    return wrap(cpu_->factor_cov(t, lambda, diag));
  }
  int assembled = 0;
  FactorPtr factor_system(int64_t n, const double* A, int64_t lda, FactorPtr) override {
    return wrap(cpu_->factor_system(n, A, lda));
  }
  void solve(const SystemFactor& f, int64_t n, int64_t nrhs, double* B, int64_t ldb) override {
    cpu_->solve(inner(f), n, nrhs, B, ldb);
  }
  void solve_triangular(const SystemFactor& f, int64_t n, bool t, int64_t nrhs, double* B, int64_t ldb) override {
    cpu_->solve_triangular(inner(f), n, t, nrhs, B, ldb);
  }
  int64_t cholesky(int64_t n, double* A, int64_t lda) override { return checks(*cpu_).cholesky(n, A, lda); }
  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override {
    checks(*cpu_).cholesky_solve(n, L, lda, nrhs, B, ldb);
  }
  void triangular_solve(int64_t n, const double* L, int64_t lda, bool t, int64_t nrhs, double* B,
                        int64_t ldb) override {
    checks(*cpu_).triangular_solve(n, L, lda, t, nrhs, B, ldb);
  }
  // Held sums: a shadow copy each, made from the host array (or zeros, checking the caller's promise), which is then
  // poisoned until to_host(): reading it before must show. Counts of float copies made, written back and dropped
  // (destroyed without a write-back).
  template <class T>
  struct ShadowCopy {
    std::vector<T> values;
  };
  template <class T>
  class ShadowSums final : ShadowCopy<T>, public HeldSums<T> {
   public:
    ShadowSums(ShadowBackend& be, T* host, int64_t count, bool host_is_zero)
        : ShadowCopy<T>{host_is_zero ? std::vector<T>(count, T{0}) : std::vector<T>(host, host + count)},
          HeldSums<T>(host, this->values.data(), count),
          be_(be) {
      if (host_is_zero)
        for (int64_t i = 0; i < count; ++i)
          if (host[i] != T{0}) {
            ADD_FAILURE() << "hold_sums(host_is_zero) on sums whose element " << i << " is " << host[i];
            break;
          }
      std::fill_n(host, count, std::numeric_limits<T>::quiet_NaN());
      be_.held_ranges_[reinterpret_cast<const char*>(this->values.data())] = count * static_cast<int64_t>(sizeof(T));
      if (std::is_same_v<T, float>) ++be_.held;
    }
    ~ShadowSums() override {
      be_.held_ranges_.erase(reinterpret_cast<const char*>(this->values.data()));
      if (std::is_same_v<T, float>) (written_ ? be_.written_back : be_.dropped) += 1;
    }
    void to_host() override {
      std::copy(this->values.begin(), this->values.end(), this->host());
      written_ = true;
    }
    void zero() override { std::fill(this->values.begin(), this->values.end(), T{0}); }

   private:
    ShadowBackend& be_;
    bool written_ = false;
  };
  HeldSumsPtr<float> hold_sums(float* p, int64_t count, bool host_is_zero) override {
    return std::make_unique<ShadowSums<float>>(*this, p, count, host_is_zero);
  }
  HeldSumsPtr<double> hold_sums(double* p, int64_t count, bool host_is_zero) override {
    return std::make_unique<ShadowSums<double>>(*this, p, count, host_is_zero);
  }
  int held = 0, written_back = 0, dropped = 0;
  int64_t live_held() const { return static_cast<int64_t>(held_ranges_.size()); }
  // A round's reduction reads the pieces where they are current (a device comm's buffer is host memory here).
  void copy_sums(const std::vector<SumPiece<float>>& pieces, int64_t off, int64_t len, float* dst,
                 bool dst_on_device) override {
    copy_current(pieces, off, len, dst, dst_on_device);
  }
  void copy_sums(const std::vector<SumPiece<double>>& pieces, int64_t off, int64_t len, double* dst,
                 bool dst_on_device) override {
    copy_current(pieces, off, len, dst, dst_on_device);
  }
  int copies_to_device = 0;

  // The serving kernels on "device memory" (with device_memory set): allocations this backend made, which every
  // kernel's operands must lie in, and host arrays crossing only through copy_from_host / copy_to_host. The host's
  // kernels compute, so the results equal the CPU's bit for bit.
  bool device_memory = false;
  bool memory_on_device() const override { return device_memory; }
  struct ShadowMemory final : Memory {
    MemoryPtr inner;
    std::map<const char*, int64_t>* live;
    ~ShadowMemory() override { live->erase(static_cast<const char*>(data)); }
  };
  MemoryPtr allocate(int64_t bytes) override {
    auto m = std::make_unique<ShadowMemory>();
    m->inner = HostBackend::allocate(bytes);
    m->data = m->inner->data, m->bytes = bytes, m->live = &live_;
    live_[static_cast<const char*>(m->data)] = bytes;
    return m;
  }
  void copy_from_host(const void* host, int64_t bytes, void* dst) override {
    if (on_device(host, 1)) ADD_FAILURE() << "copy_from_host from device memory";
    HostBackend::copy_from_host(host, bytes, device(dst, bytes));
  }
  void copy_to_host(const void* src, int64_t bytes, void* host) override {
    if (on_device(host, 1)) ADD_FAILURE() << "copy_to_host into device memory";
    HostBackend::copy_to_host(device(src, bytes), bytes, host);
  }
  void copy_within(const void* src, int64_t bytes, void* dst) override {
    HostBackend::copy_within(device(src, bytes), bytes, device(dst, bytes));
  }
  void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) override {
    HostBackend::broadcast_rows(device(b, n * 4), n, rows, device(Y, ((rows - 1) * ldy + n) * 4), ldy);
  }
  void gather_layers(const float* X, int64_t ldx, const std::vector<std::vector<int>>& lists, int64_t F,
                     int64_t rows, float* out) override {
    int64_t top = 0, count = 0;
    for (const auto& l : lists) top = std::max<int64_t>(top, l.back() + 1), count += rows * l.size() * F;
    ++gathers;
    HostBackend::gather_layers(device(X, ((rows - 1) * ldx + top * F) * 4), ldx, lists, F, rows,
                                   device(out, count * 4));
  }
  int gathers = 0, gemm_calls = 0;
  void relu(float* X, int64_t n) override { HostBackend::relu(device(X, n * 4), n); }
  void add_rows(const float* Z, int64_t n, int64_t rows, float* Y, int64_t ldy) override {
    HostBackend::add_rows(device(Z, rows * n * 4), n, rows, device(Y, ((rows - 1) * ldy + n) * 4), ldy);
  }
  void rope_rows(const Rope& rope, const LayerHeads& layers, bool strip, float* X, int64_t rows,
                 const int32_t* positions) override {
    HostBackend::rope_rows(rope, layers, strip, device(X, rows * layers.count * layers.heads * rope.head_dim() * 4),
                           rows, device(positions, rows * 4));
  }
  void serving_gemm(const BatchedGemm& g) override {
    auto extent = [&](int64_t r, int64_t c, int64_t ld, int64_t stride) {
      return ((g.batch - 1) * stride + (r - 1) * ld + c) * 4;
    };
    BatchedGemm d = g;
    d.A = device(g.A, extent(g.trans_a ? g.k : g.m, g.trans_a ? g.m : g.k, g.lda, g.stride_a));
    d.B = device(g.B, extent(g.trans_b ? g.n : g.k, g.trans_b ? g.k : g.n, g.ldb, g.stride_b));
    d.C = device(g.C, extent(g.m, g.n, g.ldc, g.stride_c));
    ++gemm_calls;
    cpu_->gemm_batched(d);
  }
  void begin_after(void* stream) override { ++stream_waits, last_stream = stream; }
  void end_before(void* stream) override { stream_signals += stream == last_stream; }
  int stream_waits = 0, stream_signals = 0;
  void* last_stream = nullptr;
  int64_t live_allocations() const { return static_cast<int64_t>(live_.size()); }

 private:
  bool on_device(const void* p, int64_t bytes) const {
    const char* c = static_cast<const char*>(p);
    auto it = live_.upper_bound(c);
    return it != live_.begin() && c + bytes <= std::prev(it)->first + std::prev(it)->second;
  }
  template <class T>
  T* device(T* p, int64_t bytes) {
    if (device_memory && !on_device(p, bytes)) ADD_FAILURE() << "a kernel's operand is not this backend's memory";
    return p;
  }
  std::map<const char*, int64_t> live_;
  // A held piece is read from its copy, which must be live; another from the host.
  template <class T>
  void copy_current(const std::vector<SumPiece<T>>& pieces, int64_t off, int64_t len, T* dst, bool dst_on_device) {
    copies_to_device += dst_on_device;
    for_each_sum_run(pieces, off, len, [&](const SumPiece<T>& q, int64_t e, int64_t rows, int64_t cols, int64_t flat) {
      const T* from = q.held ? held_copy(q.held + e, (rows - 1) * q.ld + cols) : q.host + e;
      for (int64_t r = 0; r < rows; ++r) std::copy_n(from + r * q.ld, cols, dst + (flat - off) + r * cols);
    });
  }
  // A C argument: it must lie in a live held copy (never a host array).
  template <class T>
  T* held_copy(T* p, int64_t count) const {
    const char* c = reinterpret_cast<const char*>(p);
    auto it = held_ranges_.upper_bound(c);
    if (it == held_ranges_.begin() || c + count * static_cast<int64_t>(sizeof(T)) > std::prev(it)->first + std::prev(it)->second)
      ADD_FAILURE() << "a sum argument that is not a live held copy (" << count << " elements)";
    return p;
  }
  std::map<const char*, int64_t> held_ranges_;
  struct Round {
    std::vector<std::pair<const char*, std::vector<char>>> staged;
    std::deque<std::vector<float>> products;
  };
  std::vector<float>& product() { return rounds_.front().products.emplace_back(); }
  const void* operand(const void* p, int64_t bytes) {
    if (rounds_.empty()) {
      ADD_FAILURE() << "an operand outside any round";
      return p;
    }
    const char* c = static_cast<const char*>(p);
    for (const auto& [host, copy] : rounds_.front().staged)
      if (c >= host && c + bytes <= host + copy.size()) return copy.data() + (c - host);
    for (const auto& v : rounds_.front().products)
      if (p >= v.data() && c + bytes <= reinterpret_cast<const char*>(v.data() + v.size())) return p;
    ADD_FAILURE() << "an operand was not staged or made in this round";
    return p;
  }
  const float* staged(const float* p, int64_t extent) { return static_cast<const float*>(operand(p, extent * 4)); }
 private:
  std::unique_ptr<ComputeBackend> cpu_ = make_cpu_backend();
  std::deque<Round> rounds_;
};

}  // namespace crosskv::test
