// Every bad input gets a one-line error naming the file/key and the problem, and nothing half-written is left.
#include <cmath>

#include "helpers.hpp"
#include "io/h5.hpp"
#include "io/shard.hpp"
#include "eval/retention.hpp"

#include <spdlog/sinks/ostream_sink.h>

#include <fstream>
#include <sstream>
#include <tuple>

using namespace crosskv;
using namespace crosskv::test;

namespace {

class BadInput : public ::testing::Test {
 protected:
  void SetUp() override { synthesize(small_synth(tmp.str())); }
  std::string yaml(const std::string& extra = "") { return config_yaml(tmp.str(), "{k: [1, 2]}", "out", extra); }
  std::string shard(const std::string& side, int i = 0) {
    return tmp.str(side + "/web/shard-00" + std::to_string(i) + ".h5");
  }
  void expect_fit_error(const std::string& y, const std::vector<std::string>& parts) {
    expect_error<UserError>([&] { fit_yaml(y); }, parts);
    // Nothing that looks like an artifact is left behind.
    if (fs::exists(tmp.str("out"))) {
      for (const auto& e : fs::recursive_directory_iterator(tmp.str("out"))) {
        EXPECT_NE(e.path().filename(), "manifest.json") << e.path();
      }
    }
  }
  h5::Handle open_rw(const std::string& path) {
    h5::quiet();
    return h5::Handle(H5Fopen(path.c_str(), H5F_ACC_RDWR, H5P_DEFAULT), H5Fclose);
  }
  // Overwrites one element of a dataset in place.
  template <class T>
  void poke(const std::string& path, const char* dataset, std::vector<hsize_t> start, hid_t mem_type, T value) {
    auto f = open_rw(path);
    h5::Handle d(H5Dopen2(f, dataset, H5P_DEFAULT), H5Dclose);
    std::vector<hsize_t> count(start.size(), 1);
    h5::Handle fspace(H5Dget_space(d), H5Sclose);
    H5Sselect_hyperslab(fspace, H5S_SELECT_SET, start.data(), nullptr, count.data(), nullptr);
    h5::Handle mspace(H5Screate_simple(static_cast<int>(count.size()), count.data(), nullptr), H5Sclose);
    ASSERT_GE(H5Dwrite(d, mem_type, mspace, fspace, H5P_DEFAULT, &value), 0);
  }
  void set_kv_spec(const std::string& path, const std::string& from, const std::string& to) {
    auto f = open_rw(path);
    std::string spec = h5::read_string_attr(f, "kv_spec", path);
    auto pos = spec.find(from);
    ASSERT_NE(pos, std::string::npos) << spec;
    spec.replace(pos, from.size(), to);
    H5Adelete(f, "kv_spec");
    h5::write_string_attr(f, "kv_spec", spec);
  }
  TempDir tmp;
  std::ostringstream log_text;
};

}  // namespace

TEST_F(BadInput, MissingStore) {
  fs::remove_all(tmp.str("source"));
  expect_fit_error(yaml(), {"source.store", tmp.str("source"), "does not exist"});
}

TEST_F(BadInput, UnpairedShard) {
  fs::remove(shard("target", 1));
  expect_fit_error(yaml(), {shard("source", 1), "unpaired shard", "target"});
}

TEST_F(BadInput, DifferentTokenIds) {
  poke<int32_t>(shard("target", 1), "token_ids", {37}, H5T_NATIVE_INT32, -5);
  expect_fit_error(yaml(), {shard("target", 1), "token_ids differ", "token 37"});
}

TEST_F(BadInput, NanInABlockNamesShardLayerAndToken) {
  poke<float>(shard("target", 1), "values", {300, 5, 1, 3}, H5T_NATIVE_FLOAT, NAN);
  expect_fit_error(yaml(), {shard("target", 1), "'values'", "NaN", "layer 5", "token 300"});
}

