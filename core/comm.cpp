#include "core/comm.hpp"

#include <cstdlib>

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

}  // namespace

std::unique_ptr<Comm> make_single_comm() { return std::make_unique<SingleComm>(); }
}  // namespace crosskv
