#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>

#include <nlohmann/json.hpp>

#include "backends/backends.hpp"
#include "core/half.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "helpers.hpp"
#include "reference_mapper.hpp"
#include "artifact/mapper.hpp"
#include "io/r2_file.hpp"
#include "artifact/safetensors.hpp"
#include "io/h5.hpp"
#include "io/shard.hpp"
#include "fit/export.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

nlohmann::json manifest(const std::string& dir) {
  std::ifstream in(dir + "/manifest.json");
  return nlohmann::json::parse(in);
}

// Maps a held-out source shard with the mapper and compares with the target shard (keys post-RoPE).
struct MapError {
  double max_abs_k = 0, max_abs_v = 0, scale = 0;
};
// A held-out shard pair read for a mapper: the target's keys and values as stored (keys post-RoPE), and the
// mapper's prediction in content space from the source's (its keys stripped of the source RoPE unless told not to).
struct Mapped {
  int64_t T = 0, YW = 0;
  std::vector<float> yk, yv, pk, pv;
  std::vector<int32_t> pos;
};
Mapped map_pair(const MapperWeights& m, const std::string& src, const std::string& tgt, bool strip_at_apply = true) {
  ShardReader s(src), t(tgt);
  Mapped p;
  p.T = s.header().tokens;
  const int64_t XW = m.source.n_layers * m.source.features_per_layer();
  p.YW = m.target.n_layers * m.target.features_per_layer();
  std::vector<float> xk(p.T * XW), xv(p.T * XW);
  p.yk.resize(p.T * p.YW), p.yv.resize(p.T * p.YW), p.pk.resize(p.T * p.YW), p.pv.resize(p.T * p.YW);
  std::vector<uint16_t> scratch;
  s.read_rows("keys", 0, p.T, 1, xk.data(), scratch);
  s.read_rows("values", 0, p.T, 1, xv.data(), scratch);
  t.read_rows("keys", 0, p.T, 1, p.yk.data(), scratch);
  t.read_rows("values", 0, p.T, 1, p.yv.data(), scratch);
  p.pos = s.positions();
  if (strip_at_apply)
    Rope(m.source).strip_block(xk.data(), p.T, {0, m.source.n_layers, m.source.n_kv_heads}, p.pos.data());
  map_content(m, Kind::k, xk.data(), p.T, p.pk.data());
  map_content(m, Kind::v, xv.data(), p.T, p.pv.data());
  return p;
}

MapError map_shard(const MapperWeights& m, const std::string& src, const std::string& tgt, bool strip_at_apply = true) {
  Mapped p = map_pair(m, src, tgt, strip_at_apply);
  Rope(m.target).apply_block(p.pk.data(), p.T, {0, m.target.n_layers, m.target.n_kv_heads}, p.pos.data());
  MapError e;
  for (int64_t i = 0; i < p.T * p.YW; ++i) {
    e.max_abs_k = std::max(e.max_abs_k, std::fabs(double(p.pk[i]) - p.yk[i]));
    e.max_abs_v = std::max(e.max_abs_v, std::fabs(double(p.pv[i]) - p.yv[i]));
    e.scale = std::max(e.scale, std::fabs(double(p.yk[i])));
  }
  return e;
}

SynthOptions linear_synth(const std::string& out, const std::string& src_rope, const std::string& tgt_rope) {
  SynthOptions o = small_synth(out, 31);
  o.relation = SynthRelation::linear;
  o.source.rope = RopeSpec{};
  o.source.rope.type = src_rope;
  if (src_rope == "linear") o.source.rope.factor = 2.0;
  o.source.rope.rotary_dim = 16;
  o.target.rope = default_synth_options().target.rope;
  o.target.rope.type = tgt_rope;
  o.target.rope.rotary_dim = 16;
  if (tgt_rope == "yarn") {
    o.target.rope.factor = 4.0;
    o.target.rope.original_max_position_embeddings = 2048.0;
    o.target.rope.convention = RopeConvention::interleaved;
  }
  o.large_mean = 50.0;
  for (KvSpec* side : {&o.source, &o.target})
    if (side->rope.type == "gemma3") {  // Gemma 3's pattern: every third layer global (theta 1e6), the rest local
      side->rope.type = "default", side->rope.theta = 1e6;
      RopeSpec local = side->rope;
      local.theta = 1e4;
      side->layers.assign(side->n_layers, LayerSpec{Attention::sliding, 512, local});
      for (int l = 2; l < side->n_layers; l += 3) side->layers[l] = LayerSpec{Attention::full, 0, side->rope};
    }
  return o;
}

}  // namespace

class ExactRecovery : public ::testing::TestWithParam<std::pair<std::string, std::string>> {};

