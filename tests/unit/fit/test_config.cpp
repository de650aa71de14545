#include <nlohmann/json.hpp>

#include <omp.h>
#include <unistd.h>

#include <algorithm>
#include <cstdlib>

#include "fit/config.hpp"
#include "core/threads.hpp"
#include "helpers.hpp"

using namespace crosskv;
using crosskv::test::expect_error;

namespace {
const std::string kBase = "source: {store: s}\ntarget: {store: t}\noutput: {dir: o}\n";
}

TEST(Config, DefaultsFollowTheSpec) {
  FitConfig c = parse_fit_config(kBase, "/x/cfg.yaml");
  EXPECT_EQ(c.source.store, "/x/s");
  EXPECT_EQ(c.output.dir, "/x/o");
  EXPECT_TRUE(c.fit.lambda.automatic);  // fit.lambda: auto (chosen per target layer and kind)
  EXPECT_EQ(c.fit.lambda.json(), "auto");
  ASSERT_EQ(c.fit.ks.size(), 5u);
  EXPECT_TRUE(c.fit.ks.back().is_all());
  EXPECT_EQ(c.fit.probe, ProbeMode::same_head);
  EXPECT_EQ(c.fit.dtype, Dtype::f32);
  EXPECT_EQ(c.runtime.block_tokens, 4096);
  EXPECT_EQ(c.calibration.token_stride, 1);
}

TEST(Config, FullConfigParses) {
  FitConfig c = parse_fit_config(kBase +
                                     "calibration: {domains: [web, code], token_stride: 4, max_tokens: 1000}\n"
                                     "fit: {k: [1, 4, all], lambda: 0, probe: all_heads, dtype: bf16}\n"
                                     "runtime: {device: cpu, block_tokens: 512, checkpoint: {dir: ck, every_shards: 2}}\n",
                                 "cfg.yaml");
  EXPECT_EQ(c.calibration.domains, (std::vector<std::string>{"web", "code"}));
  EXPECT_EQ(c.calibration.token_stride, 4);
  EXPECT_EQ(*c.calibration.max_tokens, 1000);
  EXPECT_EQ(c.fit.ks.size(), 3u);
  EXPECT_FALSE(c.fit.lambda.automatic);
  EXPECT_DOUBLE_EQ(c.fit.lambda.value, 0.0);
  EXPECT_EQ(c.fit.probe, ProbeMode::all_heads);
  EXPECT_EQ(c.fit.dtype, Dtype::bf16);
  EXPECT_EQ(c.runtime.device, DeviceKind::cpu);
  EXPECT_EQ(c.runtime.checkpoint.every_shards, 2);
  EXPECT_EQ(c.runtime.checkpoint.mlp_seconds, 300);  // the default
}

TEST(Config, SingleKNumber) {
  FitConfig c = parse_fit_config(kBase + "fit: {k: 8}\n", "cfg.yaml");
  ASSERT_EQ(c.fit.ks.size(), 1u);
  EXPECT_EQ(c.fit.ks[0].value, 8);
}

TEST(Config, UnknownKeyNamesKeyAndLine) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit:\n  k: 2\n  lamda: 0.1\n", "my.yaml"); },
                            {"my.yaml:6", "fit.lamda", "unknown key"});
}

TEST(Config, UnknownTopLevelKey) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "extra: 1\n", "my.yaml"); }, {"my.yaml:4", "extra", "unknown key"});
}

TEST(Config, WrongTypeIsAnError) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "runtime: {block_tokens: lots}\n", "my.yaml"); },
                            {"my.yaml:4", "runtime.block_tokens", "expected an integer"});
}

TEST(Config, OutOfRangeIsAnError) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {lambda: -1}\n", "my.yaml"); },
                            {"fit.lambda", "must be auto or >= 0"});
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {lambda: automatic}\n", "my.yaml"); },
                            {"my.yaml:4", "fit.lambda", "automatic"});
  EXPECT_TRUE(parse_fit_config(kBase + "fit: {lambda: auto}\n", "my.yaml").fit.lambda.automatic);
  expect_error<ConfigError>([] { parse_fit_config(kBase + "calibration: {token_stride: 0}\n", "my.yaml"); },
                            {"calibration.token_stride", ">= 1"});
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {k: [0]}\n", "my.yaml"); }, {"fit.k", ">= 1"});
}

TEST(Config, BadEnumValues) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {dtype: fp8}\n", "my.yaml"); }, {"fit.dtype", "fp8"});
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {probe: diag}\n", "my.yaml"); }, {"fit.probe", "diag"});
  expect_error<ConfigError>([] { parse_fit_config(kBase + "runtime: {device: tpu}\n", "my.yaml"); },
                            {"runtime.device", "tpu"});
}

TEST(Config, MissingSections) {
  expect_error<ConfigError>([] { parse_fit_config("source: {store: s}\noutput: {dir: o}\n", "my.yaml"); },
                            {"my.yaml", "target", "missing"});
  expect_error<ConfigError>([] { parse_fit_config("source: {store: s}\ntarget: {store: t}\n", "my.yaml"); },
                            {"output", "missing"});
}

