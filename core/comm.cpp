#include "core/comm.hpp"

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <vector>

#include "core/error.hpp"

namespace crosskv {

std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

namespace {

class SingleComm final : public Comm {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "single"; }
  void allreduce_sum(float*, size_t) override {}
  void allreduce_sum(double*, size_t) override {}
  void broadcast(void*, size_t, int) override {}
  void barrier() override {}
  bool all_ok(bool ok) override { return ok; }
};

void check_mpi(int rc, const char* call, size_t count) {
  if (rc == MPI_SUCCESS) return;
  char msg[MPI_MAX_ERROR_STRING];
  int len = 0;
  MPI_Error_string(rc, msg, &len);
  int rank = -1;
  MPI_Comm_rank(MPI_COMM_WORLD, &rank);
  throw SystemError(std::string(call) + " failed on host " + host_name() + " rank " + std::to_string(rank) +
                    " (count " + std::to_string(count) + "): " + std::string(msg, len));
}

class MpiComm final : public Comm {
 public:
  MpiComm() {
    check_mpi(MPI_Comm_rank(MPI_COMM_WORLD, &rank_), "MPI_Comm_rank", 0);
    check_mpi(MPI_Comm_size(MPI_COMM_WORLD, &size_), "MPI_Comm_size", 0);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  void allreduce_sum(float* d, size_t n) override { reduce(d, n, MPI_FLOAT); }
  void allreduce_sum(double* d, size_t n) override { reduce(d, n, MPI_DOUBLE); }
  void broadcast(void* d, size_t bytes, int root) override {
    auto* p = static_cast<char*>(d);
    for (size_t off = 0; off < bytes; off += kChunk) {
      int c = static_cast<int>(std::min(kChunk, bytes - off));
      check_mpi(MPI_Bcast(p + off, c, MPI_BYTE, root, MPI_COMM_WORLD), "MPI_Bcast", bytes);
    }
  }
  void barrier() override { check_mpi(MPI_Barrier(MPI_COMM_WORLD), "MPI_Barrier", 0); }
  bool all_ok(bool ok) override {
    int in = ok ? 1 : 0, out = 0;
    check_mpi(MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_LAND, MPI_COMM_WORLD), "MPI_Allreduce(LAND)", 1);
    return out != 0;
  }

 private:
  static constexpr size_t kChunk = size_t{1} << 30;  // bytes per MPI_Bcast
  // Sums in a fixed order, independent of MPI's reduction algorithm, so that the same job gives byte-identical
  // results: each rank owns a contiguous chunk, receives every rank's copy of it (MPI_Alltoallv), adds them in
  // rank order 0..P-1, and the chunks are gathered back (MPI_Allgatherv). Large buffers go in segments.
  template <class T>
  void reduce(T* d, size_t n, MPI_Datatype type) {
    if (size_ == 1) return;
    const size_t P = static_cast<size_t>(size_);
    const size_t segment = std::min(n, P * (size_t{1} << 24));
    std::vector<int> counts(P), displs(P), rcounts(P), rdispls(P);
    std::vector<T> mine, sum;
    for (size_t off = 0; off < n; off += segment) {
      const size_t len = std::min(segment, n - off);
      for (size_t r = 0, at = 0; r < P; ++r) {
        counts[r] = static_cast<int>(len / P + (r < len % P ? 1 : 0));
        displs[r] = static_cast<int>(at);
        at += counts[r];
      }
      const int c = counts[rank_];
      for (size_t r = 0; r < P; ++r) {
        rcounts[r] = c;
        rdispls[r] = static_cast<int>(r) * c;
      }
      mine.resize(static_cast<size_t>(c) * P);
      check_mpi(MPI_Alltoallv(d + off, counts.data(), displs.data(), type, mine.data(), rcounts.data(), rdispls.data(),
                              type, MPI_COMM_WORLD),
                "MPI_Alltoallv", len);
      sum.assign(mine.begin(), mine.begin() + c);
      for (size_t r = 1; r < P; ++r)
        for (int i = 0; i < c; ++i) sum[i] += mine[r * c + i];
      check_mpi(MPI_Allgatherv(sum.data(), c, type, d + off, counts.data(), displs.data(), type, MPI_COMM_WORLD),
                "MPI_Allgatherv", len);
    }
  }
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }
std::unique_ptr<Comm> make_mpi_comm() { return std::make_unique<MpiComm>(); }

MpiSession::MpiSession(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) check_mpi(MPI_Init(argc, argv), "MPI_Init", 0);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiSession::~MpiSession() {
  int finalized = 0;
  MPI_Finalized(&finalized);
  if (!finalized) MPI_Finalize();
}

}  // namespace crosskv