TEST_P(ExactRecovery, PlantedLinearMapThroughDifferentRopeIsRecoveredOnHeldOutTokens) {
  TempDir tmp;
  auto [src_rope, tgt_rope] = GetParam();
  SynthOptions o = linear_synth(tmp.str("cal"), src_rope, tgt_rope);
  synthesize(o);
  o.out = tmp.str("held");
  o.data_seed = 999;  // same maps, new tokens
  o.domains = {"eval"};
  o.shards_per_domain = 1;
  synthesize(o);
  fit_yaml(config_yaml(tmp.str("cal"), "{k: [1], lambda: 0}"));
  MapperWeights m = load_mapper(tmp.str("cal/out/k1"));
  // Target layer l was planted from source layer l mod Ls: the probe must pick it.
  for (const auto& l : m.layers) EXPECT_EQ(l.source_layers, std::vector<int>{l.target_layer % o.source.n_layers});
  MapError e = map_shard(m, tmp.str("held/source/eval/shard-000.h5"), tmp.str("held/target/eval/shard-000.h5"));
  EXPECT_LT(e.max_abs_k, 2e-5 * e.scale * 16) << "keys not recovered to fp32 precision";
  EXPECT_LT(e.max_abs_v, 1e-3);
  // Skipping the strip at apply time (the paper's "- inference RoPE") must visibly break the keys.
  if (src_rope != "none") {
    MapError bad = map_shard(m, tmp.str("held/source/eval/shard-000.h5"), tmp.str("held/target/eval/shard-000.h5"), false);
    EXPECT_GT(bad.max_abs_k, 100 * std::max(e.max_abs_k, 1e-6));
  }
}

INSTANTIATE_TEST_SUITE_P(RopePairs, ExactRecovery,
                         ::testing::Values(std::make_pair(std::string("default"), std::string("llama3")),
                                           std::make_pair(std::string("linear"), std::string("yarn")),
                                           std::make_pair(std::string("none"), std::string("default")),
                                           std::make_pair(std::string("gemma3"), std::string("gemma3"))));

TEST(Fit, FamilyDataShowsTheDiagonalBandAndR2GrowsWithK) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  FitResult r = fit_yaml(config_yaml(tmp.str(), "{k: [1, 2, 4, all], lambda: 0.01}"));
  ASSERT_EQ(r.artifacts.size(), 4u);
  auto probes = read_r2_file(r.r2_path);
  const auto& k = probes[Kind::k];
  // Each target layer's best source layer sits at a similar relative depth.
  for (int l = 0; l < k.Lt; ++l) {
    int best = 0;
    for (int a = 1; a < k.Ls; ++a)
      if (k.mean[a * k.Lt + l] > k.mean[best * k.Lt + l]) best = a;
    EXPECT_LE(std::abs(best - std::lround(double(l) * (k.Ls - 1) / (k.Lt - 1))), 1) << "target layer " << l;
  }
  // Stripping RoPE helps: the best stripped-key R² beats the raw one.
  double best_k = 0, best_raw = 0;
  for (size_t i = 0; i < k.mean.size(); ++i) {
    best_k = std::max(best_k, k.mean[i]);
    best_raw = std::max(best_raw, probes[Kind::k_rope].mean[i]);
  }
  EXPECT_GT(best_k, best_raw + 0.2);
  double prev = -1;
  for (const char* kd : {"k1", "k2", "k4", "kall"}) {
    auto m = manifest(tmp.str(std::string("out/") + kd));
    double sum = 0;
    int n = 0;
    for (const auto& l : m["layers"])
      for (double v : l["r2_k"]) {
        sum += v;
        ++n;
      }
    EXPECT_GE(sum / n, prev - 1e-9) << kd;
    prev = sum / n;
  }
  EXPECT_TRUE(fs::exists(r.heatmap_path));
}

TEST(Fit, ManifestDescribesTheArtifact) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [2], lambda: 0.05}"));
  auto m = manifest(tmp.str("out/k2"));
  EXPECT_EQ(m["format"], "crosskv-mapper");
  EXPECT_EQ(m["format_version"], 1);
  EXPECT_EQ(m["fit"]["k"], 2);
  EXPECT_EQ(m["fit"]["lambda"], 0.05);
  EXPECT_EQ(m["fit"]["lambda_scale"], "covariance");
  EXPECT_EQ(m["fit"]["content_space"], true);
  EXPECT_EQ(m["source"]["kv_spec"]["n_layers"], 6);
  EXPECT_EQ(m["target"]["kv_spec"]["rope"]["type"], "llama3");
  EXPECT_EQ(m["calibration"]["tokens_used"], 2 * 4 * 128);
  EXPECT_EQ(m["calibration"]["shards"].size(), 2u);
  ASSERT_EQ(m["layers"].size(), 8u);
  for (const auto& l : m["layers"]) {
    const std::string file = tmp.str("out/k2/" + l["file"].get<std::string>());
    EXPECT_EQ(sha256_file(file), l["sha256"]);
    EXPECT_EQ(l["source_layers"].size(), 2u);
    EXPECT_EQ(l["r2_k"].size(), 2u);
    auto t = read_safetensors(file);
    EXPECT_EQ(t["k.weight"].shape, (std::vector<int64_t>{2 * 2 * 16, 2 * 16}));
    EXPECT_EQ(t["v.bias"].shape, (std::vector<int64_t>{2 * 16}));
  }
  EXPECT_FALSE(fs::exists(tmp.str("out/k2.partial")));
}

