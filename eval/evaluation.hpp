#pragma once
// Held-out diagnostics of a mapper (docs/METHOD.md, Diagnostics), the product's types: held-out R² per layer and head, attention-output
// cosine, K- and V-concentration; a mapper's evaluation with its baselines, and its verdict.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

namespace crosskv {

struct LayerDiagnostics {
  int layer = 0;
  std::vector<double> r2_k, r2_v;  // per KV head, content space
  double r2_k_mean = 0, r2_v_mean = 0;
  // Per query head; empty when the target cache has no queries.
  std::vector<double> cosine, k_concentration, v_concentration;
  double cosine_mean = 0, k_concentration_mean = 0, v_concentration_mean = 0;
};

struct Diagnostics {
  std::vector<LayerDiagnostics> layers;
  double r2_k = 0, r2_v = 0;
  std::optional<double> attention_cosine, k_concentration, v_concentration;
  int64_t tokens = 0;
  nlohmann::json json() const;  // docs/FORMATS.md keys: r2_k, r2_v, attention_cosine, k_concentration, v_concentration, layers
};

// The predicted share of the prefix's benefit a mapper keeps (eval/retention.hpp), with its interval.
struct RetentionEstimate {
  double share = 0, low = 0, high = 0;
  std::string outside;  // non-empty: the diagnostics lie outside the calibration's data (an extrapolation), and how
};

// The verdict's class, as serving gates on it: likely (LIKELY TO TRANSFER), uncertain (only R² figures, which say
// nothing of attention), not_ready (NOT READY).
enum class VerdictClass { likely, uncertain, not_ready };
const char* to_string(VerdictClass c);  // likely, uncertain, not_ready (the JSON's verdict_class)
const char* label(VerdictClass c);      // LIKELY TO TRANSFER, UNCERTAIN, NOT READY (the verdict's first words)

struct Evaluation {
  Diagnostics mapper, mean_only, no_target_rope;
  std::optional<Diagnostics> ridge_only;  // a mapper with residual MLPs: the same without them
  std::optional<RetentionEstimate> retention;  // none without attention figures
  double min_retention = 0.8;                  // what the verdict asked of it
  VerdictClass verdict_class = VerdictClass::not_ready;
  std::string reason;  // what follows the class's label in the verdict: the figures and what they needed
  std::string verdict() const { return label(verdict_class) + reason; }
  bool ok() const { return verdict_class == VerdictClass::likely; }
  nlohmann::json json() const;  // the mapper's figures at the top level, baselines and verdict beside them
};

// What the verdict asks (eval.min_retention, crosskv-eval --min-retention).
struct VerdictThresholds {
  double min_retention = 0.8;  // the predicted recovered share
  double min_r2 = 0.0;         // held-out R² of keys and values (0: better than the mean)
};
// Sets ev.retention, ev.verdict_class and ev.reason: LIKELY TO TRANSFER when the predicted recovered share reaches
// th.min_retention, the attention-output cosine is above the mean-only baseline's and both R² reach th.min_r2.
void judge(Evaluation& ev, const VerdictThresholds& th = {});

}  // namespace crosskv
