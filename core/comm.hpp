#pragma once
// Collectives: a small interface; the single-process form is a no-op. MPI now, NCCL with the CUDA backend.
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

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
  virtual void allgather(const std::vector<float>& chunk, float* out, size_t n) = 0;
  virtual void allgather(const std::vector<double>& chunk, double* out, size_t n) = 0;
  // A communicator of the ranks that pass the same `color`, ordered by `key` (collective over this one).
  virtual std::unique_ptr<Comm> split(int color, int key) = 0;
};

std::unique_ptr<Comm> make_single_comm();
// Requires MPI to be initialised (see MpiSession).
std::unique_ptr<Comm> make_mpi_comm();

// RAII MPI_Init/MPI_Finalize for the programs' main().
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

std::string host_name();

}  // namespace crosskv