// The shards' weights fingerprints (model_weights, written by crosskv-capture) reach the manifest, for the source and
// the target, and its reader; shards without one give a manifest without one.
TEST(Fit, TheModelsWeightsFingerprintsReachTheManifest) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "plain"));
  EXPECT_FALSE(manifest(tmp.str("plain/k2"))["source"].contains("weights"));
  EXPECT_EQ(read_mapper_manifest(tmp.str("plain/k2")).source_weights, "");
  for (const std::string side : {"source", "target"})
    for (int i : {0, 1}) {
      const std::string path = tmp.str(side + "/web/shard-00" + std::to_string(i) + ".h5");
      h5::quiet();
      h5::Handle f(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
      h5::write_string_attr(f, "model_weights", "sha256:" + side);
    }
  fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "out"));
  const auto m = manifest(tmp.str("out/k2"));
  EXPECT_EQ(m["source"]["weights"], "sha256:source");
  EXPECT_EQ(m["target"]["weights"], "sha256:target");
  const MapperManifest mm = read_mapper_manifest(tmp.str("out/k2"));
  EXPECT_EQ(mm.source_weights, "sha256:source");
  EXPECT_EQ(mm.target_weights, "sha256:target");
}

TEST(Fit, KSweepGivesTheSameArtifactsAsSeparateRuns) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1, 3, all], lambda: 0.01}", "sweep"));
  for (const char* k : {"1", "3", "all"}) {
    fit_yaml(config_yaml(tmp.str(), std::string("{k: ") + k + ", lambda: 0.01}", std::string("single") + k));
    MapperWeights a = load_mapper(tmp.str(std::string("sweep/k") + k)), b = load_mapper(tmp.str(std::string("single") + k + "/k" + k));
    ASSERT_EQ(a.layers.size(), b.layers.size());
    for (size_t l = 0; l < a.layers.size(); ++l) {
      EXPECT_EQ(a.layers[l].source_layers, b.layers[l].source_layers);
      for (size_t i = 0; i < a.layers[l].wk.size(); ++i) ASSERT_NEAR(a.layers[l].wk[i], b.layers[l].wk[i], 1e-5);
      for (size_t i = 0; i < a.layers[l].bv.size(); ++i) ASSERT_NEAR(a.layers[l].bv[i], b.layers[l].bv[i], 1e-4);
    }
  }
}

TEST(Fit, TwoPassModeMatchesSinglePass) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  FitResult one = fit_yaml(config_yaml(tmp.str(), "{k: [2, 4], lambda: 0.01}", "one"));
  std::string y = config_yaml(tmp.str(), "{k: [2, 4], lambda: 0.01}", "two");
  y.replace(y.find("runtime: {"), 10, "runtime: {max_moment_gib: 0.00001, ");
  FitResult two = fit_yaml(y);
  EXPECT_EQ(one.passes, 1);
  EXPECT_EQ(two.passes, 2);
  for (const char* k : {"k2", "k4"}) {
    MapperWeights a = load_mapper(tmp.str(std::string("one/") + k)), b = load_mapper(tmp.str(std::string("two/") + k));
    for (size_t l = 0; l < a.layers.size(); ++l) {
      EXPECT_EQ(a.layers[l].source_layers, b.layers[l].source_layers);
      for (size_t i = 0; i < a.layers[l].wv.size(); ++i) ASSERT_NEAR(a.layers[l].wv[i], b.layers[l].wv[i], 1e-5);
    }
  }
}

TEST(Fit, Bf16AndFp16ExportsRoundTheFp32Weights) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [2], dtype: fp32}", "f32"));
  fit_yaml(config_yaml(tmp.str(), "{k: [2], dtype: bf16}", "b16"));
  fit_yaml(config_yaml(tmp.str(), "{k: [2], dtype: fp16}", "f16"));
  for (int l = 0; l < 8; ++l) {
    char name[64];
    std::snprintf(name, sizeof name, "/k2/layer-%03d.safetensors", l);
    auto a = read_safetensors(tmp.str("f32") + name), b = read_safetensors(tmp.str("b16") + name),
         c = read_safetensors(tmp.str("f16") + name);
    EXPECT_EQ(b["k.weight"].dtype, "BF16");
    EXPECT_EQ(c["v.weight"].dtype, "F16");
    EXPECT_EQ(b["k.bias"].dtype, "F32");
    for (size_t i = 0; i < a["k.weight"].values.size(); ++i) {
      ASSERT_EQ(b["k.weight"].values[i], bf16_to_float(float_to_bf16(a["k.weight"].values[i])));
      ASSERT_EQ(c["v.weight"].values[i], fp16_to_float(float_to_fp16(a["v.weight"].values[i])));
    }
    EXPECT_EQ(a["k.bias"].values, b["k.bias"].values);
  }
}

