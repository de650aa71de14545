// The distributed logic in one process: ranks as threads over the in-process communicator (core/thread_comm), with
// data whose expected result every rank can compute (as nccl-tests does). The mpiexec tests (tests/cli/mpi_*.sh) run
// the same code over MPI.
#include <cstring>
#include <fstream>
#include <iterator>
#include <mutex>

#include <omp.h>

#include "core/thread_comm.hpp"
#include "helpers.hpp"
#include "reference_mapper.hpp"
#include "artifact/mapper.hpp"
#include "fit/checkpoint.hpp"
#include "fit/grid.hpp"

using namespace crosskv;
using namespace crosskv::test;

extern "C" int openblas_get_num_threads();
extern "C" void openblas_set_num_threads(int);

namespace {

float value(int rank, size_t i) { return static_cast<float>((i % 97) * 0.37 + rank * 1.13) / (1.0f + rank); }

}  // namespace

// Ranks as threads share the process's cores: OpenMP's threads divided among them, OpenBLAS on one thread while they
// run (ranks calling one multi-threaded OpenBLAS at once queue on its lock), and as it was after.
TEST(ThreadComm, RanksShareTheProcesssCores) {
  const int omp_before = omp_get_max_threads();
  const int blas_before = openblas_get_num_threads();
  openblas_set_num_threads(2);
  for (int P : {1, 2, 3}) {
    SCOPED_TRACE(P);
    std::vector<int> omp(P), blas(P);
    run_ranks(P, [&](Comm& comm) {
      omp[comm.rank()] = omp_get_max_threads();
      blas[comm.rank()] = openblas_get_num_threads();
    });
    for (int r = 0; r < P; ++r) {
      EXPECT_EQ(omp[r], std::max(1, omp_before / P)) << "rank " << r;
      EXPECT_EQ(blas[r], P > 1 ? 1 : 2) << "rank " << r;
    }
    EXPECT_EQ(openblas_get_num_threads(), 2) << "restored after the ranks";
    EXPECT_EQ(omp_get_max_threads(), omp_before) << "the caller's own count is its own";
  }
  openblas_set_num_threads(blas_before);
}

// Sums in rank order on every rank, whatever the transport: the same bits as adding the ranks' values in order.
TEST(ThreadComm, FixedOrderSumsGiveEveryRankTheSameBits) {
  for (int P : {1, 2, 3, 5}) {
    SCOPED_TRACE(P);
    const size_t n = 1009;
    std::vector<float> expected(n, 0.0f);
    for (size_t i = 0; i < n; ++i)
      for (int r = 0; r < P; ++r) expected[i] = r == 0 ? value(0, i) : expected[i] + value(r, i);
    run_ranks(P, [&](Comm& comm) {
      std::vector<float> mine(n);
      for (size_t i = 0; i < n; ++i) mine[i] = value(comm.rank(), i);
      std::vector<float> chunk;
      comm.reduce_scatter_sum(mine.data(), n, chunk);
      ASSERT_EQ(chunk.size(), share_size(n, P, comm.rank()));
      std::vector<float> all(n);
      comm.allgather(chunk, all.data(), n);
      EXPECT_EQ(0, std::memcmp(all.data(), expected.data(), n * sizeof(float))) << "rank " << comm.rank();
      std::vector<double> d(n);
      for (size_t i = 0; i < n; ++i) d[i] = comm.rank() + 0.5 * i;
      comm.allreduce_sum(d.data(), n);
      for (size_t i = 0; i < n; ++i) ASSERT_EQ(d[i], P * (P - 1) / 2.0 + P * 0.5 * i);
    });
  }
}

TEST(ThreadComm, BroadcastVotesAndSplitsFollowTheMpiContract) {
  run_ranks(4, [](Comm& comm) {
    int token = comm.rank() == 2 ? 42 : -1;
    comm.broadcast(&token, sizeof token, 2);
    EXPECT_EQ(token, 42);
    EXPECT_TRUE(comm.all_ok(true));
    EXPECT_FALSE(comm.all_ok(comm.rank() != 3));
    // Colors by parity, ordered by a key that reverses the ranks: {3, 1} and {2, 0}.
    auto sub = comm.split(comm.rank() % 2, -comm.rank());
    EXPECT_EQ(sub->size(), 2);
    EXPECT_EQ(sub->rank(), comm.rank() >= 2 ? 0 : 1);
    double x = comm.rank();
    sub->allreduce_sum(&x, 1);
    EXPECT_EQ(x, comm.rank() % 2 == 0 ? 2.0 : 4.0);
    auto again = comm.split(0, comm.rank());  // a second split of the same comm starts afresh
    EXPECT_EQ(again->size(), 4);
    EXPECT_EQ(again->rank(), comm.rank());
  });
}

TEST(ThreadComm, ARankThatNeverComesIsATimeoutNotAHang) {
  expect_error<SystemError>(
      [] {
        run_ranks(2, [](Comm& comm) {
          if (comm.rank() == 0) comm.barrier();
        }, 0.5);
      },
      {"thread comm: rank 0 waited", "of 2"});
}

// A mistake some ranks find is agreed on: every rank throws AgreedError, the lowest failing rank reports it.
TEST(ThreadComm, UserErrorsAreAgreedOnAndReportedOnce) {
  std::mutex m;
  std::vector<std::pair<int, bool>> seen;
  run_ranks(3, [&](Comm& comm) {
    try {
      agreed(comm, [&] {
        if (comm.rank() > 0) throw SolveError("rank " + std::to_string(comm.rank()) + " cannot solve");
      });
      ADD_FAILURE() << "rank " << comm.rank() << " did not throw";
    } catch (const AgreedError& e) {
      EXPECT_EQ(e.exit_code, 3);
      if (e.report) {
        EXPECT_STREQ(e.what(), "rank 1 cannot solve");
      }
      std::lock_guard<std::mutex> lk(m);
      seen.emplace_back(comm.rank(), e.report);
    }
    EXPECT_EQ(agreed(comm, [&] { return comm.rank() * 2; }), comm.rank() * 2) << "no error: each rank's value";
  });
  std::sort(seen.begin(), seen.end());
  EXPECT_EQ(seen, (std::vector<std::pair<int, bool>>{{0, false}, {1, true}, {2, false}}));
}
