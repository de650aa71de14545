#pragma once
// The residual-MLP stage's data (fit/mlp): which calibration and eval rows a rank reads, split into training and
// validation by sequence, and one (target layer, kind)'s features and targets in content space.
#include <cstdint>
#include <string>
#include <vector>

#include "core/kind.hpp"
#include "fit/config.hpp"
#include "fit/calibration.hpp"

namespace crosskv {

// Whether sequence s of calibration shard `rel` is held back for validation: a function of the shard's name, the
// sequence and fit.mlp.seed alone, so that it does not depend on which rank reads the shard.
bool validation_sequence(const std::string& rel, int64_t s, const MlpSettings& c);

// The rows of one shard pair that a rank reads, for each whether it is for validation, and both sides' positions
// (read once: every (layer, kind) strips RoPE with them).
struct ShardRows {
  const ShardPair* pair = nullptr;
  std::vector<int64_t> rows;
  std::vector<uint8_t> validation;
  std::vector<int32_t> source_positions, target_positions;
};

// A rank's share of the data: shards i with i % T == token_group, over the calibration shards (the rows the fit
// used, 0, s, 2s, ..., split by sequence) and then the eval shards (every s-th row, all for validation).
std::vector<ShardRows> plan_rows(const Calibration& cal, int T, int token_group);

// One (target layer, kind)'s data on this rank, in content space: the selected source layers side by side (x, K
// wide) and the target layer (y, G wide), the rows of training [0] and of validation [1] apart.
struct LayerData {
  std::vector<float> x[2], y[2];
  int64_t rows[2] = {0, 0};
};
LayerData load_layer_data(const Calibration& cal, const std::vector<ShardRows>& share, const std::vector<int>& sources,
                          int l, Kind kind);

}  // namespace crosskv
