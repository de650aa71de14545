#pragma once
// An in-process communicator: P ranks as P threads of one process, with the same fixed-order collectives as MPI
// (FixedOrderComm), so that the distributed logic (grids, reductions, Gram exchange, checkpoint votes, whole fits) is
// unit-tested without mpiexec, as xgboost tests its collectives in memory.
#include <functional>
#include <memory>
#include <vector>

#include "core/comm.hpp"

namespace crosskv {

// P communicators of one group: comms[r] is rank r's, to be used by one thread each. A rank that waits longer than
// `timeout_s` at a collective (another rank failed or never came) throws SystemError instead of hanging.
std::vector<std::unique_ptr<Comm>> make_thread_comms(int ranks, double timeout_s = 120.0);

// Runs body(comm) for every rank on its own thread and joins them; rethrows the first rank's exception (by rank).
// The ranks share the process's cores as MPI ranks share a node's (configure_threads): each rank's OpenMP threads
// are the process's divided among the ranks, and OpenBLAS runs on one thread meanwhile (ranks calling into one
// multi-threaded OpenBLAS at once queue on its lock: 5x the time of one thread each).
void run_ranks(int ranks, const std::function<void(Comm&)>& body, double timeout_s = 120.0);

}  // namespace crosskv