TEST_F(BadInput, InfInKeys) {
  poke<float>(shard("source", 0), "keys", {10, 2, 0, 0}, H5T_NATIVE_FLOAT, INFINITY);
  expect_fit_error(yaml(), {shard("source", 0), "'keys'", "Inf", "layer 2", "token 10"});
}

TEST_F(BadInput, TruncatedHdf5File) {
  fs::resize_file(shard("target", 1), fs::file_size(shard("target", 1)) / 2);
  expect_fit_error(yaml(), {shard("target", 1), "truncated"});
}

TEST_F(BadInput, WrongShapes) {
  set_kv_spec(shard("source", 1), "\"n_layers\":6", "\"n_layers\":7");
  expect_fit_error(yaml(), {shard("source", 1), "'keys'", "shape", "expected [512, 7, 2, 16]"});
}

TEST_F(BadInput, KvSpecDiffersWithinAStore) {
  set_kv_spec(shard("target", 1), "\"theta\":500000.0", "\"theta\":10000.0");
  expect_fit_error(yaml(), {shard("target", 1), "kv_spec differs"});
}

TEST_F(BadInput, TwoModelsWeightsInOneStoreAreRefusedByShard) {
  for (int i : {0, 1}) {
    auto f = open_rw(shard("source", i));
    h5::write_string_attr(f, "model_weights", i == 0 ? "sha256:aaaa" : "sha256:bbbb");
  }
  expect_fit_error(yaml(), {shard("source", 1), "attribute model_weights is 'sha256:bbbb'", shard("source", 0),
                            "'sha256:aaaa'", "one store must hold one model's KV"});
}

TEST_F(BadInput, UnknownDtype) {
  {
    auto f = open_rw(shard("target", 0));
    H5Ldelete(f, "values", H5P_DEFAULT);
    hsize_t dims[4] = {512, 8, 2, 16};
    h5::Handle s(H5Screate_simple(4, dims, nullptr), H5Sclose);
    h5::Handle d(H5Dcreate2(f, "values", H5T_STD_I32LE, s, H5P_DEFAULT, H5P_DEFAULT, H5P_DEFAULT), H5Dclose);
    ASSERT_GE(d.get(), 0);
  }
  expect_fit_error(yaml(), {shard("target", 0), "'values'", "unknown dtype"});
}

TEST_F(BadInput, UnsupportedRopeType) {
  for (int i : {0, 1}) set_kv_spec(shard("target", i), "\"type\":\"llama3\"", "\"type\":\"dynamic\"");
  expect_fit_error(yaml(), {shard("target", 0), "dynamic", "not supported"});
}

TEST_F(BadInput, ShardListedTwice) {
  fs::create_symlink(shard("source", 0), tmp.str("source/web/shard-009.h5"));
  fs::create_symlink(shard("target", 0), tmp.str("target/web/shard-009.h5"));
  expect_fit_error(yaml(), {"shard-009.h5", "listed twice", "same file as", "shard-000.h5"});
}

TEST_F(BadInput, EmptyDomain) {
  fs::create_directories(tmp.str("source/code"));
  fs::create_directories(tmp.str("target/code"));
  expect_fit_error(yaml("calibration: {domains: [web, code]}\n"), {"calibration.domains", "\"code\"", "no shards"});
}

// Issue 26: damage that HDF5's checksum catches, and configurations refused before anything runs.
TEST_F(BadInput, FlippedByteInKeysIsCaughtByTheChecksum) {
  const std::string path = shard("source", 1);
  {
    auto f = open_rw(path);
    h5::Handle d(H5Dopen2(f, "keys", H5P_DEFAULT), H5Dclose);
    ASSERT_TRUE(h5::has_fletcher32(d)) << "crosskv-synth writes checksummed shards";
  }
  flip_chunk_byte(path, "keys", 1001);
  expect_fit_error(yaml(), {path, "'keys'", "Fletcher-32 checksum"});
}