TEST(Config, DuplicatesAreErrors) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "calibration: {domains: [web, web]}\n", "my.yaml"); },
                            {"calibration.domains", "web", "twice"});
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {k: [2, 2]}\n", "my.yaml"); }, {"fit.k", "twice"});
}

TEST(Config, InvalidYamlNamesLine) {
  expect_error<ConfigError>([] { parse_fit_config("source: {store: s\n", "my.yaml"); }, {"my.yaml", "invalid YAML"});
}

TEST(Config, MissingFile) {
  expect_error<ConfigError>([] { load_fit_config("/nonexistent/cfg.yaml"); }, {"/nonexistent/cfg.yaml", "cannot open"});
}

TEST(Config, DuplicateKeyIsAnError) {
  expect_error<ConfigError>([] { parse_fit_config(kBase + "fit: {k: 2}\nfit: {k: 3}\n", "my.yaml"); },
                            {"my.yaml:5", "fit", "duplicate key"});
}

TEST(Config, LayerGroups) {
  EXPECT_EQ(parse_fit_config(kBase, "c.yaml").runtime.layer_groups, 0);  // auto
  EXPECT_EQ(parse_fit_config(kBase + "runtime: {layer_groups: auto}\n", "c.yaml").runtime.layer_groups, 0);
  EXPECT_EQ(parse_fit_config(kBase + "runtime: {layer_groups: 4}\n", "c.yaml").runtime.layer_groups, 4);
  expect_error<ConfigError>([] { parse_fit_config(kBase + "runtime: {layer_groups: 0}\n", "my.yaml"); },
                            {"my.yaml:4", "runtime.layer_groups", "expected auto or an integer >= 1", "\"0\""});
  expect_error<ConfigError>([] { parse_fit_config(kBase + "runtime: {layer_groups: many}\n", "my.yaml"); },
                            {"runtime.layer_groups", "many"});
}

TEST(Config, NonFiniteNumbersAreErrors) {
  for (const char* v : {".inf", "-.inf", ".nan", ".NaN", "1e999"}) {
    SCOPED_TRACE(v);
    expect_error<ConfigError>([&] { parse_fit_config(kBase + "fit: {lambda: " + v + "}\n", "my.yaml"); },
                              {"my.yaml:", "fit.lambda", "finite"});
    expect_error<ConfigError>(
        [&] { parse_fit_config(kBase + "runtime: {max_moment_gib: " + v + "}\n", "my.yaml"); },
        {"runtime.max_moment_gib", "finite"});
    expect_error<ConfigError>(
        [&] { parse_fit_config(kBase + "calibration: {weights: {web: " + v + "}}\n", "my.yaml"); },
        {"calibration.weights.web", "finite"});
  }
}

TEST(Config, MapperAndMlpSettings) {
  const FitConfig d = parse_fit_config(kBase, "my.yaml");
  EXPECT_EQ(d.fit.mapper, MapperKind::ridge);  // ridge unless asked
  EXPECT_EQ(d.fit.mlp.hidden, 256);
  const FitConfig c = parse_fit_config(
      kBase + "fit: {mapper: auto, mlp: {hidden: 64, epochs: 3, lr: 0.01, batch_tokens: 512, weight_decay: 0, "
              "val_fraction: 0.25, seed: 9}}\n",
      "my.yaml");
  EXPECT_EQ(c.fit.mapper, MapperKind::auto_);
  EXPECT_EQ(c.fit.mlp.hidden, 64);
  EXPECT_EQ(c.fit.mlp.epochs, 3);
  EXPECT_DOUBLE_EQ(c.fit.mlp.lr, 0.01);
  EXPECT_EQ(c.fit.mlp.batch_tokens, 512);
  EXPECT_DOUBLE_EQ(c.fit.mlp.weight_decay, 0.0);
  EXPECT_DOUBLE_EQ(c.fit.mlp.val_fraction, 0.25);
  EXPECT_EQ(c.fit.mlp.seed, 9u);
  EXPECT_EQ(parse_fit_config(kBase + "fit: {mapper: mlp}\n", "my.yaml").fit.mapper, MapperKind::mlp);
  for (const auto& [yaml, parts] : std::vector<std::pair<std::string, std::vector<std::string>>>{
           {"fit: {mapper: mlp2}\n", {"my.yaml:4", "fit.mapper", "expected ridge, mlp or auto, got \"mlp2\""}},
           {"fit: {mlp: {hiden: 3}}\n", {"my.yaml:4", "hiden", "unknown key"}},
           {"fit: {mlp: {hidden: 0}}\n", {"fit.mlp.hidden", "must be >= 1"}},
           {"fit: {mlp: {val_fraction: 1}}\n", {"fit.mlp.val_fraction", "between 0 and 1"}},
           {"fit: {mlp: {lr: 0}}\n", {"fit.mlp.lr", "must be > 0"}},
           {"fit: {mlp: {lr: .nan}}\n", {"fit.mlp.lr"}},
           {"fit: {mlp: {weight_decay: -1}}\n", {"fit.mlp.weight_decay", "must be >= 0"}},
           {"runtime: {checkpoint: {mlp_seconds: -1}}\n", {"runtime.checkpoint.mlp_seconds", "must be >= 0"}}})
    expect_error<ConfigError>([&] { parse_fit_config(kBase + yaml, "my.yaml"); }, parts);
}
