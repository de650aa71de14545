#include "runtime/fault.hpp"

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <string>
#include <thread>

#include "core/error.hpp"

namespace crosskv {
namespace {

struct FaultRequest {
  bool set = false;
  std::string hook;  // "<what>:<n>"
  int rank = -1;     // -1: every rank
};

const FaultRequest& request() {
  static const FaultRequest r = [] {
    FaultRequest q;
    if (const char* f = std::getenv("CROSSKV_FAULT")) q.set = true, q.hook = f;
    if (const char* k = std::getenv("CROSSKV_FAULT_RANK")) q.rank = std::atoi(k);
    return q;
  }();
  return r;
}

bool starts_with(const char* s, const char* prefix) { return std::string(s).rfind(prefix, 0) == 0; }

}  // namespace

bool fault(const char* what, int64_t n, int rank) {
  const FaultRequest& r = request();
  if (!r.set || (r.rank >= 0 && r.rank != rank)) return false;
  return r.hook == std::string(what) + ":" + std::to_string(n);
}

void fault_kill() {
  std::raise(SIGKILL);
  std::_Exit(137);  // not reached
}

void fault_point(const char* what, int64_t n, int rank, const std::function<bool()>& stop) {
  if (!fault(what, n, rank)) return;
  if (starts_with(what, "kill_")) fault_kill();
  if (starts_with(what, "term_")) {
    std::raise(SIGTERM);
  } else if (starts_with(what, "fail_")) {
    throw SystemError("injected failure at " + std::string(what) + " (CROSSKV_FAULT)");
  } else if (starts_with(what, "pause_")) {
    for (int i = 0; i < 2400 && !(stop && stop()); ++i) std::this_thread::sleep_for(std::chrono::milliseconds(50));
  } else {
    CROSSKV_ASSERT(false, std::string("a fault hook without a known action: ") + what);
  }
}

}  // namespace crosskv
