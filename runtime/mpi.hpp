#pragma once
// MPI for the programs: the session, MPI_COMM_WORLD as a Comm, and the ranks of a node.
#include <memory>

#include "core/comm.hpp"

namespace crosskv {

// MPI_COMM_WORLD once MpiSession initialised MPI; else (a program run on its own) the single-process comm.
std::unique_ptr<Comm> make_mpi_comm();
// Ends every rank of the job with `code` (MPI_Abort on MPI_COMM_WORLD): for an error only some ranks met.
[[noreturn]] void mpi_abort(int code);

// Whether an MPI launcher started this process (its environment names a rank); CROSSKV_MPI=1 or 0 decides instead.
bool started_by_mpi_launcher();

// MPI_Init and MPI_Finalize for a program, when a launcher started it: a program run on its own makes no MPI calls
// (make_mpi_comm then gives the single-process comm).
class MpiSession {
 public:
  MpiSession(int* argc, char*** argv);
  ~MpiSession();
  MpiSession(const MpiSession&) = delete;
  MpiSession& operator=(const MpiSession&) = delete;
};

// This rank's index among the ranks on its node (MPI_Comm_split_type SHARED); 0 without MPI.
int mpi_local_rank();
int mpi_local_size();  // ranks of this job on this node (1 without MPI)


}  // namespace crosskv
