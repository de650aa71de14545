#pragma once
// Checkpoints of the streaming passes. Every rank writes its share of the reduced moments (so the checkpoint is
// the size of the job's moments, not world size times it) atomically; rank 0 writes the commit record only after
// every rank reported success. Only committed checkpoints are used; the previous one is kept, and a checkpoint that
// fails its checksum on any rank makes every rank fall back to the previous one.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "stages/stages.hpp"

namespace crosskv {

// What must match for a checkpoint to be resumed: everything that changes the moments (not λ, k or dtype).
nlohmann::json checkpoint_identity(const Calibration& cal, const FitPlan& plan, int ranks);

struct PassState {
  int pass = 1;               // the pass in progress (or complete, when rounds_done == rounds)
  int64_t rounds_done = 0;    // rounds of the pass in progress that are folded into the bases
  std::vector<float> pass1_f, pass2_f;   // this rank's share of the reduced moments of pass 1 and pass 2
  std::vector<double> pass1_d, pass2_d;
};

// Raised when a signal asked the job to stop; the last committed checkpoint stands. Exit code kExitRequeue.
struct Interrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};
constexpr int kExitRequeue = 75;  // EX_TEMPFAIL: the batch script requeues

class CheckpointStore {
 public:
  CheckpointStore(std::string dir, nlohmann::json identity, Comm& comm);
  // The newest committed checkpoint that verifies on every rank. With a committed checkpoint of another identity:
  // UserError listing what differs, unless `fresh` (then everything is removed). With `cache`, a checkpoint that
  // differs only in its provisional shift is removed and the data read again.
  std::optional<PassState> load(bool fresh, bool cache = false);
  void save(const PassState& s);
  const std::string& dir() const { return dir_; }

 private:
  std::string state_path(int64_t seq, int rank) const;
  std::string commit_path(int64_t seq) const;
  std::vector<int64_t> committed() const;  // newest first
  std::string dir_;
  nlohmann::json identity_;
  Comm& comm_;
  int64_t seq_ = 0;
};

// SIGTERM / SIGUSR1 set this flag (installed by crosskv-fit's main).
void install_stop_signal_handlers();
bool stop_requested();

}  // namespace crosskv
