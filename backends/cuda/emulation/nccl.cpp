// The emulated NCCL: ranks on this machine (threads or processes) connect by the unique id's token over abstract
// Unix sockets, one connection per pair, and exchange in stream order. Each message carries its size, so a send and
// the receive it meets must agree; a group's transfers progress together under poll(), as NCCL's proxies do.
#include "nccl.h"

#include <poll.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <map>
#include <random>
#include <set>
#include <thread>
#include <vector>

#include "backends/cuda/emulation/device.hpp"

struct ncclComm {
  uint64_t id = 0;
  bool live = true;
  int nranks = 0, rank = 0, device = 0;
  std::vector<int> fds;  // by peer; -1 for this rank
  std::string error;     // the first failure of its transfers (sticky, as NCCL's async error)
};

namespace crosskv_cuda_emulation {
namespace {

constexpr char kIdPrefix[] = "crosskv-emulated-nccl:";

std::mutex comm_mutex;
std::set<ncclComm*> comms;
uint64_t next_comm = 1;

double timeout_seconds() {
  const char* v = std::getenv("CROSSKV_CUDA_EMULATION_NCCL_TIMEOUT");
  const double t = v ? std::atof(v) : 0;
  return t > 0 ? t : 300;
}

size_t type_bytes(ncclDataType_t t) {
  switch (t) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
  }
  return 0;
}

std::string socket_name(const std::string& token, int rank) {
  return "crosskv-nccl-" + token + "-" + std::to_string(rank);
}
sockaddr_un address(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  a.sun_path[0] = '\0';  // the abstract namespace: nothing to clean up
  std::memcpy(a.sun_path + 1, name.data(), std::min(name.size(), sizeof a.sun_path - 2));
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + 1 + std::min(name.size(), sizeof a.sun_path - 2));
  return a;
}

bool write_all(int fd, const void* p, size_t n) {
  const char* c = static_cast<const char*>(p);
  while (n > 0) {
    const ssize_t w = ::send(fd, c, n, MSG_NOSIGNAL);
    if (w <= 0) return false;
    c += w, n -= static_cast<size_t>(w);
  }
  return true;
}
bool read_all(int fd, void* p, size_t n) {
  char* c = static_cast<char*>(p);
  while (n > 0) {
    const ssize_t r = ::recv(fd, c, n, 0);
    if (r <= 0) return false;
    c += r, n -= static_cast<size_t>(r);
  }
  return true;
}

std::string comm_error(ncclComm_t c) {
  std::lock_guard<std::mutex> lock(comm_mutex);
  if (!comms.count(c)) return "communicator was never made by ncclCommInitRank";
  if (!c->live) return "communicator #" + std::to_string(c->id) + " was destroyed";
  return "";
}

struct Transfer {
  bool send;
  int peer;
  char* buf;
  size_t bytes;
};
struct Pending {
  ncclComm_t comm;
  cudaStream_t stream;
  Transfer t;
};
thread_local int group_depth = 0;
thread_local std::vector<Pending> pending;

