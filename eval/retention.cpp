#include "eval/retention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <tuple>

#include "core/error.hpp"

namespace crosskv {

const char* to_string(RetentionFeature f) {
  switch (f) {
    case RetentionFeature::attention_cosine: return "attention_cosine";
    case RetentionFeature::cosine_margin: return "cosine_margin";
    case RetentionFeature::r2_mean: return "r2_mean";
    case RetentionFeature::k_concentration: return "k_concentration";
  }
  return "?";
}

nlohmann::json RetentionModel::json() const {
  nlohmann::json c = nlohmann::json::object();
  for (const auto& [f, w] : terms) c[to_string(f)] = w;
  return {{"intercept", intercept},
          {"coefficients", c},
          {"half_width", half_width},
          {"coverage", coverage},
          {"loso_mae", loso_mae},
          {"mappers", mappers},
          {"ranges", {{"attention_cosine", {cosine_min, cosine_max}}, {"mean_only_cosine", {mean_only_min, mean_only_max}}}},
          {"calibrated_on", calibrated_on},
          {"target", target}};
}

std::string target_name(const RetentionModel& model) {
  return model.target == "content_share" ? "content share" : "recovered share";
}

std::string target_meaning(const RetentionModel& model) {
  if (model.target == "content_share")
    return "of what the target's own prefill gains over its own prefill of another text, gained by the mapped cache "
           "over the mapper's cache of that text: a cache without this context's content scores 0";
  return "of the prefix's benefit: the target's perplexity with its own prefill against none";
}

namespace {

double number(const nlohmann::json& j, const char* key, const std::string& file, const std::string& where) {
  const auto it = j.find(key);
  if (it == j.end() || !it->is_number())
    throw ConfigError(file + ": " + where + key + ": expected a number");
  return it->get<double>();
}

std::pair<double, double> range(const nlohmann::json& ranges, const char* key, const std::string& file) {
  const auto it = ranges.find(key);
  if (it == ranges.end() || !it->is_array() || it->size() != 2 || !(*it)[0].is_number() || !(*it)[1].is_number())
    throw ConfigError(file + ": model.ranges." + key + ": expected [low, high]");
  return {(*it)[0].get<double>(), (*it)[1].get<double>()};
}

RetentionFeature feature_named(const std::string& name, const std::string& file) {
  for (RetentionFeature f : {RetentionFeature::attention_cosine, RetentionFeature::cosine_margin,
                             RetentionFeature::r2_mean, RetentionFeature::k_concentration})
    if (name == to_string(f)) return f;
  throw ConfigError(file + ": model.coefficients." + name +
                    ": not a feature (attention_cosine, cosine_margin, r2_mean or k_concentration)");
}

RetentionModel model_of(const nlohmann::json& doc, const std::string& file) {
  if (!doc.is_object() || doc.value("format", "") != "crosskv-retention-calibration" || doc.value("version", 0) != 1)
    throw ConfigError(file + ": expected \"format\": \"crosskv-retention-calibration\", \"version\": 1 "
                      "(tools/family/calibrate.py fit writes it)");
  const auto m = doc.find("model");
  if (m == doc.end() || !m->is_object()) throw ConfigError(file + ": model: expected an object");
  RetentionModel r;
  r.intercept = number(*m, "intercept", file, "model.");
  const auto c = m->find("coefficients");
  if (c == m->end() || !c->is_object() || c->empty())
    throw ConfigError(file + ": model.coefficients: expected an object of feature: coefficient");
  for (const auto& [name, w] : c->items()) {
    const RetentionFeature f = feature_named(name, file);
    if (!w.is_number()) throw ConfigError(file + ": model.coefficients." + name + ": expected a number");
    r.terms.emplace_back(f, w.get<double>());
  }
  r.half_width = number(*m, "half_width", file, "model.");
  r.coverage = number(*m, "coverage", file, "model.");
  r.loso_mae = number(*m, "loso_mae", file, "model.");
  r.mappers = static_cast<int>(number(*m, "mappers", file, "model."));
  const auto ranges = m->find("ranges");
  if (ranges == m->end() || !ranges->is_object()) throw ConfigError(file + ": model.ranges: expected an object");
  std::tie(r.cosine_min, r.cosine_max) = range(*ranges, "attention_cosine", file);
  std::tie(r.mean_only_min, r.mean_only_max) = range(*ranges, "mean_only_cosine", file);
  r.target = m->value("target", doc.value("target", std::string("recovered")));
  if (r.target != "recovered" && r.target != "content_share")
    throw ConfigError(file + ": model.target: expected \"recovered\" or \"content_share\", not \"" + r.target + "\"");
  r.calibrated_on = doc.value("calibrated_on", std::string());
  return r;
}

}  // namespace

RetentionModel load_retention_model(const std::filesystem::path& file) {
  std::ifstream in(file);
  if (!in) throw ConfigError(file.string() + ": cannot read the retention model (" + kRetentionModelEnv + ")");
  nlohmann::json doc;
  try {
    doc = nlohmann::json::parse(in);
  } catch (const nlohmann::json::parse_error& e) {
    throw ConfigError(file.string() + ": not JSON: " + e.what());
  }
  return model_of(doc, file.string());
}

std::filesystem::path retention_model_path() {
  const char* env = std::getenv(kRetentionModelEnv);
  return env && *env ? std::filesystem::path(env) : std::filesystem::path(CROSSKV_RETENTION_MODEL_FILE);
}

const RetentionModel& retention_model() {
  static const RetentionModel m = load_retention_model(retention_model_path());
  return m;
}

std::optional<double> implied_threshold(double share, const RetentionModel& model) {
  if (model.terms.size() != 1 || model.terms[0].second == 0) return std::nullopt;
  return (share - model.intercept) / model.terms[0].second;
}

std::optional<double> retention_feature(RetentionFeature f, const Diagnostics& mapper, const Diagnostics& mean_only) {
  switch (f) {
    case RetentionFeature::attention_cosine:
      return mapper.attention_cosine;
    case RetentionFeature::cosine_margin:
      if (!mapper.attention_cosine || !mean_only.attention_cosine || *mean_only.attention_cosine >= 1.0)
        return std::nullopt;
      return (*mapper.attention_cosine - *mean_only.attention_cosine) / (1.0 - *mean_only.attention_cosine);
    case RetentionFeature::r2_mean:
      return 0.5 * (mapper.r2_k + mapper.r2_v);
    case RetentionFeature::k_concentration:
      return mapper.k_concentration;
  }
  return std::nullopt;
}

std::optional<RetentionEstimate> predict_retention(const Diagnostics& mapper, const Diagnostics& mean_only,
                                                   const RetentionModel& model) {
  double share = model.intercept;
  for (const auto& [f, w] : model.terms) {
    const std::optional<double> x = retention_feature(f, mapper, mean_only);
    if (!x || !std::isfinite(*x)) return std::nullopt;
    share += w * *x;
  }
  share = std::min(share, 1.0);
  RetentionEstimate e{share, share - model.half_width, std::min(share + model.half_width, 1.0), {}};
  auto outside = [&](const char* what, std::optional<double> x, double lo, double hi) {
    if (!x || (*x >= lo && *x <= hi)) return;
    char buf[160];
    std::snprintf(buf, sizeof buf, "%s%s %.3f is outside the calibration's %.3f to %.3f", e.outside.empty() ? "" : "; ",
                  what, *x, lo, hi);
    e.outside += buf;
  };
  outside("the attention cosine", mapper.attention_cosine, model.cosine_min, model.cosine_max);
  outside("the mean-only cosine", mean_only.attention_cosine, model.mean_only_min, model.mean_only_max);
  return e;
}

}  // namespace crosskv
