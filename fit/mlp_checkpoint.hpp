#pragma once
// The residual-MLP stage's checkpoints (fit/mlp): a training state as bytes, and the stage's files, each sealed by
// the SHA-256 of the job's identity and its contents.
#include <optional>
#include <string>

#include <nlohmann/json.hpp>

#include "core/comm.hpp"
#include "core/kind.hpp"
#include "core/mlp.hpp"
#include "fit/mlp_training.hpp"

namespace crosskv {

// A training stopped after some epochs: parameters, Adam's moments and steps, the epochs' errors. A state of
// another shape reads as absent.
std::string serialise_state(const MlpTrained& t);
std::optional<MlpTrained> deserialise_state(const std::string& s, const MlpShape& shape);

// The stage's checkpoint files, sealed with the job's identity (core/sealed_file.hpp). A file that does not verify,
// or of another job, reads as absent.
class MlpCheckpoint {
 public:
  MlpCheckpoint(const std::string& ckpt_dir, const std::string& k, const nlohmann::json& identity);
  std::string path(int l, Kind kind, const char* what) const;
  void write(const std::string& file, const std::string& payload) const;
  std::optional<std::string> read(const std::string& file) const;
  const std::string& dir() const { return dir_; }

 private:
  std::string dir_, k_;
  nlohmann::json identity_;
};

// Rank 0's file, read there and broadcast to the comm: the ranks need not see the same file system.
std::optional<std::string> read_on_root(Comm& comm, const MlpCheckpoint& ck, const std::string& file);

}  // namespace crosskv