class StoredDtypes : public ::testing::TestWithParam<Dtype> {};

TEST_P(StoredDtypes, HalfPrecisionShardsFitLikeFp32) {
  TempDir tmp;
  SynthOptions o = small_synth(tmp.str("f32"));
  synthesize(o);
  o.out = tmp.str("half");
  o.dtype = GetParam();
  o.large_mean = 4.0;  // keep the half-precision rounding of the keys small
  synthesize(o);
  fit_yaml(config_yaml(tmp.str("half"), "{k: [2]}"));
  auto m = manifest(tmp.str("half/out/k2"));
  for (const auto& l : m["layers"])
    for (double v : l["r2_v"]) EXPECT_GT(v, 0.3);
}

INSTANTIATE_TEST_SUITE_P(Half, StoredDtypes, ::testing::Values(Dtype::f16, Dtype::bf16));

TEST(Fit, TokenStrideAndMaxTokensSubsampleAtReadTime) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1]}", "out", "calibration: {token_stride: 3, max_tokens: 250}\n"));
  auto m = manifest(tmp.str("out/k1"));
  EXPECT_EQ(m["calibration"]["tokens_used"], 250);
  EXPECT_EQ(m["calibration"]["token_stride"], 3);
  EXPECT_EQ(m["calibration"]["shards"][0]["tokens_used"], 171);  // ceil(512 / 3)
  EXPECT_EQ(m["calibration"]["shards"][1]["tokens_used"], 79);
}

TEST(Fit, AllHeadsProbeHandlesDifferentHeadCounts) {
  TempDir tmp;
  SynthOptions o = small_synth(tmp.str());
  o.target.n_kv_heads = 4;
  o.target.head_dim = 8;
  o.target.rope.rotary_dim = 8;
  synthesize(o);
  expect_error<ConfigError>([&] { fit_yaml(config_yaml(tmp.str(), "{k: [1]}")); }, {"same_head", "all_heads"});
  fit_yaml(config_yaml(tmp.str(), "{k: [1, 2], probe: all_heads}"));
  auto m = manifest(tmp.str("out/k2"));
  EXPECT_EQ(m["fit"]["probe"], "all_heads");
  EXPECT_EQ(m["layers"][0]["r2_k"].size(), 4u);
}

TEST(Fit, DomainsSelectShards) {
  TempDir tmp;
  SynthOptions o = small_synth(tmp.str());
  o.domains = {"web", "code"};
  synthesize(o);
  fit_yaml(config_yaml(tmp.str(), "{k: [1]}", "out", "calibration: {domains: [code]}\n"));
  auto m = manifest(tmp.str("out/k1"));
  EXPECT_EQ(m["calibration"]["domains"], nlohmann::json({"code"}));
  EXPECT_EQ(m["calibration"]["shards"].size(), 2u);
  EXPECT_EQ(m["calibration"]["shards"][0]["path"], "code/shard-000.h5");
}

TEST(Fit, DomainWeightsScaleEachDomainsMoments) {
  TempDir tmp;
  SynthOptions o = small_synth(tmp.str());
  o.domains = {"web", "code"};
  synthesize(o);
  auto layer_bytes = [&](const std::string& out) {
    std::ifstream in(tmp.str(out + "/k2/layer-004.safetensors"), std::ios::binary);
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  };
  fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "web", "calibration: {domains: [web]}\n"));
  // A zero weight leaves a domain out; the moments already read for web are reused.
  fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "zero", "calibration: {domains: [web, code], weights: {code: 0}}\n"));
  EXPECT_EQ(layer_bytes("web"), layer_bytes("zero"));
  // Weighting every domain alike changes nothing (λ is on the covariance scale).
  fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "both", "calibration: {domains: [web, code]}\n"));
  fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "twice", "calibration: {domains: [web, code], weights: {web: 2, code: 2}}\n"));
  EXPECT_EQ(layer_bytes("both"), layer_bytes("twice"));
  EXPECT_NE(layer_bytes("both"), layer_bytes("web"));
  EXPECT_EQ(manifest(tmp.str("twice/k2"))["calibration"]["weights"]["code"], 2.0);
  expect_error<ConfigError>(
      [&] { fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "bad", "calibration: {domains: [web], weights: {code: 1}}\n")); },
      {"calibration.weights", "\"code\"", "not among"});
  expect_error<ConfigError>(
      [&] { fit_yaml(config_yaml(tmp.str(), "{k: [2]}", "neg", "calibration: {weights: {web: -1}}\n")); },
      {"calibration.weights.web", ">= 0"});
}

