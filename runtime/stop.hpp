#pragma once
// A request to stop a job at its next safe point (a round's end, the solve's next layer). The process's signal
// handlers (SIGTERM, SIGINT, SIGUSR1) set one flag, the only state a handler may touch; the stages read whichever flag
// their Context holds (by default that one; tests give theirs).
#include <csignal>

namespace crosskv {

class StopFlag {
 public:
  StopFlag() : flag_(&signals()) {}  // the process's signal flag
  explicit StopFlag(volatile std::sig_atomic_t& flag) : flag_(&flag) {}
  bool requested() const { return *flag_ != 0; }

  // The flag that SIGTERM, SIGINT and SIGUSR1 set once install_signal_handlers() ran (crosskv-fit's main).
  static volatile std::sig_atomic_t& signals();
  static void install_signal_handlers();

 private:
  volatile std::sig_atomic_t* flag_;
};

}  // namespace crosskv
