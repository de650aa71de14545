#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "fit/config.hpp"
#include "core/threads.hpp"
#include "helpers.hpp"

using namespace crosskv;
using crosskv::test::expect_error;

// Threads per rank: the user's OPENBLAS_NUM_THREADS / OMP_NUM_THREADS win; otherwise an unbound process shares the
// node's cores with the node's other ranks.
TEST(Threads, RanksOnANodeShareItsCores) {
  const char* keep_blas = std::getenv("OPENBLAS_NUM_THREADS");
  const char* keep_omp = std::getenv("OMP_NUM_THREADS");
  const std::string blas = keep_blas ? keep_blas : "", omp = keep_omp ? keep_omp : "";
  unsetenv("OPENBLAS_NUM_THREADS");
  unsetenv("OMP_NUM_THREADS");
  const ThreadChoice one = configure_threads(1);
  EXPECT_FALSE(one.from_env);
  EXPECT_GE(one.cores, 1);
  const long online = sysconf(_SC_NPROCESSORS_ONLN);
  if (one.cores >= online) {  // unbound (as under ctest): cores / ranks, at least 1
    EXPECT_EQ(one.threads, one.cores);
    EXPECT_EQ(configure_threads(2).threads, std::max(1, one.cores / 2));
    EXPECT_EQ(omp_get_max_threads(), std::max(1, one.cores / 2));
    EXPECT_EQ(configure_threads(one.cores * 4).threads, 1);
  } else {  // bound by the launcher: its cores, whatever the rank count
    EXPECT_EQ(configure_threads(8).threads, one.cores);
  }
  setenv("OMP_NUM_THREADS", "3", 1);
  EXPECT_TRUE(configure_threads(2).from_env);
  keep_omp ? setenv("OMP_NUM_THREADS", omp.c_str(), 1) : unsetenv("OMP_NUM_THREADS");
  if (keep_blas) setenv("OPENBLAS_NUM_THREADS", blas.c_str(), 1);
  configure_threads(1);
}
