#include <filesystem>
#include <string>

#include "core/error.hpp"
#include "runtime/yaml_reader.hpp"
#include "helpers.hpp"

using namespace crosskv;
using namespace crosskv::test;

// The reader's checks name the file, the line and the dotted key, and say what was expected.
TEST(YamlReader, EveryMistakeNamesFileLineAndKey) {
  const YamlReader r{"/cfg/job.yaml"};
  const YAML::Node doc = r.load("a: 1\nsection:\n  known: x\n  other: 2\nlist: [p, q, p]\nname: maybe\n");
  expect_error<ConfigError>([&] { r.only_keys(doc["section"], "section", {"known"}); },
                            {"/cfg/job.yaml:4: section.other: unknown key (expected one of: known)"});
  expect_error<ConfigError>([&] { r.distinct_strings(doc["list"], "list", "expected a list", "entry "); },
                            {"list: entry \"p\" listed twice"});
  expect_error<ConfigError>([&] { r.integer(doc["a"], "a", 2); }, {"/cfg/job.yaml:1: a: must be >= 2, got 1"});
  expect_error<ConfigError>([&] { r.number(doc["section"]["known"], "section.known"); },
                            {"section.known: expected a finite number, got x"});
  expect_error<ConfigError>([&] { r.choice<int>(doc["name"], "name", {"yes", "no", "auto"}, {1, 0, 2}); },
                            {"name: expected yes, no or auto, got \"maybe\""});
  expect_error<ConfigError>([&] { r.load("a: [1,\n"); }, {"/cfg/job.yaml:"});
  EXPECT_EQ(r.choice<int>(doc["section"]["known"], "k", {"x"}, {7}), 7);
  EXPECT_EQ(r.path_relative_to_config("data/s"), "/cfg/data/s");
  EXPECT_EQ(r.path_relative_to_config("/abs"), "/abs");
  YamlReader here("job.yaml");  // named relative to the working folder
  EXPECT_EQ(here.path_relative_to_config("data/s"), (std::filesystem::current_path() / "data/s").string());
}
