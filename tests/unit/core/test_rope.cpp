#include <cmath>
#include <random>

#include "core/rope.hpp"
#include "helpers.hpp"

using namespace crosskv;
using crosskv::test::expect_error;

namespace {

KvSpec spec_with(const std::string& type, int D = 128, int rotary = 128,
                 RopeConvention conv = RopeConvention::half) {
  KvSpec s;
  s.n_layers = 2;
  s.n_kv_heads = 2;
  s.head_dim = D;
  s.rope.type = type;
  s.rope.rotary_dim = rotary;
  s.rope.convention = conv;
  if (type == "linear") s.rope.factor = 4.0;
  if (type == "llama3") {
    s.rope.theta = 500000.0;
    s.rope.factor = 8.0;
    s.rope.low_freq_factor = 1.0;
    s.rope.high_freq_factor = 4.0;
    s.rope.original_max_position_embeddings = 8192.0;
  }
  if (type == "yarn") {
    s.rope.theta = 1e6;
    s.rope.factor = 4.0;
    s.rope.original_max_position_embeddings = 4096.0;
  }
  return s;
}

}  // namespace

// Expected values computed independently (plain Python, math module) from the formulas in docs/METHOD.md, RoPE / HF.
TEST(Rope, Llama3InvFreqMatchesIndependentValues) {
  Rope r(spec_with("llama3"));
  const std::vector<std::pair<int, double>> want = {{0, 1.0},
                                                    {10, 0.12868737343265052},
                                                    {20, 0.016560440080994446},
                                                    {30, 0.0013718935677611381},
                                                    {40, 3.428102195952591e-05},
                                                    {47, 8.160728247435943e-06},
                                                    {50, 4.411534674558404e-06},
                                                    {63, 3.068925988914511e-07}};
  for (auto [i, v] : want) EXPECT_NEAR(r.layer(0).inv_freq()[i] / v, 1.0, 1e-6) << "index " << i;
  EXPECT_DOUBLE_EQ(r.layer(0).attention_factor(), 1.0);
}

TEST(Rope, YarnInvFreqAndAttentionFactorMatchIndependentValues) {
  Rope r(spec_with("yarn"));
  const std::vector<std::pair<int, double>> want = {{0, 1.0},
                                                    {5, 0.3398208328942559},
                                                    {10, 0.1154781984689458},
                                                    {20, 0.00944577681115688},
                                                    {30, 0.0004491452367673518},
                                                    {40, 4.445698525097307e-05},
                                                    {63, 3.102344401879299e-07}};
  for (auto [i, v] : want) EXPECT_NEAR(r.layer(0).inv_freq()[i] / v, 1.0, 1e-6) << "index " << i;
  EXPECT_NEAR(r.layer(0).attention_factor(), 1.138629436111989, 1e-12);  // 0.1 ln 4 + 1
  KvSpec s = spec_with("yarn");
  s.rope.factor = 40.0;
  s.rope.mscale = 1.0;
  s.rope.mscale_all_dim = 0.707;
  EXPECT_NEAR(Rope(s).layer(0).attention_factor(), 1.0857263992561355, 1e-12);
  s.rope.attention_factor = 1.5;
  EXPECT_DOUBLE_EQ(Rope(s).layer(0).attention_factor(), 1.5);
}

TEST(Rope, LinearDividesDefault) {
  Rope d(spec_with("default")), l(spec_with("linear"));
  for (size_t i = 0; i < d.layer(0).inv_freq().size(); ++i) EXPECT_NEAR(l.layer(0).inv_freq()[i], d.layer(0).inv_freq()[i] / 4.0, 1e-7 * d.layer(0).inv_freq()[i]);
}

TEST(Rope, HalfConventionMatchesRotateHalfFormula) {
  KvSpec s = spec_with("default", 8, 8);
  Rope r(s);
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8}, y = x;
  const int32_t pos = 7;
  r.apply_block(y.data(), 1, {0, 1, 1}, &pos);
  for (int i = 0; i < 4; ++i) {
    const double a = pos * std::pow(10000.0, -2.0 * i / 8);
    EXPECT_NEAR(y[i], x[i] * std::cos(a) - x[i + 4] * std::sin(a), 1e-5);
    EXPECT_NEAR(y[i + 4], x[i + 4] * std::cos(a) + x[i] * std::sin(a), 1e-5);
  }
}