// The writer thread: every layer's files and manifest entries arrive (in any order, sorted at the end), and a write
// that fails surfaces in the solving thread with the file it was writing.
TEST(Export, LayersAreWrittenBehindTheSolvesAndWriteErrorsSurface) {
  TempDir dir;
  for (bool sabotage : {false, true}) {
    Calibration cal;
    cal.cfg.output.dir = dir.str(sabotage ? "bad" : "good");
    cal.cfg.fit.dtype = Dtype::bf16;
    FitPlan plan;
    plan.dims = PairDims{3, 2, 4, 5, 2, 4};
    cal.source.n_layers = 3, cal.target.n_layers = 5;
    for (KvSpec* side : {&cal.source, &cal.target})
      side->n_kv_heads = side->n_q_heads = 2, side->head_dim = side->rope.rotary_dim = 4;
    cal.source_model = "a", cal.target_model = "b";
    for (int k : {1, 3}) plan.ks.push_back(KPlan{k == 3 ? "all" : "1", k, k * plan.dims.F(), 0, 0});
    auto fits = [&](int l, float v) {
      std::vector<LayerFit> f;
      for (const auto& k : plan.ks) {
        LayerFit x;
        x.k = k.count;
        for (int a = 0; a < k.count; ++a) x.layers.push_back(a);
        x.W.assign(k.features * plan.dims.G(), v + l);
        x.b.assign(plan.dims.G(), -v);
        x.r2.assign(plan.dims.Ht, 0.5);
        f.push_back(std::move(x));
      }
      return f;
    };
    auto be = make_cpu_backend();
    ArtifactWriter w(cal, plan);
    w.begin({{"job", "export test"}});
    if (sabotage) {  // k1.partial becomes a file: the first layer's first write fails
      std::filesystem::remove_all(cal.cfg.output.dir + "/k1.partial");
      std::ofstream(cal.cfg.output.dir + "/k1.partial") << "in the way";
    }
    auto write_all = [&] {
      for (int l = 0; l < plan.dims.Lt; ++l) w.write_layer(l, fits(l, 1.0f), fits(l, 2.0f));
      w.drain();
    };
    if (sabotage) {
      try {
        write_all();
        FAIL() << "a failed write was not reported";
      } catch (const std::runtime_error& e) {
        EXPECT_NE(std::string(e.what()).find("k1.partial/layer-000.safetensors"), std::string::npos) << e.what();
      }
      continue;
    }
    write_all();
    const auto out = w.finish(ManifestRun{});
    ASSERT_EQ(out.size(), plan.ks.size());
    EXPECT_FALSE(std::filesystem::exists(out[0] + "/.layers")) << "the resume records are not part of an artifact";
    for (size_t i = 0; i < plan.ks.size(); ++i) {
      EXPECT_EQ(out[i], cal.cfg.output.dir + "/k" + plan.ks[i].label);
      const std::vector<ManifestLayer> entries = read_mapper_manifest(out[i]).layers;
      ASSERT_EQ(entries.size(), static_cast<size_t>(plan.dims.Lt));
      for (int l = 0; l < plan.dims.Lt; ++l) {
        const ManifestLayer& e = entries[l];
        EXPECT_EQ(e.target_layer, l);
        const std::string path = out[i] + "/" + e.file;
        EXPECT_EQ(e.sha256, sha256_file(path)) << path;
        EXPECT_EQ(e.r2_k, std::vector<double>(plan.dims.Ht, 0.5));
        EXPECT_EQ(read_safetensors(path).at("k.weight").values.front(), 1.0f + l) << path;
      }
    }
    // Another rank's entries, as the gather carries them, are taken in after this rank's.
    ArtifactWriter other(cal, plan, 1);
    other.add_layer_entries(w.layer_entries());
    EXPECT_EQ(other.layer_entries(), w.layer_entries());
  }
}

