// Applying and diagnosing mappers: the transfer library, the diagnostics on cases with known answers, the
// baselines, hardened manifests.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <map>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <tuple>

#include "scalar_oracle.hpp"
#include "eval/report.hpp"
#include "eval/retention.hpp"
#include "serve/serving_mapper.hpp"
#include "serve/transfer.hpp"
#include "backends/backends.hpp"
#include "core/half.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "helpers.hpp"
#include "reference_mapper.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "artifact/safetensors.hpp"
#include "io/shard.hpp"

using namespace crosskv;
using namespace crosskv::test;

// ---- Diagnostics on hand-made caches with known answers.
namespace {

Cache toy_cache(int L, int H, int Hq, int D, int T, uint64_t seed) {
  Cache c;
  c.spec.n_layers = L;
  c.spec.n_kv_heads = H;
  c.spec.n_q_heads = Hq;
  c.spec.head_dim = D;
  c.spec.rope.type = "none";
  c.spec.rope.rotary_dim = D;
  c.tokens = T;
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0, 1);
  c.keys.resize(int64_t{T} * L * H * D);
  c.values.resize(c.keys.size());
  c.queries.resize(int64_t{T} * L * Hq * D);
  for (auto& x : c.keys) x = n(rng);
  for (auto& x : c.values) x = n(rng);
  for (auto& x : c.queries) x = n(rng);
  c.positions.resize(T);
  for (int t = 0; t < T; ++t) c.positions[t] = t % (T / 2);
  c.seq_offsets = {0, T / 2, T};
  return c;
}

}  // namespace

TEST(Diagnostics, IdenticalCachesGiveCosineOneAndDefinedConcentrations) {
  Cache c = toy_cache(2, 2, 4, 8, 64, 1);
  Diagnostics d = diagnose(c, c.keys, c.values);
  EXPECT_DOUBLE_EQ(d.r2_k, 1.0);
  EXPECT_DOUBLE_EQ(d.r2_v, 1.0);
  ASSERT_TRUE(d.attention_cosine && d.k_concentration && d.v_concentration);
  EXPECT_NEAR(*d.attention_cosine, 1.0, 1e-12);
  EXPECT_TRUE(std::isfinite(*d.k_concentration));
  EXPECT_TRUE(std::isfinite(*d.v_concentration));
  EXPECT_EQ(d.layers.size(), 2u);
  EXPECT_EQ(d.layers[0].cosine.size(), 4u);  // per query head
}

TEST(Diagnostics, IsotropicErrorHasConcentrationNearOne) {
  Cache c = toy_cache(1, 1, 2, 16, 4000, 2);
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n(0, 0.1f);
  auto k = c.keys, v = c.values;
  for (auto& x : k) x += n(rng);
  for (auto& x : v) x += n(rng);
  Diagnostics d = diagnose(c, k, v);
  EXPECT_NEAR(*d.k_concentration, 1.0, 0.1);
  EXPECT_NEAR(*d.v_concentration, 1.0, 0.1);
  EXPECT_LT(*d.attention_cosine, 1.0);
}

TEST(Diagnostics, ErrorAlongTheQueriesTopDirectionRaisesKConcentration) {
  const int D = 8;
  Cache c = toy_cache(1, 1, 1, D, 2000, 4);
  // Queries with most of their energy along dim 0.
  for (int64_t t = 0; t < c.tokens; ++t) c.queries[t * D + 0] *= 10.0f;
  auto along = c.keys, across = c.keys;
  for (int64_t t = 0; t < c.tokens; ++t) {
    along[t * D + 0] += 0.3f;   // error where the queries look
    across[t * D + 5] += 0.3f;  // error where they do not
  }
  const double k_along = *diagnose(c, along, c.values).k_concentration;
  const double k_across = *diagnose(c, across, c.values).k_concentration;
  EXPECT_GT(k_along, 3.0);
  EXPECT_LT(k_across, 0.5);
}

TEST(Diagnostics, ValueErrorWhereAttentionReadsRaisesVConcentration) {
  const int D = 8;
  Cache c = toy_cache(1, 1, 1, D, 400, 5);
  // Every query looks at the first token of its sequence: huge key there along the queries' mean direction.
  for (int64_t t = 0; t < c.tokens; ++t) c.queries[t * D + 1] = 4.0f;
  for (int64_t a : {int64_t{0}, c.tokens / 2}) c.keys[a * D + 1] = 10.0f;
  auto read = c.values, unread = c.values;
  read[0 * D + 2] += 1.0f;                     // error on a token every query attends to
  unread[(c.tokens / 2 - 1) * D + 2] += 1.0f;  // error on the last token of a sequence: one query sees it
  EXPECT_GT(*diagnose(c, c.keys, read).v_concentration, 10.0);
  EXPECT_LT(*diagnose(c, c.keys, unread).v_concentration, 1.0);
}

