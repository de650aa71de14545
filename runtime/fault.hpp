#pragma once
// Fault injection for the tests of crashes, failures and stops: CROSSKV_FAULT=<hook>:<n> fires hook <hook> at its
// n-th occurrence (on every rank, or on rank CROSSKV_FAULT_RANK only). Production code names a hook site with one
// call, fault_point(), which does what the hook's name says when it fires and nothing otherwise (one environment
// read per process). Hooks: fail_state_write, kill_in_state_write, kill_before_commit, pause_after_commit
// (fit/checkpoint.cpp); kill_in_export, kill_in_layer_write (fit/export.cpp); kill_in_mlp (after an epoch's
// state is written), term_in_mlp (after an epoch), kill_in_mlp_rewrite (after a layer file is rewritten with its
// MLPs) (fit/mlp.cpp).
#include <cstdint>
#include <functional>

namespace crosskv {

// Whether hook `what` fires now (its n-th occurrence, on `rank`).
bool fault(const char* what, int64_t n, int rank);
// A hook site. When `what` fires: kill_*: the process ends by SIGKILL; term_*: it sends itself SIGTERM (a stop
// request) and goes on; fail_*: throws SystemError; pause_*: waits up to 120 s, or until `stop` returns true.
void fault_point(const char* what, int64_t n, int rank, const std::function<bool()>& stop = {});
// Ends the process by SIGKILL: for a site that fired a kill_* hook after doing part of its work (a write cut short).
[[noreturn]] void fault_kill();

}  // namespace crosskv