namespace {

// Rank 0 of P ranks whose partners all hold the same values: its share of a reduce-scatter is P times its part. It
// does not override reduce_scatter_filled, so the interface's default (segments through a host buffer) is tested.
class MirrorComm final : public Comm {
 public:
  explicit MirrorComm(int ranks) : P_(ranks) {}
  int rank() const override { return 0; }
  int size() const override { return P_; }
  std::string name() const override { return "mirror"; }
  void reduce_scatter_sum(const float* in, size_t n, std::vector<float>& c) override { scaled(in, n, c); }
  void reduce_scatter_sum(const double* in, size_t n, std::vector<double>& c) override { scaled(in, n, c); }
  void allreduce_sum(float*, size_t) override { ADD_FAILURE(); }
  void allreduce_sum(double*, size_t) override { ADD_FAILURE(); }
  void broadcast(void*, size_t, int) override { ADD_FAILURE(); }
  void barrier() override {}
  bool all_ok(bool ok) override { return ok; }
  // Every rank's share holds the values of this one's (n a multiple of P: shares of equal size).
  void allgather(const std::vector<float>& c, float* out, size_t n) override { mirrored(c, out, n); }
  void allgather(const std::vector<double>& c, double* out, size_t n) override { mirrored(c, out, n); }
  std::unique_ptr<Comm> split(int, int) override { return nullptr; }
  size_t calls = 0;

 private:
  template <class T>
  void scaled(const T* in, size_t n, std::vector<T>& chunk) {
    ++calls;
    chunk.clear();
    for (const ShareSegment& s : share_layout(n, P_))
      for (int i = 0; i < s.counts[0]; ++i) chunk.push_back(static_cast<T>(P_) * in[s.off + s.displs[0] + i]);
  }
  template <class T>
  void mirrored(const std::vector<T>& chunk, T* out, size_t n) {
    size_t at = 0;
    for (const ShareSegment& s : share_layout(n, P_)) {
      for (int r = 0; r < P_; ++r) {
        ASSERT_EQ(s.counts[r], s.counts[0]);
        std::copy_n(chunk.begin() + at, s.counts[0], out + s.off + s.displs[r]);
      }
      at += s.counts[0];
    }
  }
  int P_;
};

}  // namespace

// The share layout covers every value once, in segments of at most P * 2^24; share_size counts a rank's values.
TEST(ShareLayout, SegmentsCoverEveryValueOnceAndShareSizesAddUp) {
  for (size_t n : {size_t{0}, size_t{1}, size_t{7}, size_t{1000}, (size_t{3} << 24) + 5})
    for (int P : {1, 2, 3, 8}) {
      const auto segs = share_layout(n, P);
      size_t at = 0, owned = 0;
      for (const ShareSegment& s : segs) {
        ASSERT_EQ(s.off, at);
        ASSERT_LE(s.len, static_cast<size_t>(P) << 24);
        for (int r = 0, d = 0; r < P; d += s.counts[r], ++r) ASSERT_EQ(s.displs[r], d) << "n " << n << ", P " << P;
        at += s.len;
      }
      ASSERT_EQ(at, n);
      for (int r = 0; r < P; ++r) owned += share_size(n, P, r);
      ASSERT_EQ(owned, n) << "n " << n << ", P " << P;
    }
}

// reduce_scatter_filled's default gives reduce_scatter_sum's share over all the values, asking the caller for one
// segment at a time (here three, each handed to the comm's reduce_scatter_sum) into host memory.
TEST(ShareLayout, FilledReduceScatterEqualsThePackedOne) {
  const int P = 2;
  const size_t n = (size_t{P} << 25) + 12345;  // two full segments of P * 2^24 and a short one
  std::vector<float> values(n);
  for (size_t i = 0; i < n; ++i) values[i] = static_cast<float>(i % 1000) - 500.0f;
  MirrorComm packed(P), filled(P);
  std::vector<float> want, got;
  packed.reduce_scatter_sum(values.data(), n, want);
  std::vector<std::pair<size_t, size_t>> asked;
  filled.reduce_scatter_filled(
      n,
      [&](size_t off, size_t len, float* dst, bool on_device) {
        EXPECT_FALSE(on_device);
        asked.emplace_back(off, len);
        std::copy_n(values.data() + off, len, dst);
      },
      got);
  EXPECT_EQ(got, want);
  EXPECT_EQ(got.size(), share_size(n, P, 0));
  ASSERT_EQ(asked.size(), 3u);
  EXPECT_EQ(asked[1], std::make_pair(size_t{P} << 24, size_t{P} << 24));
  EXPECT_EQ(filled.calls, 3u);
  // The gather back, drained a segment at a time, equals the whole allgather.
  std::vector<float> whole(n), drained(n, -1.0f);
  const size_t even = n - n % P;
  filled.allgather(std::vector<float>(got.begin(), got.begin() + static_cast<long>(share_size(even, P, 0))),
                   whole.data(), even);
  size_t segments = 0;
  filled.allgather_drained(std::vector<float>(got.begin(), got.begin() + static_cast<long>(share_size(even, P, 0))),
                           even, [&](size_t off, size_t len, const float* v) {
                             ++segments;
                             std::copy_n(v, len, drained.begin() + static_cast<long>(off));
                           });
  EXPECT_EQ(segments, 3u);
  EXPECT_TRUE(std::equal(whole.begin(), whole.begin() + static_cast<long>(even), drained.begin()));
  auto single = make_single_comm();
  std::vector<double> d;
  single->reduce_scatter_filled(
      3, [](size_t off, size_t len, double* dst, bool) { for (size_t i = 0; i < len; ++i) dst[i] = off + i + 0.5; }, d);
  EXPECT_EQ(d, (std::vector<double>{0.5, 1.5, 2.5}));
}

