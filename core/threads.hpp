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

// OpenBLAS on one thread for a scope (restored after), where the caller runs independent BLAS calls on OpenMP
// threads: two thread pools spinning on the same cores cost more than either gains.
class SingleThreadedBlas {
 public:
  SingleThreadedBlas();
  ~SingleThreadedBlas();
  SingleThreadedBlas(const SingleThreadedBlas&) = delete;
  SingleThreadedBlas& operator=(const SingleThreadedBlas&) = delete;

 private:
  int saved_ = 0;
};

}  // namespace crosskv
