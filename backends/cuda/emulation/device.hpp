#pragma once
// The emulated device's state, shared by the runtime, cuBLAS, cuSOLVER and NCCL emulations: tracked allocations,
// stream queues, and the reporting of misuse.
#include <atomic>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <string>
#include <vector>

#include "cuda_runtime.h"

namespace crosskv_cuda_emulation {

// ---- Failures. misuse() is a programming error (reported on stderr at once, counted, and failing the process at
// exit); failure() a condition a correct program can meet (out of memory, no such device). Both keep the message
// for the next cudaGetErrorString / cublasGetStatusName / ncclGetErrorString of this thread, and return `code`.
void note_misuse(const std::string& message);
void note_failure(const std::string& message);
template <class Code>
Code misuse(Code code, const std::string& message) {
  note_misuse(message);
  return code;
}
template <class Code>
Code failure(Code code, const std::string& message) {
  note_failure(message);
  return code;
}
const char* last_message();
// The misuses counted so far; the count starts again at 0 (for tests that misuse the device on purpose).
int take_misuses();  // null when this thread's last failure was reported already
void set_last_error(cudaError_t e);

// ---- Memory.
enum class Side { device, pinned, pageable };
struct Allocation {
  uint64_t id = 0;
  char* p = nullptr;
  size_t bytes = 0;
  int device = -1;  // -1: pinned host memory
  bool live = true;
};
// The side a pointer lies on (pageable: not from cudaMalloc or cudaMallocHost, or freed; `found` then names a freed
// allocation holding it).
Side side_of(const void* p, Allocation* found = nullptr);
std::string describe(const void* p);
// "" when [p, p + bytes) lies in one live device allocation, else what is wrong (host memory, freed, past its end).
std::string check_device(const void* p, size_t bytes);
// "" when [p, p + bytes) is host memory (pageable, or inside one live pinned allocation).
std::string check_host(const void* p, size_t bytes);
int current_device();
// Device memory is inaccessible to the host, as a GPU's is: only the stream work that names an allocation opens it,
// for as long as it runs (counted, so work on several threads may share one). A host read or write of device memory
// outside that faults, and the SIGSEGV report names the allocation.
class DeviceAccess {
 public:
  explicit DeviceAccess(const std::vector<const void*>& pointers);
  ~DeviceAccess();
  DeviceAccess(const DeviceAccess&) = delete;
  DeviceAccess& operator=(const DeviceAccess&) = delete;

 private:
  std::vector<uintptr_t> opened_;
};

// ---- Streams: work queued in order, run by the thread that waits for it (lazily: a host read without the wait
// reads what was there before).
struct Stream;
using Op = std::function<std::string()>;  // returns "" or what failed while it ran
// Queues `op` (described by `what`) on `stream` (null: the current device's default stream).
cudaError_t enqueue(cudaStream_t stream, const std::string& what, Op op);
// The stream a handle names, or null (and `why`) when it was destroyed or never made.
Stream* stream_of(cudaStream_t stream, std::string* why);
cudaError_t synchronize(Stream* s);
// Device operands [pointer, pointer + bytes) of one piece of stream work.
using Operands = std::vector<std::pair<const void*, size_t>>;
// Queues `work` on `stream` (null: the default one): when the stream runs it, its operands are checked again (freed
// since the call?, a misuse then) and opened to it (DeviceAccess) while it runs; `work` returns "" or what failed.
cudaError_t enqueue_on(cudaStream_t stream, const std::string& what, Operands operands, Op work);

// Parses a size with an optional K/M/G/T suffix ("16G"); `fallback` when unset or malformed.
size_t env_size(const char* name, size_t fallback);

}  // namespace crosskv_cuda_emulation
