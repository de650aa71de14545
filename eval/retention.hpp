#pragma once
// The retention predictor behind the verdict: the share of the prefix's benefit a mapper keeps (the
// family studies' perplexity protocol, docs/RESULTS.md), predicted from its held-out diagnostics by a small monotone
// model fitted by tools/family/calibrate.py, with the interval that held 90% of its errors when each study was left
// out. The programs read it at run time from one file (docs/retention-calibration.json unless CROSSKV_RETENTION_MODEL
// names another), so a refit reaches them without a rebuild. Calibrated on one small family: a real pair may differ.
#include <filesystem>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "eval/evaluation.hpp"

namespace crosskv {

enum class RetentionFeature { attention_cosine, cosine_margin, r2_mean, k_concentration };
const char* to_string(RetentionFeature f);

struct RetentionModel {
  double intercept = 0;
  std::vector<std::pair<RetentionFeature, double>> terms;  // recovered = intercept + Σ coefficient·feature (≤ 1)
  double half_width = 0;                                   // the interval: ± this
  double coverage = 0;                                     // of the held-out errors it covered
  double loso_mae = 0;                                     // mean absolute error, leaving one study out
  int mappers = 0;                                         // calibrated on
  // Where the calibration has data: the mappers' attention cosines, and their mean-only baselines'.
  double cosine_min = 0, cosine_max = 1, mean_only_min = 0, mean_only_max = 1;
  std::string calibrated_on;
  std::string target = "recovered";  // what it predicts: "recovered" (the share of the prefix's gain) or "content_share"
  nlohmann::json json() const;  // calibrate.py's "model" (crosskv-eval --print-retention-model)
};

// The predicted figure's name in a sentence ("recovered share", "content share") and what it measures.
std::string target_name(const RetentionModel& model);
std::string target_meaning(const RetentionModel& model);

// The environment variable that names the model's file; without it, the file configured at build time
// (CROSSKV_RETENTION_MODEL_FILE: the source tree's docs/retention-calibration.json unless set otherwise).
inline constexpr const char* kRetentionModelEnv = "CROSSKV_RETENTION_MODEL";
std::filesystem::path retention_model_path();
// A calibration file's model (calibrate.py fit's output); ConfigError naming the file and key where it is not one.
RetentionModel load_retention_model(const std::filesystem::path& file);
// The process's model: load_retention_model(retention_model_path()), read once on first use.
const RetentionModel& retention_model();

// Where the model reads one feature: the value of it at which the predicted share is `share` (none otherwise).
std::optional<double> implied_threshold(double share, const RetentionModel& model = retention_model());

// A feature of a mapper's diagnostics; none where it needs attention figures the held-out shard could not give.
std::optional<double> retention_feature(RetentionFeature f, const Diagnostics& mapper, const Diagnostics& mean_only);
// The predicted share and its interval; none where a feature is missing.
std::optional<RetentionEstimate> predict_retention(const Diagnostics& mapper, const Diagnostics& mean_only,
                                                   const RetentionModel& model = retention_model());

}  // namespace crosskv