// Issue 25: a refit from stored moments (another lambda or k) reads no keys or values. The shards' keys and values
// are damaged in their first chunks with their modification times kept: any read of them fails its Fletcher-32
// check, and the refit must give the bytes it gave before the damage.
TEST(Fit, ARefitFromStoredMomentsReadsNoKeysOrValues) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  ASSERT_GT(fit_yaml(config_yaml(tmp.str(), "{k: [1, 2], lambda: 0.01}")).tokens_read, 0);
  ASSERT_TRUE(fs::exists(tmp.str("out/checkpoint/shifts.bin"))) << "the provisional shifts are kept";
  const std::string refit = config_yaml(tmp.str(), "{k: [1, 3], lambda: 0.5}");
  ASSERT_EQ(fit_yaml(refit).tokens_read, 0);
  std::map<std::string, std::string> before;
  for (const char* k : {"k1", "k3"})
    for (const auto& e : fs::directory_iterator(tmp.str(std::string("out/") + k)))
      if (e.path().extension() == ".safetensors") before[e.path().string()] = file_bytes(e.path().string());
  ASSERT_FALSE(before.empty());
  for (const char* side : {"source", "target"})
    for (const auto& e : fs::recursive_directory_iterator(tmp.str(side)))
      if (e.path().extension() == ".h5")
        for (const char* ds : {"keys", "values"}) flip_chunk_byte(e.path().string(), ds, 301, /*keep_time=*/true);
  const FitResult r = fit_yaml(refit);  // throws (a failed Fletcher-32 check) if it reads a damaged chunk
  EXPECT_EQ(r.tokens_read, 0);
  for (const auto& [path, bytes] : before) EXPECT_EQ(file_bytes(path), bytes) << path;
  // A change of structure is a refit too: the cross-head job's moments give the head-matched mappers.
  const FitResult ph = fit_yaml(config_yaml(tmp.str(), "{k: [1, 3], lambda: 0.5, structure: [cross_head, per_head]}"));
  EXPECT_EQ(ph.tokens_read, 0);
  EXPECT_EQ(ph.artifacts.size(), 4u);
  EXPECT_TRUE(fs::exists(tmp.str("out/k3-per_head/manifest.json")));
  for (const auto& [path, bytes] : before) EXPECT_EQ(file_bytes(path), bytes) << path;
  // Without the kept shifts the refit must read the shift shard's first block, and the damage shows.
  fs::remove(tmp.str("out/checkpoint/shifts.bin"));
  EXPECT_THROW(fit_yaml(refit), InputError);
}


namespace {

// Held-out R² of a mapper on a shard pair, keys and values (over every target column, variance-weighted).
std::pair<double, double> held_out_r2(const MapperWeights& m, const std::string& src, const std::string& tgt) {
  Mapped p = map_pair(m, src, tgt);
  Rope(m.target).strip_block(p.yk.data(), p.T, {0, m.target.n_layers, m.target.n_kv_heads}, p.pos.data());
  const int64_t T = p.T, YW = p.YW;
  auto r2 = [&](const std::vector<float>& y, const std::vector<float>& p) {
    double sse = 0, sst = 0;
    for (int64_t c = 0; c < YW; ++c) {
      double mean = 0;
      for (int64_t i = 0; i < T; ++i) mean += y[i * YW + c] / T;
      for (int64_t i = 0; i < T; ++i) {
        sse += (y[i * YW + c] - p[i * YW + c]) * double(y[i * YW + c] - p[i * YW + c]);
        sst += (y[i * YW + c] - mean) * (y[i * YW + c] - mean);
      }
    }
    return 1.0 - sse / sst;
  };
  return {r2(p.yk, p.pk), r2(p.yv, p.pv)};
}

}  // namespace

