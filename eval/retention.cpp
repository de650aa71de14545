#include "eval/retention.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>

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

const RetentionModel& retention_model() {
  // tools/family/calibrate.py fit (docs/retention-calibration.json, "model"); ctest docs.retention_calibration.
  static const RetentionModel m{
      /*intercept=*/-0.21315,
      /*terms=*/{{RetentionFeature::attention_cosine, 1.178903}},
      /*half_width=*/0.118325,
      /*coverage=*/0.9,
      /*loso_mae=*/0.049796,
      /*mappers=*/69,
      /*cosine_min=*/0.305675, /*cosine_max=*/0.896879, /*mean_only_min=*/0.002081, /*mean_only_max=*/0.490776,
      "the small family of docs/RESULTS.md (two Qwen3-style models trained on Shakespeare, 4 and 8 layers), its "
      "content share (crosskv.retention); a real pair may differ",
      /*target=*/"content_share"};
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
