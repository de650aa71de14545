#include "core/comm.hpp"

#include <cstdlib>

#include <mpi.h>
#include <unistd.h>

#include <algorithm>
#include <climits>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "core/error.hpp"

namespace crosskv {

std::string host_name() {
  char buf[256] = {0};
  gethostname(buf, sizeof buf - 1);
  return buf;
}

std::vector<ShareSegment> share_layout(size_t n, int ranks) {
  const size_t P = static_cast<size_t>(ranks);
  const size_t seg = std::max<size_t>(1, std::min(n, P * (size_t{1} << 24)));
  std::vector<ShareSegment> out;
  for (size_t off = 0; off < n; off += seg) {
    ShareSegment s{off, std::min(seg, n - off), std::vector<int>(P), std::vector<int>(P)};
    for (size_t r = 0, at = 0; r < P; ++r) {
      s.counts[r] = static_cast<int>(s.len / P + (r < s.len % P ? 1 : 0));
      s.displs[r] = static_cast<int>(at);
      at += s.counts[r];
    }
    out.push_back(std::move(s));
  }
  return out;
}

size_t share_size(size_t n, int ranks, int rank) {
  size_t total = 0;
  for (const ShareSegment& s : share_layout(n, ranks)) total += static_cast<size_t>(s.counts[rank]);
  return total;
}

namespace {
// Segment by segment through a host buffer: share_layout(len, P) of one segment is that segment's own layout, so the
// result is the one of reduce_scatter_sum over all n values.
template <class T>
void filled_through_host(Comm& comm, size_t n, const Comm::Fill<T>& fill, std::vector<T>& chunk) {
  chunk.clear();
  if (comm.size() == 1) {
    chunk.resize(n);
    if (n > 0) fill(0, n, chunk.data(), false);
    return;
  }
  chunk.reserve(share_size(n, comm.size(), comm.rank()));
  std::vector<T> seg, part;
  for (const ShareSegment& s : share_layout(n, comm.size())) {
    seg.resize(s.len);
    fill(s.off, s.len, seg.data(), false);
    comm.reduce_scatter_sum(seg.data(), s.len, part);
    chunk.insert(chunk.end(), part.begin(), part.end());
  }
}
}  // namespace

void broadcast_string(Comm& comm, std::string& s, int root) {
  uint64_t n = s.size();
  comm.broadcast(&n, sizeof n, root);
  s.resize(n);
  if (n > 0) comm.broadcast(s.data(), n, root);
}

std::vector<std::string> gather_strings(Comm& comm, const std::string& mine) {
  std::vector<double> len(comm.size(), 0.0);
  len[comm.rank()] = static_cast<double>(mine.size());
  comm.allreduce_sum(len.data(), len.size());
  std::vector<std::string> out(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    out[r] = r == comm.rank() ? mine : std::string(static_cast<size_t>(len[r]), '\0');
    comm.broadcast(out[r].data(), out[r].size(), r);
  }
  return out;
}

void agree_on_user_error(Comm& comm, const std::exception_ptr& error) {
  if (comm.size() == 1) {  // nothing to agree on: the error as it is
    if (error) std::rethrow_exception(error);
    return;
  }
  std::vector<double> codes(comm.size(), 0.0);
  std::string what;
  if (error) {
    try {
      std::rethrow_exception(error);
    } catch (const UserError& e) {
      codes[comm.rank()] = user_error_code(e);
      what = e.what();
    }
  }
  comm.allreduce_sum(codes.data(), codes.size());
  const auto first = std::find_if(codes.begin(), codes.end(), [](double c) { return c != 0.0; });
  if (first == codes.end()) return;
  const int reporter = static_cast<int>(first - codes.begin());
  throw AgreedError(what, static_cast<int>(*first), reporter == comm.rank());
}

void Comm::allgather_drained(const std::vector<float>& chunk, size_t n, const Drain<float>& drain) {
  // One segment's layout is that segment's own (as above): gather each into a buffer of its size.
  std::vector<float> mine, seg;
  size_t at = 0;
  for (const ShareSegment& s : share_layout(n, size())) {
    const auto c = static_cast<size_t>(s.counts[rank()]);
    CROSSKV_ASSERT(at + c <= chunk.size(), "allgather_drained: a share smaller than its layout");
    mine.assign(chunk.begin() + at, chunk.begin() + at + c);
    seg.resize(s.len);
    allgather(mine, seg.data(), s.len);
    drain(s.off, s.len, seg.data());
    at += c;
  }
}

void Comm::reduce_scatter_filled(size_t n, const Fill<float>& fill, std::vector<float>& chunk) {
  filled_through_host(*this, n, fill, chunk);
}
void Comm::reduce_scatter_filled(size_t n, const Fill<double>& fill, std::vector<double>& chunk) {
  filled_through_host(*this, n, fill, chunk);
}

// Sums in a fixed order, independent of the transport's reduction algorithm, so that the same job gives
// byte-identical results: buffers go in segments; in each, rank r owns a contiguous part, receives every rank's copy
// of it (alltoallv) and adds them in rank order 0..P-1. allgather (allgatherv) reverses the layout.
template <class T>
void FixedOrderComm::scatter(const T* in, size_t n, std::vector<T>& chunk) {
  const size_t P = static_cast<size_t>(size());
  const int me = rank();
  chunk.clear();
  chunk.reserve(share_size(n, size(), me));
  std::vector<int> rcounts(P), rdispls(P);
  std::vector<T> mine;
  for (const ShareSegment& s : share_layout(n, size())) {
    const int c = s.counts[me];
    for (size_t r = 0; r < P; ++r) {
      rcounts[r] = c;
      rdispls[r] = static_cast<int>(r) * c;
    }
    mine.resize(static_cast<size_t>(c) * P);
    alltoallv(in + s.off, s.counts.data(), s.displs.data(), mine.data(), rcounts.data(), rdispls.data(), sizeof(T));
    const size_t base = chunk.size();
    chunk.insert(chunk.end(), mine.begin(), mine.begin() + c);
    for (size_t r = 1; r < P; ++r)
      for (int i = 0; i < c; ++i) chunk[base + i] += mine[r * c + i];
  }
}

template <class T>
void FixedOrderComm::gather(const std::vector<T>& chunk, T* out, size_t n) {
  size_t at = 0;
  for (const ShareSegment& s : share_layout(n, size())) {
    const int c = s.counts[rank()];
    allgatherv(chunk.data() + at, c, out + s.off, s.counts.data(), s.displs.data(), sizeof(T));
    at += c;
  }
}

void FixedOrderComm::allreduce_sum(float* d, size_t n) {
  if (size() == 1) return;
  std::vector<float> chunk;
  scatter(d, n, chunk);
  gather(chunk, d, n);
}
void FixedOrderComm::allreduce_sum(double* d, size_t n) {
  if (size() == 1) return;
  std::vector<double> chunk;
  scatter(d, n, chunk);
  gather(chunk, d, n);
}
void FixedOrderComm::reduce_scatter_sum(const float* in, size_t n, std::vector<float>& c) { scatter(in, n, c); }
void FixedOrderComm::reduce_scatter_sum(const double* in, size_t n, std::vector<double>& c) { scatter(in, n, c); }
void FixedOrderComm::allgather(const std::vector<float>& c, float* out, size_t n) { gather(c, out, n); }
void FixedOrderComm::allgather(const std::vector<double>& c, double* out, size_t n) { gather(c, out, n); }

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
  void reduce_scatter_sum(const float* in, size_t n, std::vector<float>& c) override { c.assign(in, in + n); }
  void reduce_scatter_sum(const double* in, size_t n, std::vector<double>& c) override { c.assign(in, in + n); }
  void allgather(const std::vector<float>& c, float* out, size_t) override { std::copy(c.begin(), c.end(), out); }
  void allgather(const std::vector<double>& c, double* out, size_t) override { std::copy(c.begin(), c.end(), out); }
  std::unique_ptr<Comm> split(int, int) override { return std::make_unique<SingleComm>(); }
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

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }
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

}  // namespace crosskv
