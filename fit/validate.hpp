#pragma once
// Stage 1 of a fit: the config, the stores and their shards checked, read as metadata.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fit/config.hpp"
#include "fit/calibration.hpp"

namespace crosskv {

// Stage 1: config, stores, shards. Reads only metadata, token ids and positions.
// `fresh` (crosskv-fit --fresh): the checkpoint's kept provisional shift is not preferred (a fresh start chooses
// as a new job does).
Calibration validate(const FitConfig& cfg, bool fresh = false);

}  // namespace crosskv
