#include "core/threads.hpp"

#include <omp.h>
#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

extern "C" void openblas_set_num_threads(int) __attribute__((weak));
extern "C" int openblas_get_num_threads() __attribute__((weak));

namespace crosskv {

ThreadChoice configure_threads(int local_ranks) {
  ThreadChoice c;
  cpu_set_t set;
  CPU_ZERO(&set);
  const long online = std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
  c.cores = sched_getaffinity(0, sizeof set, &set) == 0 ? std::max(1, CPU_COUNT(&set)) : static_cast<int>(online);
  if (std::getenv("OPENBLAS_NUM_THREADS") || std::getenv("OMP_NUM_THREADS")) {
    c.from_env = true;
    c.threads = omp_get_max_threads();
    return c;
  }
  const bool unbound = c.cores >= online;
  c.threads = unbound ? std::max(1, c.cores / std::max(1, local_ranks)) : c.cores;
  omp_set_num_threads(c.threads);
  if (openblas_set_num_threads) openblas_set_num_threads(c.threads);
  return c;
}

SingleThreadedBlas::SingleThreadedBlas() {
  if (openblas_get_num_threads && openblas_set_num_threads) {
    saved_ = openblas_get_num_threads();
    openblas_set_num_threads(1);
  }
}

SingleThreadedBlas::~SingleThreadedBlas() {
  if (saved_ > 0) openblas_set_num_threads(saved_);
}

}  // namespace crosskv