TEST_F(BadInput, CheckpointDirIsARegularFile) {
  std::ofstream(tmp.str("ck")) << "not a folder";
  std::string y = yaml();
  y.replace(y.find("runtime: {block_tokens: 200}"), 28,
            "runtime: {block_tokens: 200, checkpoint: {dir: " + tmp.str("ck") + "}}");
  expect_fit_error(y, {"runtime.checkpoint.dir", tmp.str("ck"), "exists and is not a folder"});
  EXPECT_FALSE(fs::exists(tmp.str("out/k1"))) << "refused before anything ran";
}

TEST_F(BadInput, OutputDirInsideAStore) {
  expect_fit_error(config_yaml(tmp.str(), "{k: [1, 2]}", "target/fitout"),
                   {"output.dir", "inside the target store", tmp.str("target")});
  EXPECT_FALSE(fs::exists(tmp.str("target/fitout/r2.h5")));
}

TEST_F(BadInput, SourceAndTargetStoreAreOne) {
  std::string y = yaml();
  y.replace(y.find(tmp.str("target") + "}"), tmp.str("target").size(), tmp.str("source") + "/.");
  expect_fit_error(y, {"source.store and target.store", "the two stores are one"});
}

TEST_F(BadInput, EvalShardsHoldOutEveryShard) {
  expect_fit_error(yaml("eval: {shards: [web/shard-000.h5, web/shard-001.h5]}\n"),
                   {"eval.shards", "holds out every shard", "nothing to fit on"});
  expect_fit_error(yaml("calibration: {domains: [web]}\neval: {shards: [web/shard-000.h5, web/shard-001.h5]}\n"),
                   {"eval.shards", "every shard of domain \"web\""});
}

TEST_F(BadInput, PlanCountsUncheckedShards) {
  FitResult checked = fit_yaml(yaml());
  EXPECT_NE(checked.plan_text.find("checksums: all 4 shard files (Fletcher-32)"), std::string::npos)
      << checked.plan_text;
  SynthOptions o = small_synth(tmp.str("old"));
  o.checksum = false;
  synthesize(o);
  FitResult old = fit_yaml(config_yaml(tmp.str("old"), "{k: [1]}"));
  EXPECT_NE(old.plan_text.find("checksums: 4 of 4 shard files unchecked"), std::string::npos) << old.plan_text;
}

TEST_F(BadInput, UnknownConfigKey) {
  expect_fit_error(yaml("calibration: {domains: [web], stride: 3}\n"), {"cfg.yaml:6", "calibration.stride", "unknown key"});
}

TEST_F(BadInput, OutputFolderNotWritable) {
  write_text(tmp.str("a-file"), "x");
  const std::string y = "source: {store: " + tmp.str("source") + "}\ntarget: {store: " + tmp.str("target") +
                        "}\noutput: {dir: " + tmp.str("a-file/out") + "}\n";
  expect_fit_error(y, {"output.dir", tmp.str("a-file/out"), "cannot be created"});
}

TEST_F(BadInput, KLargerThanTheSource) {
  expect_fit_error(config_yaml(tmp.str(), "{k: [2, 9]}"), {"fit.k", "k = 9", "6 layers"});
}

TEST_F(BadInput, KEqualToTheSourceDepthAndAllTogether) {
  expect_fit_error(config_yaml(tmp.str(), "{k: [2, 6, all]}"), {"fit.k", "k = 6 and k = all"});
}

TEST_F(BadInput, MissingAttribute) {
  {
    auto f = open_rw(shard("source", 1));
    H5Adelete(f, "kv_spec");
  }
  expect_fit_error(yaml(), {shard("source", 1), "kv_spec", "missing"});
}

TEST_F(BadInput, NotAShard) {
  write_text(shard("source", 1), "this is not HDF5");
  expect_fit_error(yaml(), {shard("source", 1), "not a readable HDF5 file"});
}