TEST(Fit, WeightsOfOneGiveTheUnweightedLayerFilesAndWeightingIsPartOfTheMomentsIdentity) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  const std::string uniform = "{k: [1, all], lambda: 0.01, structure: [cross_head, per_head]}";
  const std::string weighted = "{k: [1, all], lambda: 0.01, structure: [cross_head, per_head], weighting: dataset}";
  ASSERT_GT(fit_yaml(config_yaml(tmp.str(), uniform, "plain")).tokens_read, 0);
  for (const auto& e : fs::recursive_directory_iterator(tmp.str("target")))
    if (e.path().extension() == ".h5") add_weights(e.path().string(), std::vector<float>(512, 1.0f));
  fit_yaml(config_yaml(tmp.str(), weighted, "ones"));
  int compared = 0;
  for (const char* k : {"k1", "kall", "k1-per_head", "kall-per_head"})
    for (const auto& e : fs::directory_iterator(tmp.str(std::string("plain/") + k)))
      if (e.path().extension() == ".safetensors") {
        EXPECT_EQ(file_bytes(e.path().string()),
                  file_bytes(tmp.str(std::string("ones/") + k + "/" + e.path().filename().string())))
            << e.path();
        ++compared;
      }
  EXPECT_EQ(compared, 4 * 8);
  EXPECT_EQ(manifest(tmp.str("ones/kall"))["calibration"]["token_weighting"], "dataset");
  EXPECT_EQ(manifest(tmp.str("plain/kall"))["calibration"]["token_weighting"], "uniform");
  // A refit that only changes the weighting reads the data again; the same weighting again reads nothing.
  EXPECT_GT(fit_yaml(config_yaml(tmp.str(), weighted, "plain")).tokens_read, 0);
  EXPECT_EQ(fit_yaml(config_yaml(tmp.str(), weighted, "plain")).tokens_read, 0);
}

TEST(Fit, PerHeadMappersRecoverAHeadMatchedMapAndAreHtTimesSmaller) {
  TempDir tmp;
  SynthOptions o = linear_synth(tmp.str("cal"), "default", "llama3");
  o.relation = SynthRelation::per_head;
  synthesize(o);
  o.out = tmp.str("held"), o.data_seed = 999, o.domains = {"eval"}, o.shards_per_domain = 1;
  synthesize(o);
  fit_yaml(config_yaml(tmp.str("cal"), "{k: [1], lambda: 0, structure: [cross_head, per_head]}"));
  const auto cross = manifest(tmp.str("cal/out/k1")), head = manifest(tmp.str("cal/out/k1-per_head"));
  EXPECT_EQ(cross["fit"]["structure"], "cross_head");
  EXPECT_EQ(head["fit"]["structure"], "per_head");
  const int H = o.target.n_kv_heads, Ds = o.source.head_dim, Dt = o.target.head_dim;
  EXPECT_EQ(head["fit"]["params"].get<int64_t>() * H, cross["fit"]["params"].get<int64_t>());
  EXPECT_EQ(head["fit"]["features"], Ds);
  for (const auto& l : head["layers"]) {
    auto t = read_safetensors(tmp.str("cal/out/k1-per_head/" + l["file"].get<std::string>()));
    EXPECT_EQ(t["k.weight"].shape, (std::vector<int64_t>{H, Ds, Dt}));
    EXPECT_EQ(t["v.bias"].shape, (std::vector<int64_t>{int64_t{H} * Dt}));
  }
  const std::string src = tmp.str("held/source/eval/shard-000.h5"), tgt = tmp.str("held/target/eval/shard-000.h5");
  MapperWeights m = load_mapper(tmp.str("cal/out/k1-per_head"));
  for (const auto& l : m.layers) EXPECT_EQ(l.source_layers, std::vector<int>{l.target_layer % o.source.n_layers});
  MapError e = map_shard(m, src, tgt);
  EXPECT_LT(e.max_abs_k, 2e-5 * e.scale * 16) << "keys not recovered to fp32 precision";
  EXPECT_LT(e.max_abs_v, 1e-3);
}

TEST(Fit, PerHeadFallsShortWhereTheFamilyMixesHeads) {
  TempDir tmp;
  SynthOptions o = linear_synth(tmp.str("cal"), "default", "llama3");  // a dense map: every head reads every head
  synthesize(o);
  o.out = tmp.str("held"), o.data_seed = 999, o.domains = {"eval"}, o.shards_per_domain = 1;
  synthesize(o);
  fit_yaml(config_yaml(tmp.str("cal"), "{k: [1], lambda: 0.001, structure: [cross_head, per_head]}"));
  const std::string src = tmp.str("held/source/eval/shard-000.h5"), tgt = tmp.str("held/target/eval/shard-000.h5");
  const auto [ck, cv] = held_out_r2(load_mapper(tmp.str("cal/out/k1")), src, tgt);
  const auto [hk, hv] = held_out_r2(load_mapper(tmp.str("cal/out/k1-per_head")), src, tgt);
  EXPECT_GT(ck, 0.999);
  EXPECT_GT(cv, 0.999);
  // The head-matched mapper sees 1/H of what each target head is made of.
  EXPECT_LT(hk, 0.6);
  EXPECT_LT(hv, 0.6);
  // Its in-sample R² in the manifest says the same before any held-out data is looked at.
  const auto head = manifest(tmp.str("cal/out/k1-per_head"));
  for (const auto& l : head["layers"])
    for (const auto& r : l["r2_v"]) EXPECT_LT(r.get<double>(), 0.6);
}
