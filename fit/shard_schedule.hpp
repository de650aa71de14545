#pragma once
// Which shards each reader of a streaming pass reads, round by round.
#include <cstdint>
#include <vector>

#include "fit/calibration.hpp"

namespace crosskv {

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

}  // namespace crosskv
