// Applying and diagnosing mappers: the transfer library, the diagnostics on cases with known answers, the
// baselines, hardened manifests.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <tuple>

#include "eval/diagnose.hpp"
#include "eval/report.hpp"
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

namespace {

SynthOptions linear_pair(const std::string& out, uint64_t data_seed = 0) {
  SynthOptions o = small_synth(out, 31);
  o.relation = SynthRelation::linear;
  o.source.rope = RopeSpec{};
  o.source.rope.type = "default";
  o.source.rope.rotary_dim = 16;
  o.target.rope = default_synth_options().target.rope;
  o.target.rope.type = "llama3";
  o.target.rope.rotary_dim = 16;
  o.with_queries = true;
  o.data_seed = data_seed;
  return o;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float x : a) m = std::max(m, std::fabs(double(x)));
  return m;
}

}  // namespace

TEST(Transfer, PlantedMapIsRecoveredOnHeldOutTokensThroughTheLibrary) {
  TempDir tmp;
  synthesize(linear_pair(tmp.str("cal")));
  SynthOptions h = linear_pair(tmp.str("held"), 999);
  h.domains = {"eval"};
  h.shards_per_domain = 1;
  synthesize(h);
  fit_yaml(config_yaml(tmp.str("cal"), "{k: [1], lambda: 0}"));
  auto be = make_cpu_backend();
  Transfer tr(tmp.str("cal/out/k1"), *be);
  Cache s = read_cache(tmp.str("held/source/eval/shard-000.h5"), false);
  Cache t = read_cache(tmp.str("held/target/eval/shard-000.h5"));
  std::vector<float> k(t.keys.size()), v(t.values.size());
  tr.apply(s.keys.data(), s.values.data(), s.positions.data(), t.positions.data(), s.tokens, k.data(), v.data());
  // Keys come out post target-RoPE, exactly as the target caches them.
  EXPECT_LT(max_abs_diff(k, t.keys), 2e-5 * max_abs(t.keys) * 16);
  EXPECT_LT(max_abs_diff(v, t.values), 1e-3);
  // Peak memory is one layer: each layer file was read once for this call.
  EXPECT_EQ(tr.layer_loads(), h.target.n_layers);
  // And the diagnostics say so: R² ~ 1, cosine ~ 1.
  Evaluation ev = evaluate(tr, s, t);
  EXPECT_GT(ev.mapper.r2_k, 0.9999);
  EXPECT_GT(ev.mapper.r2_v, 0.9999);
  ASSERT_TRUE(ev.mapper.attention_cosine.has_value());
  EXPECT_GT(*ev.mapper.attention_cosine, 0.9999);
  EXPECT_TRUE(ev.ok) << ev.verdict;
  // The "- inference RoPE" bug is caught by every figure.
  EXPECT_LT(ev.no_target_rope.r2_k, 0.5);
  EXPECT_LT(*ev.no_target_rope.attention_cosine, *ev.mapper.attention_cosine - 0.05);
  // The mean-only baseline explains nothing held out.
  EXPECT_LT(std::fabs(ev.mean_only.r2_k), 0.05);
  EXPECT_LT(*ev.mean_only.attention_cosine, *ev.mapper.attention_cosine);
}

