#include "artifact/manifest.hpp"

#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include "artifact/manifest_json.hpp"
#include "artifact/mapper.hpp"
#include "core/atomic_file.hpp"
#include "core/error.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace manifest_json {

const nlohmann::json& field(const nlohmann::json& j, const std::string& key, const std::string& path,
                            const std::string& prefix) {
  if (!j.is_object() || !j.contains(key)) throw InputError(path + ": missing field '" + prefix + key + "'");
  return j[key];
}

std::string str_field(const nlohmann::json& j, const std::string& key, const std::string& path,
                      const std::string& prefix) {
  const auto& v = field(j, key, path, prefix);
  if (!v.is_string()) throw InputError(path + ": field '" + prefix + key + "' must be a string");
  return v.get<std::string>();
}

int64_t int_field(const nlohmann::json& j, const std::string& key, const std::string& path,
                  const std::string& prefix) {
  const auto& v = field(j, key, path, prefix);
  if (!v.is_number_integer()) throw InputError(path + ": field '" + prefix + key + "' must be an integer");
  return v.get<int64_t>();
}

namespace {

double num_field(const nlohmann::json& j, const std::string& key, const std::string& path, const std::string& prefix) {
  const auto& v = field(j, key, path, prefix);
  if (!v.is_number()) throw InputError(path + ": field '" + prefix + key + "' must be a number");
  return v.get<double>();
}

// A number, or null for NaN or infinity.
double num_or_null(const nlohmann::json& j, const std::string& key, const std::string& path,
                   const std::string& prefix) {
  return field(j, key, path, prefix).is_null() ? NAN : num_field(j, key, path, prefix);
}

std::vector<double> nums_or_null(const nlohmann::json& j, const std::string& key, const std::string& path,
                                 const std::string& prefix) {
  const auto& a = field(j, key, path, prefix);
  if (!a.is_array()) throw InputError(path + ": field '" + prefix + key + "' must be a list of numbers");
  std::vector<double> v;
  for (const auto& x : a) {
    if (!x.is_number() && !x.is_null())
      throw InputError(path + ": field '" + prefix + key + "' must be a list of numbers (or null), got " + x.dump());
    v.push_back(x.is_null() ? NAN : x.get<double>());
  }
  return v;
}

nlohmann::json nan_to_null(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr));
  return a;
}

nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

const nlohmann::json& object_field(const nlohmann::json& j, const std::string& key, const std::string& path,
                                   const std::string& prefix) {
  const auto& v = field(j, key, path, prefix);
  if (!v.is_object()) throw InputError(path + ": field '" + prefix + key + "' must be an object");
  return v;
}

// {"keys": x, "values": y} of one value per mapped kind.
template <class T, class Read>
ByKind<T> by_kind(const nlohmann::json& j, const std::string& key, const std::string& path, const std::string& prefix,
                  Read read) {
  const auto& o = object_field(j, key, path, prefix);
  ByKind<T> out;
  for (Kind kind : kMappedKinds) out[kind] = read(o, kind_dataset(kind), path, prefix + key + ".");
  return out;
}

nlohmann::json lambda_to_json(const ManifestLambda& x) {
  nlohmann::json j = {{"source_layer", x.source_layer}};
  for (Kind kind : kMappedKinds) {
    j["rho"][kind_dataset(kind)] = x.rho[kind];
    j["gcv"][kind_dataset(kind)] = nan_to_null(x.gcv[kind]);
    j[kind_dataset(kind)] = x.lambda[kind];
  }
  return j;
}

ManifestLambda lambda_from_json(const nlohmann::json& j, const std::string& path, const std::string& pre) {
  ManifestLambda x;
  x.source_layer = static_cast<int>(int_field(j, "source_layer", path, pre));
  x.rho = by_kind<double>(j, "rho", path, pre, num_field);
  x.gcv = by_kind<std::vector<double>>(j, "gcv", path, pre, nums_or_null);
  for (Kind kind : kMappedKinds) x.lambda[kind] = num_field(j, kind_dataset(kind), path, pre);
  return x;
}

