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

}  // namespace

nlohmann::json manifest_layer_entry(int target_layer, const std::vector<int>& source_layers, const std::string& file,
                                    const std::string& sha256, const std::vector<double>& r2_k,
                                    const std::vector<double>& r2_v) {
  return {{"target_layer", target_layer}, {"source_layers", source_layers}, {"file", file},
          {"sha256", sha256},             {"r2_k", nan_to_null(r2_k)},      {"r2_v", nan_to_null(r2_v)}};
}

nlohmann::json make_manifest(const std::string& source_model, const KvSpec& source, const std::string& target_model,
                             const KvSpec& target, const ManifestFit& fit, const nlohmann::json& layers,
                             const nlohmann::json& calibration) {
  return {{"format", kMapperFormat},
          {"format_version", kManifestVersion},
          {"tool", {{"name", "crosskv"}, {"version", CROSSKV_VERSION}}},
          {"source", {{"model", source_model}, {"kv_spec", kv_spec_to_json(source)}}},
          {"target", {{"model", target_model}, {"kv_spec", kv_spec_to_json(target)}}},
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
          {"calibration", calibration}};
}

void add_layer_mlp(nlohmann::json& entry, const std::string& sha256, const nlohmann::json& decisions) {
  entry["sha256"] = sha256;
  entry["mlp"] = decisions;
}

void add_fit_mlp(nlohmann::json& manifest, const std::string& mapper_kind, const nlohmann::json& settings,
                 double seconds) {
  manifest["fit"]["mapper"] = mapper_kind;
  manifest["fit"]["mlp"] = settings;
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