TEST(Transfer, ApplyEqualsTheFitsOwnPredictionOnTheCalibrationTokens) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [2], lambda: 0.01}"));
  auto be = make_cpu_backend();
  Transfer tr(tmp.str("out/k2"), *be, TransferOptions{true});
  // In-sample R² per head from the moments (the manifest) vs the R² of the applied mapper on every calibration token.
  std::vector<double> sse_k(tr.target().n_layers * tr.target().n_kv_heads, 0.0), sse_v = sse_k, sst_k = sse_k,
                      sst_v = sse_k, sum_k = sse_k;
  std::vector<Cache> sources, targets;
  for (const char* sh : {"web/shard-000.h5", "web/shard-001.h5"}) {
    sources.push_back(read_cache(tmp.str(std::string("source/") + sh), false));
    targets.push_back(read_cache(tmp.str(std::string("target/") + sh), false));
  }
  const KvSpec& Tg = tr.target();
  const int L = Tg.n_layers, H = Tg.n_kv_heads, D = Tg.head_dim;
  const int64_t W = int64_t{L} * H * D;
  // Column means over all calibration tokens, content space.
  std::vector<double> mk(W, 0.0), mv(W, 0.0);
  int64_t N = 0;
  std::vector<std::vector<float>> ck, pk, pv;
  for (size_t i = 0; i < sources.size(); ++i) {
    const Cache &s = sources[i], &t = targets[i];
    std::vector<float> k(t.keys.size()), v(t.values.size()), tk = t.keys;
    tr.apply(s.keys.data(), s.values.data(), s.positions.data(), t.positions.data(), s.tokens, k.data(), v.data());
    Rope(Tg).strip_block(k.data(), s.tokens, int64_t{L} * H, t.positions.data());
    Rope(Tg).strip_block(tk.data(), s.tokens, int64_t{L} * H, t.positions.data());
    for (int64_t r = 0; r < t.tokens; ++r)
      for (int64_t c = 0; c < W; ++c) {
        mk[c] += tk[r * W + c];
        mv[c] += t.values[r * W + c];
      }
    N += t.tokens;
    ck.push_back(std::move(tk));
    pk.push_back(std::move(k));
    pv.push_back(std::move(v));
  }
  for (int64_t c = 0; c < W; ++c) {
    mk[c] /= N;
    mv[c] /= N;
  }
  for (size_t i = 0; i < sources.size(); ++i)
    for (int64_t r = 0; r < targets[i].tokens; ++r)
      for (int64_t c = 0; c < W; ++c) {
        const int64_t head = c / D;
        const double yk = ck[i][r * W + c], yv = targets[i].values[r * W + c];
        sse_k[head] += (pk[i][r * W + c] - yk) * (pk[i][r * W + c] - yk);
        sse_v[head] += (pv[i][r * W + c] - yv) * (pv[i][r * W + c] - yv);
        sst_k[head] += (yk - mk[c]) * (yk - mk[c]);
        sst_v[head] += (yv - mv[c]) * (yv - mv[c]);
      }
  const auto& layers = tr.manifest().json["layers"];
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const int i = l * H + h;
      EXPECT_NEAR(1 - sse_k[i] / sst_k[i], layers[l]["r2_k"][h].get<double>(), 2e-4) << "layer " << l << " head " << h;
      EXPECT_NEAR(1 - sse_v[i] / sst_v[i], layers[l]["r2_v"][h].get<double>(), 2e-4) << "layer " << l << " head " << h;
    }
}

TEST(Transfer, ResidentOptionReadsEachLayerOnce) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1], lambda: 0.01}"));
  auto be = make_cpu_backend();
  Cache s = read_cache(tmp.str("source/web/shard-000.h5"), false);
  for (bool resident : {false, true}) {
    Transfer tr(tmp.str("out/k1"), *be, TransferOptions{resident});
    const int64_t W = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
    std::vector<float> k(s.tokens * W), v(s.tokens * W);
    for (int rep = 0; rep < 3; ++rep)
      tr.apply(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), s.tokens, k.data(), v.data());
    EXPECT_EQ(tr.layer_loads(), tr.target().n_layers * (resident ? 1 : 3));
  }
}

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
  ev.verdict = "LIKELY TO TRANSFER: test";
  ev.ok = true;
  ReportInput in;
  in.title = "a -> b";
  in.manifests.push_back({{"fit", {{"k", 2}}}, {"layers", nlohmann::json::array()}});
  in.evaluations.push_back(ev);
  const std::string html = render_report(in);
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
  for (auto [k, sigma, ok] : {std::tuple<nlohmann::json, float, bool>{1, 0.9f, false}, {2, 0.3f, true},
                              {"all", 0.05f, true}}) {
    std::mt19937_64 rng(7);
    std::normal_distribution<float> n(0, sigma);
    auto keys = c.keys;
    for (auto& x : keys) x += n(rng);
    Evaluation ev;
    ev.mapper = ev.mean_only = ev.no_target_rope = diagnose(c, keys, c.values);
    ev.ok = ok;
    ev.verdict = std::string(ok ? "LIKELY TO TRANSFER" : "NOT READY") + ": attention-output cosine ...";
    in.manifests.push_back({{"fit", {{"k", k}, {"params", 1000}, {"bias_params", 24}, {"features", 16}}},
                            {"target", {{"kv_spec", {{"n_kv_heads", 2}, {"head_dim", 8}}}}}});
    if (k == 2)  // k = 2 keeps a residual MLP of 4 hidden for its keys: 16*4 + 4 + 4*4 + 4 + 4*16 + 16 = 168
      in.manifests.back()["layers"] = {{{"target_layer", 0}, {"mlp", {{"k", {{"kept", true}, {"hidden", 4}}},
                                                                      {"v", {{"kept", false}}}}}}};
    in.evaluations.push_back(ev);
  }
  const std::string html = render_report(in);
  const size_t summary = html.find("The k sweep at a glance");
  ASSERT_NE(summary, std::string::npos);
  EXPECT_LT(summary, html.find("<h2>k = 1</h2>"));          // before the details per k
  EXPECT_LT(html.find("id='heatmap'"), html.find("<h2>k = 1</h2>"));  // the heatmap embedded near the top
  EXPECT_EQ(html.find("<?xml"), std::string::npos);
  EXPECT_NE(html.find("<th>all &#9733;</th>"), std::string::npos) << "the best cosine is starred";
  EXPECT_NE(html.find("smallest k that passes the verdict: <b>k = 2</b>"), std::string::npos);
  EXPECT_NE(html.find("<td>1.02 K</td><td>4.00 KiB</td><td>2.05 KiB</td>"), std::string::npos)
      << "parameters and bytes per dtype (biases stay fp32)";
  EXPECT_NE(html.find("<td>1.19 K</td><td>4.66 KiB</td><td>2.70 KiB</td>"), std::string::npos)
      << "with a kept residual MLP: its parameters counted, fp32 in every dtype";
  EXPECT_NE(html.find("<td>1 / 0 of 1</td>"), std::string::npos) << "MLPs kept per kind";
  EXPECT_NE(html.find("count the kept residual MLPs"), std::string::npos);
  EXPECT_NE(html.find("NOT READY</td>"), std::string::npos);
}