nlohmann::json mlp_to_json(const std::vector<ManifestMlpDecision>& kinds) {
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
  return mlp;
}

std::vector<ManifestMlpDecision> mlp_from_json(const nlohmann::json& j, const std::string& path,
                                               const std::string& pre) {
  if (!j.is_object()) throw InputError(path + ": field '" + pre + "' must be an object");
  std::vector<ManifestMlpDecision> out;
  for (Kind kind : kMappedKinds) {
    if (!j.contains(kind_name(kind))) continue;
    const std::string p = pre + "." + kind_name(kind) + ".";
    const auto& d = object_field(j, kind_name(kind), path, pre + ".");
    const auto& kept = field(d, "kept", path, p);
    if (!kept.is_boolean()) throw InputError(path + ": field '" + p + "kept' must be true or false");
    out.push_back({kind, kept.get<bool>(), num_or_null(d, "val_mse_ridge", path, p),
                   num_or_null(d, "val_mse_mlp", path, p), num_or_null(d, "val_r2_ridge", path, p),
                   num_or_null(d, "val_r2_mlp", path, p), kept.get<bool>() ? int_field(d, "hidden", path, p) : 0});
  }
  return out;
}

MlpSettings mlp_settings_from_json(const nlohmann::json& j, const std::string& path) {
  const std::string p = "fit.mlp.";
  if (!j.is_object()) throw InputError(path + ": field 'fit.mlp' must be an object");
  MlpSettings s;
  s.hidden = static_cast<int>(int_field(j, "hidden", path, p));
  s.epochs = static_cast<int>(int_field(j, "epochs", path, p));
  s.lr = num_field(j, "lr", path, p);
  s.batch_tokens = int_field(j, "batch_tokens", path, p);
  s.weight_decay = num_field(j, "weight_decay", path, p);
  s.val_fraction = num_field(j, "val_fraction", path, p);
  s.seed = static_cast<uint64_t>(int_field(j, "seed", path, p));
  return s;
}

}  // namespace

nlohmann::json layer_to_json(const ManifestLayer& e) {
  nlohmann::json j = {{"target_layer", e.target_layer}, {"source_layers", e.source_layers}, {"file", e.file},
                      {"sha256", e.sha256},             {"r2_k", nan_to_null(e.r2_k)},      {"r2_v", nan_to_null(e.r2_v)}};
  if (e.lambda) j["lambda"] = lambda_to_json(*e.lambda);
  if (!e.mlp.empty()) j["mlp"] = mlp_to_json(e.mlp);
  return j;
}

ManifestLayer layer_from_json(const nlohmann::json& l, const std::string& path, const std::string& pre) {
  if (!l.is_object()) throw InputError(path + ": " + pre + " must be an object");
  ManifestLayer e;
  e.target_layer = static_cast<int>(int_field(l, "target_layer", path, pre + "."));
  const auto& sl = field(l, "source_layers", path, pre + ".");
  if (!sl.is_array()) throw InputError(path + ": " + pre + ".source_layers must be a list of integers");
  for (const auto& a : sl) {
    if (!a.is_number_integer() || a.get<int64_t>() < 0 || a.get<int64_t>() > (1 << 20))
      throw InputError(path + ": " + pre + ".source_layers must be layer numbers, got " + sl.dump());
    e.source_layers.push_back(a.get<int>());
  }
  e.file = str_field(l, "file", path, pre + ".");
  e.sha256 = str_field(l, "sha256", path, pre + ".");
  if (l.contains("r2_k")) e.r2_k = nums_or_null(l, "r2_k", path, pre + ".");
  if (l.contains("r2_v")) e.r2_v = nums_or_null(l, "r2_v", path, pre + ".");
  if (l.contains("lambda") && !l["lambda"].is_null())
    e.lambda = lambda_from_json(object_field(l, "lambda", path, pre + "."), path, pre + ".lambda.");
  if (l.contains("mlp")) e.mlp = mlp_from_json(l["mlp"], path, pre + ".mlp");
  return e;
}

