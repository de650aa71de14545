#pragma once
// Checkpoints of the streaming passes. Every rank writes its share of the reduced moments (so the checkpoint is
// the size of the job's moments, not world size times it) atomically; rank 0 writes the commit record only after
// every rank reported success. Only committed checkpoints are used; the previous one is kept, and a checkpoint that
// fails its checksum on any rank makes every rank fall back to the previous one. States are streamed through a
// bounded buffer both ways (they are as large as the moments): never a second copy of the sums in memory.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/backend.hpp"
#include "runtime/stop.hpp"
#include "fit/plan.hpp"

namespace crosskv {

// A file's size and modification time, as identities record them ([size, time]):
// they catch a file re-written in place.
nlohmann::json file_stamp(const std::string& path);

// What must match for a checkpoint to be resumed: everything that changes the moments (not λ, k or dtype).
nlohmann::json checkpoint_identity(const Calibration& cal, const FitPlan& plan, int ranks);

struct PassState {
  int pass = 1;               // the pass in progress (or complete, when rounds_done == rounds)
  int64_t rounds_done = 0;    // rounds of the pass in progress that are folded into the bases
  std::vector<float> pass1_f, pass2_f;   // this rank's share of the reduced moments of pass 1 and pass 2
  std::vector<double> pass1_d, pass2_d;
  // Set by load(…, defer = true): the sums of pass `pass` were verified but left in the state file, to be read
  // straight into the moments (read_deferred); that pass's vectors above are empty.
  struct Deferred {
    std::string path;
    uint64_t f_at = 0, f_count = 0, d_at = 0, d_count = 0;  // byte offsets in the file, and value counts
  };
  std::optional<Deferred> deferred;
};

// A pass's sums where they are, for save() in place of a PassState's vectors: one reader's share of a pass is its
// moments, read through the backend (a device backend's resident copies, without a flush).
struct LiveSums {
  Residency* backend = nullptr;
  std::vector<Residency::SumPiece<float>> f;
  std::vector<Residency::SumPiece<double>> d;
};

// A state's sums of a pass (`have`) must be as many as the job's moments take (`want`); else a UserError naming
// `where` (a state written by another version).
void check_state_size(const std::string& where, uint64_t have, uint64_t want);

// Deferred sums into host memory: the floats into `into` a segment at a time (place_sums; their count must match),
// the doubles returned.
std::vector<double> read_deferred(const PassState::Deferred& d, const std::vector<Residency::SumPiece<float>>& into);

// Raised when a signal asked the job to stop; the last committed checkpoint stands. Exit code kExitRequeue.
struct Interrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};
constexpr int kExitRequeue = 75;  // EX_TEMPFAIL: the batch script requeues

// What CheckpointStore::load may do beyond reading the newest committed checkpoint.
struct LoadOptions {
  bool fresh = false;               // a committed checkpoint of another identity is removed, not refused
  bool reread_other_shift = false;  // one that differs only in its provisional shift is removed (the data read again)
  bool defer_latest_sums = false;   // the latest pass's sums are verified but not read (PassState::deferred)
};

class CheckpointStore {
 public:
  // `stop` ends the pause_after_commit test hook (runtime/fault.hpp).
  CheckpointStore(std::string dir, nlohmann::json identity, Comm& comm, StopFlag stop = {});
  // The newest committed checkpoint that verifies on every rank. With a committed checkpoint of another identity:
  // UserError listing what differs, unless the options say otherwise (LoadOptions).
  std::optional<PassState> load(const LoadOptions& options = {});
  // Writes and commits `s`; with `live`, the sums of pass s.pass are read from there instead of s's vectors.
  void save(const PassState& s, const LiveSums* live = nullptr);
  const std::string& dir() const { return dir_; }

 private:
  std::string state_path(int64_t seq, int rank) const;
  std::string commit_path(int64_t seq) const;
  std::vector<int64_t> committed() const;  // newest first
  std::optional<nlohmann::json> read_commit(int64_t seq, std::string& why) const;
  void remove_stray_temporaries() const;
  std::string dir_;
  nlohmann::json identity_;
  Comm& comm_;
  StopFlag stop_;
  int64_t seq_ = 0;
};


}  // namespace crosskv