TEST_F(BadInput, RopeParametersOutOfRangeAreRefusedByShardAndKey) {
  // The source is "default" with theta 10000; the target llama3 (factor 8, low 1, high 4, orig 8192).
  const std::vector<std::tuple<std::string, std::string, std::string, std::string>> cases = {
      {"source", "\"theta\":10000.0", "\"theta\":0.0", "kv_spec.rope.theta"},
      {"source", "\"theta\":10000.0", "\"theta\":-5.0", "kv_spec.rope.theta"},
      {"source", "\"theta\":10000.0", "\"theta\":1e-300", "kv_spec.rope.theta"},
      {"source", "\"theta\":10000.0", "\"theta\":1.0", "kv_spec.rope.theta"},
      {"source", "\"theta\":10000.0", "\"theta\":\"big\"", "kv_spec.rope.theta"},
      {"target", "\"factor\":8.0", "\"factor\":0.0", "kv_spec.rope.factor"},
      {"target", "\"factor\":8.0", "\"factor\":-2.0", "kv_spec.rope.factor"},
      {"target", "\"high_freq_factor\":4.0", "\"high_freq_factor\":1.0", "kv_spec.rope.high_freq_factor"},
      {"target", "\"original_max_position_embeddings\":8192.0", "\"original_max_position_embeddings\":0.0",
       "kv_spec.rope.original_max_position_embeddings"},
      {"source", "\"type\":\"default\"", "\"type\":\"linear\",\"factor\":0", "kv_spec.rope.factor"},
  };
  for (const auto& [side, from, to, key] : cases) {
    SCOPED_TRACE(side + ": " + to);
    set_kv_spec(shard(side, 0), from, to);
    expect_fit_error(yaml(), {shard(side, 0), key});
    set_kv_spec(shard(side, 0), to, from);
  }
  EXPECT_FALSE(fs::exists(tmp.str("out"))) << "a refused kv_spec leaves no output folder";
}

TEST_F(BadInput, TheSameShardCopiedUnderAnotherNameIsRefused) {
  for (const char* side : {"source", "target"}) fs::copy_file(shard(side, 0), tmp.str(std::string(side) + "/web/copy.h5"));
  expect_fit_error(yaml(), {"copy.h5", "same token_ids and positions as", "shard-000.h5", "counted twice"});
}

TEST_F(BadInput, SourceAndTargetPositionsThatDifferAreRefused) {
  poke<int32_t>(shard("target", 1), "positions", {40}, H5T_NATIVE_INT32, 7777);
  expect_fit_error(yaml(), {shard("target", 1), "positions differ from", shard("source", 1), "token 40"});
}

TEST_F(BadInput, ARegularFileWhereAnArtifactFolderGoesIsRefused) {
  write_text(tmp.str("out/k2"), "not a folder");
  expect_fit_error(yaml(), {"output.dir", tmp.str("out/k2"), "is not a folder"});
  EXPECT_EQ(std::ifstream(tmp.str("out/k2")).get(), 'n') << "the file is left as it was";
}

TEST_F(BadInput, ASymlinkLoopInAStoreIsNamedOnce) {
  fs::create_directory_symlink(tmp.str("source"), tmp.str("source/web/loop"));
  try {
    fit_yaml(yaml());
    ADD_FAILURE() << "expected an error";
  } catch (const UserError& e) {
    const std::string msg = e.what();
    EXPECT_THAT(msg, ::testing::HasSubstr("source.store"));
    EXPECT_THAT(msg, ::testing::HasSubstr("symlink loop"));
    EXPECT_THAT(msg, ::testing::HasSubstr(tmp.str("source/web/loop")));
    EXPECT_LT(msg.size(), 600u) << msg;
  }
}

