#include "fit/shard_schedule.hpp"

#include <algorithm>

namespace crosskv {

ShardSchedule::ShardSchedule(const Calibration& cal, int readers, int reader)
    : cal_(cal), readers_(readers), reader_(reader),
      per_round_(int64_t{readers} * cal.cfg.runtime.checkpoint.every_shards) {}

int64_t ShardSchedule::rounds() const {
  return (static_cast<int64_t>(cal_.shards.size()) + per_round_ - 1) / per_round_;
}

std::vector<const ShardPair*> ShardSchedule::shards(int64_t round) const {
  std::vector<const ShardPair*> out;
  const int64_t end = std::min<int64_t>((round + 1) * per_round_, static_cast<int64_t>(cal_.shards.size()));
  for (int64_t i = round * per_round_; i < end; ++i)
    if (mine(static_cast<size_t>(i)) && cal_.shards[i].used > 0) out.push_back(&cal_.shards[i]);
  return out;
}

int64_t ShardSchedule::tokens(int64_t start_round, bool mine_only) const {
  int64_t n = 0;
  for (size_t i = static_cast<size_t>(start_round * per_round_); i < cal_.shards.size(); ++i)
    if (!mine_only || mine(i)) n += cal_.shards[i].used;
  return n;
}

}  // namespace crosskv
