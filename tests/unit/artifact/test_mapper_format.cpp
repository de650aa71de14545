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

#include "scalar_oracle.hpp"
#include "eval/report.hpp"
#include "serve/serving_mapper.hpp"
#include "serve/transfer.hpp"
#include "backends/backends.hpp"
#include "core/half.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "helpers.hpp"
#include "unit/mapper_fixture.hpp"
#include "reference_mapper.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "artifact/safetensors.hpp"
#include "io/shard.hpp"

using namespace crosskv;
using namespace crosskv::test;

// ---- Hardened manifests.
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
  expect_error<InputError>([&] { tr.map_content(Kind::k, X.data(), 10, Y.data()); },
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
  expect_error<InputError>([&] { tr.map_content(Kind::v, X.data(), 10, Y.data()); },
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
  expect_error<InputError>([&] { tr.map_content(Kind::k, X.data(), 10, Y.data()); },
                           {file, "symlink leaving the mapper folder", "elsewhere.safetensors"});
  fs::remove(file);
  fs::rename(outside, a.dir + "/moved.safetensors");
  fs::create_symlink("moved.safetensors", file);
  Transfer again(a.dir, *be);
  EXPECT_NO_THROW(again.map_content(Kind::k, X.data(), 10, Y.data()));
}

// ---- Residual MLPs in artifacts: optional <kind>.mlp.* tensors of a layer, applied on top of ridge.

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
  for (Kind keys : kMappedKinds) {
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
                         {{dtype, f32 ? static_cast<const void*>(wk.data()) : hk.data(), bk.data(), mlps & 1 ? &mk : nullptr},
                          {dtype, f32 ? static_cast<const void*>(wv.data()) : hv.data(), bv.data(), mlps & 2 ? &mv : nullptr}}};
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
      for (auto [kind, on, p] : {std::tuple{Kind::k, mlps & 1, &mk}, std::tuple{Kind::v, mlps & 2, &mv}})
        if (on)
          for (const MlpTensor& x : mlp_tensors(p->shape)) want.insert(layer_tensor_name(kind, std::string("mlp.") + x.name));
      EXPECT_EQ(names, want) << what;
    }
}

