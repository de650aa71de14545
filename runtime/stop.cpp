#include "runtime/stop.hpp"

namespace crosskv {
namespace {

volatile std::sig_atomic_t signalled = 0;
void on_stop_signal(int) { signalled = 1; }

}  // namespace

volatile std::sig_atomic_t& StopFlag::signals() { return signalled; }

void StopFlag::install_signal_handlers() {
  std::signal(SIGTERM, on_stop_signal);
  std::signal(SIGINT, on_stop_signal);
  std::signal(SIGUSR1, on_stop_signal);
}

}  // namespace crosskv
