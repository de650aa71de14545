#pragma once
// A mapper folder's manifest (docs/FORMATS.md, Mapper artifact): its JSON is written here only (the export writes it,
// the residual-MLP stage adds its decisions to it) and read in artifact/mapper only, into typed fields.
#include <cmath>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/kind.hpp"
#include "core/kv_spec.hpp"
#include "core/mlp.hpp"

namespace crosskv {

inline constexpr const char* kManifestFile = "manifest.json";
inline constexpr const char* kMapperFormat = "crosskv-mapper";  // the manifest's and the layer files' "format"
inline constexpr int kManifestVersion = 1;

// fit.lambda: auto, the fit's choice: the criterion, the ρ grid and the k = all system's ρ per kind.
struct ManifestLambdaChoice {
  std::string criterion = "gcv";
  std::vector<double> grid;
  ByKind<double> rho_all;
};

// What one k of a fit is: its label ("4", "all"), source layers per target layer, features and parameters.
struct ManifestFit {
  std::string k_label;
  int k_count = 0;
  int64_t features = 0, params = 0, bias_params = 0;
  std::optional<double> lambda = 0.0;                 // the fixed λ; empty: "auto"
  std::optional<ManifestLambdaChoice> lambda_choice;  // auto: how λ was chosen (fit/lambda.hpp)
  std::string probe, dtype;
  std::string structure = "cross_head";  // or "per_head" (core/structure.hpp)
  bool synthetic = false;  // random weights of a real shape, for timing (fit.synthetic: true)
};

// The calibration a mapper was fitted on: "calibration".
struct ManifestShard {
  std::string path, domain, fingerprint_sha256;
  int64_t tokens = 0, tokens_used = 0;
};
struct ManifestCalibration {
  std::vector<std::string> domains;
  std::map<std::string, double> weights;
  std::vector<ManifestShard> shards;
  int64_t tokens_used = 0, token_stride = 1;
  std::optional<int64_t> max_tokens;
  std::string token_weighting = "uniform";  // fit.weighting: "uniform" or "dataset" (the target shards' weights)
};

// The run that made it: "timings_s" (stage -> seconds), "grid", "passes", "r2_file".
struct ManifestRun {
  std::vector<std::pair<std::string, double>> timings_s;
  int ranks = 1, layer_groups = 1, token_groups = 1;
  std::string collectives, backend, targets;
  int passes = 1;
  std::string r2_file;
};

// The residual MLPs' settings ("fit.mlp"), and one kind's decision of one layer ("layers[].mlp.k" / ".v").
struct ManifestMlpDecision {
  Kind kind = Kind::k;
  bool kept = false;
  double val_mse_ridge = NAN, val_mse_mlp = NAN, val_r2_ridge = NAN, val_r2_mlp = NAN;  // NaN or infinite as null
  int64_t hidden = 0;  // of the kept MLP
};

// fit.lambda: auto, one target layer's choice: the source layer GCV ran on, per kind ρ, the GCV curve over the grid
// (NaN where ρ was not a candidate) and the λ it gave.
struct ManifestLambda {
  int source_layer = 0;
  ByKind<double> rho, lambda;
  ByKind<std::vector<double>> gcv;
};

// A target layer's entry: its source layers, its layer file and that file's SHA-256, the fit's in-sample R² of keys
// and values per target head (NaN where undefined), and what later stages added.
struct ManifestLayer {
  int target_layer = 0;
  std::vector<int> source_layers;  // ascending, distinct
  std::string file, sha256;
  std::vector<double> r2_k, r2_v;
  std::optional<ManifestLambda> lambda;  // fit.lambda: auto
  std::vector<ManifestMlpDecision> mlp;  // the residual-MLP stage's decisions, keys then values (empty: no stage)
};
// An entry as the manifest holds it (one line of JSON: the export's record of a written layer), and read back:
// empty where the text is not an entry.
std::string manifest_layer_text(const ManifestLayer& layer);
std::optional<ManifestLayer> parse_manifest_layer_text(const std::string& text);

// A model as a manifest names it: its name, and its weights' fingerprint where the shards recorded one
// ("sha256:...", docs/FORMATS.md; empty: not written).
struct ManifestModel {
  std::string name, weights;
  ManifestModel(std::string name, std::string weights = {}) : name(std::move(name)), weights(std::move(weights)) {}
  ManifestModel(const char* name) : name(name) {}
};

// The whole manifest of one k: the models and their kv_specs, the fit, the layer entries, the calibration, and
// (when given) the run.
// Written into `dir` whole or not at all (indented, one trailing newline).
void write_manifest(const std::string& dir, const ManifestModel& source_model, const KvSpec& source,
                    const ManifestModel& target_model, const KvSpec& target, const ManifestFit& fit,
                    const std::vector<ManifestLayer>& layers, const ManifestCalibration& calibration,
                    const std::optional<ManifestRun>& run = {});
// The residual-MLP stage's rewrite of `dir`'s manifest: the given layers' entries (SHA-256 and decisions) replace
// theirs, and the fit gains its mapper kind, MLP settings and the stage's time.
void add_mlps_to_manifest(const std::string& dir, const std::vector<ManifestLayer>& rewritten,
                          const std::string& mapper_kind, const MlpSettings& settings, double seconds);
// The MLP settings as the manifest holds them (fit/solve.cpp's export identity holds them too).
nlohmann::json mlp_settings_json(const MlpSettings& s);

}  // namespace crosskv
