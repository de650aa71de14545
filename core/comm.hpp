#pragma once
// Collectives: a small interface; the single-process form is a no-op. MPI (runtime/mpi), threads (thread_comm),
// NCCL with the CUDA backend.
#include <cstddef>
#include <exception>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <type_traits>
#include <vector>

#include "core/error.hpp"

namespace crosskv {

class Comm {
 public:
  virtual ~Comm() = default;
  virtual int rank() const = 0;
  virtual int size() const = 0;
  virtual std::string name() const = 0;
  virtual void allreduce_sum(float* data, size_t n) = 0;
  virtual void allreduce_sum(double* data, size_t n) = 0;
  virtual void broadcast(void* data, size_t bytes, int root) = 0;
  virtual void barrier() = 0;
  // Logical AND of `ok` over all ranks (for "every rank succeeded" decisions).
  virtual bool all_ok(bool ok) = 0;
  // Fixed-order reduce-scatter: `chunk` receives this rank's share of the element-wise sum over ranks (ranks added
  // in order 0..P-1). allgather() puts the shares back together. Their layout depends only on n and P.
  virtual void reduce_scatter_sum(const float* in, size_t n, std::vector<float>& chunk) = 0;
  virtual void reduce_scatter_sum(const double* in, size_t n, std::vector<double>& chunk) = 0;
  // The same reduce-scatter of n values that the caller writes segment by segment into the comm's own buffer, never
  // all n at once: fill(off, len, dst, dst_on_device) writes values [off, off + len) to dst, device memory when the
  // comm exchanges device buffers (NCCL; the values are then read in place from a device backend's sums).
  template <class T>
  using Fill = std::function<void(size_t off, size_t len, T* dst, bool dst_on_device)>;
  virtual void reduce_scatter_filled(size_t n, const Fill<float>& fill, std::vector<float>& chunk);
  virtual void reduce_scatter_filled(size_t n, const Fill<double>& fill, std::vector<double>& chunk);
  virtual void allgather(const std::vector<float>& chunk, float* out, size_t n) = 0;
  // The same gathered a segment at a time: drain(off, len, values) receives values [off, off + len) of the result
  // (host memory, valid during the call), so that nobody holds a copy of all n.
  template <class T>
  using Drain = std::function<void(size_t off, size_t len, const T* values)>;
  virtual void allgather_drained(const std::vector<float>& chunk, size_t n, const Drain<float>& drain);
  virtual void allgather(const std::vector<double>& chunk, double* out, size_t n) = 0;
  // A communicator of the ranks that pass the same `color`, ordered by `key` (collective over this one).
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;
};

// The collective algorithms, written once: fixed-order sums made of all-to-all and all-gather exchanges, so the same
// job gives the same bits whatever the transport. A transport derives from this class and implements only those two
// exchanges, broadcast, barrier, all_ok and split (xgboost keeps its Coll apart from its Comm as two objects; here
// they are one hierarchy, and NcclComm overrides the collectives themselves).
class FixedOrderComm : public Comm {
 public:
  void allreduce_sum(float* data, size_t n) override;
  void allreduce_sum(double* data, size_t n) override;
  // Segment by segment (share_layout): rank r receives every rank's copy of its part and adds them in rank order.
  void reduce_scatter_sum(const float* in, size_t n, std::vector<float>& chunk) override;
  void reduce_scatter_sum(const double* in, size_t n, std::vector<double>& chunk) override;
  void allgather(const std::vector<float>& chunk, float* out, size_t n) override;
  void allgather(const std::vector<double>& chunk, double* out, size_t n) override;

  // Values of `bytes` bytes each (4: float, 8: double). alltoallv: to rank q go send_counts[q] values at
  // send_displs[q] of `send`; from rank q come recv_counts[q] values, placed at recv_displs[q] of `recv`.
  virtual void alltoallv(const void* send, const int* send_counts, const int* send_displs, void* recv,
                         const int* recv_counts, const int* recv_displs, size_t bytes) = 0;
  // Rank q's `counts[q]` values land at displs[q] of `out`, on every rank.
  virtual void allgatherv(const void* mine, int count, void* out, const int* counts, const int* displs,
                          size_t bytes) = 0;

 private:
  template <class T>
  void scatter(const T* in, size_t n, std::vector<T>& chunk);
  template <class T>
  void gather(const std::vector<T>& chunk, T* out, size_t n);
};

// The layout of reduce_scatter_sum/allgather shares, the same for every Comm (so checkpointed shares do not depend
// on the collectives): segments of at most P * 2^24 elements; in each, rank r owns counts[r] elements at displs[r].
struct ShareSegment {
  size_t off, len;
  std::vector<int> counts, displs;
};
std::vector<ShareSegment> share_layout(size_t n, int ranks);
// The number of values rank `rank` owns in that layout (a share's size, to allocate it once).
size_t share_size(size_t n, int ranks, int rank);

// Every rank's string, on every rank (lengths summed over ranks, then one broadcast per rank).
std::vector<std::string> gather_strings(Comm& comm, const std::string& mine);
// `s` of rank `root` on every rank (its length, then its bytes).
void broadcast_string(Comm& comm, std::string& s, int root);

// Every rank passes its user error (or none) and learns whether any rank had one: if so, every rank throws an
// AgreedError with that error's exit code, which the lowest such rank alone reports (its message); else returns.
// A single-process comm rethrows the error itself.
void agree_on_user_error(Comm& comm, const std::exception_ptr& error);

// Runs `check` (with no collectives inside) on every rank and agrees on its user errors (agree_on_user_error), so
// that a mistake every rank finds, in a config or an input file, is reported once, not by every rank.
template <class Check>
auto agreed(Comm& comm, Check&& check) {
  using R = decltype(check());
  std::exception_ptr error;
  if constexpr (std::is_void_v<R>) {
    try {
      check();
    } catch (const UserError&) {
      error = std::current_exception();
    }
    agree_on_user_error(comm, error);
  } else {
    std::optional<R> result;
    try {
      result.emplace(check());
    } catch (const UserError&) {
      error = std::current_exception();
    }
    agree_on_user_error(comm, error);
    return std::move(*result);
  }
}

std::unique_ptr<Comm> make_single_comm();
std::string host_name();
}  // namespace crosskv