TEST(Rope, InterleavedConventionRotatesAdjacentPairs) {
  KvSpec s = spec_with("default", 8, 8, RopeConvention::interleaved);
  Rope r(s);
  std::vector<float> x = {1, 2, 3, 4, 5, 6, 7, 8}, y = x;
  const int32_t pos = 3;
  r.apply_block(y.data(), 1, {0, 1, 1}, &pos);
  for (int i = 0; i < 4; ++i) {
    const double a = pos * std::pow(10000.0, -2.0 * i / 8);
    EXPECT_NEAR(y[2 * i], x[2 * i] * std::cos(a) - x[2 * i + 1] * std::sin(a), 1e-5);
    EXPECT_NEAR(y[2 * i + 1], x[2 * i + 1] * std::cos(a) + x[2 * i] * std::sin(a), 1e-5);
  }
}

TEST(Rope, PartialRotaryLeavesTailDimsUntouched) {
  Rope r(spec_with("default", 16, 8));
  std::vector<float> x(16);
  for (int i = 0; i < 16; ++i) x[i] = i + 1.0f;
  auto y = x;
  const int32_t pos = 11;
  r.apply_block(y.data(), 1, {0, 1, 1}, &pos);
  for (int i = 8; i < 16; ++i) EXPECT_EQ(y[i], x[i]);
  EXPECT_NE(y[1], x[1]);
}

class RopeRoundTrip : public ::testing::TestWithParam<std::tuple<std::string, RopeConvention, int>> {};

TEST_P(RopeRoundTrip, StripUndoesApplyAtLargeNonContiguousPositions) {
  auto [type, conv, rotary] = GetParam();
  Rope r(spec_with(type, 64, rotary, conv));
  std::mt19937 rng(3);
  std::normal_distribution<float> n(0, 1);
  const int T = 16, heads = 3;
  std::vector<float> x(T * heads * 64);
  for (auto& v : x) v = n(rng);
  std::vector<int32_t> pos(T);
  for (int t = 0; t < T; ++t) pos[t] = t * 977 + (t % 3) * 31;  // gaps, up to ~15K
  auto y = x;
  r.apply_block(y.data(), T, {0, 1, heads}, pos.data());
  double moved = 0;
  for (size_t i = 0; i < x.size(); ++i) moved += std::fabs(y[i] - x[i]);
  if (type != "none") {
    EXPECT_GT(moved, 1.0);
  }
  r.strip_block(y.data(), T, {0, 1, heads}, pos.data());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 2e-5f * (1 + std::fabs(x[i]))) << type << " at " << i;
}

INSTANTIATE_TEST_SUITE_P(
    AllTypes, RopeRoundTrip,
    ::testing::Combine(::testing::Values("default", "linear", "llama3", "yarn", "none"),
                       ::testing::Values(RopeConvention::half, RopeConvention::interleaved), ::testing::Values(64, 32)));

TEST(Rope, DynamicIsRefusedByName) {
  expect_error<InputError>([] { Rope r(spec_with("dynamic"), "a.h5"); }, {"a.h5", "dynamic", "not supported"});
}

TEST(Rope, UnknownTypeIsRefusedByName) {
  expect_error<InputError>([] { Rope r(spec_with("longrope"), "b.h5"); }, {"b.h5", "unknown rope type", "longrope"});
}

TEST(Rope, Llama3WithoutItsParametersIsRefused) {
  KvSpec s = spec_with("llama3");
  s.rope.low_freq_factor.reset();
  expect_error<InputError>([&] { Rope r(s, "c.h5"); }, {"c.h5", "low_freq_factor"});
}

namespace {

// Gemma 3's pattern: layers 0, 1, 3 local (theta 1e4, sliding), layer 2 global (theta 1e6, llama3-scaled).
KvSpec per_layer_spec() {
  KvSpec s = spec_with("llama3", 64, 64);
  s.n_layers = 4;
  s.rope.theta = 1e6;
  RopeSpec local;
  local.theta = 1e4;
  local.rotary_dim = 64;
  s.layers.assign(4, LayerSpec{Attention::sliding, 512, local});
  s.layers[2] = LayerSpec{Attention::full, 0, s.rope};
  return s;
}

KvSpec one_layer(const RopeSpec& rope) {
  KvSpec s = spec_with("default", 64, 64);
  s.n_layers = 1;
  s.rope = rope;
  return s;
}

}  // namespace