TEST_F(BadInput, StoreEntriesThatAreSkippedAreLogged) {
  fs::create_directories(tmp.str("source/web/folder.h5"));
  fs::create_symlink(tmp.str("nowhere.h5"), tmp.str("target/web/dangling.h5"));
  auto sink = std::make_shared<spdlog::sinks::ostream_sink_mt>(log_text);
  auto previous = spdlog::default_logger();
  spdlog::set_default_logger(std::make_shared<spdlog::logger>("capture", sink));
  try {
    fit_yaml(yaml());
  } catch (...) {
    spdlog::set_default_logger(previous);
    throw;
  }
  spdlog::set_default_logger(previous);
  const std::string log = log_text.str();
  EXPECT_THAT(log, ::testing::HasSubstr(tmp.str("source/web/folder.h5") + ": skipped (a folder, not a shard)"));
  EXPECT_THAT(log, ::testing::HasSubstr(tmp.str("target/web/dangling.h5") + ": skipped (a dangling symlink)"));
}

TEST_F(BadInput, StructureIsCheckedByKey) {
  expect_fit_error(config_yaml(tmp.str(), "{k: [1], structure: head_matched}"),
                   {"cfg.yaml", "fit.structure", "expected cross_head or per_head", "head_matched"});
  expect_fit_error(config_yaml(tmp.str(), "{k: [1], structure: [per_head, per_head]}"),
                   {"fit.structure", "per_head listed twice"});
  expect_fit_error(config_yaml(tmp.str(), "{k: [1], structure: []}"), {"fit.structure", "non-empty list"});
  expect_fit_error(config_yaml(tmp.str(), "{k: [1], structure: per_head, mapper: mlp}"),
                   {"fit.mapper", "cross_head only", "mapper: ridge with per_head"});
}

TEST_F(BadInput, PerHeadWithDifferentHeadCountsPointsToCrossHeadWithTheAllHeadsProbe) {
  SynthOptions o = small_synth(tmp.str("heads"));
  o.target.n_kv_heads = 4, o.target.n_q_heads = 8;
  synthesize(o);
  // Named for per_head even with the probe's own objection pending: per_head is what cannot be done.
  for (const char* probe : {"same_head", "all_heads"})
    expect_fit_error(config_yaml(tmp.str("heads"), std::string("{k: [1], structure: per_head, probe: ") + probe + "}"),
                     {"fit.structure: per_head needs equal KV head counts", "source 2, target 4",
                      "structure: cross_head with probe: all_heads"});
  EXPECT_NO_THROW(fit_yaml(config_yaml(tmp.str("heads"), "{k: [1], structure: cross_head, probe: all_heads}")));
  // crosskv-synth plants a head-matched pair only where heads match.
  o.relation = SynthRelation::per_head;
  o.out = tmp.str("heads2");
  expect_error<UserError>([&] { synthesize(o); }, {"--relation per_head", "equal KV head counts", "source 2, target 4"});
}

TEST_F(BadInput, BadTokenWeightsAreRefusedByShardAndToken) {
  const std::string weighted = "{k: [1, 2], weighting: dataset}";
  const std::string y = config_yaml(tmp.str(), weighted);
  // Present in one store only: the source's shard has weights, the target's (which the fit reads) has none.
  add_weights(shard("source", 0), std::vector<float>(512, 1.0f));
  expect_fit_error(y, {shard("target", 0), "no dataset 'weights'", "fit.weighting: dataset", shard("source", 0),
                       "target's shard"});
  add_weights(shard("target", 0), std::vector<float>(512, 1.0f));
  expect_fit_error(y, {shard("target", 1), "no dataset 'weights'"});  // and one target shard without them
  std::vector<float> w(512, 1.0f);
  w[7] = -1.0f;
  add_weights(shard("target", 1), w);
  expect_fit_error(y, {shard("target", 1), "'weights'", "-1.0", "token 7", "finite weights >= 0"});
  poke<float>(shard("target", 1), "weights", {7}, H5T_NATIVE_FLOAT, NAN);
  expect_fit_error(y, {shard("target", 1), "'weights'", "nan", "token 7"});
  for (int t = 0; t < 512; ++t) poke<float>(shard("target", 1), "weights", {hsize_t(t)}, H5T_NATIVE_FLOAT, 0.0f);
  expect_fit_error(y, {shard("target", 1), "'weights' is all zero", "512 tokens"});
  for (int t = 0; t < 512; ++t) poke<float>(shard("target", 1), "weights", {hsize_t(t)}, H5T_NATIVE_FLOAT, 2.0f);
  EXPECT_NO_THROW(fit_yaml(y));
  // Uniform fits do not read them.
  poke<float>(shard("target", 1), "weights", {3}, H5T_NATIVE_FLOAT, -4.0f);
  EXPECT_NO_THROW(fit_yaml(config_yaml(tmp.str(), "{k: [1]}", "out-uniform")));
}

