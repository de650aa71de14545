#pragma once
// Stage 8: held-out diagnostics of mappers (docs/METHOD.md, Diagnostics), the same for crosskv-fit (eval.shards, every k) and
// crosskv-eval (one mapper): per k a JSON of figures, and one report.html for a person to read.
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "artifact/mapper.hpp"
#include "eval/evaluation.hpp"
#include "core/kv_spec.hpp"

namespace crosskv {

class ComputeBackend;
class Comm;

struct MapperEvaluation {
  std::string dir;           // the mapper folder (k<K>/)
  MapperManifest manifest;
  std::string title;         // "<source model> -> <target model>"
  Evaluation evaluation;
  nlohmann::json json() const;  // the figures, with "mapper"
};

// The held-out tokens: a source and a target shard of the same tokens, pair by pair.
struct HeldOut {
  std::vector<std::string> source_shards, target_shards;
  std::string names;  // how the report names them
};

// What evaluate_mappers will hold and compute per rank (for --plan and the log).
struct EvalCost {
  int64_t tokens = 0, layers_per_rank = 0;
  int64_t peak_bytes = 0;   // one target layer with its queries and the diagnostics' scratch, plus the source
                            // layers resident at once (all of them when a mapper selects every source layer)
  double flops = 0;         // on the busiest rank, every mapper and both baselines
  std::string text() const;
};
EvalCost eval_cost(const KvSpec& source, const KvSpec& target, int64_t tokens, const std::vector<int64_t>& seq_offsets,
                   bool queries, int mappers, int ranks);
// The same for held-out shards (their headers and sequence offsets read).
EvalCost held_out_cost(const HeldOut& data, const KvSpec& source, const KvSpec& target, int mappers, int ranks);

// Each mapper in `dirs` diagnosed on the held-out shards with both baselines. Streamed by target layer: one target
// layer (keys, values, queries) is read at a time and diagnosed for every mapper; a source layer is read once, when
// first selected, and dropped after its last use. Target layers are shared out over the ranks of `comm` (layer l to
// rank l mod P) and every rank returns the whole result. `verify`: check the layer files' SHA-256. `th`: what the
// verdict asks.
std::vector<MapperEvaluation> evaluate_mappers(const std::vector<std::string>& dirs, const HeldOut& data,
                                               ComputeBackend& be, Comm& comm, bool verify,
                                               const VerdictThresholds& th = {});

// report.html of the evaluations: `held_out` names the held-out data; `heatmap_path`, when it exists, the fit's R²
// heatmaps to embed.
std::string render_evaluation_report(const std::vector<MapperEvaluation>& evals, const std::string& held_out,
                                     const std::string& heatmap_path);

// crosskv-fit's eval stage, on every rank: every k in `artifacts` on the held-out shard pairs; rank 0 writes
// <out>/eval-k<K>.json and <out>/report.html and returns the report's path.
std::string evaluate_held_out(const HeldOut& data, const std::vector<std::string>& artifacts,
                              const std::string& output_dir, const std::string& heatmap_path, ComputeBackend& be,
                              Comm& comm, const VerdictThresholds& th = {});

}  // namespace crosskv
