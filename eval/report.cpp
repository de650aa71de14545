#include "eval/report.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <optional>
#include <set>
#include <sstream>

#include "runtime/log.hpp"
#include "core/kind.hpp"
#include "core/mlp.hpp"
#include "eval/retention.hpp"

namespace crosskv {
namespace {

std::string esc(const std::string& s) {
  std::string o;
  for (char c : s) {
    switch (c) {
      case '<': o += "&lt;"; break;
      case '>': o += "&gt;"; break;
      case '&': o += "&amp;"; break;
      case '"': o += "&quot;"; break;
      default: o += c;
    }
  }
  return o;
}

std::string fmt(double x, int digits = 3) {
  if (!std::isfinite(x)) return "n/a";
  char b[64];
  std::snprintf(b, sizeof b, "%.*f", digits, x);
  return b;
}

std::string short_number(double x) {  // 1e-06, 0.01, 100000
  char b[64];
  std::snprintf(b, sizeof b, "%g", x);
  return b;
}

struct Series {
  std::string name, color;
  std::vector<double> y;
  bool dashed = false;
};

// A line chart of per-layer values (x = target layer), with a legend; NaN points are skipped.
std::string chart(const std::string& title, const std::vector<Series>& series, double ref = NAN) {
  const int W = 580, H = 220, L = 48, R = 12, T = 40, B = 30;
  double lo = INFINITY, hi = -INFINITY;
  size_t n = 0;
  for (const auto& s : series) {
    n = std::max(n, s.y.size());
    for (double v : s.y)
      if (std::isfinite(v)) {
        lo = std::min(lo, v);
        hi = std::max(hi, v);
      }
  }
  if (std::isfinite(ref)) {
    lo = std::min(lo, ref);
    hi = std::max(hi, ref);
  }
  if (!std::isfinite(lo)) lo = 0, hi = 1;
  if (hi - lo < 1e-9) hi = lo + 1;
  const double pad = 0.05 * (hi - lo);
  lo -= pad;
  hi += pad;
  auto X = [&](size_t i) { return L + (n > 1 ? double(i) / double(n - 1) : 0.5) * (W - L - R); };
  auto Y = [&](double v) { return T + (1.0 - (v - lo) / (hi - lo)) * (H - T - B); };
  std::ostringstream o;
  o << "<svg xmlns='http://www.w3.org/2000/svg' width='" << W << "' height='" << H << "' font-family='sans-serif' "
    << "font-size='11'><text x='" << L << "' y='32' font-size='13' font-weight='bold'>" << esc(title) << "</text>";
  o << "<rect x='" << L << "' y='" << T << "' width='" << W - L - R << "' height='" << H - T - B
    << "' fill='none' stroke='#999'/>";
  for (int k = 0; k <= 4; ++k) {
    const double v = lo + (hi - lo) * k / 4.0;
    o << "<text x='" << L - 4 << "' y='" << Y(v) + 4 << "' text-anchor='end'>" << fmt(v, 2) << "</text>";
  }
  for (size_t i = 0; i < n; i += std::max<size_t>(1, n / 10))
    o << "<text x='" << X(i) << "' y='" << H - 12 << "' text-anchor='middle'>" << i << "</text>";
  o << "<text x='" << (L + W - R) / 2 << "' y='" << H - 1 << "' text-anchor='middle'>target layer</text>";
  if (std::isfinite(ref))
    o << "<line x1='" << L << "' x2='" << W - R << "' y1='" << Y(ref) << "' y2='" << Y(ref)
      << "' stroke='#c00' stroke-dasharray='2,3'/>";
  int li = 0;
  for (const auto& s : series) {
    std::string pts;
    for (size_t i = 0; i < s.y.size(); ++i)
      if (std::isfinite(s.y[i])) pts += std::to_string(X(i)) + "," + std::to_string(Y(s.y[i])) + " ";
    o << "<polyline fill='none' stroke='" << s.color << "' stroke-width='1.8'" << (s.dashed ? " stroke-dasharray='5,3'" : "")
      << " points='" << pts << "'/>";
    const int lx = W - R - 115 * static_cast<int>(series.size()) + 115 * li++;  // legend on the title line
    o << "<line x1='" << lx << "' x2='" << lx + 18 << "' y1='12' y2='12' stroke='" << s.color << "' stroke-width='2'"
      << (s.dashed ? " stroke-dasharray='5,3'" : "") << "/><text x='" << lx + 22 << "' y='16'>" << esc(s.name)
      << "</text>";
  }
  o << "</svg>";
  return o.str();
}

std::vector<double> per_layer(const Diagnostics& d, double LayerDiagnostics::*f) {
  std::vector<double> v;
  for (const auto& l : d.layers) v.push_back(l.*f);
  return v;
}

std::string opt(const std::optional<double>& x) { return x ? fmt(*x) : "n/a"; }

// "62% (47% to 77%)": the predicted share (recovered or content, as the model says) and its interval.
std::string share_text(const Evaluation& ev) {
  if (!ev.retention) return "n/a";
  const RetentionEstimate& r = *ev.retention;
  return fmt(100 * r.share, 1) + "% (" + fmt(100 * r.low, 0) + "% to " + fmt(100 * r.high, 0) + "%)";
}

// The attention cosine the verdict's share implies, where the predictor reads the cosine alone (else NaN: no line).
double implied_cosine(double min_retention) {
  const bool cosine = retention_model().terms.size() == 1 &&
                      retention_model().terms[0].first == RetentionFeature::attention_cosine;
  return cosine ? implied_threshold(min_retention).value_or(NAN) : NAN;
}

// "4", or "4, per_head" for a head-matched mapper.
std::string mapper_label(const MapperManifest& m) {
  const std::string k = m.k_label.empty() ? "?" : m.k_label;
  return k + (m.structure == Structure::cross_head ? "" : std::string(", ") + to_string(m.structure));
}

// With residual MLPs (fit.mapper: mlp | auto): how many target layers keep one per kind, and the kept ones'
// parameters (always fp32 in the files).
struct MlpSummary {
  std::string kept;  // "k / v of n", or empty without MLPs
  double params = 0;
};

MlpSummary mlp_summary(const MapperManifest& m) {
  MlpSummary s;
  const int64_t G = m.target.features_per_layer();
  ByKind<int> kept;
  int n = 0;
  for (const ManifestLayer& l : m.layers) {
    if (l.mlp.empty()) continue;
    ++n;
    for (const ManifestMlpDecision& d : l.mlp) {
      if (!d.kept) continue;
      ++kept[d.kind];
      s.params += static_cast<double>(MlpShape{m.features, d.hidden, G}.parameters());
    }
  }
  if (n) s.kept = std::to_string(kept.k) + " / " + std::to_string(kept.v) + " of " + std::to_string(n);
  return s;
}

// The k sweep on one screen: per k its size and held-out figures, the k with the best attention cosine (or R²
// without queries) starred, and the smallest k that passes named.
class Sweep {
 public:
  explicit Sweep(const ReportInput& in) : in_(in), fits_(in.evaluations.size()), mlps_(in.evaluations.size()) {
    static const MapperManifest none;
    for (size_t i = 0; i < fits_.size(); ++i) fits_[i] = i < in_.manifests.size() ? &in_.manifests[i] : &none;
    std::set<Structure> structures;
    for (const MapperManifest* m : fits_) structures.insert(m->structure);
    both_ = structures.size() > 1;
    for (size_t i = 1; i < in_.evaluations.size(); ++i)
      if (score(in_.evaluations[i]) > score(in_.evaluations[best_])) best_ = i;
    // Rows by k, each k's structures side by side.
    rows_.resize(in_.evaluations.size());
    for (size_t i = 0; i < rows_.size(); ++i) rows_[i] = i;
    std::stable_sort(rows_.begin(), rows_.end(), [&](size_t a, size_t b) {
      return std::pair{fits_[a]->k_count, fits_[a]->structure} < std::pair{fits_[b]->k_count, fits_[b]->structure};
    });
    for (size_t i = 0; i < mlps_.size(); ++i) {
      mlps_[i] = mlp_summary(*fits_[i]);
      any_mlps_ = any_mlps_ || !mlps_[i].kept.empty();
    }
    for (size_t i : rows_)
      if (in_.evaluations[i].ok() && (!smallest_ok_ || params_of(i) < params_of(*smallest_ok_))) smallest_ok_ = i;
  }

