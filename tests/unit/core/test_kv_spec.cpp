#include <cmath>

#include <nlohmann/json.hpp>

#include "core/kv_spec.hpp"
#include "helpers.hpp"

using namespace crosskv;
using crosskv::test::expect_error;

namespace {

nlohmann::json base() {
  return {{"n_layers", 3},
          {"n_kv_heads", 1},
          {"head_dim", 8},
          {"n_q_heads", 4},
          {"rope", {{"type", "default"}, {"theta", 1e6}, {"rotary_dim", 8}}}};
}

nlohmann::json layer(const char* attention, nlohmann::json window, double theta) {
  return {{"attention", attention}, {"window", window}, {"rope", {{"type", "default"}, {"theta", theta}}}};
}

nlohmann::json gemma_like() {
  nlohmann::json j = base();
  j["layers"] = {layer("sliding", 512, 1e4), layer("sliding", 512, 1e4), layer("full", nullptr, 1e6)};
  return j;
}

}  // namespace

TEST(KvSpec, PerLayerAttentionAndRopeReadAndRoundTrip) {
  const KvSpec s = parse_kv_spec(gemma_like().dump(), "g.h5");
  ASSERT_EQ(s.layers.size(), 3u);
  EXPECT_EQ(s.attention(0), Attention::sliding);
  EXPECT_EQ(s.window(1), 512);
  EXPECT_EQ(s.attention(2), Attention::full);
  EXPECT_EQ(s.layer_rope(0).theta, 1e4);
  EXPECT_EQ(s.layer_rope(2).theta, 1e6);
  EXPECT_EQ(s.layer_rope(0).rotary_dim, 8);  // a layer's rope without rotary_dim: the whole head, as the default's
  const KvSpec again = parse_kv_spec(kv_spec_to_string(s), "again");
  EXPECT_EQ(again, s);
  EXPECT_NE(again, parse_kv_spec(base().dump(), "base"));
}

TEST(KvSpec, OldSpecsAndUniformLayersReadAsBefore) {
  const KvSpec old = parse_kv_spec(base().dump(), "old.h5");
  EXPECT_TRUE(old.layers.empty());
  EXPECT_EQ(old.layer_rope(2).theta, 1e6);
  EXPECT_EQ(old.attention(1), Attention::full);
  EXPECT_FALSE(kv_spec_to_json(old).contains("layers"));  // the bytes a spec without layers had
  nlohmann::json j = base();
  j["layers"] = {layer("full", nullptr, 1e6), layer("full", nullptr, 1e6), layer("full", nullptr, 1e6)};
  const KvSpec uniform = parse_kv_spec(j.dump(), "uniform.h5");
  EXPECT_TRUE(uniform.layers.empty());
  EXPECT_EQ(kv_spec_to_string(uniform), kv_spec_to_string(old));
}

TEST(KvSpec, AQueryScaleIsKeptOnlyWhereItIsNotTheHeadDims) {
  nlohmann::json j = base();
  EXPECT_DOUBLE_EQ(parse_kv_spec(j.dump(), "s.h5").attention_scale(), 1.0 / std::sqrt(8.0));
  j["query_scale"] = 1.0 / std::sqrt(8.0);  // the default, stated: read and written as no field
  EXPECT_FALSE(parse_kv_spec(j.dump(), "s.h5").query_scale);
  EXPECT_FALSE(kv_spec_to_json(parse_kv_spec(j.dump(), "s.h5")).contains("query_scale"));
  j["query_scale"] = 0.25;
  const KvSpec s = parse_kv_spec(j.dump(), "s.h5");
  EXPECT_DOUBLE_EQ(s.attention_scale(), 0.25);
  EXPECT_EQ(parse_kv_spec(kv_spec_to_string(s), "again"), s);
  for (nlohmann::json bad : {nlohmann::json(0), nlohmann::json(-1), nlohmann::json("x")}) {
    j["query_scale"] = bad;
    expect_error<InputError>([&] { parse_kv_spec(j.dump(), "s.h5"); }, {"s.h5", "kv_spec.query_scale", "positive"});
  }
}

TEST(KvSpec, BadLayersAreRefusedByTheirKey) {
  auto refuses = [](nlohmann::json j, std::vector<std::string> parts) {
    parts.insert(parts.begin(), "s.h5");
    expect_error<InputError>([&] { parse_kv_spec(j.dump(), "s.h5"); }, parts);
  };
  nlohmann::json j = gemma_like();
  j["layers"].erase(1);
  refuses(j, {"kv_spec.layers", "n_layers (3)"});
  j = gemma_like();
  j["layers"][1]["attention"] = "chunked";
  refuses(j, {"kv_spec.layers[1].attention", "\"full\" or \"sliding\"", "chunked"});
  j = gemma_like();
  j["layers"][0]["window"] = nullptr;
  refuses(j, {"kv_spec.layers[0].window", "positive integer"});
  j = gemma_like();
  j["layers"][2]["window"] = 4;
  refuses(j, {"kv_spec.layers[2].window", "null for a full-attention layer"});
  j = gemma_like();
  j["layers"][1]["rope"]["rotary_dim"] = 4;
  refuses(j, {"kv_spec.layers[1].rope", "rotary_dim 4", "frequencies only"});
  j = gemma_like();
  j["layers"][1]["rope"]["theta"] = -1;
  refuses(j, {"kv_spec.layers[1].rope.theta", "finite number > 1"});
  j = gemma_like();
  j["layers"][2]["rope"] = "default";
  refuses(j, {"kv_spec.layers[2].rope must be an object"});
}
