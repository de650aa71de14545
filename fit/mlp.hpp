#pragma once
// Stage 7b: residual MLPs on top of the ridge mappers (fit.mapper: mlp | auto), between the export's
// manifests (written into k<K>.partial) and their publication as k<K>.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "fit/calibration.hpp"
#include "fit/context.hpp"

namespace crosskv {

// For every mapper folder in `partial_dirs` and every (target layer, kind): a residual MLP on the ridge's residual,
// trained on the calibration sequences not held back (fit.mlp.val_fraction) and judged on those held back plus every
// token_stride-th token of eval.shards. Layer l goes to layer group l mod G; its T ranks split the shards round-robin
// and train data-parallel (train_residual_mlp over the group's comm), so every rank of the group ends with the same
// bits. An MLP is kept where fit.mapper is mlp, or where it raises the validation R² by at least 0.001 (auto). Rank 0
// adds the kept MLPs to the layer files, records every decision with both validation scores in the manifest
// (layers[].mlp) and updates the export's records, so that a resumed export takes the rewritten layers over.
//
// Checkpointed under <ckpt_dir>/mlp/: each trained (layer, kind) as soon as it is judged, and a training in progress
// after an epoch at most every fit.mlp.checkpoint_seconds (and when a stop is requested: the stop is agreed per
// epoch within the layer group, then Interrupted is raised). Running the job again takes those over (same
// identity: `export_identity`, which holds the mapper and fit.mlp) and ends with the same bytes as an uninterrupted run.
// Every rank calls it.
void fit_residual_mlps(Context& ctx, const Calibration& cal, const std::vector<std::string>& partial_dirs,
                       const std::string& ckpt_dir, const nlohmann::json& export_identity);

}  // namespace crosskv
