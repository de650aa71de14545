#pragma once
// A mapper folder's manifest (docs/FORMATS.md, Mapper artifact), built and written here only: the export writes it, the
// residual-MLP stage adds its decisions to it, artifact/mapper reads it back.
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

// What one k of a fit is: its label ("4", "all"), source layers per target layer, features and parameters.
struct ManifestFit {
  std::string k_label;
  int k_count = 0;
  int64_t features = 0, params = 0, bias_params = 0;
  nlohmann::json lambda = 0.0;       // a number, or "auto"
  nlohmann::json lambda_choice;      // auto: how λ was chosen (fit/lambda.hpp); null otherwise
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
  double val_mse_ridge = 0, val_mse_mlp = 0, val_r2_ridge = 0, val_r2_mlp = 0;  // NaN or infinite as null
  int64_t hidden = 0;  // of the kept MLP
};

// A target layer's entry: its source layers, its layer file and that file's SHA-256, and the fit's per-output R²
// of keys and values (NaN as null).
nlohmann::json manifest_layer_entry(int target_layer, const std::vector<int>& source_layers, const std::string& file,
                                    const std::string& sha256, const std::vector<double>& r2_k,
                                    const std::vector<double>& r2_v);
// A model as a manifest names it: its name, and its weights' fingerprint where the shards recorded one
// ("sha256:...", docs/FORMATS.md; empty: not written).
struct ManifestModel {
  std::string name, weights;
  ManifestModel(std::string name, std::string weights = {}) : name(std::move(name)), weights(std::move(weights)) {}
  ManifestModel(const char* name) : name(name) {}
};

// The whole manifest of one k: the models and their kv_specs, the fit, the layer entries, the calibration, and
// (when given) the run.
nlohmann::json make_manifest(const ManifestModel& source_model, const KvSpec& source, const ManifestModel& target_model,
                             const KvSpec& target, const ManifestFit& fit, const nlohmann::json& layers,
                             const ManifestCalibration& calibration, const std::optional<ManifestRun>& run = {});
nlohmann::json calibration_json(const ManifestCalibration& c);
nlohmann::json mlp_settings_json(const MlpSettings& s);
// The residual-MLP stage's additions: a layer's decisions (and its rewritten file's SHA-256), and the fit's mapper
// kind, MLP settings and the stage's time.
void add_layer_mlp(nlohmann::json& entry, const std::string& sha256, const std::vector<ManifestMlpDecision>& kinds);
void add_fit_mlp(nlohmann::json& manifest, const std::string& mapper_kind, const MlpSettings& settings,
                 double seconds);
// Written whole or not at all (indented, one trailing newline), and read back as JSON (the caller checks it).
void write_manifest(const std::string& dir, const nlohmann::json& m);
nlohmann::json read_manifest_json(const std::string& dir);

}  // namespace crosskv