TEST(Diagnostics, ReportIsOneSelfContainedHtmlFile) {
  Cache c = toy_cache(2, 2, 2, 8, 64, 6);
  Evaluation ev;
  ev.mapper = ev.mean_only = ev.no_target_rope = diagnose(c, c.keys, c.values);
  ev.verdict_class = VerdictClass::likely;
  ev.reason = ": test";
  ReportInput in;
  in.title = "a -> b";
  MapperManifest& m = in.manifests.emplace_back();
  m.k_label = "2", m.k_count = 2, m.source_model = "a", m.target_model = "b", m.lambda = 1e-6, m.probe = "same_head";
  m.source.n_layers = 2, m.source.n_kv_heads = 2, m.source.head_dim = 8, m.source.n_q_heads = 4;
  m.calibration.domains = {"web"}, m.calibration.tokens_used = 512;
  in.evaluations.push_back(ev);
  const std::string html = render_report(in);
  // The settings in words, from the manifest's typed fields.
  EXPECT_NE(html.find("a: 2 layers × 2 KV heads × 8 (4 query heads), RoPE default θ 10000"), std::string::npos);
  EXPECT_NE(html.find("k 2 (2 source layers), cross_head, λ 1e-06, probe same_head"), std::string::npos);
  EXPECT_NE(html.find("0 shard(s), 512 tokens used, domains web"), std::string::npos);
  EXPECT_NE(html.find("<!DOCTYPE html>"), std::string::npos);
  EXPECT_NE(html.find("LIKELY TO TRANSFER: test"), std::string::npos);
  EXPECT_NE(html.find("<svg"), std::string::npos);
  EXPECT_EQ(html.find("http://"), html.find("http://www.w3.org/2000/svg"));  // no links but the SVG namespace
  EXPECT_EQ(html.find("<script"), std::string::npos);
}

TEST(Diagnostics, ReportOpensWithTheKSweepAtAGlance) {
  Cache c = toy_cache(2, 2, 2, 8, 64, 6);
  ReportInput in;
  in.title = "a -> b";
  in.heatmap_svg = "<?xml version='1.0'?><svg id='heatmap'></svg>";
  // k = 1 fails, k = 2 passes, k = all passes with the best cosine.
  for (auto [k, sigma, ok] : {std::tuple<std::string, float, bool>{"1", 0.9f, false}, {"2", 0.3f, true},
                              {"all", 0.05f, true}}) {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0, sigma);
    auto keys = c.keys;
    for (auto& x : keys) x += n(rng);
    Evaluation ev;
    ev.mapper = ev.mean_only = ev.no_target_rope = diagnose(c, keys, c.values);
    ev.verdict_class = ok ? VerdictClass::likely : VerdictClass::not_ready;
    ev.reason = ": attention-output cosine ...";
    MapperManifest& m = in.manifests.emplace_back();
    m.k_label = k, m.params = k == "all" ? 3000 : 1000, m.bias_params = 24, m.features = 16;
    m.target.n_kv_heads = 2, m.target.head_dim = 8;
    if (k == "2") {  // k = 2 keeps a residual MLP of 4 hidden for its keys: 16*4 + 4 + 4*4 + 4 + 4*16 + 16 = 168
      m.layers.emplace_back().mlp = {{Kind::k, true}, {Kind::v, false}};
      m.layers.back().mlp[0].hidden = 4;
    }
    in.evaluations.push_back(ev);
  }
  const std::string html = render_report(in);
  const size_t summary = html.find("The k sweep at a glance");
  ASSERT_NE(summary, std::string::npos);
  EXPECT_LT(summary, html.find("<h2>k = 1</h2>"));          // before the details per k
  EXPECT_LT(html.find("id='heatmap'"), html.find("<h2>k = 1</h2>"));  // the heatmap embedded near the top
  EXPECT_EQ(html.find("<?xml"), std::string::npos);
  EXPECT_NE(html.find("<th>all &#9733;</th>"), std::string::npos) << "the best cosine is starred";
  EXPECT_NE(html.find("smallest mapper that passes the verdict: <b>k = 2</b>"), std::string::npos);
  EXPECT_NE(html.find("<td>1.02 K</td><td>4.00 KiB</td><td>2.05 KiB</td>"), std::string::npos)
      << "parameters and bytes per dtype (biases stay fp32)";
  EXPECT_NE(html.find("<td>1.19 K</td><td>4.66 KiB</td><td>2.70 KiB</td>"), std::string::npos)
      << "with a kept residual MLP: its parameters counted, fp32 in every dtype";
  EXPECT_NE(html.find("<td>1 / 0 of 1</td>"), std::string::npos) << "MLPs kept per kind";
  EXPECT_NE(html.find("count the kept residual MLPs"), std::string::npos);
  EXPECT_NE(html.find("NOT READY</td>"), std::string::npos);
  EXPECT_EQ(html.find("<th>structure</th>"), std::string::npos) << "one structure: no structure column";
  // A head-matched k = 1 that passes with fewer parameters: listed beside k = 1, named as the smallest that passes.
  Evaluation ph = in.evaluations[1];
  in.evaluations.push_back(ph);
  MapperManifest& head_matched = in.manifests.emplace_back();
  head_matched.k_label = "1", head_matched.k_count = 1, head_matched.structure = Structure::per_head;
  head_matched.params = 500, head_matched.bias_params = 24, head_matched.features = 8;
  for (size_t i = 0; i < 3; ++i) in.manifests[i].k_count = i == 2 ? 6 : static_cast<int>(i) + 1;
  const std::string both = render_report(in);
  EXPECT_NE(both.find("<th>structure</th>"), std::string::npos);
  EXPECT_NE(both.find("smallest mapper that passes the verdict: <b>k = 1, per_head</b> (524 parameters)"),
            std::string::npos);
  const size_t cross1 = both.find("<tr><th>1</th><td style='text-align:left'>cross_head</td>");
  const size_t head1 = both.find("<th>1</th><td style='text-align:left'>per_head</td>");
  const size_t cross2 = both.find("<th>2</th><td style='text-align:left'>cross_head</td>");
  ASSERT_NE(cross1, std::string::npos);
  ASSERT_NE(head1, std::string::npos);
  EXPECT_LT(cross1, head1);
  EXPECT_LT(head1, cross2) << "each k's structures side by side";
  EXPECT_NE(both.find("<h2>k = 1, per_head</h2>"), std::string::npos);
}


