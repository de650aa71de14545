#pragma once
// Stage 8: held-out diagnostics of mappers (SPEC §7), the same for crosskv-fit (eval.shards, every k) and
// crosskv-eval (one mapper): per k a JSON of figures, and one report.html for a person to read.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "apply/diagnose.hpp"

namespace crosskv {

class ComputeBackend;

struct MapperEvaluation {
  std::string dir;           // the mapper folder (k<K>/)
  nlohmann::json manifest;
  std::string title;         // "<source model> -> <target model>"
  Evaluation evaluation;
  nlohmann::json json() const;  // the figures, with "mapper"
};

// Each mapper in `dirs` diagnosed on the same held-out caches (`verify`: check the layer files' SHA-256).
std::vector<MapperEvaluation> evaluate_mappers(const std::vector<std::string>& dirs, const Cache& source,
                                               const Cache& target, ComputeBackend& be, bool verify);

// report.html of the evaluations: `held_out` names the held-out data; `heatmap_path`, when it exists, the fit's R²
// heatmaps to embed.
std::string render_evaluation_report(const std::vector<MapperEvaluation>& evals, const std::string& held_out,
                                     const std::string& heatmap_path);

// crosskv-fit's eval stage: every k in `artifacts` on the held-out shard pairs; writes <out>/eval-k<K>.json and
// <out>/report.html, returns the report's path.
std::string evaluate_held_out(const std::vector<std::string>& source_shards,
                              const std::vector<std::string>& target_shards, const std::string& held_out_names,
                              const std::vector<std::string>& artifacts, const std::string& output_dir,
                              const std::string& heatmap_path, ComputeBackend& be);

}  // namespace crosskv