// The manifest's one writer and the reader agree: a manifest written by write_manifest (and given the MLP stage's
// additions) reads back with every field, and its JSON is the documented one (NaN and infinity as null).
TEST(Manifest, WhatTheWriterWritesTheReaderReadsBack) {
  Artifact a;
  const MapperManifest m0 = read_mapper_manifest(a.dir);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<ManifestLayer> layers = m0.layers;
  for (ManifestLayer& e : layers) e.r2_k = {0.5, nan}, e.r2_v = {0.25};
  layers[0].lambda = ManifestLambda{1, {1e-3, 1e-2}, {0.5, 0.75}, {{2.0, nan, 1.0}, {3.0, 2.0, 4.0}}};
  ManifestFit fit{"2", 2, 2 * m0.source.features_per_layer(), 1234, 56, std::nullopt, {}, "same_head", "bf16"};
  fit.lambda_choice = ManifestLambdaChoice{"gcv", {1e-3, 1e-2, 1e-1}, {1e-2, 1e-1}};
  ManifestCalibration cal;
  cal.domains = {"web"};
  cal.weights = {{"web", 2.0}};
  cal.shards.push_back({"web/shard-000.h5", "web", std::string(64, 'a'), 100, 50});
  cal.tokens_used = 50, cal.token_stride = 2;
  ManifestRun run;
  run.timings_s = {{"total", 1.0}};
  run.ranks = 2, run.passes = 1, run.backend = "cpu";
  write_manifest(a.dir, "src-model", m0.source, "tgt-model", m0.target, fit, layers, cal, run);
  ManifestMlpDecision dropped{Kind::k, false, 1.0, std::numeric_limits<double>::infinity(), 0.5, 0.4, 0};
  ManifestMlpDecision kept{Kind::v, true, 1.0, 0.5, 0.5, 0.75, 8};
  layers[1].mlp = {dropped, kept};
  MlpSettings settings;
  settings.hidden = 8;
  add_mlps_to_manifest(a.dir, {layers[1]}, "auto", settings, 2.5);
  const MapperManifest got = read_mapper_manifest(a.dir);
  EXPECT_EQ(got.source_model, "src-model");
  EXPECT_EQ(got.target_model, "tgt-model");
  EXPECT_EQ(got.source, m0.source);
  EXPECT_EQ(got.target, m0.target);
  EXPECT_EQ(got.k_count, 2);
  EXPECT_EQ(got.k_label, "2");
  EXPECT_EQ(got.dtype, "bf16");
  EXPECT_EQ(got.probe, "same_head");
  EXPECT_EQ(got.features, fit.features);
  EXPECT_EQ(got.params, 1234);
  EXPECT_EQ(got.bias_params, 56);
  EXPECT_FALSE(got.lambda.has_value()) << "auto";
  ASSERT_TRUE(got.lambda_choice.has_value());
  EXPECT_EQ(got.lambda_choice->grid, fit.lambda_choice->grid);
  EXPECT_EQ(got.lambda_choice->rho_all.v, 1e-1);
  EXPECT_EQ(got.mapper, "auto");
  EXPECT_TRUE(got.residual_mlps());
  ASSERT_TRUE(got.mlp.has_value());
  EXPECT_EQ(got.mlp->hidden, 8);
  EXPECT_EQ(got.calibration.domains, cal.domains);
  EXPECT_EQ(got.calibration.weights, cal.weights);
  ASSERT_EQ(got.calibration.shards.size(), 1u);
  EXPECT_EQ(got.calibration.shards[0].tokens_used, 50);
  EXPECT_EQ(got.calibration.token_stride, 2);
  EXPECT_FALSE(got.calibration.max_tokens.has_value());
  EXPECT_EQ(got.tool, std::string("crosskv ") + CROSSKV_VERSION);
  ASSERT_EQ(got.layers.size(), m0.layers.size());
  for (size_t l = 0; l < got.layers.size(); ++l) {
    EXPECT_EQ(got.layers[l].target_layer, m0.layers[l].target_layer);
    EXPECT_EQ(got.layers[l].source_layers, m0.layers[l].source_layers);
    EXPECT_EQ(got.layers[l].file, m0.layers[l].file);
    EXPECT_EQ(got.layers[l].sha256, m0.layers[l].sha256);
    EXPECT_EQ(got.layers[l].r2_k[0], 0.5);
    EXPECT_TRUE(std::isnan(got.layers[l].r2_k[1]));
  }
  ASSERT_TRUE(got.layers[0].lambda.has_value());
  EXPECT_EQ(got.layers[0].lambda->source_layer, 1);
  EXPECT_EQ(got.layers[0].lambda->lambda.v, 0.75);
  EXPECT_TRUE(std::isnan(got.layers[0].lambda->gcv.k[1]));
  EXPECT_EQ(got.layers[0].lambda->gcv.v, (std::vector<double>{3.0, 2.0, 4.0}));
  EXPECT_TRUE(got.layers[0].mlp.empty());
  ASSERT_EQ(got.layers[1].mlp.size(), 2u);
  EXPECT_FALSE(got.layers[1].mlp[0].kept);
  EXPECT_TRUE(std::isnan(got.layers[1].mlp[0].val_mse_mlp)) << "infinity reads back as undefined";
  EXPECT_EQ(got.layers[1].mlp[1].hidden, 8);
  // The text of the format, as docs/FORMATS.md gives it.
  const nlohmann::json j = nlohmann::json::parse(file_bytes(a.dir + "/manifest.json"));
  EXPECT_EQ(j["format"], kMapperFormat);
  EXPECT_EQ(j["format_version"], kManifestVersion);
  EXPECT_EQ(j["fit"]["k"], 2);
  EXPECT_EQ(j["fit"]["lambda"], "auto");
  EXPECT_EQ(j["timings_s"]["mlp"], 2.5);
  EXPECT_EQ(j["timings_s"]["total"], 3.5);
  EXPECT_TRUE(j["layers"][0]["r2_k"][1].is_null()) << "NaN is written as null";
  EXPECT_TRUE(j["layers"][0]["lambda"]["gcv"]["keys"][1].is_null());
  EXPECT_EQ(j["layers"][0]["lambda"]["rho"]["values"], 1e-2);
  EXPECT_TRUE(j["layers"][1]["mlp"]["k"]["val_mse_mlp"].is_null()) << "infinity is written as null";
  EXPECT_FALSE(j["layers"][1]["mlp"]["k"].contains("hidden")) << "a dropped MLP has no width";
  EXPECT_EQ(j["calibration"]["shards"][0]["tokens_used"], 50);
  EXPECT_TRUE(j["calibration"]["max_tokens"].is_null());
  EXPECT_EQ(j["grid"]["ranks"], 2);
  EXPECT_EQ(j["r2_file"], "");
  // An entry as the export records it reads back as itself.
  const std::optional<ManifestLayer> again = parse_manifest_layer_text(manifest_layer_text(got.layers[0]));
  ASSERT_TRUE(again.has_value());
  EXPECT_EQ(manifest_layer_text(*again), manifest_layer_text(got.layers[0]));
  EXPECT_FALSE(parse_manifest_layer_text("{\"target_layer\": \"one\"}").has_value());
  // A transfer through it maps as the export's own manifest does (the same weights).
  auto be = make_cpu_backend();
  Transfer tr(a.dir, *be);
  EXPECT_EQ(tr.manifest().k_count, 2);
}

