#include "eval/evaluation.hpp"

#include <cmath>
#include <cstdio>

#include "eval/retention.hpp"

namespace crosskv {
namespace {

nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }
nlohmann::json nums(const std::vector<double>& v) {
  nlohmann::json a = nlohmann::json::array();
  for (double x : v) a.push_back(finite_or_null(x));
  return a;
}

}  // namespace

nlohmann::json Diagnostics::json() const {
  auto opt = [](const std::optional<double>& x) { return x ? finite_or_null(*x) : nlohmann::json(nullptr); };
  nlohmann::json j = {{"tokens", tokens},
                      {"r2_k", finite_or_null(r2_k)},
                      {"r2_v", finite_or_null(r2_v)},
                      {"attention_cosine", opt(attention_cosine)},
                      {"k_concentration", opt(k_concentration)},
                      {"v_concentration", opt(v_concentration)}};
  nlohmann::json ls = nlohmann::json::array();
  const bool att = attention_cosine.has_value();
  for (const auto& l : layers)
    ls.push_back({{"layer", l.layer},
                  {"r2_k", finite_or_null(l.r2_k_mean)},
                  {"r2_v", finite_or_null(l.r2_v_mean)},
                  {"attention_cosine", att ? finite_or_null(l.cosine_mean) : nlohmann::json(nullptr)},
                  {"k_concentration", att ? finite_or_null(l.k_concentration_mean) : nlohmann::json(nullptr)},
                  {"v_concentration", att ? finite_or_null(l.v_concentration_mean) : nlohmann::json(nullptr)},
                  {"per_head", {{"r2_k", nums(l.r2_k)},
                                {"r2_v", nums(l.r2_v)},
                                {"attention_cosine", nums(l.cosine)},
                                {"k_concentration", nums(l.k_concentration)},
                                {"v_concentration", nums(l.v_concentration)}}}});
  j["layers"] = ls;
  return j;
}

namespace {

struct VerdictNames {
  const char* name;   // in JSON: verdict_class
  const char* label;  // in the verdict's text and the report
};

VerdictNames names_of(VerdictClass c) {
  switch (c) {
    case VerdictClass::likely: return {"likely", "LIKELY TO TRANSFER"};
    case VerdictClass::uncertain: return {"uncertain", "UNCERTAIN"};
    case VerdictClass::not_ready: break;
  }
  return {"not_ready", "NOT READY"};
}

}  // namespace

const char* to_string(VerdictClass c) { return names_of(c).name; }
const char* label(VerdictClass c) { return names_of(c).label; }

nlohmann::json Evaluation::json() const {
  nlohmann::json j = mapper.json();
  j["baselines"] = {{"mean_only", mean_only.json()}, {"no_target_rope", no_target_rope.json()}};
  if (ridge_only) j["baselines"]["ridge_only"] = ridge_only->json();
  if (retention) {
    const RetentionModel& m = retention_model();
    j["predicted_retention"] = {{"share", retention->share},     {"low", retention->low},
                                {"high", retention->high},       {"min_retention", min_retention},
                                {"extrapolated", !retention->outside.empty()},
                                {"outside", retention->outside},
                                {"coverage", m.coverage},        {"loso_mae", m.loso_mae},
                                {"calibrated_on", m.calibrated_on}, {"target", m.target}};
  } else {
    j["predicted_retention"] = nullptr;
  }
  j["verdict"] = verdict();
  j["verdict_class"] = to_string(verdict_class);
  j["ok"] = ok();
  return j;
}

void judge(Evaluation& ev, const VerdictThresholds& th) {
  char buf[640];
  std::string extrapolated;
  ev.min_retention = th.min_retention;
  ev.retention = predict_retention(ev.mapper, ev.mean_only);
  if (ev.mapper.attention_cosine && ev.retention) {
    const double c = *ev.mapper.attention_cosine, c0 = ev.mean_only.attention_cosine.value_or(0);
    const RetentionEstimate& r = *ev.retention;
    const bool likely = r.share >= th.min_retention && c > c0 && ev.mapper.r2_k >= th.min_r2 && ev.mapper.r2_v >= th.min_r2;
    ev.verdict_class = likely ? VerdictClass::likely : VerdictClass::not_ready;
    // With one feature, the threshold it implies on that feature.
    std::string implied;
    if (const auto x = implied_threshold(th.min_retention)) {
      char t[128];
      std::snprintf(t, sizeof t, ": %s >= %.3f", to_string(retention_model().terms[0].first), *x);
      implied = t;
    }
    std::snprintf(buf, sizeof buf,
                  ": predicted %s %.1f%% (%.0f%% to %.0f%%; needs >= %.0f%%%s); attention-output "
                  "cosine %.3f (needs above the mean-only %.3f); held-out R2 k %.3f, v %.3f (needs >= %.2f)",
                  target_name(retention_model()).c_str(), 100 * r.share, 100 * r.low, 100 * r.high,
                  100 * th.min_retention, implied.c_str(), c, c0, ev.mapper.r2_k, ev.mapper.r2_v, th.min_r2);
    if (!r.outside.empty()) extrapolated = "; an extrapolation: " + r.outside;
  } else {  // without attention figures nothing says it transfers
    const bool fits = ev.mapper.r2_k >= th.min_r2 && ev.mapper.r2_v >= th.min_r2;
    std::snprintf(buf, sizeof buf,
                  " (R2 only: the target cache has no queries, so no attention figures): held-out R2 k %.3f, "
                  "v %.3f (needs >= %.2f)",
                  ev.mapper.r2_k, ev.mapper.r2_v, th.min_r2);
    ev.verdict_class = fits ? VerdictClass::uncertain : VerdictClass::not_ready;
  }
  ev.reason = buf + extrapolated;
}

}  // namespace crosskv
