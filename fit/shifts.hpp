#pragma once
// The provisional shifts the moments are accumulated about, and their copy kept beside the checkpoints.
#include <array>
#include <string>
#include <vector>

#include "core/kind.hpp"
#include "fit/calibration.hpp"

namespace crosskv {

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

}  // namespace crosskv
