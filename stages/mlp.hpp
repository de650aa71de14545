#pragma once
// Stage 7b (issue 15): residual MLPs on top of the exported ridge mappers (fit.mapper: mlp | auto).
#include <string>
#include <vector>

#include "stages/stages.hpp"

namespace crosskv {

// For every mapper folder in `artifacts` and every target layer (layer l on rank l mod P) and kind: the calibration
// tokens' content-space features of the layer's selected source layers and the ridge's residual on them, split by
// sequence into training and validation (fit.mlp.val_fraction); a residual MLP trained on the first
// (train_residual_mlp), and kept where fit.mapper is mlp, or where it raises the validation R² by at least 0.001
// (auto). Rank 0 adds
// the kept MLPs to the layer files and records every decision and both validation scores in the manifest
// (layers[].mlp). Deterministic: the same job writes the same bytes. Every rank calls it.
void fit_residual_mlps(Context& ctx, const Calibration& cal, const std::vector<std::string>& artifacts);

}  // namespace crosskv