// ---- Hardened manifests.
namespace {

struct Artifact {
  TempDir tmp;
  std::string dir;
  nlohmann::json manifest;
  explicit Artifact(const std::string& k = "2") {
    synthesize(small_synth(tmp.str()));
    fit_yaml(config_yaml(tmp.str(), "{k: [" + k + "], lambda: 0.01}"));
    dir = tmp.str("out/k" + k);
    std::ifstream in(dir + "/manifest.json");
    in >> manifest;
  }
  void write(const nlohmann::json& m) const { std::ofstream(dir + "/manifest.json") << m.dump(); }
};

}  // namespace

TEST(HardenedManifest, EveryBadFieldIsNamed) {
  Artifact a;
  auto be = make_cpu_backend();
  auto expect_bad = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& parts) {
    nlohmann::json m = a.manifest;
    edit(m);
    a.write(m);
    expect_error<InputError>([&] { Transfer tr(a.dir, *be); }, parts);
  };
  expect_bad([](auto& m) { m.erase("layers"); }, {"manifest.json", "missing field 'layers'"});
  expect_bad([](auto& m) { m["format_version"] = 7; }, {"unknown format_version 7"});
  expect_bad([](auto& m) { m["format"] = "other"; }, {"format is 'other'"});
  expect_bad([](auto& m) { m["source"].erase("kv_spec"); }, {"missing field 'source.kv_spec'"});
  expect_bad([](auto& m) { m["fit"].erase("k_count"); }, {"missing field 'fit.k_count'"});
  expect_bad([](auto& m) { m["layers"][1]["source_layers"] = {0, 99}; }, {"layers[1].source_layers", "ascending"});
  expect_bad([](auto& m) { m["layers"][1]["source_layers"] = {3, 1}; }, {"layers[1].source_layers"});
  expect_bad([](auto& m) { m["layers"][2]["target_layer"] = 1; }, {"layers[2].target_layer 1", "repeated"});
  expect_bad([](auto& m) { m["layers"][0]["file"] = "../../etc/passwd"; }, {"layers[0].file", "not a layer-NNN"});
  expect_bad([](auto& m) { m["layers"][0]["sha256"] = "xyz"; }, {"layers[0].sha256"});
  expect_bad([](auto& m) { m["layers"].erase(m["layers"].begin()); }, {"each of the target's"});
  expect_bad([](auto& m) { m["source"]["kv_spec"]["n_layers"] = 100000; }, {"implausibly large"});
  // Invalid JSON.
  std::ofstream(a.dir + "/manifest.json") << "{ not json";
  expect_error<InputError>([&] { Transfer tr(a.dir, *be); }, {"manifest.json", "not valid JSON"});
  // A layer file that does not match its SHA-256 is refused when it is read.
  a.write(a.manifest);
  {
    std::fstream f(a.dir + "/layer-003.safetensors", std::ios::in | std::ios::out | std::ios::binary);
    f.seekp(-3, std::ios::end);
    f.put('\x7f');
  }
  Transfer tr(a.dir, *be);
  std::vector<float> X(10 * tr.source().n_layers * tr.source().features_per_layer(), 0.0f),
      Y(10 * tr.target().n_layers * tr.target().features_per_layer());
  expect_error<InputError>([&] { tr.map_content(true, X.data(), 10, Y.data()); },
                           {"layer-003.safetensors", "SHA-256 does not match"});
}

