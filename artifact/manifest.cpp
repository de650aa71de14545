#include "artifact/manifest.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>

#include "core/atomic_file.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

nlohmann::json nan_to_null(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(std::isnan(x) ? nlohmann::json(nullptr) : nlohmann::json(x));
  return a;
}

nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

nlohmann::json run_json(const ManifestRun& r) {
  nlohmann::json timings = nlohmann::json::object();
  for (const auto& [stage, s] : r.timings_s) timings[stage] = s;
  return {{"timings_s", timings},
          {"grid", {{"ranks", r.ranks}, {"layer_groups", r.layer_groups}, {"token_groups", r.token_groups},
                    {"collectives", r.collectives}, {"backend", r.backend}, {"targets", r.targets}}},
          {"passes", r.passes},
          {"r2_file", r.r2_file}};
}

}  // namespace

nlohmann::json calibration_json(const ManifestCalibration& c) {
  nlohmann::json shards = nlohmann::json::array();
  for (const auto& s : c.shards)
    shards.push_back({{"path", s.path}, {"domain", s.domain}, {"tokens", s.tokens}, {"tokens_used", s.tokens_used},
                      {"fingerprint_sha256", s.fingerprint_sha256}});
  return {{"domains", c.domains},
          {"weights", c.weights},
          {"shards", shards},
          {"tokens_used", c.tokens_used},
          {"token_stride", c.token_stride},
          {"max_tokens", c.max_tokens ? nlohmann::json(*c.max_tokens) : nlohmann::json(nullptr)},
          {"token_weighting", c.token_weighting}};
}

nlohmann::json mlp_settings_json(const MlpSettings& m) {
  return {{"hidden", m.hidden},
          {"epochs", m.epochs},
          {"lr", m.lr},
          {"batch_tokens", m.batch_tokens},
          {"weight_decay", m.weight_decay},
          {"val_fraction", m.val_fraction},
          {"seed", m.seed}};
}

nlohmann::json manifest_layer_entry(int target_layer, const std::vector<int>& source_layers, const std::string& file,
                                    const std::string& sha256, const std::vector<double>& r2_k,
                                    const std::vector<double>& r2_v) {
  return {{"target_layer", target_layer}, {"source_layers", source_layers}, {"file", file},
          {"sha256", sha256},             {"r2_k", nan_to_null(r2_k)},      {"r2_v", nan_to_null(r2_v)}};
}

namespace {

nlohmann::json model_json(const ManifestModel& model, const KvSpec& spec) {
  nlohmann::json j = {{"model", model.name}, {"kv_spec", kv_spec_to_json(spec)}};
  if (!model.weights.empty()) j["weights"] = model.weights;
  return j;
}

}  // namespace

nlohmann::json make_manifest(const ManifestModel& source_model, const KvSpec& source, const ManifestModel& target_model,
                             const KvSpec& target, const ManifestFit& fit, const nlohmann::json& layers,
                             const ManifestCalibration& calibration, const std::optional<ManifestRun>& run) {
  nlohmann::json m = {{"format", kMapperFormat},
          {"format_version", kManifestVersion},
          {"tool", {{"name", "crosskv"}, {"version", CROSSKV_VERSION}}},
          {"source", model_json(source_model, source)},
          {"target", model_json(target_model, target)},
          {"fit",
           {{"k", fit.k_label == "all" ? nlohmann::json("all") : nlohmann::json(fit.k_count)},
            {"k_count", fit.k_count},
            {"features", fit.features},
            {"lambda", fit.lambda},
            {"lambda_scale", "covariance"},
            {"probe", fit.probe},
            {"structure", fit.structure},
            {"dtype", fit.dtype},
            {"content_space", true},
            {"params", fit.params},
            {"bias_params", fit.bias_params}}},
          {"layers", layers},
          {"calibration", calibration_json(calibration)}};
  if (fit.synthetic) m["fit"]["synthetic"] = true;
  if (!fit.lambda_choice.is_null()) m["fit"]["lambda_choice"] = fit.lambda_choice;
  if (run) {
    const nlohmann::json r = run_json(*run);
    for (auto it = r.begin(); it != r.end(); ++it) m[it.key()] = it.value();
  }
  return m;
}

void add_layer_mlp(nlohmann::json& entry, const std::string& sha256, const std::vector<ManifestMlpDecision>& kinds) {
  nlohmann::json mlp = nlohmann::json::object();
  for (const ManifestMlpDecision& d : kinds) {
    nlohmann::json& j = mlp[kind_name(d.kind)];
    j = {{"kept", d.kept},
         {"val_mse_ridge", finite_or_null(d.val_mse_ridge)},
         {"val_mse_mlp", finite_or_null(d.val_mse_mlp)},
         {"val_r2_ridge", finite_or_null(d.val_r2_ridge)},
         {"val_r2_mlp", finite_or_null(d.val_r2_mlp)}};
    if (d.kept) j["hidden"] = d.hidden;
  }
  entry["sha256"] = sha256;
  entry["mlp"] = mlp;
}

void add_fit_mlp(nlohmann::json& manifest, const std::string& mapper_kind, const MlpSettings& settings,
                 double seconds) {
  manifest["fit"]["mapper"] = mapper_kind;
  manifest["fit"]["mlp"] = mlp_settings_json(settings);
  if (manifest.contains("timings_s")) {
    manifest["timings_s"]["mlp"] = seconds;
    manifest["timings_s"]["total"] = manifest["timings_s"].value("total", 0.0) + seconds;
  }
}

void write_manifest(const std::string& dir, const nlohmann::json& m) {
  write_file_atomic((fs::path(dir) / kManifestFile).string(), m.dump(2) + "\n");
}

nlohmann::json read_manifest_json(const std::string& dir) {
  std::ifstream in((fs::path(dir) / kManifestFile).string());
  return nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
}

}  // namespace crosskv
