// The emulated CUDA runtime: devices, tracked memory with guard pages, lazy streams and events, kernel launches.
#include <signal.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <set>
#include <vector>

#include "backends/cuda/emulation/device.hpp"

thread_local uint3 threadIdx{0, 0, 0}, blockIdx{0, 0, 0};
thread_local dim3 blockDim, gridDim;

namespace crosskv_cuda_emulation {
namespace {

constexpr int kExitMisuse = 86;

std::string hex(const void* p) {
  char b[32];
  std::snprintf(b, sizeof b, "%p", p);
  return b;
}

// ---- Failure reporting.
std::atomic<int> misuses{0};
std::mutex report_mutex;
std::vector<std::string> misuse_log;  // the first few, repeated at exit
thread_local std::string last_failure;
thread_local cudaError_t last_error = cudaSuccess;

int device_count() {
  const char* v = std::getenv("CROSSKV_CUDA_EMULATION_DEVICES");
  if (!v || !*v) return 1;
  char* end = nullptr;
  const long n = std::strtol(v, &end, 10);
  return end && *end == '\0' && n >= 0 && n <= 64 ? static_cast<int>(n) : 1;
}
thread_local int this_thread_device = 0;

struct Record : Allocation {
  char* map = nullptr;  // the mapping: [map, map + map_bytes), its last page the guard
  size_t map_bytes = 0;
  int users = 0;  // stream work running on it (device memory is accessible only then)
};
thread_local const std::string* running_op = nullptr;  // named in a SIGSEGV report

// Every allocation (live, and the most recent freed ones, kept inaccessible so that a late access faults and a late
// call is named), per-device use, the streams and events ever made. Never destroyed: the exit check runs last.
class Registry {
 public:
  Registry() : capacity(env_size("CROSSKV_CUDA_EMULATION_MEMORY", size_t{16} << 30)), devices(device_count()) {
    used.assign(static_cast<size_t>(std::max(devices, 1)), 0);
    page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
    struct sigaction sa {};
    sa.sa_sigaction = on_segv;
    sa.sa_flags = SA_SIGINFO;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGSEGV, &sa, &previous_segv);
    std::atexit(at_exit);
  }

  std::mutex m;
  std::map<uintptr_t, Record> allocations;  // by start
  std::deque<uintptr_t> quarantine;         // freed, oldest first
  uint64_t next_id = 1;
  const size_t capacity;
  const int devices;
  std::vector<size_t> used;
  size_t page = 4096;
  std::set<Stream*> streams;
  std::vector<Stream*> default_streams;
  struct sigaction previous_segv {};

  const Record* containing(const void* p) const {
    const auto u = reinterpret_cast<uintptr_t>(p);
    auto it = allocations.upper_bound(u);
    if (it == allocations.begin()) return nullptr;
    --it;
    return u < it->first + it->second.bytes ? &it->second : nullptr;
  }
  const Record* mapped_near(const void* p) const {  // the mapping (guard page included) holding p
    const auto u = reinterpret_cast<uintptr_t>(p);
    for (const auto& [start, r] : allocations)
      if (u >= reinterpret_cast<uintptr_t>(r.map) && u < reinterpret_cast<uintptr_t>(r.map) + r.map_bytes) return &r;
    return nullptr;
  }