  std::string html() const {
    std::ostringstream o;
    o << header();
    bool any_outside = false;
    for (size_t i : rows_) {
      o << row(i);
      const Evaluation& ev = in_.evaluations[i];
      any_outside = any_outside || (ev.retention && !ev.retention->outside.empty());
    }
    o << footer(any_outside);
    return o.str();
  }

 private:
  static double score(const Evaluation& ev) {
    return ev.mapper.attention_cosine ? *ev.mapper.attention_cosine : 0.5 * (ev.mapper.r2_k + ev.mapper.r2_v);
  }
  std::string k_of(size_t i) const { return mapper_label(*fits_[i]); }
  // Every parameter of mapper i, biases and kept MLPs included.
  double params_of(size_t i) const {
    return static_cast<double>(fits_[i]->params + fits_[i]->bias_params) + mlps_[i].params;
  }

  std::string header() const {
    std::ostringstream o;
    o << "<h2>The k sweep at a glance</h2><table><tr><th>k</th>" << (both_ ? "<th>structure</th>" : "")
      << "<th>parameters</th><th>bytes fp32</th>"
         "<th>bytes bf16/fp16</th><th>held-out R² keys</th><th>R² values</th><th>attention cosine</th>"
         "<th>K-concentration</th><th>V-concentration</th>"
      << (any_mlps_ ? "<th>residual MLPs kept (keys / values)</th>" : "")
      << "<th>predicted " << target_name(retention_model()) << "</th><th>verdict</th></tr>";
    return o.str();
  }