// The optional fields a reader shows are typed too: a wrong type is named.
TEST(Manifest, MistypedOptionalFieldsAreNamed) {
  auto be = make_cpu_backend();
  Artifact a;
  auto expect_bad = [&](auto edit, std::vector<std::string> parts) {
    nlohmann::json m = a.manifest;
    edit(m);
    a.write(m);
    expect_error<InputError>([&] { read_mapper_manifest(a.dir); }, parts);
  };
  expect_bad([](auto& m) { m["fit"]["lambda"] = "big"; }, {"manifest.json", "fit.lambda is \"big\"", "\"auto\""});
  expect_bad([](auto& m) { m["fit"]["params"] = "many"; }, {"fit.params", "must be an integer"});
  expect_bad([](auto& m) { m["layers"][1]["r2_k"] = {0.5, "x"}; }, {"layers[1].r2_k", "list of numbers"});
  expect_bad([](auto& m) { m["layers"][0]["lambda"] = {{"source_layer", 0}}; }, {"layers[0].lambda.rho", "missing"});
  expect_bad([](auto& m) { m["layers"][0]["mlp"] = {{"k", {{"kept", 1}}}}; }, {"layers[0].mlp.k.kept", "true or false"});
  expect_bad([](auto& m) { m["fit"]["mlp"] = {{"hidden", 8}}; }, {"fit.mlp.epochs", "missing"});
  expect_bad([](auto& m) { m["calibration"] = {{"shards", {{{"tokens", 3}}}}}; }, {"calibration", "malformed"});
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

// ---- Head-matched (per_head) artifacts.
TEST(PerHeadArtifact, WhatTheWriterStoresTheReaderReadsBackForEveryDtype) {
  Artifact a("2", "per_head");
  const MapperManifest m0 = read_mapper_manifest(a.dir);
  ASSERT_EQ(m0.structure, Structure::per_head);
  EXPECT_EQ(a.manifest["fit"]["structure"], "per_head");
  const int l = 1, H = m0.target.n_kv_heads;
  const int64_t Ds = m0.source.head_dim, Dt = m0.target.head_dim, G = m0.target.features_per_layer();
  const std::vector<int> layers = m0.layers[l].source_layers;
  const int64_t rows = static_cast<int64_t>(layers.size()) * Ds;
  EXPECT_EQ(m0.weight_rows(), rows);
  std::mt19937_64 rng(23);
  std::normal_distribution<float> n(0, 0.5f);
  std::vector<float> wk(H * rows * Dt), wv(wk.size()), bk(G), bv(G);
  for (auto* v : {&wk, &wv, &bk, &bv})
    for (auto& x : *v) x = n(rng);
  for (const std::string dtype : {"F32", "BF16", "F16"}) {
    std::vector<uint16_t> hk(wk.size()), hv(wv.size());
    for (size_t i = 0; i < wk.size(); ++i) {
      hk[i] = dtype == "BF16" ? float_to_bf16(wk[i]) : float_to_fp16(wk[i]);
      hv[i] = dtype == "BF16" ? float_to_bf16(wv[i]) : float_to_fp16(wv[i]);
    }
    const bool f32 = dtype == "F32";
    LayerFileContent c{l, layers, rows, G, {{dtype, f32 ? static_cast<const void*>(wk.data()) : hk.data(), bk.data()},
                       {dtype, f32 ? static_cast<const void*>(wv.data()) : hv.data(), bv.data()}}, H};
    const std::string file = a.dir + "/" + layer_file_name(l);
    write_layer_file(file, c);
    EXPECT_EQ(read_safetensors(file).at("k.weight").shape, (std::vector<int64_t>{H, rows, Dt})) << dtype;
    nlohmann::json m = a.manifest;
    m["layers"][l]["sha256"] = sha256_file(file);
    a.write(m);
    const MapperLayer got = load_mapper_layer(read_mapper_manifest(a.dir), l);
    EXPECT_EQ(got.structure, Structure::per_head);
    std::vector<float> want(wk.size());
    for (size_t i = 0; i < wk.size(); ++i) want[i] = f32 ? wk[i] : dtype == "BF16" ? bf16_to_float(hk[i]) : fp16_to_float(hk[i]);
    EXPECT_EQ(got.wk, want) << dtype;
    EXPECT_EQ(got.bv, bv) << dtype;
  }
}

TEST(PerHeadArtifact, BadFieldsAndShapesAreNamed) {
  Artifact a("2", "per_head");
  auto be = make_cpu_backend();
  auto expect_bad = [&](const std::function<void(nlohmann::json&)>& edit, const std::vector<std::string>& parts) {
    nlohmann::json m = a.manifest;
    edit(m);
    a.write(m);
    expect_error<InputError>([&] { ServingMapper rt(a.dir, *be); }, parts);
  };
  expect_bad([](auto& m) { m["fit"]["structure"] = "diagonal"; },
             {"manifest.json", "fit.structure is 'diagonal'", "cross_head or per_head"});
  expect_bad([](auto& m) { m["fit"]["structure"] = 3; }, {"fit.structure", "must be a string"});
  expect_bad([](auto& m) { m["target"]["kv_spec"]["n_kv_heads"] = 4; }, {"fit.structure is per_head", "2 KV heads",
                                                                          "target 4"});
  // A cross_head manifest over per_head files (or the reverse): the weights' shapes say so.
  expect_bad([](auto& m) { m["fit"].erase("structure"); }, {"layer-000.safetensors", "tensor 'k.weight' has shape [2, 32, 16]",
                                                             "expected [64, 32]"});
  Artifact c("2");
  nlohmann::json m = c.manifest;
  m["fit"]["structure"] = "per_head";
  c.write(m);
  expect_error<InputError>([&] { ServingMapper rt(c.dir, *be); }, {"tensor 'k.weight' has shape [64, 32]", "expected [2, 32, 16]"});
  // A residual MLP has no place in a per_head layer.
  a.write(a.manifest);
  const std::string file = a.dir + "/layer-002.safetensors";
  auto t = read_safetensors(file);
  TensorIn& w1 = t["k.mlp.w1"];
  w1.dtype = "F32", w1.shape = {32, 4}, w1.values.assign(32 * 4, 0.1f);
  std::vector<TensorOut> out;
  for (const auto& [name, x] : t) out.push_back({name, "F32", x.shape, x.values.data(), x.values.size() * 4});
  write_safetensors(file, out, {});
  nlohmann::json mm = a.manifest;
  mm["layers"][2]["sha256"] = sha256_file(file);
  a.write(mm);
  expect_error<InputError>([&] { ServingMapper rt(a.dir, *be); }, {"layer-002.safetensors", "k.mlp.w1", "per_head"});
}