  static void on_segv(int sig, siginfo_t* info, void* ctx);
  static void at_exit();
};

Registry& registry() {
  static Registry* r = new Registry;
  return *r;
}

void Registry::on_segv(int, siginfo_t* info, void*) {
  Registry& r = registry();
  char line[512];
  int n = std::snprintf(line, sizeof line, "[cuda emulation] SIGSEGV at %p", info->si_addr);
  if (r.m.try_lock()) {
    if (const Record* a = r.mapped_near(info->si_addr)) {
      const auto off = static_cast<long long>(static_cast<char*>(info->si_addr) - a->p);
      const char* at = static_cast<char*>(info->si_addr);
      if (!a->live)
        n += std::snprintf(line + n, sizeof line - n, ": inside allocation #%" PRIu64 " (%zu bytes) after its cudaFree",
                           a->id, a->bytes);
      else if (at >= a->p && at < a->p + a->bytes && a->device >= 0 && a->users == 0)
        n += std::snprintf(line + n, sizeof line - n,
                           ": the host touched device memory, allocation #%" PRIu64
                           " (%zu bytes, device %d) at offset "
                           "%lld (device memory is read and written by kernels and copies only)",
                           a->id, a->bytes, a->device, off);
      else
        n += std::snprintf(line + n, sizeof line - n,
                           ": %lld bytes past the end of allocation #%" PRIu64 " (%zu bytes%s)",
                           off - static_cast<long long>(a->bytes), a->id, a->bytes, a->device < 0 ? ", pinned" : "");
    }
    r.m.unlock();
  }
  if (running_op) n += std::snprintf(line + n, sizeof line - n, ", while running %s", running_op->c_str());
  std::snprintf(line + n, sizeof line - n, "\n");
  if (write(2, line, std::strlen(line)) < 0) {
  }
  sigaction(SIGSEGV, &r.previous_segv, nullptr);  // the fault repeats, now with the default action
}

void Registry::at_exit() {
  Registry& r = registry();
  const char* check = std::getenv("CROSSKV_CUDA_EMULATION_LEAK_CHECK");
  std::vector<std::string> leaks;
  {
    std::lock_guard<std::mutex> lock(r.m);
    for (const auto& [start, a] : r.allocations)
      if (a.live)
        leaks.push_back("allocation #" + std::to_string(a.id) + " (" + std::to_string(a.bytes) + " bytes, " +
                        (a.device < 0 ? std::string("pinned host") : "device " + std::to_string(a.device)) + ")");
  }
  const bool leak_fails = !(check && std::string(check) == "0") && !leaks.empty();
  const int bad = misuses.load();
  if (!leak_fails && bad == 0) return;
  std::fflush(stdout);
  if (leak_fails) {
    std::fprintf(stderr, "[cuda emulation] %zu allocation(s) never freed at exit:", leaks.size());
    for (size_t i = 0; i < leaks.size() && i < 8; ++i) std::fprintf(stderr, " %s", leaks[i].c_str());
    std::fprintf(stderr, "%s\n", leaks.size() > 8 ? " ..." : "");
  }
  if (bad > 0) {
    std::fprintf(stderr, "[cuda emulation] %d misuse(s) of the device:\n", bad);
    std::lock_guard<std::mutex> lock(report_mutex);
    for (const auto& m : misuse_log) std::fprintf(stderr, "  %s\n", m.c_str());
  }
  std::fflush(stderr);
  _exit(kExitMisuse);
}

// ---- Streams and events.
}  // namespace

struct Stream {
  uint64_t id = 0;
  int device = 0;
  bool live = true;
  std::mutex m;
  std::deque<std::pair<std::string, Op>> queue;
  std::atomic<uint64_t> enqueued{0}, done{0};
  std::recursive_mutex exec;
  cudaError_t error_code = cudaSuccess;
  std::string error;  // the first failure of its work (sticky)
};

namespace {

struct Event {
  uint64_t id = 0;
  bool live = true;
  Stream* stream = nullptr;  // the last record: done once `stream` has run `at` operations
  uint64_t at = 0;
};
std::mutex event_mutex;
std::set<Event*> events;
std::atomic<uint64_t> next_stream_id{1}, next_event_id{1}, launches{0};

// Runs `s` until it has done `until` operations.
void drain(Stream* s, uint64_t until) {
  // Done already: return without the stream's lock, which another thread may hold while its work waits for this one
  // (a wait captures its event's position when queued, so what it needs here is always done).
  if (s->done.load() >= until) return;
  std::lock_guard<std::recursive_mutex> exec(s->exec);
  while (s->done.load() < until) {
    std::pair<std::string, Op> op;
    {
      std::lock_guard<std::mutex> lock(s->m);
      op = std::move(s->queue.front());
      s->queue.pop_front();
    }
    const std::string* outer = running_op;
    running_op = &op.first;
    std::string err = op.second();
    running_op = outer;
    if (!err.empty() && s->error.empty()) {
      s->error_code = cudaErrorIllegalAddress;
      s->error = op.first + ": " + err;
    }
    s->done.fetch_add(1);
  }
}

Stream* make_stream(int device) {
  auto* s = new Stream;
  s->id = next_stream_id++;
  s->device = device;
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  r.streams.insert(s);
  return s;
}

Stream* default_stream(int device) {
  Registry& r = registry();
  {
    std::lock_guard<std::mutex> lock(r.m);
    if (r.default_streams.empty()) r.default_streams.assign(static_cast<size_t>(std::max(r.devices, 1)), nullptr);
    if (Stream* s = r.default_streams[static_cast<size_t>(device)]) return s;
  }
  Stream* s = make_stream(device);
  std::lock_guard<std::mutex> lock(r.m);
  Stream*& slot = r.default_streams[static_cast<size_t>(device)];
  if (!slot) slot = s;
  return slot;
}

std::vector<Stream*> streams_of(int device) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  std::vector<Stream*> out;
  for (Stream* s : r.streams)
    if (s->live && s->device == device) out.push_back(s);
  return out;
}