TEST(HardenedManifest, ACacheOfAnotherModelIsRefusedWithWhatDiffers) {
  Artifact a;
  auto be = make_cpu_backend();
  Transfer tr(a.dir, *be);
  Cache wrong = read_cache(a.tmp.str("target/web/shard-000.h5"), true);  // the target's cache as the source
  Cache t = wrong;
  expect_error<InputError>([&] { evaluate(tr, wrong, t); },
                           {a.tmp.str("target/web/shard-000.h5"), "kv_spec does not match the mapper's source",
                            "n_layers"});
  Cache s = read_cache(a.tmp.str("source/web/shard-000.h5"), false);
  Cache other = read_cache(a.tmp.str("source/web/shard-001.h5"), true);  // the target side named by its file too
  expect_error<InputError>([&] { evaluate(tr, s, other); },
                           {a.tmp.str("source/web/shard-001.h5"), "kv_spec does not match the mapper's target"});
}

// A manifest edited by hand is validated like a shard: rope parameters that give no frequencies are refused.
TEST(HardenedManifest, RopeParametersAreValidatedLikeAShards) {
  Artifact a;
  auto be = make_cpu_backend();
  for (const double theta : {0.0, -1.0, 1e-300}) {
    nlohmann::json m = a.manifest;
    m["target"]["kv_spec"]["rope"]["theta"] = theta;
    a.write(m);
    expect_error<InputError>([&] { Transfer tr(a.dir, *be); },
                             {"manifest.json", "target.kv_spec", "kv_spec.rope.theta", "finite number > 1"});
  }
  nlohmann::json m = a.manifest;
  m["target"]["kv_spec"]["rope"]["factor"] = 0;
  a.write(m);
  expect_error<InputError>([&] { Transfer tr(a.dir, *be); }, {"target.kv_spec", "kv_spec.rope.factor"});
}

// Weights that are not finite are refused by layer and tensor, even when the manifest's SHA-256 was updated.
TEST(HardenedManifest, NonFiniteWeightsAreRefusedByLayerAndTensor) {
  Artifact a;
  auto be = make_cpu_backend();
  const std::string file = a.dir + "/layer-004.safetensors";
  std::ifstream in(file, std::ios::binary);
  const std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  auto t = parse_safetensors(bytes, file);
  t["v.bias"].values[3] = NAN;
  std::vector<TensorOut> out;
  for (const char* name : {"k.weight", "k.bias", "v.weight", "v.bias"})
    out.push_back({name, "F32", t[name].shape, t[name].values.data(), t[name].values.size() * 4});
  write_safetensors(file, out, {});
  nlohmann::json m = a.manifest;
  m["layers"][4]["sha256"] = sha256_file(file);
  a.write(m);
  Transfer tr(a.dir, *be);
  std::vector<float> X(10 * tr.source().n_layers * tr.source().features_per_layer(), 0.0f),
      Y(10 * tr.target().n_layers * tr.target().features_per_layer());
  expect_error<InputError>([&] { tr.map_content(false, X.data(), 10, Y.data()); },
                           {file, "target layer 4", "tensor 'v.bias'", "NaN", "element 3"});
}

// A layer file that is a symlink out of the mapper folder is refused; one inside it is fine.
TEST(HardenedManifest, ALayerFileLinkedFromOutsideTheFolderIsRefused) {
  Artifact a;
  auto be = make_cpu_backend();
  const std::string file = a.dir + "/layer-002.safetensors", outside = a.tmp.str("elsewhere.safetensors");
  fs::rename(file, outside);
  fs::create_symlink(outside, file);
  Transfer tr(a.dir, *be);
  std::vector<float> X(10 * tr.source().n_layers * tr.source().features_per_layer(), 0.0f),
      Y(10 * tr.target().n_layers * tr.target().features_per_layer());
  expect_error<InputError>([&] { tr.map_content(true, X.data(), 10, Y.data()); },
                           {file, "symlink leaving the mapper folder", "elsewhere.safetensors"});
  fs::remove(file);
  fs::rename(outside, a.dir + "/moved.safetensors");
  fs::create_symlink("moved.safetensors", file);
  Transfer again(a.dir, *be);
  EXPECT_NO_THROW(again.map_content(true, X.data(), 10, Y.data()));
}

