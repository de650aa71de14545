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
#include "fit/context.hpp"
#include "fit/shard_schedule.hpp"
#include "fit/shifts.hpp"

namespace crosskv {

struct PassStats {
  int64_t tokens = 0;
  double seconds = 0, bytes = 0;
};

// Stage 3/5: one streaming pass over ctx.readers()'s schedule (ShardSchedule), into `m`. After each round
// `on_round` runs on every rank (it reduces and checkpoints); `abandoned` is true when this rank stopped reading on
// a stop signal.
using RoundHook = std::function<void(int64_t round, int64_t rounds, bool abandoned)>;
PassStats stream_pass(const Calibration& cal, Context& ctx, const PassMoments& m, const std::string& label,
                      int64_t start_round = 0, const RoundHook& on_round = {});

}  // namespace crosskv
