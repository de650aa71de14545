#include "runtime/mpi.hpp"

#include <mpi.h>

#include <climits>
#include <cstdlib>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace crosskv {

namespace {

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

MPI_Datatype mpi_type(size_t bytes) {
  CROSSKV_ASSERT(bytes == 4 || bytes == 8, "values of 4 or 8 bytes");
  return bytes == 4 ? MPI_FLOAT : MPI_DOUBLE;
}

class MpiComm final : public FixedOrderComm {
 public:
  explicit MpiComm(MPI_Comm comm = MPI_COMM_WORLD, bool owned = false) : comm_(comm), owned_(owned) {
    check_mpi(MPI_Comm_rank(comm_, &rank_), "MPI_Comm_rank", 0);
    check_mpi(MPI_Comm_size(comm_, &size_), "MPI_Comm_size", 0);
  }
  ~MpiComm() override {
    if (owned_) MPI_Comm_free(&comm_);
  }
  MpiComm(const MpiComm&) = delete;
  MpiComm& operator=(const MpiComm&) = delete;
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "mpi"; }
  std::unique_ptr<Comm> split(int color, int key) override {
    MPI_Comm sub;
    check_mpi(MPI_Comm_split(comm_, color, key, &sub), "MPI_Comm_split", static_cast<size_t>(color));
    MPI_Comm_set_errhandler(sub, MPI_ERRORS_RETURN);
    return std::make_unique<MpiComm>(sub, true);
  }
  void broadcast(void* d, size_t bytes, int root) override {
    auto* p = static_cast<char*>(d);
    for (size_t off = 0; off < bytes; off += kChunk) {
      int c = static_cast<int>(std::min(kChunk, bytes - off));
      check_mpi(MPI_Bcast(p + off, c, MPI_BYTE, root, comm_), "MPI_Bcast", bytes);
    }
  }
  void barrier() override { check_mpi(MPI_Barrier(comm_), "MPI_Barrier", 0); }
  bool all_ok(bool ok) override {
    int in = ok ? 1 : 0, out = 0;
    check_mpi(MPI_Allreduce(&in, &out, 1, MPI_INT, MPI_LAND, comm_), "MPI_Allreduce(LAND)", 1);
    return out != 0;
  }
  void alltoallv(const void* send, const int* send_counts, const int* send_displs, void* recv,
                 const int* recv_counts, const int* recv_displs, size_t bytes) override {
    const MPI_Datatype t = mpi_type(bytes);
    check_mpi(MPI_Alltoallv(send, send_counts, send_displs, t, recv, recv_counts, recv_displs, t, comm_),
              "MPI_Alltoallv", static_cast<size_t>(send_counts[0]));
  }
  void allgatherv(const void* mine, int count, void* out, const int* counts, const int* displs,
                  size_t bytes) override {
    const MPI_Datatype t = mpi_type(bytes);
    check_mpi(MPI_Allgatherv(mine, count, t, out, counts, displs, t, comm_), "MPI_Allgatherv",
              static_cast<size_t>(count));
  }

 private:
  static constexpr size_t kChunk = size_t{1} << 30;  // bytes per MPI_Bcast
  MPI_Comm comm_;
  bool owned_;
  int rank_ = 0, size_ = 1;
};

}  // namespace

std::unique_ptr<Comm> make_mpi_comm() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) return make_single_comm();  // not started by a launcher (MpiSession)
  return std::make_unique<MpiComm>();
}

namespace {
// This rank's index among the job's ranks on its node, and their number.
// Collective over MPI_COMM_WORLD the first time (every rank asks first at the same point, the program's start);
// later calls, by any subset of the ranks, read the answer (a rank-0-only call once deadlocked crosskv-fit).
std::pair<int, int> node_rank_and_size() {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) return {0, 1};
  static std::mutex m;
  static std::optional<std::pair<int, int>> known;
  std::lock_guard<std::mutex> lock(m);
  if (known) return *known;
  MPI_Comm node;
  check_mpi(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, 0, MPI_INFO_NULL, &node),
            "MPI_Comm_split_type", 0);
  int r = 0, n = 1;
  check_mpi(MPI_Comm_rank(node, &r), "MPI_Comm_rank (node)", 0);
  check_mpi(MPI_Comm_size(node, &n), "MPI_Comm_size (node)", 0);
  MPI_Comm_free(&node);
  known = std::make_pair(r, n);
  return *known;
}
}  // namespace

int mpi_local_rank() { return node_rank_and_size().first; }
int mpi_local_size() { return node_rank_and_size().second; }

bool started_by_mpi_launcher() {
  if (const char* force = std::getenv("CROSSKV_MPI")) return std::string(force) != "0";
  // mpirun/mpiexec (OpenMPI, MPICH's Hydra, Intel MPI) and srun's PMI/PMIx plugins name the rank in the environment.
  for (const char* v : {"OMPI_COMM_WORLD_SIZE", "PMIX_RANK", "PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID"})
    if (std::getenv(v)) return true;
  return false;
}

MpiSession::MpiSession(int* argc, char*** argv) {
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited && !started_by_mpi_launcher()) return;  // one process: no MPI_Init (0.4 s of a singleton's start)
  if (!inited) check_mpi(MPI_Init(argc, argv), "MPI_Init", 0);
  MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
}

MpiSession::~MpiSession() {
  int inited = 0, finalized = 0;
  MPI_Initialized(&inited);
  MPI_Finalized(&finalized);
  if (inited && !finalized) MPI_Finalize();
}

void mpi_abort(int code) {
  MPI_Abort(MPI_COMM_WORLD, code);
  std::_Exit(code);  // MPI_Abort does not return; should it, the rank still ends
}

}  // namespace crosskv