// The predictor is read from its file at run time: the configured default is the repository's calibration, the
// environment names another, and a changed file changes the prediction without a rebuild.
TEST(RetentionModel, IsReadFromItsFileAtRunTime) {
  const std::string docs = std::string(CROSSKV_SOURCE_DIR) + "/docs/retention-calibration.json";
  ::unsetenv(kRetentionModelEnv);
  EXPECT_EQ(fs::weakly_canonical(retention_model_path()), fs::weakly_canonical(docs));
  EXPECT_EQ(retention_model().json(), load_retention_model(docs).json());
  TempDir tmp;
  std::ifstream in(docs);
  nlohmann::json doc = nlohmann::json::parse(in);
  doc["model"]["intercept"] = doc["model"]["intercept"].get<double>() + 0.05;
  const std::string refit = tmp.str("refit.json");
  std::ofstream(refit) << doc.dump();
  ::setenv(kRetentionModelEnv, refit.c_str(), 1);
  EXPECT_EQ(retention_model_path(), fs::path(refit));
  ::unsetenv(kRetentionModelEnv);
  const RetentionModel changed = load_retention_model(refit);
  Diagnostics mapper, mean_only;
  mapper.attention_cosine = 0.6, mapper.r2_k = mapper.r2_v = 0.5, mapper.k_concentration = 0.2;
  mean_only.attention_cosine = 0.1;
  const auto before = predict_retention(mapper, mean_only);
  const auto after = predict_retention(mapper, mean_only, changed);
  ASSERT_TRUE(before && after);
  EXPECT_NEAR(after->share - before->share, 0.05, 1e-12);
}

