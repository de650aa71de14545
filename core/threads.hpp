#pragma once
// Threads per rank for BLAS and OpenMP. Several ranks on one node each starting one thread per core oversubscribe
// the node (OpenBLAS and libgomp both default to every core).

namespace crosskv {

struct ThreadChoice {
  int threads = 1;
  int cores = 1;         // cores this process may run on (its affinity mask)
  bool from_env = false;  // OPENBLAS_NUM_THREADS or OMP_NUM_THREADS was set: left as the user chose
};

// Unless OPENBLAS_NUM_THREADS or OMP_NUM_THREADS is set: when this process may run on every core of the node, the
// cores divided among the node's `local_ranks` ranks; when the launcher bound it to some cores, those. Sets both
// OpenBLAS's and OpenMP's thread counts.
ThreadChoice configure_threads(int local_ranks);

}  // namespace crosskv