cudaError_t device_synchronize(int device) {
  cudaError_t first = cudaSuccess;
  for (Stream* s : streams_of(device)) {
    const cudaError_t e = synchronize(s);
    if (first == cudaSuccess) first = e;
  }
  return first;
}

Event* event_of(cudaEvent_t e, std::string* why) {
  auto* ev = reinterpret_cast<Event*>(e);
  std::lock_guard<std::mutex> lock(event_mutex);
  if (!events.count(ev)) {
    *why = "event " + hex(e) + " was never made by cudaEventCreate";
    return nullptr;
  }
  if (!ev->live) {
    *why = "event #" + std::to_string(ev->id) + " was destroyed";
    return nullptr;
  }
  return ev;
}

cudaError_t ret(cudaError_t e) {
  if (e != cudaSuccess) set_last_error(e);
  return e;
}

const char* kind_name(cudaMemcpyKind k) {
  switch (k) {
    case cudaMemcpyHostToHost:
      return "cudaMemcpyHostToHost";
    case cudaMemcpyHostToDevice:
      return "cudaMemcpyHostToDevice";
    case cudaMemcpyDeviceToHost:
      return "cudaMemcpyDeviceToHost";
    case cudaMemcpyDeviceToDevice:
      return "cudaMemcpyDeviceToDevice";
    case cudaMemcpyDefault:
      return "cudaMemcpyDefault";
  }
  return "an unknown cudaMemcpyKind";
}

// Both ends of a (2D) copy checked against `kind`; a pageable source is read at the call, as the driver stages it,
// everything else when the stream runs the copy.
cudaError_t copy(const char* call, void* dst, size_t dpitch, const void* src, size_t spitch, size_t width,
                 size_t height, cudaMemcpyKind kind, cudaStream_t stream) {
  const std::string where = std::string(call) + "(dst " + hex(dst) + ", src " + hex(src) + ", " +
                            std::to_string(width) + " x " + std::to_string(height) + " bytes, " + kind_name(kind) + ")";
  std::string why;
  if (!stream_of(stream, &why)) return ret(misuse(cudaErrorInvalidResourceHandle, where + ": " + why));
  if (width == 0 || height == 0) return cudaSuccess;
  if (height > 1 && (width > dpitch || width > spitch))
    return ret(misuse(cudaErrorInvalidPitchValue, where + ": width over a pitch (dpitch " + std::to_string(dpitch) +
                                                      ", spitch " + std::to_string(spitch) + ")"));
  const size_t dext = (height - 1) * dpitch + width, sext = (height - 1) * spitch + width;
  bool dst_dev, src_dev;
  switch (kind) {
    case cudaMemcpyHostToHost:
      dst_dev = false, src_dev = false;
      break;
    case cudaMemcpyHostToDevice:
      dst_dev = true, src_dev = false;
      break;
    case cudaMemcpyDeviceToHost:
      dst_dev = false, src_dev = true;
      break;
    case cudaMemcpyDeviceToDevice:
      dst_dev = true, src_dev = true;
      break;
    case cudaMemcpyDefault:
      dst_dev = side_of(dst) == Side::device;
      src_dev = side_of(src) == Side::device;
      break;
    default:
      return ret(misuse(cudaErrorInvalidMemcpyDirection, where + ": not a cudaMemcpyKind"));
  }
  const std::string derr = dst_dev ? check_device(dst, dext) : check_host(dst, dext);
  if (!derr.empty())
    return ret(misuse(cudaErrorInvalidValue, where + ": dst: " + derr + (dst_dev ? " (device memory expected)" : "")));
  const std::string serr = src_dev ? check_device(src, sext) : check_host(src, sext);
  if (!serr.empty())
    return ret(misuse(cudaErrorInvalidValue, where + ": src: " + serr + (src_dev ? " (device memory expected)" : "")));
  std::shared_ptr<std::vector<char>> staged;
  const char* from = static_cast<const char*>(src);
  size_t from_pitch = spitch;
  if (!src_dev && side_of(src) == Side::pageable) {
    staged = std::make_shared<std::vector<char>>(width * height);
    for (size_t r = 0; r < height; ++r) std::memcpy(staged->data() + r * width, from + r * spitch, width);
    from = staged->data();
    from_pitch = width;
  }
  const bool src_recheck = !staged;
  auto op = [=]() -> std::string {
    const std::string d = dst_dev ? check_device(dst, dext) : check_host(dst, dext);
    const std::string s = !src_recheck ? "" : src_dev ? check_device(src, sext) : check_host(src, sext);
    if (!d.empty() || !s.empty()) {
      const std::string m = where + " when the stream ran it: " + (d.empty() ? "src: " + s : "dst: " + d);
      note_misuse(m);
      return m;
    }
    const DeviceAccess access({dst_dev ? dst : nullptr, src_dev ? src : nullptr});
    for (size_t r = 0; r < height; ++r)
      std::memmove(static_cast<char*>(dst) + r * dpitch, from + r * from_pitch, width);
    (void)staged;  // held until the copy has run
    return "";
  };
  return ret(enqueue(stream, where, op));
}

}  // namespace