// ---- Residual MLPs in artifacts (issue 15): optional <kind>.mlp.* tensors of a layer, applied on top of ridge.
namespace {

// Adds residual MLPs (hidden width h, random, non-zero last layer) for keys and values to layer `l` of an artifact,
// or the tensors `only` alone when given; re-hashes the file in the manifest.
void add_mlp_tensors(Artifact& a, int l, int64_t h, const std::vector<std::string>& only = {}, float poison = 0) {
  const std::string file = a.dir + "/" + a.manifest["layers"][l]["file"].get<std::string>();
  auto t = read_safetensors(file);
  const int64_t in = t.at("k.weight").shape[0], G = t.at("k.weight").shape[1];
  std::mt19937_64 rng(11);
  std::normal_distribution<float> n(0, 0.3f);
  for (const char* kind : {"k", "v"})
    for (auto [name, shape] : {std::pair<const char*, std::vector<int64_t>>{"w1", {in, h}}, {"b1", {h}},
                               {"w2", {h, h}}, {"b2", {h}}, {"w3", {h, G}}, {"b3", {G}}}) {
      const std::string full = std::string(kind) + ".mlp." + name;
      if (!only.empty() && std::find(only.begin(), only.end(), full) == only.end()) continue;
      TensorIn& x = t[full];
      x.dtype = "F32", x.shape = shape;
      int64_t count = 1;
      for (auto d : shape) count *= d;
      x.values.resize(count);
      for (auto& v : x.values) v = n(rng);
      if (poison != 0) x.values[1] = poison;
    }
  std::vector<TensorOut> out;
  for (const auto& [name, x] : t)
    out.push_back({name, "F32", x.shape, x.values.data(), x.values.size() * sizeof(float)});
  write_safetensors(file, out, {});
  a.manifest["layers"][l]["sha256"] = sha256_file(file);
  a.write(a.manifest);
}

}  // namespace

TEST(ResidualMlpArtifact, ApplyAddsTheMlpToRidgeLikeTheLoopReference) {
  Artifact a;
  add_mlp_tensors(a, 2, 8);
  auto be = make_cpu_backend();
  const MapperManifest m = read_mapper_manifest(a.dir);
  const MapperLayer l2 = load_mapper_layer(m, 2);
  ASSERT_EQ(l2.mlp_k.shape.hidden, 8);
  ASSERT_EQ(l2.mlp_v.shape.in, int64_t(l2.source_layers.size()) * m.source.features_per_layer());
  EXPECT_TRUE(load_mapper_layer(m, 1).mlp_k.flat.empty());  // other layers: ridge alone
  const int64_t rows = 12, XW = m.source.n_layers * m.source.features_per_layer(),
                YW = m.target.n_layers * m.target.features_per_layer(), G = m.target.features_per_layer();
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> X(rows * XW);
  for (auto& x : X) x = n(rng);
  for (bool keys : {true, false}) {
    std::vector<float> got(rows * YW), want(rows * YW), ridge(rows * YW);
    Transfer tr(a.dir, *be);
    tr.map_content(keys, X.data(), rows, got.data());
    map_content(load_mapper(a.dir), keys, X.data(), rows, want.data());
    for (size_t i = 0; i < got.size(); ++i) ASSERT_NEAR(got[i], want[i], 1e-4f * (1 + std::fabs(want[i]))) << i;
    // Layer 2 differs from ridge alone by f(x), the other layers not at all.
    MapperWeights plain = load_mapper(a.dir);
    plain.layers[2].mlp_k = plain.layers[2].mlp_v = MlpParams();
    map_content(plain, keys, X.data(), rows, ridge.data());
    double diff2 = 0, diff_other = 0;  // the largest difference in layer 2, and elsewhere (fp32 rounding only)
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t c = 0; c < YW; ++c) {
        double& d = c / G == 2 ? diff2 : diff_other;
        d = std::max(d, std::fabs(double(got[t * YW + c]) - ridge[t * YW + c]));
      }
    EXPECT_GT(diff2, 0.1);
    EXPECT_LT(diff_other, 1e-4);
  }
}