  std::string row(size_t i) const {
    std::ostringstream o;
    const Evaluation& ev = in_.evaluations[i];
    const MapperManifest& fit = *fits_[i];
    const double ridge = static_cast<double>(fit.params), bias = static_cast<double>(fit.bias_params);
    const double mlp = mlps_[i].params;
    const double params = ridge + bias + mlp;  // biases and MLPs stay fp32 in bf16/fp16 artifacts
    const std::string verdict = label(ev.verdict_class);
    o << "<tr" << (ev.ok() ? " class='okrow'" : "") << "><th>" << esc(both_ ? fit.k_label : k_of(i))
      << (i == best_ ? " &#9733;" : "") << "</th>"
      << (both_ ? std::string("<td style='text-align:left'>") + to_string(fit.structure) + "</td>" : "") << "<td>"
      << (params > 0 ? human_count(params) : "?") << "</td><td>" << (params > 0 ? human_bytes(4 * params) : "?")
      << "</td><td>" << (params > 0 ? human_bytes(2 * ridge + 4 * (bias + mlp)) : "?") << "</td><td>"
      << fmt(ev.mapper.r2_k) << "</td><td>" << fmt(ev.mapper.r2_v) << "</td><td>" << opt(ev.mapper.attention_cosine)
      << "</td><td>" << opt(ev.mapper.k_concentration) << "</td><td>" << opt(ev.mapper.v_concentration) << "</td>"
      << (any_mlps_ ? "<td>" + esc(mlps_[i].kept) + "</td>" : "") << "<td>" << share_text(ev)
      << (ev.retention && !ev.retention->outside.empty() ? " &dagger;" : "")
      << "</td><td style='text-align:left'>" << esc(verdict) << "</td></tr>";
    return o.str();
  }