// ---- Shared with the other emulated libraries.
void note_misuse(const std::string& message) {
  misuses.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(report_mutex);
    if (misuse_log.size() < 16) misuse_log.push_back(message);
  }
  std::fprintf(stderr, "[cuda emulation] misuse: %s\n", message.c_str());
  std::fflush(stderr);
  last_failure = message;
}
void note_failure(const std::string& message) { last_failure = message; }
const char* last_message() { return last_failure.empty() ? nullptr : last_failure.c_str(); }
void set_last_error(cudaError_t e) { last_error = e; }
int take_misuses() {
  std::lock_guard<std::mutex> lock(report_mutex);
  misuse_log.clear();
  return misuses.exchange(0);
}
int current_device() { return this_thread_device; }

DeviceAccess::DeviceAccess(const std::vector<const void*>& pointers) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  for (const void* p : pointers) {
    if (!p) continue;
    const auto u = reinterpret_cast<uintptr_t>(p);
    auto it = r.allocations.upper_bound(u);
    if (it == r.allocations.begin()) continue;
    --it;
    Record& a = it->second;
    if (u >= it->first + a.bytes || !a.live || a.device < 0) continue;
    if (a.users++ == 0) mprotect(a.map, a.map_bytes - r.page, PROT_READ | PROT_WRITE);
    opened_.push_back(it->first);
  }
}

DeviceAccess::~DeviceAccess() {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  for (uintptr_t start : opened_) {
    auto it = r.allocations.find(start);
    if (it == r.allocations.end() || !it->second.live) continue;
    if (--it->second.users == 0) mprotect(it->second.map, it->second.map_bytes - r.page, PROT_NONE);
  }
}

size_t env_size(const char* name, size_t fallback) {
  const char* v = std::getenv(name);
  if (!v || !*v) return fallback;
  char* end = nullptr;
  const double x = std::strtod(v, &end);
  if (!end || x < 0) return fallback;
  double scale = 1;
  switch (*end) {
    case '\0':
      break;
    case 'K':
    case 'k':
      scale = 1024.0;
      break;
    case 'M':
    case 'm':
      scale = 1024.0 * 1024;
      break;
    case 'G':
    case 'g':
      scale = 1024.0 * 1024 * 1024;
      break;
    case 'T':
    case 't':
      scale = 1024.0 * 1024 * 1024 * 1024;
      break;
    default:
      return fallback;
  }
  return static_cast<size_t>(x * scale);
}

Side side_of(const void* p, Allocation* found) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  const Record* a = r.containing(p);
  if (!a) return Side::pageable;
  if (found) *found = *a;
  if (!a->live) return Side::pageable;
  return a->device < 0 ? Side::pinned : Side::device;
}

std::string describe(const void* p) {
  Allocation a;
  side_of(p, &a);
  if (a.id == 0) return "host memory at " + hex(p) + " (not from cudaMalloc)";
  const std::string what = "allocation #" + std::to_string(a.id) + " (" + std::to_string(a.bytes) + " bytes, " +
                           (a.device < 0 ? std::string("pinned host") : "device " + std::to_string(a.device)) +
                           ") at offset " + std::to_string(static_cast<const char*>(p) - a.p);
  if (!a.live) return what + ", after its " + (a.device < 0 ? "cudaFreeHost" : "cudaFree");
  return what;
}

std::string check_device(const void* p, size_t bytes) {
  if (bytes == 0) return "";
  if (!p) return "a null pointer";
  Allocation a;
  const Side s = side_of(p, &a);
  if (s != Side::device) {
    if (a.id != 0 && !a.live) return describe(p);
    return (s == Side::pinned ? "pinned host memory, " + describe(p) : describe(p)) +
           ", where device memory is required";
  }
  const size_t off = static_cast<size_t>(static_cast<const char*>(p) - a.p);
  if (off + bytes > a.bytes)
    return std::to_string(bytes) + " bytes at offset " + std::to_string(off) + " of allocation #" +
           std::to_string(a.id) + " (" + std::to_string(a.bytes) + " bytes, device " + std::to_string(a.device) +
           "): " + std::to_string(off + bytes - a.bytes) + " bytes past its end";
  return "";
}