// The layer file's one writer and its reader agree on every field: weights as F32, BF16 and F16 bits, biases, the
// residual MLPs of keys, values, both or neither, and the source layers of the manifest; the file holds exactly the
// tensors the format names.
TEST(LayerFile, WhatTheWriterStoresTheReaderReadsBack) {
  Artifact a;
  const MapperManifest m0 = read_mapper_manifest(a.dir);
  const int l = 1;
  const int64_t F = m0.source.features_per_layer(), G = m0.target.features_per_layer();
  const std::vector<int> layers = m0.layers[l].source_layers;
  const int64_t rows = static_cast<int64_t>(layers.size()) * F;
  std::mt19937_64 rng(21);
  std::normal_distribution<float> n(0, 0.5f);
  auto random = [&](int64_t count) {
    std::vector<float> v(count);
    for (auto& x : v) x = n(rng);
    return v;
  };
  const std::vector<float> wk = random(rows * G), wv = random(rows * G), bk = random(G), bv = random(G);
  MlpParams mk(MlpShape{rows, 6, G}), mv(MlpShape{rows, 3, G});
  mk.flat = random(mk.shape.parameters()), mv.flat = random(mv.shape.parameters());
  for (const std::string dtype : {"F32", "BF16", "F16"})
    for (int mlps = 0; mlps < 4; ++mlps) {
      const std::string what = dtype + ", MLPs " + std::to_string(mlps);
      std::vector<uint16_t> hk(wk.size()), hv(wv.size());
      for (size_t i = 0; i < wk.size(); ++i) {
        hk[i] = dtype == "BF16" ? float_to_bf16(wk[i]) : float_to_fp16(wk[i]);
        hv[i] = dtype == "BF16" ? float_to_bf16(wv[i]) : float_to_fp16(wv[i]);
      }
      const bool f32 = dtype == "F32";
      LayerFileContent c{l, layers, rows, G,
                         {dtype, f32 ? static_cast<const void*>(wk.data()) : hk.data(), bk.data(), mlps & 1 ? &mk : nullptr},
                         {dtype, f32 ? static_cast<const void*>(wv.data()) : hv.data(), bv.data(), mlps & 2 ? &mv : nullptr}};
      const std::string file = a.dir + "/" + layer_file_name(l);
      write_layer_file(file, c);
      nlohmann::json m = a.manifest;
      m["layers"][l]["sha256"] = sha256_file(file);
      a.write(m);
      const MapperLayer got = load_mapper_layer(read_mapper_manifest(a.dir), l);
      EXPECT_EQ(got.source_layers, layers) << what;
      auto stored = [&](const std::vector<float>& w, const std::vector<uint16_t>& h) {
        std::vector<float> v(w.size());
        for (size_t i = 0; i < w.size(); ++i) v[i] = f32 ? w[i] : dtype == "BF16" ? bf16_to_float(h[i]) : fp16_to_float(h[i]);
        return v;
      };
      EXPECT_EQ(got.wk, stored(wk, hk)) << what;
      EXPECT_EQ(got.wv, stored(wv, hv)) << what;
      EXPECT_EQ(got.bk, bk) << what;
      EXPECT_EQ(got.bv, bv) << what;
      EXPECT_EQ(got.mlp_k.flat, mlps & 1 ? mk.flat : std::vector<float>()) << what;
      EXPECT_EQ(got.mlp_v.flat, mlps & 2 ? mv.flat : std::vector<float>()) << what;
      if (mlps & 1) {
        EXPECT_EQ(got.mlp_k.shape.hidden, 6) << what;
      }
      std::set<std::string> names, want = {"k.weight", "k.bias", "v.weight", "v.bias"};
      for (const auto& [name, x] : read_safetensors(file)) names.insert(name);
      for (auto [kind, on, p] : {std::tuple{'k', mlps & 1, &mk}, std::tuple{'v', mlps & 2, &mv}})
        if (on)
          for (const MlpTensor& x : mlp_tensors(p->shape)) want.insert(layer_tensor_name(kind, std::string("mlp.") + x.name));
      EXPECT_EQ(names, want) << what;
    }
}