TEST(Rope, EachLayerRotatesWithItsOwnFrequencies) {
  const KvSpec s = per_layer_spec();
  const Rope r(s);
  ASSERT_EQ(r.runs(r.all()).size(), 3u);  // layers 0-1, 2, 3
  EXPECT_EQ(r.runs({1, 2, 2}).size(), 2u);
  EXPECT_NEAR(r.layer(0).inv_freq()[1], std::pow(1e4, -2.0 / 64), 1e-7);  // rounded to fp32, as HF keeps it
  const int T = 5, H = 2, D = 64;
  std::mt19937 rng(7);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> x(T * 4 * H * D);
  for (auto& v : x) v = n(rng);
  std::vector<int32_t> pos = {0, 9, 700, 4096, 30000};
  auto y = x;
  r.apply_block(y.data(), T, r.all(), pos.data());
  // Each layer as a one-layer model of its own RoPE gives the same bits.
  for (int l = 0; l < 4; ++l) {
    const Rope alone(one_layer(s.layers[l].rope));
    std::vector<float> want(T * H * D);
    for (int t = 0; t < T; ++t)
      std::copy_n(x.data() + (t * 4 + l) * H * D, H * D, want.data() + t * H * D);
    alone.apply_block(want.data(), T, alone.all(), pos.data());
    for (int t = 0; t < T; ++t)
      for (int c = 0; c < H * D; ++c) ASSERT_EQ(y[(t * 4 + l) * H * D + c], want[t * H * D + c]) << l << " " << t;
  }
  // A block of layers 1..2 only, with one head of each: the same rotation as those layers in the whole.
  std::vector<float> part(T * 2 * 1 * D), whole = x;
  for (int t = 0; t < T; ++t)
    for (int l = 1; l < 3; ++l) std::copy_n(x.data() + (t * 4 + l) * H * D, D, part.data() + (t * 2 + l - 1) * D);
  r.apply_block(part.data(), T, {1, 2, 1}, pos.data());
  for (int t = 0; t < T; ++t)
    for (int l = 1; l < 3; ++l)
      for (int c = 0; c < D; ++c) ASSERT_EQ(part[(t * 2 + l - 1) * D + c], y[(t * 4 + l) * H * D + c]);
  r.strip_block(y.data(), T, r.all(), pos.data());
  for (size_t i = 0; i < x.size(); ++i) ASSERT_NEAR(y[i], x[i], 2e-5f * (1 + std::fabs(x[i])));
}

TEST(Rope, OneThetaForEveryLayerDoesNotUndoPerLayerRope) {  // the bug per-layer RoPE fixes, caught
  KvSpec s = per_layer_spec();
  const Rope right(s);
  s.layers.clear();  // Gemma 3 read as before: every layer with the global theta
  const Rope wrong(s);
  const int T = 3, D = 64;
  std::vector<float> x(T * 4 * 2 * D, 1.0f);
  std::vector<int32_t> pos = {5, 100, 2000};
  right.apply_block(x.data(), T, right.all(), pos.data());
  auto y = x;
  wrong.strip_block(x.data(), T, wrong.all(), pos.data());
  right.strip_block(y.data(), T, right.all(), pos.data());
  double off_wrong = 0, off_right = 0;
  for (size_t i = 0; i < x.size(); ++i) off_wrong += std::fabs(x[i] - 1.0f), off_right += std::fabs(y[i] - 1.0f);
  EXPECT_LT(off_right, 1e-3);
  EXPECT_GT(off_wrong, 10.0);
}

TEST(Rope, ALayersUnsupportedRopeIsRefusedByItsKey) {
  KvSpec s = per_layer_spec();
  s.layers[3].rope.type = "dynamic";
  expect_error<InputError>([&] { Rope r(s, "g.h5"); }, {"g.h5", "dynamic"});
  s.layers[3].rope.type = "linear";
  expect_error<InputError>([&] { Rope r(s, "g.h5"); }, {"g.h5", "kv_spec.layers[3].rope.factor"});
}