// One group's transfers of one communicator, run by its stream: messages of [size | bytes], per peer in order.
std::string exchange(ncclComm* comm, const std::vector<Transfer>& ts) {
  const std::string who = "rank " + std::to_string(comm->rank) + " of " + std::to_string(comm->nranks);
  if (!comm->error.empty()) return comm->error;
  // This rank's own sends meet its own receives in order.
  std::vector<const Transfer*> self_sends, self_recvs;
  struct Peer {
    std::vector<const Transfer*> sends, recvs;
    size_t si = 0, so = 0;  // send: transfer index, bytes of [header | payload] written
    size_t ri = 0, ro = 0;  // receive: transfer index, bytes read
    uint64_t out_header = 0, in_header = 0;
  };
  std::map<int, Peer> peers;
  for (const Transfer& t : ts) {
    if (t.peer == comm->rank)
      (t.send ? self_sends : self_recvs).push_back(&t);
    else
      (t.send ? peers[t.peer].sends : peers[t.peer].recvs).push_back(&t);
  }
  if (self_sends.size() != self_recvs.size())
    return "ncclGroupEnd: " + who + " sends itself " + std::to_string(self_sends.size()) + " message(s) and receives " +
           std::to_string(self_recvs.size());
  for (size_t i = 0; i < self_sends.size(); ++i) {
    if (self_sends[i]->bytes != self_recvs[i]->bytes)
      return "ncclGroupEnd: " + who + " sends itself " + std::to_string(self_sends[i]->bytes) +
             " bytes where its ncclRecv expects " + std::to_string(self_recvs[i]->bytes);
    std::memmove(self_recvs[i]->buf, self_sends[i]->buf, self_sends[i]->bytes);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds());
  for (;;) {
    std::vector<pollfd> fds;
    std::vector<int> ranks;
    for (auto& [r, p] : peers) {
      short ev = 0;
      if (p.si < p.sends.size()) ev |= POLLOUT;
      if (p.ri < p.recvs.size()) ev |= POLLIN;
      if (ev) fds.push_back({comm->fds[static_cast<size_t>(r)], ev, 0}), ranks.push_back(r);
    }
    if (fds.empty()) return "";
    if (std::chrono::steady_clock::now() > deadline)
      return who + ": no progress with rank " + std::to_string(ranks[0]) + " in " +
             std::to_string(static_cast<int>(timeout_seconds())) + " s (CROSSKV_CUDA_EMULATION_NCCL_TIMEOUT)";
    if (poll(fds.data(), fds.size(), 100) < 0) return who + ": poll failed: " + std::strerror(errno);
    for (size_t i = 0; i < fds.size(); ++i) {
      Peer& p = peers[ranks[i]];
      const std::string with = " (" + who + ", peer rank " + std::to_string(ranks[i]) + ")";
      if (fds[i].revents & (POLLIN | POLLHUP | POLLERR)) {
        if (p.ri < p.recvs.size()) {
          const Transfer& t = *p.recvs[p.ri];
          char* dst;
          size_t want;
          if (p.ro < 8) {
            dst = reinterpret_cast<char*>(&p.in_header) + p.ro, want = 8 - p.ro;
          } else {
            dst = t.buf + (p.ro - 8), want = t.bytes - (p.ro - 8);
          }
          const ssize_t n = want ? ::recv(fds[i].fd, dst, want, MSG_DONTWAIT) : 0;
          if (want && n == 0) return "the peer closed its connection mid-transfer" + with;
          if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
            return std::string("recv: ") + std::strerror(errno) + with;
          if (n > 0) p.ro += static_cast<size_t>(n);
          if (p.ro == 8 && p.in_header != t.bytes) {
            const std::string m = "ncclSend of " + std::to_string(p.in_header) + " bytes met an ncclRecv of " +
                                  std::to_string(t.bytes) + " bytes" + with;
            note_misuse(m);
            return m;
          }
          if (p.ro == 8 + t.bytes) ++p.ri, p.ro = 0;
        }
      }
      if ((fds[i].revents & POLLOUT) && p.si < p.sends.size()) {
        const Transfer& t = *p.sends[p.si];
        p.out_header = t.bytes;
        const char* src;
        size_t left;
        if (p.so < 8) {
          src = reinterpret_cast<const char*>(&p.out_header) + p.so, left = 8 - p.so;
        } else {
          src = t.buf + (p.so - 8), left = t.bytes - (p.so - 8);
        }
        const ssize_t n = left ? ::send(fds[i].fd, src, left, MSG_DONTWAIT | MSG_NOSIGNAL) : 0;
        if (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK)
          return std::string("send: ") + std::strerror(errno) + with;
        if (n > 0) p.so += static_cast<size_t>(n);
        if (p.so == 8 + t.bytes) ++p.si, p.so = 0;
      }
    }
  }
}

ncclResult_t flush_group() {
  std::vector<Pending> work;
  work.swap(pending);
  std::map<std::pair<ncclComm_t, cudaStream_t>, std::vector<Transfer>> by;
  std::vector<std::pair<ncclComm_t, cudaStream_t>> order;
  for (const Pending& p : work) {
    auto key = std::make_pair(p.comm, p.stream);
    if (!by.count(key)) order.push_back(key);
    by[key].push_back(p.t);
  }
  for (const auto& key : order) {
    ncclComm* comm = key.first;
    std::vector<Transfer> ts = std::move(by[key]);
    const std::string what =
        "NCCL group of " + std::to_string(ts.size()) + " transfer(s), rank " + std::to_string(comm->rank);
    Operands operands;
    for (const Transfer& t : ts) operands.emplace_back(t.buf, t.bytes);
    auto op = [comm, ts, what]() -> std::string {
      if (!comm_error(comm).empty()) {
        const std::string m = what + ": " + comm_error(comm);
        note_misuse(m);
        return m;
      }
      std::string e = exchange(comm, ts);
      if (!e.empty() && comm->error.empty()) comm->error = e;
      return e;
    };
    if (enqueue_on(key.second, what, std::move(operands), std::move(op)) != cudaSuccess)
      return misuse(ncclInvalidArgument, what + ": the stream was destroyed or never made");
  }
  return ncclSuccess;
}