std::string check_host(const void* p, size_t bytes) {
  if (bytes == 0) return "";
  if (!p) return "a null pointer";
  Allocation a;
  const Side s = side_of(p, &a);
  if (s == Side::device) return "device memory, " + describe(p) + ", where host memory is required";
  if (a.id != 0 && !a.live) return describe(p);
  if (s == Side::pinned) {
    const size_t off = static_cast<size_t>(static_cast<const char*>(p) - a.p);
    if (off + bytes > a.bytes)
      return std::to_string(bytes) + " bytes at offset " + std::to_string(off) + " of pinned allocation #" +
             std::to_string(a.id) + " (" + std::to_string(a.bytes) +
             " bytes): " + std::to_string(off + bytes - a.bytes) + " bytes past its end";
  }
  return "";
}

Stream* stream_of(cudaStream_t stream, std::string* why) {
  if (!stream) return default_stream(current_device());
  auto* s = reinterpret_cast<Stream*>(stream);
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  if (!r.streams.count(s)) {
    *why = "stream " + hex(stream) + " was never made by cudaStreamCreate";
    return nullptr;
  }
  if (!s->live) {
    *why = "stream #" + std::to_string(s->id) + " was destroyed";
    return nullptr;
  }
  return s;
}

cudaError_t enqueue(cudaStream_t stream, const std::string& what, Op op) {
  std::string why;
  Stream* s = stream_of(stream, &why);
  if (!s) return misuse(cudaErrorInvalidResourceHandle, what + ": " + why);
  std::lock_guard<std::mutex> lock(s->m);
  s->queue.emplace_back("stream #" + std::to_string(s->id) + ": " + what, std::move(op));
  s->enqueued.fetch_add(1);
  return cudaSuccess;
}

cudaError_t enqueue_on(cudaStream_t stream, const std::string& what, Operands operands, Op work) {
  auto op = [what, operands = std::move(operands), work = std::move(work)]() -> std::string {
    std::vector<const void*> opened;
    for (const auto& [p, bytes] : operands) {
      const std::string e = check_device(p, bytes);
      if (!e.empty()) {
        const std::string m = what + " when the stream ran it: " + e;
        note_misuse(m);
        return m;
      }
      opened.push_back(p);
    }
    const DeviceAccess access(opened);
    return work();
  };
  return enqueue(stream, what, std::move(op));
}

cudaError_t synchronize(Stream* s) {
  drain(s, s->enqueued.load());
  if (!s->error.empty()) return failure(s->error_code, s->error);
  return cudaSuccess;
}

cudaError_t launch(const cudaLaunchConfig_t& c, const std::vector<PointerArg>& pointers, std::function<void()> body) {
  const uint64_t n = ++launches;
  const dim3 g = c.gridDim, b = c.blockDim;
  const std::string what = "kernel launch #" + std::to_string(n) + " (grid " + std::to_string(g.x) + "x" +
                           std::to_string(g.y) + "x" + std::to_string(g.z) + ", block " + std::to_string(b.x) + "x" +
                           std::to_string(b.y) + "x" + std::to_string(b.z) + ")";
  const uint64_t threads = uint64_t{b.x} * b.y * b.z;
  if (threads == 0 || threads > 1024 || g.x == 0 || g.y == 0 || g.z == 0 || g.y > 65535 || g.z > 65535 ||
      g.x > 2147483647u)
    return ret(misuse(cudaErrorInvalidConfiguration, what + ": invalid launch configuration"));
  if (c.dynamicSmemBytes > 48 * 1024)
    return ret(misuse(cudaErrorInvalidValue, what + ": " + std::to_string(c.dynamicSmemBytes) +
                                                 " bytes of dynamic shared memory (at most 48 KiB without opt-in)"));
  for (const PointerArg& a : pointers) {
    if (!a.p) continue;
    const std::string err = check_device(a.p, 1);
    if (!err.empty())
      return ret(misuse(cudaErrorInvalidValue, what + ": argument " + std::to_string(a.index) + ": " + err));
  }
  Operands operands;
  for (const PointerArg& a : pointers)
    if (a.p) operands.emplace_back(a.p, 1);
  auto run = [g, b, body = std::move(body)]() -> std::string {
    gridDim = g;
    blockDim = b;
    for (unsigned bz = 0; bz < g.z; ++bz)
      for (unsigned by = 0; by < g.y; ++by)
        for (unsigned bx = 0; bx < g.x; ++bx) {
          blockIdx = uint3{bx, by, bz};
          for (unsigned tz = 0; tz < b.z; ++tz)
            for (unsigned ty = 0; ty < b.y; ++ty)
              for (unsigned tx = 0; tx < b.x; ++tx) {
                threadIdx = uint3{tx, ty, tz};
                body();
              }
        }
    return "";
  };
  return ret(enqueue_on(c.stream, what, std::move(operands), std::move(run)));
}

}  // namespace crosskv_cuda_emulation