void read_fit_details(const nlohmann::json& fit, const std::string& path, MapperManifest& m) {
  const std::string p = "fit.";
  if (fit.contains("lambda") && !(fit["lambda"].is_number() || fit["lambda"] == "auto"))
    throw InputError(path + ": fit.lambda is " + fit["lambda"].dump() + ", expected a number or \"auto\"");
  if (fit.contains("lambda") && fit["lambda"].is_number()) m.lambda = fit["lambda"].get<double>();
  if (fit.contains("lambda_choice")) {
    const auto& c = object_field(fit, "lambda_choice", path, p);
    ManifestLambdaChoice choice;
    choice.criterion = str_field(c, "criterion", path, "fit.lambda_choice.");
    choice.grid = nums_or_null(c, "grid", path, "fit.lambda_choice.");
    choice.rho_all = by_kind<double>(c, "rho_all", path, "fit.lambda_choice.", num_field);
    m.lambda_choice = std::move(choice);
  }
  for (auto [key, to] : {std::pair{"features", &m.features}, {"params", &m.params}, {"bias_params", &m.bias_params}})
    if (fit.contains(key)) *to = int_field(fit, key, path, p);
  if (fit.contains("probe")) m.probe = str_field(fit, "probe", path, p);
  if (fit.contains("mlp")) m.mlp = mlp_settings_from_json(fit["mlp"], path);
}

ManifestCalibration calibration_from_json(const nlohmann::json& c, const std::string& path) {
  const std::string p = "calibration.";
  if (!c.is_object()) throw InputError(path + ": field 'calibration' must be an object");
  ManifestCalibration out;
  try {  // the types of the parts a reader shows; the calibration is a record, not an input
    out.domains = c.value("domains", std::vector<std::string>{});
    out.weights = c.value("weights", std::map<std::string, double>{});
    for (const auto& s : c.value("shards", nlohmann::json::array()))
      out.shards.push_back({s.at("path").get<std::string>(), s.value("domain", ""), s.value("fingerprint_sha256", ""),
                            s.value("tokens", int64_t{0}), s.value("tokens_used", int64_t{0})});
    out.tokens_used = c.value("tokens_used", int64_t{0});
    out.token_stride = c.value("token_stride", int64_t{1});
    if (c.contains("max_tokens") && !c["max_tokens"].is_null()) out.max_tokens = c["max_tokens"].get<int64_t>();
    out.token_weighting = c.value("token_weighting", std::string("uniform"));
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": field 'calibration' is malformed: " + e.what());
  }
  return out;
}

}  // namespace manifest_json

namespace {

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

nlohmann::json run_json(const ManifestRun& r) {
  nlohmann::json timings = nlohmann::json::object();
  for (const auto& [stage, s] : r.timings_s) timings[stage] = s;
  return {{"timings_s", timings},
          {"grid", {{"ranks", r.ranks}, {"layer_groups", r.layer_groups}, {"token_groups", r.token_groups},
                    {"collectives", r.collectives}, {"backend", r.backend}, {"targets", r.targets}}},
          {"passes", r.passes},
          {"r2_file", r.r2_file}};
}

nlohmann::json model_json(const ManifestModel& model, const KvSpec& spec) {
  nlohmann::json j = {{"model", model.name}, {"kv_spec", kv_spec_to_json(spec)}};
  if (!model.weights.empty()) j["weights"] = model.weights;
  return j;
}

nlohmann::json lambda_choice_json(const ManifestLambdaChoice& c) {
  nlohmann::json j = {{"criterion", c.criterion}, {"grid", c.grid}};
  for (Kind kind : kMappedKinds) j["rho_all"][kind_dataset(kind)] = c.rho_all[kind];
  return j;
}

nlohmann::json fit_json(const ManifestFit& fit) {
  nlohmann::json j = {{"k", fit.k_label == "all" ? nlohmann::json("all") : nlohmann::json(fit.k_count)},
                      {"k_count", fit.k_count},
                      {"features", fit.features},
                      {"lambda", fit.lambda ? nlohmann::json(*fit.lambda) : nlohmann::json("auto")},
                      {"lambda_scale", "covariance"},
                      {"probe", fit.probe},
                      {"structure", fit.structure},
                      {"dtype", fit.dtype},
                      {"content_space", true},
                      {"params", fit.params},
                      {"bias_params", fit.bias_params}};
  if (fit.synthetic) j["synthetic"] = true;
  if (fit.lambda_choice) j["lambda_choice"] = lambda_choice_json(*fit.lambda_choice);
  return j;
}

void write_json(const std::string& dir, const nlohmann::json& m) {
  write_file_atomic((fs::path(dir) / kManifestFile).string(), m.dump(2) + "\n");
}

}  // namespace

