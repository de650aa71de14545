#pragma once
// What one CUDA backend owns on its device, apart from the algorithms that use it (as faiss keeps GpuResources apart
// from its indexes): the compute and copy streams, the cuBLAS and cuSOLVER handles, the two staging slots of the
// input rounds, scratch buffers, and the events that order its work with a caller's stream. Nothing here computes.
#include <cstdint>
#include <initializer_list>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "backends/cuda/cuda_check.hpp"
#include "backends/cuda/resources.hpp"

namespace crosskv::cuda {

class DeviceResources {
  static Where select_device(int device, int rank);
  Where where_;  // first: checked and made current before any resource below is made
  std::string name_;

 public:
  // Checks that `device` exists (a UserError naming the host and rank if not) and makes it current before any
  // resource is made; every handle is owned, so a constructor throwing half-way leaks none of them.
  DeviceResources(int device, int rank, bool tf32);
  ~DeviceResources();  // waits for both streams
  DeviceResources(const DeviceResources&) = delete;
  DeviceResources& operator=(const DeviceResources&) = delete;

  const Where& where() const { return where_; }
  const std::string& name() const { return name_; }
  cudaStream_t compute() const { return compute_; }
  cudaStream_t copy() const { return copy_; }
  cublasHandle_t blas() const { return blas_; }
  cusolverDnHandle_t solver() const { return solver_; }
  cusolverDnParams_t solver_params() const { return params_; }
  int* info() const { return info_; }  // one int of device memory for cuSOLVER's info
  // This backend's device made current for the calling thread (a serving process may call from any thread).
  void make_current() const;

  // ---- Input rounds: two slots of pinned staging and device memory, used in turn (the round before last must be
  // done with a slot before it is reused).
  void begin_round();
  void end_round();  // records the current slot as used by the work queued so far (flush, between rounds)
  // Host arrays copied once, on the copy stream, into the current slot; the compute stream waits for the copies.
  void stage(std::initializer_list<Residency::HostSpan> spans);
  // The device address of an operand of this round: a staged host array, or memory of this round's slot.
  const void* operand(const void* p, size_t bytes) const;
  void* round_memory(size_t bytes);  // device memory of the current slot, valid until its next reuse
  // A small host array copied to the current slot's device memory in compute-stream order.
  const void* upload(const void* host, size_t bytes);

  // ---- Scratch, grown on demand and owned here.
  DeviceBuffer<double> other, rhs, mean;  // host-array kernels, right-hand sides, the systems' means
  DeviceBuffer<float> block, apply;       // an fp32 moment block; host operands of the products
  DeviceBuffer<char> work;                // cuSOLVER's device workspace
  std::vector<char> host_work;            // and its host workspace
  Event external_in, external_out;        // ordering with a caller's stream (begin_after, end_before)

 private:
  struct Span {
    const char* host;
    size_t bytes;
    char* dev;
  };
  struct Slot {
    explicit Slot(const Where& w) : host(true, w), dev(false, w), copied(w), used(w) {}
    Arena host, dev;  // pinned staging and device memory of this round's inputs and products
    std::vector<Span> spans;
    Event copied, used;
  };
  Stream compute_, copy_;
  BlasHandle blas_;
  SolverHandle solver_;
  SolverParams params_;
  DeviceArray<int> info_;
  Slot slots_[2];
  int cur_ = -1;
};

}  // namespace crosskv::cuda