// The manifest's one writer and the reader agree: a manifest made by make_manifest (and given the MLP stage's
// additions) reads back with every field the reader takes, and its layer entries as written.
TEST(Manifest, WhatTheWriterWritesTheReaderReadsBack) {
  Artifact a;
  const MapperManifest m0 = read_mapper_manifest(a.dir);
  nlohmann::json layers = nlohmann::json::array();
  for (const MapperLayerEntry& e : m0.layers)
    layers.push_back(manifest_layer_entry(e.target_layer, e.source_layers, e.file, e.sha256,
                                          {0.5, std::numeric_limits<double>::quiet_NaN()}, {0.25}));
  const ManifestFit fit{"2", 2, 2 * m0.source.features_per_layer(), 1234, 56, 0.01, "same_head", "bf16"};
  nlohmann::json m = make_manifest("src-model", m0.source, "tgt-model", m0.target, fit, layers, {{"domains", {"web"}}});
  m["timings_s"] = {{"total", 1.0}};
  add_layer_mlp(m["layers"][1], m0.layers[1].sha256, {{"k", {{"kept", false}}}});
  add_fit_mlp(m, "auto", {{"hidden", 8}}, 2.5);
  write_manifest(a.dir, m);
  const MapperManifest got = read_mapper_manifest(a.dir);
  EXPECT_EQ(got.source_model, "src-model");
  EXPECT_EQ(got.target_model, "tgt-model");
  EXPECT_EQ(got.source, m0.source);
  EXPECT_EQ(got.target, m0.target);
  EXPECT_EQ(got.k_count, 2);
  EXPECT_EQ(got.dtype, "bf16");
  ASSERT_EQ(got.layers.size(), m0.layers.size());
  for (size_t l = 0; l < got.layers.size(); ++l) {
    EXPECT_EQ(got.layers[l].target_layer, m0.layers[l].target_layer);
    EXPECT_EQ(got.layers[l].source_layers, m0.layers[l].source_layers);
    EXPECT_EQ(got.layers[l].file, m0.layers[l].file);
    EXPECT_EQ(got.layers[l].sha256, m0.layers[l].sha256);
  }
  const nlohmann::json& j = got.json;
  EXPECT_EQ(j["format"], kMapperFormat);
  EXPECT_EQ(j["format_version"], kManifestVersion);
  EXPECT_EQ(j["fit"]["k"], 2);
  EXPECT_EQ(j["fit"]["features"], fit.features);
  EXPECT_EQ(j["fit"]["params"], 1234);
  EXPECT_EQ(j["fit"]["bias_params"], 56);
  EXPECT_EQ(j["fit"]["probe"], "same_head");
  EXPECT_EQ(j["fit"]["mapper"], "auto");
  EXPECT_EQ(j["fit"]["mlp"]["hidden"], 8);
  EXPECT_EQ(j["timings_s"]["mlp"], 2.5);
  EXPECT_EQ(j["timings_s"]["total"], 3.5);
  EXPECT_TRUE(j["layers"][0]["r2_k"][1].is_null()) << "NaN is written as null";
  EXPECT_EQ(j["layers"][0]["r2_v"][0], 0.25);
  EXPECT_EQ(j["layers"][1]["mlp"]["k"]["kept"], false);
  EXPECT_EQ(j["calibration"]["domains"][0], "web");
  // A transfer through it maps as the export's own manifest does (the same weights).
  auto be = make_cpu_backend();
  Transfer tr(a.dir, *be);
  EXPECT_EQ(tr.manifest().k_count, 2);
}

TEST(ResidualMlpArtifact, IncompleteOrBadMlpTensorsAreNamed) {
  {
    Artifact a;
    add_mlp_tensors(a, 1, 4, {"k.mlp.b1", "k.mlp.w2"});
    expect_error<InputError>([&] { load_mapper_layer(read_mapper_manifest(a.dir), 1); },
                             {"layer-001.safetensors", "tensor 'k.mlp.b1' without 'k.mlp.w1'"});
  }
  {
    Artifact a;
    add_mlp_tensors(a, 1, 4, {"v.mlp.w1", "v.mlp.b1"});
    expect_error<InputError>([&] { load_mapper_layer(read_mapper_manifest(a.dir), 1); },
                             {"layer-001.safetensors", "tensor 'v.mlp.w2' is missing"});
  }
  {
    Artifact a;
    add_mlp_tensors(a, 0, 4, {}, std::numeric_limits<float>::quiet_NaN());
    expect_error<InputError>([&] { load_mapper_layer(read_mapper_manifest(a.dir), 0); },
                             {"layer-000.safetensors", "tensor 'k.mlp.w1' holds NaN at element 1"});
  }
}