ncclResult_t add(const char* call, const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                 cudaStream_t stream, bool send) {
  const std::string name =
      std::string(call) + "(" + std::to_string(count) + " elements, peer " + std::to_string(peer) + ")";
  const std::string ce = comm_error(comm);
  if (!ce.empty()) return misuse(ncclInvalidArgument, name + ": " + ce);
  if (type_bytes(type) == 0) return misuse(ncclInvalidArgument, name + ": not an ncclDataType_t");
  if (peer < 0 || peer >= comm->nranks)
    return misuse(ncclInvalidArgument, name + ": peer out of range (" + std::to_string(comm->nranks) + " ranks)");
  std::string why;
  if (!stream_of(stream, &why)) return misuse(ncclInvalidArgument, name + ": " + why);
  const size_t bytes = count * type_bytes(type);
  const std::string e = check_device(buf, bytes);
  if (!e.empty()) return misuse(ncclInvalidArgument, name + ": buffer: " + e);
  pending.push_back({comm, stream, {send, peer, const_cast<char*>(static_cast<const char*>(buf)), bytes}});
  return group_depth == 0 ? flush_group() : ncclSuccess;
}

}  // namespace
}  // namespace crosskv_cuda_emulation

using namespace crosskv_cuda_emulation;

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
  std::random_device rd;
  char token[64];
  std::snprintf(token, sizeof token, "%08x%08x%08x-%d", rd(), rd(), rd(), static_cast<int>(getpid()));
  std::memset(id->internal, 0, sizeof id->internal);
  std::snprintf(id->internal, sizeof id->internal, "%s%s", kIdPrefix, token);
  return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t* out, int nranks, ncclUniqueId id, int rank) {
  const std::string name = "ncclCommInitRank(" + std::to_string(nranks) + " ranks, rank " + std::to_string(rank) + ")";
  if (nranks < 1 || rank < 0 || rank >= nranks) return misuse(ncclInvalidArgument, name + ": rank out of range");
  id.internal[NCCL_UNIQUE_ID_BYTES - 1] = '\0';
  const std::string text(id.internal);
  if (text.rfind(kIdPrefix, 0) != 0) return misuse(ncclInvalidArgument, name + ": not an id from ncclGetUniqueId");
  const std::string token = text.substr(sizeof kIdPrefix - 1);
  auto* c = new ncclComm;
  c->nranks = nranks, c->rank = rank, c->device = current_device();
  c->fds.assign(static_cast<size_t>(nranks), -1);
  auto fail = [&](ncclResult_t r, const std::string& why) {
    for (int fd : c->fds)
      if (fd >= 0) close(fd);
    delete c;
    return failure(r, name + ": " + why);
  };
  if (nranks > 1) {
    const int listener = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    socklen_t len;
    sockaddr_un me = address(socket_name(token, rank), &len);
    if (listener < 0 || bind(listener, reinterpret_cast<sockaddr*>(&me), len) != 0 || listen(listener, nranks) != 0) {
      if (listener >= 0) close(listener);
      return fail(ncclSystemError, std::string("cannot listen: ") + std::strerror(errno));
    }
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(timeout_seconds());
    const int hello[2] = {rank, nranks};
    for (int p = 0; p < rank; ++p) {  // connect to every lower rank, retrying until it listens
      for (;;) {
        const int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
        sockaddr_un peer = address(socket_name(token, p), &len);
        if (connect(fd, reinterpret_cast<sockaddr*>(&peer), len) == 0) {
          c->fds[static_cast<size_t>(p)] = fd;
          break;
        }
        close(fd);
        if (std::chrono::steady_clock::now() > deadline) {
          close(listener);
          return fail(ncclSystemError, "rank " + std::to_string(p) + " never listened (timeout)");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
      }
      if (!write_all(c->fds[static_cast<size_t>(p)], hello, sizeof hello)) {
        close(listener);
        return fail(ncclSystemError, "lost rank " + std::to_string(p) + " while connecting");
      }
    }
    for (int n = rank + 1; n < nranks; ++n) {  // every higher rank connects here
      pollfd pf{listener, POLLIN, 0};
      const int left = static_cast<int>(
          std::chrono::duration_cast<std::chrono::milliseconds>(deadline - std::chrono::steady_clock::now()).count());
      if (left <= 0 || poll(&pf, 1, left) <= 0) {
        close(listener);
        return fail(ncclSystemError, "a higher rank never connected (timeout)");
      }
      const int fd = accept4(listener, nullptr, nullptr, SOCK_CLOEXEC);
      int peer[2] = {-1, -1};
      if (fd < 0 || !read_all(fd, peer, sizeof peer) || peer[0] <= rank || peer[0] >= nranks ||
          c->fds[static_cast<size_t>(peer[0])] >= 0) {
        if (fd >= 0) close(fd);
        close(listener);
        return fail(ncclInternalError, "a bad hello from a peer");
      }
      if (peer[1] != nranks) {
        close(fd);
        close(listener);
        return fail(ncclInvalidUsage, "rank " + std::to_string(peer[0]) + " was made with " + std::to_string(peer[1]) +
                                          " ranks, this one with " + std::to_string(nranks));
      }
      c->fds[static_cast<size_t>(peer[0])] = fd;
    }
    close(listener);
  }
  std::lock_guard<std::mutex> lock(comm_mutex);
  c->id = next_comm++;
  comms.insert(c);
  *out = c;
  return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
  const std::string e = comm_error(comm);
  if (!e.empty()) return misuse(ncclInvalidArgument, "ncclCommDestroy: " + e);
  std::lock_guard<std::mutex> lock(comm_mutex);
  for (int& fd : comm->fds)
    if (fd >= 0) close(fd), fd = -1;
  comm->live = false;
  return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t r) {
  static thread_local std::string text;
  const char* name = "unknown result";
  switch (r) {
    case ncclSuccess:
      return "no error";
    case ncclUnhandledCudaError:
      name = "unhandled cuda error";
      break;
    case ncclSystemError:
      name = "unhandled system error";
      break;
    case ncclInternalError:
      name = "internal error";
      break;
    case ncclInvalidArgument:
      name = "invalid argument";
      break;
    case ncclInvalidUsage:
      name = "invalid usage";
      break;
    case ncclRemoteError:
      name = "remote process exited or there was a network error";
      break;
    case ncclInProgress:
      name = "NCCL operation in progress";
      break;
  }
  const char* m = last_message();
  text = m ? std::string(name) + ": " + m : name;
  return text.c_str();
}

ncclResult_t ncclGroupStart() {
  ++group_depth;
  return ncclSuccess;
}
ncclResult_t ncclGroupEnd() {
  if (group_depth == 0) return misuse(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
  return --group_depth == 0 ? flush_group() : ncclSuccess;
}
ncclResult_t ncclSend(const void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
  return add("ncclSend", buf, count, type, peer, comm, stream, true);
}
ncclResult_t ncclRecv(void* buf, size_t count, ncclDataType_t type, int peer, ncclComm_t comm, cudaStream_t stream) {
  return add("ncclRecv", buf, count, type, peer, comm, stream, false);
}
ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t type, int root,
                           ncclComm_t comm, cudaStream_t stream) {
  const std::string e = comm_error(comm);
  if (!e.empty()) return misuse(ncclInvalidArgument, "ncclBroadcast: " + e);
  if (root < 0 || root >= comm->nranks) return misuse(ncclInvalidArgument, "ncclBroadcast: root out of range");
  ncclGroupStart();
  ncclResult_t r = ncclSuccess;
  if (comm->rank == root) {
    for (int p = 0; p < comm->nranks && r == ncclSuccess; ++p)
      if (p != root) r = ncclSend(sendbuff, count, type, p, comm, stream);
    if (r == ncclSuccess && sendbuff != recvbuff) {
      r = ncclSend(sendbuff, count, type, root, comm, stream);
      if (r == ncclSuccess) r = ncclRecv(recvbuff, count, type, root, comm, stream);
    }
  } else {
    r = ncclRecv(recvbuff, count, type, root, comm, stream);
  }
  const ncclResult_t end = ncclGroupEnd();
  return r != ncclSuccess ? r : end;
}