  std::string footer(bool any_outside) const {
    std::ostringstream o;
    o << "</table><p>&#9733; the best held-out "
      << (in_.evaluations[best_].mapper.attention_cosine ? "attention cosine" : "R² (no queries)")
      << ": k = " << esc(k_of(best_)) << ". ";
    if (smallest_ok_)
      o << "The smallest mapper that passes the verdict: <b>k = " << esc(k_of(*smallest_ok_)) << "</b> ("
        << human_count(params_of(*smallest_ok_)) << " parameters).";
    else
      o << "No mapper passes the verdict.";
    if (both_)
      o << " per_head: target head h reads source head h alone (Ht&times; fewer parameters); cross_head: every "
           "head of the selected layers.";
    if (any_mlps_) o << " Parameters and bytes count the kept residual MLPs (stored fp32) with the ridge.";
    if (any_outside)
      o << " &dagger; An extrapolation: these figures lie outside the data the predictor was calibrated on.";
    o << " Details per k below.</p>";
    return o.str();
  }

  const ReportInput& in_;
  std::vector<const MapperManifest*> fits_;  // per evaluation, its manifest (an empty one without)
  std::vector<MlpSummary> mlps_;
  std::vector<size_t> rows_;
  bool both_ = false, any_mlps_ = false;
  size_t best_ = 0;
  std::optional<size_t> smallest_ok_;
};

constexpr const char* kHead =
    "<style>body{font-family:sans-serif;margin:24px;max-width:1200px}table{border-collapse:collapse;margin:8px 0}"
    "td,th{border:1px solid #ccc;padding:3px 8px;font-size:13px;text-align:right}th{background:#f3f3f3}"
    ".ok{background:#e6f4e6;border:1px solid #7b7;padding:8px}.bad{background:#fbe9e9;border:1px solid #d88;"
    "padding:8px}.charts svg{margin:4px}tr.okrow td{background:#f1faf1}"
    "table.settings td{text-align:left;overflow-wrap:anywhere;font-family:monospace}</style></head><body>";

std::string heatmap_section(std::string svg) {
  if (svg.rfind("<?xml", 0) == 0) svg = svg.substr(svg.find("?>") + 2);
  return "<details open><summary><b>Probe R² (calibration): which source layers predict each target layer"
         "</b></summary>" + svg + "</details>";
}

std::string retention_paragraph(const Evaluation& ev) {
  std::ostringstream o;
  const RetentionModel& rm = retention_model();
  o << "<p class='retention'><b>Predicted " << target_name(rm) << ": " << share_text(ev) << "</b> "
    << esc(target_meaning(rm)) << ". LIKELY TO TRANSFER needs " << fmt(100 * ev.min_retention, 0)
    << "% (<code>eval.min_retention</code>). The interval held "
    << fmt(100 * rm.coverage, 0) << "% of the predictor's errors on studies it was not fitted on (mean error "
    << fmt(100 * rm.loso_mae, 0) << " points); calibrated on " << esc(rm.calibrated_on)
    << " (docs/RESULTS.md).";
  if (!ev.retention->outside.empty())
    o << " <b>An extrapolation:</b> " << esc(ev.retention->outside)
      << ", so the share is a guess beyond the data it was fitted on.";
  o << "</p>";
  return o.str();
}

// The mapper beside its baselines: the ridge alone (with MLPs), the mean-only mapper, no target RoPE.
std::string held_out_table(const Evaluation& ev, const std::string& eval_source) {
  std::ostringstream o;
  o << "<table><tr><th>held-out figures</th><th>R² keys</th><th>R² values</th><th>attention cosine</th>"
       "<th>K-concentration</th><th>V-concentration</th></tr>";
  std::vector<std::pair<std::string, const Diagnostics*>> rows = {
      {ev.ridge_only ? "mapper (ridge + residual MLPs)" : "mapper", &ev.mapper}};
  if (ev.ridge_only) rows.push_back({"ridge alone (the MLPs left out)", &*ev.ridge_only});
  rows.push_back({"mean-only (constant)", &ev.mean_only});
  rows.push_back({"mapper without target RoPE", &ev.no_target_rope});
  for (const auto& [name, d] : rows)
    o << "<tr><th>" << esc(name) << "</th><td>" << fmt(d->r2_k) << "</td><td>" << fmt(d->r2_v) << "</td><td>"
      << opt(d->attention_cosine) << "</td><td>" << opt(d->k_concentration) << "</td><td>"
      << opt(d->v_concentration) << "</td></tr>";
  o << "</table><p>" << ev.mapper.tokens << " held-out tokens (" << esc(eval_source)
    << "). Concentrations above 1: the error sits where attention reads.</p>";
  return o.str();
}

std::string per_layer_charts(const Evaluation& ev) {
  std::string o = "<div class='charts'>";
  o += chart("held-out R² per layer, keys",
             {{"mapper", "#1f77b4", per_layer(ev.mapper, &LayerDiagnostics::r2_k_mean)},
              {"mean-only", "#999", per_layer(ev.mean_only, &LayerDiagnostics::r2_k_mean), true}},
             0.0);
  o += chart("held-out R² per layer, values",
             {{"mapper", "#2ca02c", per_layer(ev.mapper, &LayerDiagnostics::r2_v_mean)},
              {"mean-only", "#999", per_layer(ev.mean_only, &LayerDiagnostics::r2_v_mean), true}},
             0.0);
  if (ev.mapper.attention_cosine) {
    o += chart("attention-output cosine per layer",
               {{"mapper", "#1f77b4", per_layer(ev.mapper, &LayerDiagnostics::cosine_mean)},
                {"mean-only", "#999", per_layer(ev.mean_only, &LayerDiagnostics::cosine_mean), true},
                {"no target RoPE", "#d62728", per_layer(ev.no_target_rope, &LayerDiagnostics::cosine_mean), true}},
               implied_cosine(ev.min_retention));
    o += chart("K- and V-concentration per layer",
               {{"K", "#9467bd", per_layer(ev.mapper, &LayerDiagnostics::k_concentration_mean)},
                {"V", "#8c564b", per_layer(ev.mapper, &LayerDiagnostics::v_concentration_mean)}},
               1.0);
  }
  return o + "</div>";
}

// The fit's own R² of keys for one manifest layer, the mean over heads (NaN where the manifest has none).
double in_sample_r2_k(const ManifestLayer& layer) {
  double s = 0;
  int c = 0;
  for (double x : layer.r2_k)
    if (std::isfinite(x)) s += x, ++c;
  return c ? s / c : NAN;
}

// A GCV curve over the λ grid as a sparkline (low = better), its minimum marked; blank where ρ was not a candidate.
std::string gcv_sparkline(const std::vector<double>& curve) {
  static const char* bars[] = {"▁", "▂", "▃", "▄", "▅", "▆", "▇", "█"};
  double lo = INFINITY, hi = -INFINITY;
  for (double v : curve)
    if (std::isfinite(v)) lo = std::min(lo, v), hi = std::max(hi, v);
  std::string s;
  for (double v : curve) {
    if (!std::isfinite(v)) {
      s += "·";
      continue;
    }
    const int i = hi > lo ? static_cast<int>(std::lround(7 * std::log1p(v - lo) / std::log1p(hi - lo))) : 0;
    s += v == lo ? "<b>" + std::string(bars[i]) + "</b>" : bars[i];
  }
  return s;
}

std::string sci(double x) {
  char b[32];
  std::snprintf(b, sizeof b, "%.0e", x);
  return b;
}

template <class T>
std::string list_text(const std::vector<T>& v, std::string (*item)(T)) {
  std::string s = "[";
  for (size_t i = 0; i < v.size(); ++i) s += (i ? ", " : "") + item(v[i]);
  return s + "]";
}
std::string int_text(int x) { return std::to_string(x); }

// fit.lambda auto: ρ (λ over the system's mean feature variance) and the GCV curve that chose it, keys / values.
std::string lambda_cells(const ManifestLayer& l) {
  if (!l.lambda) return "";
  const ManifestLambda& x = *l.lambda;
  return "<td>" + sci(x.rho.k) + " / " + sci(x.rho.v) + "</td><td class='spark'>" + gcv_sparkline(x.gcv.k) + " " +
         gcv_sparkline(x.gcv.v) + "</td>";
}

std::string selected_layers_table(const Evaluation& ev, const MapperManifest& m) {
  std::ostringstream o;
  const bool auto_lambda = m.lambda_choice.has_value();
  o << "<details><summary>selected source layers per target layer" << (auto_lambda ? ", and each layer's λ" : "")
    << "</summary><table><tr><th>target layer</th>"
       "<th>source layers</th><th>in-sample R² k (head mean)</th><th>held-out R² k</th><th>held-out R² v</th>";
  if (auto_lambda)
    o << "<th>ρ keys / values</th><th>GCV over ρ = " << esc(list_text(m.lambda_choice->grid, sci))
      << " (keys, values; lowest bold)</th>";
  o << "</tr>";
  for (const ManifestLayer& l : m.layers) {
    const int t = l.target_layer;
    const bool ok = t >= 0 && t < static_cast<int>(ev.mapper.layers.size());
    o << "<tr><td>" << t << "</td><td style='text-align:left'>" << esc(list_text(l.source_layers, int_text))
      << "</td><td>" << fmt(in_sample_r2_k(l)) << "</td><td>" << (ok ? fmt(ev.mapper.layers[t].r2_k_mean) : "")
      << "</td><td>" << (ok ? fmt(ev.mapper.layers[t].r2_v_mean) : "") << "</td>"
      << (auto_lambda ? lambda_cells(l) : "") << "</tr>";
  }
  o << "</table>";
  if (auto_lambda)
    o << "<p>λ = ρ × the mean feature variance of the layer's system; ρ minimises generalized cross-validation on the "
         "system of the layer's top source layer; the k = all system, shared by every layer, takes the layers' median ("
      << "keys " << sci(m.lambda_choice->rho_all.k) << ", values " << sci(m.lambda_choice->rho_all.v) << ").</p>";
  o << "</details>";
  return o.str();
}

std::string mapper_section(const Evaluation& ev, const MapperManifest& m, const std::string& eval_source) {
  std::ostringstream o;
  o << "<h2>k = " << esc(mapper_label(m)) << "</h2><p class='" << (ev.ok() ? "ok" : "bad") << "'><b>Verdict:</b> "
    << esc(ev.verdict()) << "</p>";
  if (ev.retention) o << retention_paragraph(ev);
  o << held_out_table(ev, eval_source) << per_layer_charts(ev);
  if (!m.layers.empty()) o << selected_layers_table(ev, m);
  return o.str();
}

std::string verdict_thresholds(const ReportInput& in) {
  const VerdictThresholds th;
  const double min_share = in.evaluations.empty() ? th.min_retention : in.evaluations.front().min_retention;
  std::string model = fmt(retention_model().intercept, 3);
  for (const auto& [f, w] : retention_model().terms)
    model += (w < 0 ? " - " : " + ") + fmt(std::fabs(w), 3) + "·" + to_string(f);
  return "predicted " + target_name(retention_model()) + " >= " + fmt(100 * min_share, 0) + "% (" +
         target_name(retention_model()) + " = " + model +
         "); attention-output cosine above the mean-only baseline; held-out R² of keys and values >= " +
         fmt(th.min_r2, 2);
}

// "SmolLM2: 30 layers × 3 KV heads × 64 (9 query heads), RoPE default θ 100000", with per-layer attention noted.
std::string model_text(const std::string& name, const std::string& weights, const KvSpec& spec) {
  std::ostringstream o;
  o << name << ": " << spec.n_layers << " layers × " << spec.n_kv_heads << " KV heads × " << spec.head_dim << " ("
    << spec.n_q_heads << " query heads), RoPE " << spec.rope.type << " θ " << short_number(spec.rope.theta)
    << (spec.layers.empty() ? "" : ", each layer's attention and RoPE of its own")
    << (spec.query_scale ? ", query scale " + short_number(*spec.query_scale) : "")
    << (weights.empty() ? "" : ", weights " + weights);
  return o.str();
}

// fit: what was solved, in the config's words.
std::string fit_text(const MapperManifest& m) {
  std::ostringstream o;
  o << "k " << m.k_label << " (" << m.k_count << " source layer" << (m.k_count == 1 ? "" : "s") << "), " << to_string(m.structure) << ", λ "
    << (m.lambda ? short_number(*m.lambda) : m.lambda_choice ? "auto (" + m.lambda_choice->criterion + ")" : "?")
    << ", probe " << m.probe << ", " << m.dtype << ", " << m.features << " features, " << m.params << " + "
    << m.bias_params << " parameters, mapper " << m.mapper;
  if (m.mlp)
    o << " (MLP hidden " << m.mlp->hidden << ", " << m.mlp->epochs << " epochs, lr " << m.mlp->lr << ", batch "
      << m.mlp->batch_tokens << " tokens, weight decay " << m.mlp->weight_decay << ", validation "
      << m.mlp->val_fraction << ", seed " << m.mlp->seed << ")";
  return o.str();
}

std::string calibration_text(const ManifestCalibration& c) {
  std::ostringstream o;
  o << c.shards.size() << " shard(s), " << c.tokens_used << " tokens used, domains";
  for (const std::string& d : c.domains) {
    const auto w = c.weights.find(d);
    o << " " << d << (w == c.weights.end() ? "" : " (weight " + fmt(w->second, 3) + ")");
  }
  o << ", token stride " << c.token_stride << ", max tokens "
    << (c.max_tokens ? std::to_string(*c.max_tokens) : "none") << ", token weighting " << c.token_weighting;
  return o.str();
}

// The pair and the fit's settings, from the first manifest.
std::string settings_section(const ReportInput& in) {
  std::ostringstream o;
  const MapperManifest& m = in.manifests.front();
  o << "<h2>The pair and its settings</h2><table class='settings'>";
  auto row = [&](const std::string& k, const std::string& v) {
    o << "<tr><th style='text-align:left'>" << esc(k) << "</th><td>" << esc(v) << "</td></tr>";
  };
  row("source", model_text(m.source_model, m.source_weights, m.source));
  row("target", model_text(m.target_model, m.target_weights, m.target));
  row("fit", fit_text(m));
  row("calibration", calibration_text(m.calibration));
  if (!m.tool.empty()) row("tool", m.tool);
  row("verdict thresholds", verdict_thresholds(in));
  o << "</table>";
  return o.str();
}

}  // namespace

std::string render_report(const ReportInput& in) {
  std::ostringstream o;
  o << "<!DOCTYPE html><html><head><meta charset='utf-8'><title>crosskv report: " << esc(in.title) << "</title>"
    << kHead;
  o << "<h1>crosskv: " << esc(in.title) << "</h1>";
  if (in.evaluations.empty()) o << "<p>No held-out evaluation.</p>";
  if (!in.evaluations.empty()) o << Sweep(in).html();
  if (!in.heatmap_svg.empty()) o << heatmap_section(in.heatmap_svg);
  for (size_t i = 0; i < in.evaluations.size(); ++i)
    o << mapper_section(in.evaluations[i], i < in.manifests.size() ? in.manifests[i] : MapperManifest{},
                        in.eval_source);
  if (!in.manifests.empty()) o << settings_section(in);
  o << "</body></html>\n";
  return o.str();
}

}  // namespace crosskv
