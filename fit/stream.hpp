#pragma once
// Stages 3 and 5 of a fit: a streaming pass over the calibration shards, in rounds, into the moments.
#include <array>
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/kind.hpp"
#include "fit/calibration.hpp"

namespace crosskv {

struct PassStats {
  int64_t tokens = 0;
  double seconds = 0, bytes = 0;
};

// The provisional shifts of each kind's moments: source columns (x) and target columns (y).
struct Shift {
  std::vector<float> x, y;
};
struct Shifts {
  std::array<Shift, kAllKinds.size()> by_kind;  // by kind_index
  Shift& operator[](Kind k) { return by_kind[kind_index(k)]; }
  const Shift& operator[](Kind k) const { return by_kind[kind_index(k)]; }
};
// Provisional shifts: means of the first block of cal.shift_shard (the same on every rank and for every domain
// selection).
Shifts compute_shifts(const Calibration& cal);
// The provisional shifts kept beside the moments made about them, in <ckpt_dir>/shifts.bin, so that a refit from
// stored moments reads no calibration data: read there when the file is of this shift shard (its paths, tokens,
// the files' sizes and times, block_tokens and token_stride) and its values' SHA-256 holds; else computed from
// the shard (compute_shifts) and written by rank 0 (`writer`). With `fresh` (crosskv-fit --fresh) the kept file
// is not read, and is rewritten.
Shifts provisional_shifts(const Calibration& cal, const std::string& ckpt_dir, bool writer, bool fresh);
// The shard (relative path) the shifts kept in <ckpt_dir>/shifts.bin were taken from, or "" when there are none.
std::string kept_shift_shard(const std::string& ckpt_dir);

// Which shards each reader reads, round by round. With T readers and E = runtime.checkpoint.every_shards, round r
// covers the shards [r*T*E, (r+1)*T*E), and reader p reads those with index % T == p.
class ShardSchedule {
 public:
  ShardSchedule(const Calibration& cal, int readers, int reader);
  int64_t rounds() const;
  // This reader's shards of `round` that hold tokens, in order.
  std::vector<const ShardPair*> shards(int64_t round) const;
  // The tokens of the rounds from `start_round` on: this reader's, and every reader's.
  int64_t my_tokens(int64_t start_round) const { return tokens(start_round, true); }
  int64_t job_tokens(int64_t start_round) const { return tokens(start_round, false); }

 private:
  bool mine(size_t i) const { return static_cast<int>(i % static_cast<size_t>(readers_)) == reader_; }
  int64_t tokens(int64_t start_round, bool mine_only) const;
  const Calibration& cal_;
  int readers_, reader_;
  int64_t per_round_;
};

// Stage 3/5: one streaming pass over ctx.readers()'s schedule (ShardSchedule), into `m`. After each round
// `on_round` runs on every rank (it reduces and checkpoints); `abandoned` is true when this rank stopped reading on
// a stop signal.
using RoundHook = std::function<void(int64_t round, int64_t rounds, bool abandoned)>;
PassStats stream_pass(const Calibration& cal, Context& ctx, const PassMoments& m, const std::string& label,
                      int64_t start_round = 0, const RoundHook& on_round = {});

}  // namespace crosskv
