#pragma once
// Stage 6: the ridge solves of every k for this rank's target layers, handed to the export (fit/export).
#include <functional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "artifact/manifest.hpp"
#include "fit/moments.hpp"
#include "fit/plan.hpp"

namespace crosskv {

class ArtifactWriter;
class Lambdas;

// Target layer l belongs to layer group l mod G and, within it, round-robin to its solve units: pairs of readers
// (token groups 2j and 2j+1), and for an odd T the last reader alone. In a pair, member 0 solves the keys and member 1
// the values of the pair's layers, and they take turns writing a layer's file (the other sends its fits), so each
// frees the other kind's moments and factors one k = all system; a reader alone solves both kinds. Layers an
// interrupted export already wrote (ArtifactWriter::resume_layer, agreed within a pair) are not solved again. Returns
// when this rank's layers are written (writer.drain()); `mk` or `mv` may be emptied. A stop signal is agreed per
// layer within a pair and raises Interrupted (naming `ckpt_dir`, where the moments are committed).
void solve_layers(Context& ctx, const FitPlan& plan, Moments& mk, Moments& mv,
                  const std::vector<std::vector<int>>& rankings, const Lambdas& lambdas, ArtifactWriter& writer,
                  const std::string& ckpt_dir);

// What the layers' files depend on: the data and how it was read (the checkpoint's identity, with the grid), the
// solve's settings, the residual MLPs' (fit.mapper, fit.mlp, eval.shards) when there are any, and this version. An
// interrupted export (and the residual-MLP stage) resumes only for the same.
nlohmann::json export_identity(const Calibration& cal, const FitPlan& plan, int ranks);

// Stages 6-7 for the job: an ArtifactWriter for every k (an interrupted export of the same job keeps the layers it
// wrote), this rank's layers solved and written (solve_layers), and on rank 0 every rank's manifest entries gathered
// and the manifests written with the run's record `manifest_run()` (called there, after the solves). Returns the k<K>/ folders on
// rank 0, nothing elsewhere; without `publish`, the k<K>.partial folders, with their manifests, not yet in place
// (ArtifactWriter::finish).
std::vector<std::string> solve_and_export(Context& ctx, const Calibration& cal, const FitPlan& plan, Moments& mk,
                                          Moments& mv, const std::vector<std::vector<int>>& rankings,
                                          const Lambdas& lambdas, const std::string& ckpt_dir,
                                          const std::function<ManifestRun()>& manifest_run, bool publish = true);

}  // namespace crosskv