// ---- The serving apply (issue 16): weights resident, every layer in one call, the caches in the backend's memory.
namespace {

// Transfer::apply and ServingMapper (one call, and host arrays) on the same caches: the same bits on the CPU.
void expect_resident_equals_transfer(const std::string& dir, const Cache& s, int64_t rows) {
  auto be = make_cpu_backend();
  Transfer tr(dir, *be);
  ServingMapper rt(dir, *be);
  const int64_t W = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
  std::vector<int32_t> tgt(s.positions.begin(), s.positions.begin() + rows);
  for (auto& p : tgt) p += 3;  // the target's positions need not be the source's
  std::vector<float> k(rows * W), v(rows * W), rk(rows * W, -1), rv(rows * W, -1), hk(rows * W), hv(rows * W);
  tr.apply(s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, k.data(), v.data());
  rt.apply({s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, rk.data(), rv.data()});
  rt.apply_host(s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, hk.data(), hv.data());
  EXPECT_EQ(std::memcmp(k.data(), rk.data(), k.size() * 4), 0) << dir << ": keys";
  EXPECT_EQ(std::memcmp(v.data(), rv.data(), v.size() * 4), 0) << dir << ": values";
  EXPECT_EQ(std::memcmp(k.data(), hk.data(), k.size() * 4), 0) << dir << ": keys (host arrays)";
  EXPECT_EQ(std::memcmp(v.data(), hv.data(), v.size() * 4), 0) << dir << ": values (host arrays)";
  EXPECT_GT(max_abs(rk), 0.1);
}

}  // namespace

TEST(ServingMapper, EqualsTransferBitForBitOnTheCpuForEveryK) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1, 2, all], lambda: 0.01}"));
  const Cache s = read_cache(tmp.str("source/web/shard-000.h5"), false);
  ASSERT_GT(s.seq_offsets.size(), 2u);  // a batch of several sequences, back to back
  for (const char* k : {"k1", "k2", "kall"}) expect_resident_equals_transfer(tmp.str("out/") + k, s, s.tokens);
  // A batch of one token, and of none; target layers in chunks of one and of three (a cap on the gather).
  expect_resident_equals_transfer(tmp.str("out/k2"), s, 1);
  for (int64_t per_chunk : {1, 3}) {
    auto cpu = make_cpu_backend();
    Transfer tr(tmp.str("out/k2"), *cpu);
    ServingMapper rt(tmp.str("out/k2"), *cpu);
    rt.set_gather_bytes(per_chunk * s.tokens * 2 * rt.source().features_per_layer() * 4);
    const int64_t W = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
    std::vector<float> k(s.tokens * W), v(s.tokens * W), rk(s.tokens * W), rv(s.tokens * W);
    tr.apply(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), s.tokens, k.data(), v.data());
    rt.apply_host(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), s.tokens, rk.data(),
                  rv.data());
    EXPECT_EQ(k, rk) << per_chunk << " layer(s) per product";
    EXPECT_EQ(v, rv) << per_chunk << " layer(s) per product";
  }
  auto be = make_cpu_backend();
  ServingMapper rt(tmp.str("out/k1"), *be);
  rt.apply(ServingBatch{});
  const int64_t F = rt.source().features_per_layer(), G = rt.target().features_per_layer();
  EXPECT_EQ(rt.weight_bytes(), int64_t{rt.target().n_layers} * 2 * (F * G + G) * 4);
}

TEST(ServingMapper, EqualsTransferBitForBitWithResidualMlps) {
  for (const char* k : {"1", "2", "all"}) {  // the MLP's input read in place, gathered for it, or the chunk's gather
    Artifact a(k);
    add_mlp_tensors(a, 2, 8);
    add_mlp_tensors(a, 3, 4);
    const Cache s = read_cache(a.tmp.str("source/web/shard-000.h5"), false);
    expect_resident_equals_transfer(a.dir, s, s.tokens);
  }
}

TEST(ServingMapper, RefusesWhatTransferRefusesByName) {
  Artifact a;
  auto be = make_cpu_backend();
  nlohmann::json m = a.manifest;
  m["target"]["kv_spec"]["rope"]["type"] = "dynamic";
  a.write(m);
  expect_error<InputError>([&] { ServingMapper rt(a.dir, *be); }, {"target.kv_spec", "dynamic"});
  a.write(a.manifest);
  std::ofstream(a.dir + "/" + a.manifest["layers"][1]["file"].get<std::string>(), std::ios::app) << "x";
  expect_error<InputError>([&] { ServingMapper rt(a.dir, *be); }, {"SHA-256"});
}