TEST(Verdict, ThePredictedShareAgainstMinRetentionDecidesIt) {
  const RetentionModel& m = retention_model();
  ASSERT_FALSE(m.terms.empty());
  ASSERT_GT(m.half_width, 0.0);
  // A diagnostics record whose predicted share is `share` (every feature the model reads is set from the cosine).
  auto judged = [&](double cosine, double min_retention, double mean_only = 0.1) {
    Evaluation ev;
    ev.mapper.r2_k = ev.mapper.r2_v = 0.5;
    ev.mapper.attention_cosine = cosine;
    ev.mapper.k_concentration = 1.5;
    ev.mean_only.attention_cosine = mean_only;
    judge(ev, VerdictThresholds{min_retention});
    return ev;
  };
  for (double cos : {0.6, 0.75, 0.85, 0.95}) {
    const Evaluation ev = judged(cos, 0.8);
    ASSERT_TRUE(ev.retention.has_value());
    const auto want = predict_retention(ev.mapper, ev.mean_only);
    EXPECT_DOUBLE_EQ(ev.retention->share, want->share);
    EXPECT_NEAR(ev.retention->high - ev.retention->share, std::min(m.half_width, 1.0 - want->share), 1e-12);
    EXPECT_EQ(ev.ok(), ev.retention->share >= 0.8) << ev.verdict();
    // The setting moves the verdict across the predicted share, and nothing else does.
    EXPECT_TRUE(judged(cos, std::max(0.01, ev.retention->share - 1e-6)).ok());
    if (ev.retention->share < 1.0) {
      EXPECT_FALSE(judged(cos, ev.retention->share + 1e-6).ok());
    }
    EXPECT_NE(ev.verdict().find("predicted " + target_name(retention_model())), std::string::npos) << ev.verdict();
    EXPECT_EQ(ev.json()["predicted_retention"]["share"], ev.retention->share);
  }
  // The predictor is monotone: a higher cosine never predicts less.
  double last = -1e9;
  for (double cos = 0.0; cos <= 1.0; cos += 0.05) {
    const double s = judged(cos, 0.8).retention->share;
    EXPECT_GE(s, last);
    last = s;
  }
  // Inside the calibration's data nothing is flagged; outside it, the verdict says it extrapolates.
  EXPECT_TRUE(judged(0.6, 0.8, 0.1).retention->outside.empty());
  const Evaluation far = judged(0.95, 0.8, 0.8);
  EXPECT_NE(far.retention->outside.find("the mean-only cosine 0.800 is outside"), std::string::npos);
  EXPECT_NE(far.retention->outside.find("the attention cosine 0.950 is outside"), std::string::npos);
  EXPECT_NE(far.verdict().find("an extrapolation"), std::string::npos) << far.verdict();
  EXPECT_EQ(far.json()["predicted_retention"]["extrapolated"], true);
  // A cosine at or under the mean-only baseline's is NOT READY whatever the share.
  EXPECT_FALSE(judged(0.99, 0.01, 0.99).ok());
  // Negative held-out R² is NOT READY.
  Evaluation neg = judged(0.99, 0.01);
  neg.mapper.r2_v = -0.1;
  judge(neg, VerdictThresholds{0.01});
  EXPECT_FALSE(neg.ok());
  // Without queries there is no share: UNCERTAIN at best, never ok.
  Evaluation none;
  none.mapper.r2_k = none.mapper.r2_v = 0.9;
  judge(none);
  EXPECT_FALSE(none.retention.has_value());
  EXPECT_FALSE(none.ok());
  EXPECT_EQ(none.verdict().rfind("UNCERTAIN", 0), 0u) << none.verdict();
  EXPECT_TRUE(none.json()["predicted_retention"].is_null());
}

TEST(Verdict, ItsClassSaysWhatItsTextSays) {
  auto judged = [](double cosine, double r2, bool queries) {
    Evaluation ev;
    ev.mapper.r2_k = ev.mapper.r2_v = r2;
    if (queries) {
      ev.mapper.attention_cosine = cosine;
      ev.mapper.k_concentration = 1.5;
      ev.mean_only.attention_cosine = 0.1;
    }
    judge(ev, VerdictThresholds{0.5});
    return ev;
  };
  const std::pair<Evaluation, const char*> cases[] = {{judged(0.99, 0.5, true), "likely"},
                                                      {judged(0.05, 0.5, true), "not_ready"},
                                                      {judged(0.99, -0.5, true), "not_ready"},
                                                      {judged(0.0, 0.9, false), "uncertain"},
                                                      {judged(0.0, -0.9, false), "not_ready"}};
  const std::map<std::string, std::string> text = {
      {"likely", "LIKELY TO TRANSFER"}, {"uncertain", "UNCERTAIN"}, {"not_ready", "NOT READY"}};
  for (const auto& [ev, want] : cases) {
    EXPECT_STREQ(to_string(ev.verdict_class), want) << ev.verdict();
    EXPECT_EQ(ev.json()["verdict_class"], want);
    EXPECT_EQ(ev.verdict().rfind(text.at(want), 0), 0u) << ev.verdict();
    EXPECT_EQ(ev.ok(), ev.verdict_class == VerdictClass::likely);
  }
}
