#pragma once
// A YAML config read with its checks: every mistake is a ConfigError naming the file, line and key.
// A section lists the keys it knows; any other key is an error that names it and lists the known ones.
#include <cstdint>
#include <set>
#include <string>
#include <vector>

#include <yaml-cpp/yaml.h>

namespace crosskv {

class YamlReader {
 public:
  explicit YamlReader(std::string path) : path_(std::move(path)) {}
  const std::string& path() const { return path_; }
  // The document in `text` (invalid YAML: a ConfigError with its line).
  YAML::Node load(const std::string& text) const;

  [[noreturn]] void fail(const YAML::Node& n, const std::string& key, const std::string& what) const;
  // `n` is a mapping of `allowed` keys, each once (`section`: its dotted name, "" for the document).
  void only_keys(const YAML::Node& n, const std::string& section, const std::set<std::string>& allowed) const;
  std::string str(const YAML::Node& n, const std::string& key) const;
  bool boolean(const YAML::Node& n, const std::string& key) const;
  int64_t integer(const YAML::Node& n, const std::string& key, int64_t min) const;
  double number(const YAML::Node& n, const std::string& key) const;  // finite
  // A list of distinct strings (`what` names an entry in the message about a repeat).
  std::vector<std::string> distinct_strings(const YAML::Node& n, const std::string& key, const std::string& expected,
                                            const std::string& what) const;
  // A path as written, relative to the config file's folder when it is relative; absolute either way, so that one job
  // named from another folder (`crosskv-fit job.yaml` or `crosskv-fit jobs/job.yaml`) is the same job to its checkpoint.
  std::string path_relative_to_config(const std::string& p) const;

  // One of `names` (a scalar) as its value in `values`; else the key's error listing them.
  template <class T>
  T choice(const YAML::Node& n, const std::string& key, const std::vector<std::string>& names,
           const std::vector<T>& values) const {
    const std::string v = str(n, key);
    for (size_t i = 0; i < names.size(); ++i)
      if (v == names[i]) return values[i];
    fail(n, key, "expected " + one_of(names) + ", got \"" + v + "\"");
  }

 private:
  static std::string one_of(const std::vector<std::string>& names);  // "a, b or c"
  std::string path_;
};

}  // namespace crosskv
