#pragma once
// Stages 3 and 5 of a fit: a streaming pass over the calibration shards, in rounds, into the moments.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fit/calibration.hpp"

namespace crosskv {

struct PassStats {
  int64_t tokens = 0;
  double seconds = 0, bytes = 0;
};

struct Shifts {
  std::vector<float> xk, yk, xk_raw, yk_raw, xv, yv;
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

// Stage 3/5: one streaming pass, in rounds. With T = ctx.readers().size(), round r covers the shards
// [r*T*E, (r+1)*T*E) (E = runtime.checkpoint.every_shards); reader p reads those with index % T == p. After each round `on_round` runs on
// every rank (it reduces and checkpoints); `abandoned` is true when this rank stopped reading on a stop signal.
// k_rope may be null (the pass then does not keep raw keys).
using RoundHook = std::function<void(int64_t round, int64_t rounds, bool abandoned)>;
int64_t pass_rounds(const Calibration& cal, int ranks);
PassStats stream_pass(const Calibration& cal, Context& ctx, Moments& k, Moments* k_rope, Moments& v,
                      const std::string& label, int64_t start_round = 0, const RoundHook& on_round = {});

}  // namespace crosskv