TEST_F(BadInput, TokenWeightsOfTheWrongLengthOrTypeAreRefused) {
  add_weights(shard("target", 0), std::vector<float>(100, 1.0f));
  expect_fit_error(yaml(), {shard("target", 0), "'weights' has 100 rows", "T = 512", "one weight per token"});
}

TEST_F(BadInput, WeightingAndRetentionAreCheckedByKey) {
  expect_fit_error(config_yaml(tmp.str(), "{k: [1], weighting: attention}"),
                   {"cfg.yaml", "fit.weighting", "uniform or dataset", "attention"});
  expect_fit_error(config_yaml(tmp.str(), "{k: [1], weighting: dataset, mapper: auto}"),
                   {"fit.weighting", "not weighted", "mapper: ridge"});
  expect_fit_error(config_yaml(tmp.str(), "{k: [1]}", "out", "eval: {min_retention: 80}\n"),
                   {"eval.min_retention", "(0, 1]"});
}

// The retention predictor's file (CROSSKV_RETENTION_MODEL, or the one configured at build time) is checked by key.
TEST(BadRetentionModel, EachMistakeNamesTheFileAndTheKey) {
  TempDir tmp;
  std::ifstream in(std::string(CROSSKV_SOURCE_DIR) + "/docs/retention-calibration.json");
  const nlohmann::json good = nlohmann::json::parse(in);
  const std::string path = tmp.str("retention.json");
  auto expect = [&](const std::function<void(nlohmann::json&)>& spoil, const std::vector<std::string>& parts) {
    nlohmann::json doc = good;
    spoil(doc);
    std::ofstream(path) << doc.dump();
    std::vector<std::string> all{path};
    all.insert(all.end(), parts.begin(), parts.end());
    expect_error<ConfigError>([&] { load_retention_model(path); }, all);
  };
  expect([](nlohmann::json& d) { d["format"] = "something-else"; }, {"crosskv-retention-calibration", "calibrate.py"});
  expect([](nlohmann::json& d) { d.erase("model"); }, {"model: expected an object"});
  expect([](nlohmann::json& d) { d["model"].erase("intercept"); }, {"model.intercept", "a number"});
  expect([](nlohmann::json& d) { d["model"]["half_width"] = "wide"; }, {"model.half_width", "a number"});
  expect([](nlohmann::json& d) { d["model"]["coefficients"] = nlohmann::json::object(); }, {"model.coefficients"});
  expect([](nlohmann::json& d) { d["model"]["coefficients"]["perplexity"] = 1.0; },
         {"model.coefficients.perplexity", "not a feature", "attention_cosine"});
  expect([](nlohmann::json& d) { d["model"]["ranges"]["attention_cosine"] = {0.3}; },
         {"model.ranges.attention_cosine", "[low, high]"});
  expect([](nlohmann::json& d) { d["model"]["target"] = "accuracy"; }, {"model.target", "content_share", "accuracy"});
  std::ofstream(path) << "{\"format\": ";
  expect_error<ConfigError>([&] { load_retention_model(path); }, {path, "not JSON"});
  expect_error<ConfigError>([&] { load_retention_model(tmp.str("absent.json")); },
                            {tmp.str("absent.json"), "cannot read", "CROSSKV_RETENTION_MODEL"});
}