nlohmann::json mlp_settings_json(const MlpSettings& m) {
  return {{"hidden", m.hidden},
          {"epochs", m.epochs},
          {"lr", m.lr},
          {"batch_tokens", m.batch_tokens},
          {"weight_decay", m.weight_decay},
          {"val_fraction", m.val_fraction},
          {"seed", m.seed}};
}

std::string manifest_layer_text(const ManifestLayer& layer) { return manifest_json::layer_to_json(layer).dump(); }

std::optional<ManifestLayer> parse_manifest_layer_text(const std::string& text) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  try {
    return manifest_json::layer_from_json(j, "record", "layer");
  } catch (const InputError&) {
    return std::nullopt;
  }
}

void write_manifest(const std::string& dir, const ManifestModel& source_model, const KvSpec& source,
                    const ManifestModel& target_model, const KvSpec& target, const ManifestFit& fit,
                    const std::vector<ManifestLayer>& layers, const ManifestCalibration& calibration,
                    const std::optional<ManifestRun>& run) {
  nlohmann::json entries = nlohmann::json::array();
  for (const ManifestLayer& e : layers) entries.push_back(manifest_json::layer_to_json(e));
  nlohmann::json m = {{"format", kMapperFormat},
                      {"format_version", kManifestVersion},
                      {"tool", {{"name", "crosskv"}, {"version", CROSSKV_VERSION}}},
                      {"source", model_json(source_model, source)},
                      {"target", model_json(target_model, target)},
                      {"fit", fit_json(fit)},
                      {"layers", entries},
                      {"calibration", calibration_json(calibration)}};
  if (run) {
    const nlohmann::json r = run_json(*run);
    for (auto it = r.begin(); it != r.end(); ++it) m[it.key()] = it.value();
  }
  write_json(dir, m);
}

void add_mlps_to_manifest(const std::string& dir, const std::vector<ManifestLayer>& rewritten,
                          const std::string& mapper_kind, const MlpSettings& settings, double seconds) {
  const std::string path = (fs::path(dir) / kManifestFile).string();
  std::ifstream in(path);
  nlohmann::json m = nlohmann::json::parse(in, nullptr, /*allow_exceptions=*/false);
  CROSSKV_ASSERT(m.is_object() && m.contains("layers") && m["layers"].is_array(),
                 "residual MLPs for " + dir + " without its manifest");
  std::map<int, const ManifestLayer*> by_layer;
  for (const ManifestLayer& e : rewritten) by_layer[e.target_layer] = &e;
  for (auto& entry : m["layers"]) {
    const auto it = by_layer.find(entry.value("target_layer", -1));
    if (it != by_layer.end()) entry = manifest_json::layer_to_json(*it->second);
  }
  m["fit"]["mapper"] = mapper_kind;
  m["fit"]["mlp"] = mlp_settings_json(settings);
  if (m.contains("timings_s")) {
    m["timings_s"]["mlp"] = seconds;
    m["timings_s"]["total"] = m["timings_s"].value("total", 0.0) + seconds;
  }
  write_json(dir, m);
}

}  // namespace crosskv
