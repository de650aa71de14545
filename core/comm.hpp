#pragma once
// Collectives: a small interface; the single-process form is a no-op. MPI now, NCCL with the CUDA backend.
#include <cstddef>
#include <memory>
#include <string>

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
