#pragma once
// Test hooks for fault tests: CROSSKV_FAULT=<what>:<n> fires at the n-th occurrence of <what> (on every rank, or on
// rank CROSSKV_FAULT_RANK only). Hooks: kill_before_commit, fail_state_write, kill_in_state_write,
// pause_after_commit (stages/checkpoint.cpp); kill_in_export, kill_in_layer_write (stages/export.cpp);
// kill_in_mlp (after an epoch's state is written), term_in_mlp (SIGTERM to itself after an epoch),
// kill_in_mlp_rewrite (after a layer file is rewritten with its MLPs) (stages/mlp.cpp).
#include <cstdint>
#include <cstdlib>
#include <string>

namespace crosskv {

inline bool fault(const char* what, int64_t n, int rank) {
  const char* f = std::getenv("CROSSKV_FAULT");
  const char* r = std::getenv("CROSSKV_FAULT_RANK");
  if (!f || (r && std::atoi(r) != rank)) return false;
  return std::string(f) == std::string(what) + ":" + std::to_string(n);
}

}  // namespace crosskv