using namespace crosskv_cuda_emulation;

// ---- Devices and errors.
cudaError_t cudaGetDeviceCount(int* count) {
  const int n = registry().devices;
  *count = n;
  if (n == 0) return ret(failure(cudaErrorNoDevice, "no emulated device (CROSSKV_CUDA_EMULATION_DEVICES=0)"));
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  const int n = registry().devices;
  if (device < 0 || device >= n)
    return ret(failure(cudaErrorInvalidDevice, "cudaSetDevice(" + std::to_string(device) + "): " + std::to_string(n) +
                                                   " emulated device(s) (CROSSKV_CUDA_EMULATION_DEVICES)"));
  this_thread_device = device;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
  *device = this_thread_device;
  return cudaSuccess;
}
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* prop, int device) {
  Registry& r = registry();
  if (device < 0 || device >= r.devices)
    return ret(failure(cudaErrorInvalidDevice, "cudaGetDeviceProperties(" + std::to_string(device) + ")"));
  *prop = cudaDeviceProp{};
  std::snprintf(prop->name, sizeof prop->name, "crosskv emulated GPU");
  prop->totalGlobalMem = r.capacity;
  prop->multiProcessorCount = 1;
  prop->major = 9, prop->minor = 0;
  prop->warpSize = 32;
  prop->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
cudaError_t cudaMemGetInfo(size_t* free, size_t* total) {
  Registry& r = registry();
  std::lock_guard<std::mutex> lock(r.m);
  const size_t used = r.used[static_cast<size_t>(current_device())];
  *total = r.capacity;
  *free = r.capacity > used ? r.capacity - used : 0;
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() { return ret(device_synchronize(current_device())); }
cudaError_t cudaGetLastError() { return std::exchange(last_error, cudaSuccess); }
cudaError_t cudaPeekAtLastError() { return last_error; }
const char* cudaGetErrorName(cudaError_t e) {
  switch (e) {
    case cudaSuccess:
      return "cudaSuccess";
    case cudaErrorInvalidValue:
      return "cudaErrorInvalidValue";
    case cudaErrorMemoryAllocation:
      return "cudaErrorMemoryAllocation";
    case cudaErrorInvalidConfiguration:
      return "cudaErrorInvalidConfiguration";
    case cudaErrorInvalidPitchValue:
      return "cudaErrorInvalidPitchValue";
    case cudaErrorInvalidDevicePointer:
      return "cudaErrorInvalidDevicePointer";
    case cudaErrorInvalidMemcpyDirection:
      return "cudaErrorInvalidMemcpyDirection";
    case cudaErrorNoDevice:
      return "cudaErrorNoDevice";
    case cudaErrorInvalidDevice:
      return "cudaErrorInvalidDevice";
    case cudaErrorInvalidResourceHandle:
      return "cudaErrorInvalidResourceHandle";
    case cudaErrorNotReady:
      return "cudaErrorNotReady";
    case cudaErrorIllegalAddress:
      return "cudaErrorIllegalAddress";
    case cudaErrorLaunchFailure:
      return "cudaErrorLaunchFailure";
    case cudaErrorUnknown:
      return "cudaErrorUnknown";
  }
  return "cudaError (unknown code)";
}
const char* cudaGetErrorString(cudaError_t e) {
  if (e != cudaSuccess)
    if (const char* m = last_message()) return m;
  return e == cudaSuccess ? "no error" : "emulated CUDA error";
}

// ---- Memory: each allocation its own mapping, ending on an inaccessible guard page.
namespace {

cudaError_t allocate(const char* call, void** ptr, size_t bytes, int device) {
  if (!ptr) return ret(misuse(cudaErrorInvalidValue, std::string(call) + ": a null result pointer"));
  *ptr = nullptr;
  if (bytes == 0) return cudaSuccess;
  Registry& r = registry();
  const size_t body = (bytes + r.page - 1) / r.page * r.page, total = body + r.page;
  {
    std::lock_guard<std::mutex> lock(r.m);
    if (device >= 0 && r.used[static_cast<size_t>(device)] + bytes > r.capacity)
      return ret(failure(cudaErrorMemoryAllocation,
                         std::string(call) + "(" + std::to_string(bytes) + " bytes) on device " +
                             std::to_string(device) + ": " + std::to_string(r.capacity - r.used[device]) + " of " +
                             std::to_string(r.capacity) + " bytes free (CROSSKV_CUDA_EMULATION_MEMORY)"));
  }
  void* map = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
  if (map == MAP_FAILED)
    return ret(
        failure(cudaErrorMemoryAllocation, std::string(call) + "(" + std::to_string(bytes) + " bytes): mmap failed"));
  char* m = static_cast<char*>(map);
  // Fresh memory is not zero on a GPU: here it is all ones (NaN as fp32 and fp64), so a read before a write shows.
  std::memset(m, 0xFF, body);
  // The guard page always; a device allocation's body too, until stream work opens it (DeviceAccess).
  if (device >= 0)
    mprotect(m, total, PROT_NONE);
  else
    mprotect(m + body, r.page, PROT_NONE);
  // The allocation ends where the guard page starts, aligned as its size allows (at most 16 bytes, at least 1).
  size_t align = 16;
  while (align > 1 && bytes % align) align /= 2;
  char* p = m + body - (bytes + align - 1) / align * align;
  Record rec;
  rec.p = p;
  rec.bytes = bytes;
  rec.device = device;
  rec.map = m;
  rec.map_bytes = total;
  std::lock_guard<std::mutex> lock(r.m);
  rec.id = r.next_id++;
  if (device >= 0) r.used[static_cast<size_t>(device)] += bytes;
  r.allocations[reinterpret_cast<uintptr_t>(p)] = rec;
  *ptr = p;
  return cudaSuccess;
}

cudaError_t release(const char* call, void* p, bool pinned) {
  if (!p) return cudaSuccess;
  Registry& r = registry();
  // cudaFree waits for the device (the driver synchronizes before it frees).
  int device = current_device();
  {
    std::lock_guard<std::mutex> lock(r.m);
    if (const Record* a = r.containing(p); a && a->device >= 0) device = a->device;
  }
  device_synchronize(device);
  std::lock_guard<std::mutex> lock(r.m);
  auto it = r.allocations.find(reinterpret_cast<uintptr_t>(p));
  if (it == r.allocations.end() || !it->second.live || (it->second.device < 0) != pinned) {
    std::string why;
    if (it != r.allocations.end() && !it->second.live)
      why = "allocation #" + std::to_string(it->second.id) + " was freed already";
    else if (it != r.allocations.end())
      why = pinned ? "device memory (use cudaFree)" : "pinned host memory (use cudaFreeHost)";
    else if (const Record* a = r.containing(p))
      why = "offset " + std::to_string(static_cast<char*>(p) - a->p) + " inside allocation #" + std::to_string(a->id) +
            ", not its start";
    else
      why = "not memory from " + std::string(pinned ? "cudaMallocHost" : "cudaMalloc");
    return ret(misuse(cudaErrorInvalidValue, std::string(call) + "(" + hex(p) + "): " + why));
  }
  Record& a = it->second;
  a.live = false;
  if (a.device >= 0) r.used[static_cast<size_t>(a.device)] -= a.bytes;
  madvise(a.map, a.map_bytes - r.page, MADV_DONTNEED);
  mprotect(a.map, a.map_bytes, PROT_NONE);
  r.quarantine.push_back(it->first);
  while (r.quarantine.size() > 4096) {
    auto old = r.allocations.find(r.quarantine.front());
    r.quarantine.pop_front();
    if (old == r.allocations.end()) continue;
    munmap(old->second.map, old->second.map_bytes);
    r.allocations.erase(old);
  }
  return cudaSuccess;
}

}  // namespace

cudaError_t cudaMalloc(void** ptr, size_t bytes) { return allocate("cudaMalloc", ptr, bytes, current_device()); }
cudaError_t cudaFree(void* ptr) { return release("cudaFree", ptr, false); }
cudaError_t cudaMallocHost(void** ptr, size_t bytes) { return allocate("cudaMallocHost", ptr, bytes, -1); }
cudaError_t cudaFreeHost(void* ptr) { return release("cudaFreeHost", ptr, true); }

cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
  const cudaError_t e = copy("cudaMemcpy", dst, bytes, src, bytes, bytes, 1, kind, nullptr);
  if (e != cudaSuccess) return e;
  return ret(device_synchronize(current_device()));
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
  return copy("cudaMemcpyAsync", dst, bytes, src, bytes, bytes, 1, kind, stream);
}
cudaError_t cudaMemcpy2DAsync(void* dst, size_t dpitch, const void* src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
  return copy("cudaMemcpy2DAsync", dst, dpitch, src, spitch, width, height, kind, stream);
}
cudaError_t cudaMemsetAsync(void* ptr, int value, size_t bytes, cudaStream_t stream) {
  const std::string where = "cudaMemsetAsync(" + hex(ptr) + ", " + std::to_string(bytes) + " bytes)";
  const std::string err = check_device(ptr, bytes);
  if (!err.empty()) return ret(misuse(cudaErrorInvalidValue, where + ": " + err));
  if (bytes == 0) return cudaSuccess;
  return ret(enqueue_on(stream, where, {{ptr, bytes}}, [=]() -> std::string {
    std::memset(ptr, value, bytes);
    return "";
  }));
}
cudaError_t cudaMemset(void* ptr, int value, size_t bytes) {
  const cudaError_t e = cudaMemsetAsync(ptr, value, bytes, nullptr);
  return e != cudaSuccess ? e : ret(device_synchronize(current_device()));
}

// ---- Streams and events.
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* stream, unsigned int flags) {
  if (!stream) return ret(misuse(cudaErrorInvalidValue, "cudaStreamCreateWithFlags: a null result pointer"));
  *stream = reinterpret_cast<cudaStream_t>(
      make_stream(current_device()));  // no implicit sync with the default stream: stricter than CUDA
  return cudaSuccess;
}
cudaError_t cudaStreamCreate(cudaStream_t* stream) { return cudaStreamCreateWithFlags(stream, cudaStreamDefault); }
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  std::string why;
  if (!stream) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: the default stream"));
  Stream* s = stream_of(stream, &why);
  if (!s) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaStreamDestroy: " + why));
  drain(s, s->enqueued.load());  // its work completes, as on a GPU, before its resources go
  std::lock_guard<std::mutex> lock(registry().m);
  s->live = false;
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
  std::string why;
  Stream* s = stream_of(stream, &why);
  if (!s) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaStreamSynchronize: " + why));
  return ret(synchronize(s));
}
// No work progresses unless something waits: a query runs the stream's work (it cannot be polled to completion).
cudaError_t cudaStreamQuery(cudaStream_t stream) { return cudaStreamSynchronize(stream); }
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int) {
  std::string why;
  Event* e = event_of(event, &why);
  if (!e) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: " + why));
  Stream* target = e->stream;
  const uint64_t at = e->at;
  if (!stream_of(stream, &why)) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaStreamWaitEvent: " + why));
  return ret(enqueue(stream, "wait for event #" + std::to_string(e->id), [target, at]() -> std::string {
    if (target) drain(target, at);
    return "";
  }));
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* event, unsigned int) {
  if (!event) return ret(misuse(cudaErrorInvalidValue, "cudaEventCreateWithFlags: a null result pointer"));
  auto* e = new Event;
  e->id = next_event_id++;
  std::lock_guard<std::mutex> lock(event_mutex);
  events.insert(e);
  *event = reinterpret_cast<cudaEvent_t>(e);
  return cudaSuccess;
}
cudaError_t cudaEventCreate(cudaEvent_t* event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }
cudaError_t cudaEventDestroy(cudaEvent_t event) {
  std::string why;
  Event* e = event_of(event, &why);
  if (!e) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaEventDestroy: " + why));
  std::lock_guard<std::mutex> lock(event_mutex);
  e->live = false;
  return cudaSuccess;
}
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
  std::string why;
  Event* e = event_of(event, &why);
  if (!e) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaEventRecord: " + why));
  Stream* s = stream_of(stream, &why);
  if (!s) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaEventRecord: " + why));
  std::lock_guard<std::mutex> lock(event_mutex);
  e->stream = s;
  e->at = s->enqueued.load();
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t event) {
  std::string why;
  Event* e = event_of(event, &why);
  if (!e) return ret(misuse(cudaErrorInvalidResourceHandle, "cudaEventSynchronize: " + why));
  if (!e->stream) return cudaSuccess;  // never recorded: complete
  drain(e->stream, e->at);
  if (!e->stream->error.empty()) return ret(failure(e->stream->error_code, e->stream->error));
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t event) { return cudaEventSynchronize(event); }
