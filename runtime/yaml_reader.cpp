#include "runtime/yaml_reader.hpp"

#include <cmath>
#include <filesystem>
#include <sstream>

#include "core/error.hpp"

namespace crosskv {

YAML::Node YamlReader::load(const std::string& text) const {
  try {
    return YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(path_ + ":" + std::to_string(e.mark.line + 1) + ": invalid YAML: " + e.msg);
  }
}

void YamlReader::fail(const YAML::Node& n, const std::string& key, const std::string& what) const {
  std::ostringstream os;
  os << path_;
  if (n.IsDefined() && n.Mark().line >= 0) os << ":" << n.Mark().line + 1;
  os << ": " << key << ": " << what;
  throw ConfigError(os.str());
}

void YamlReader::only_keys(const YAML::Node& n, const std::string& section, const std::set<std::string>& allowed) const {
  if (!n.IsMap()) fail(n, section, "expected a mapping");
  std::set<std::string> seen;
  for (const auto& kv : n) {
    const std::string k = kv.first.as<std::string>();
    if (!seen.insert(k).second) fail(kv.first, section.empty() ? k : section + "." + k, "duplicate key");
    if (!allowed.count(k)) {
      std::string list;
      for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
      fail(kv.first, section.empty() ? k : section + "." + k, "unknown key (expected one of: " + list + ")");
    }
  }
}

std::string YamlReader::str(const YAML::Node& n, const std::string& key) const {
  if (!n.IsScalar()) fail(n, key, "expected a string");
  return n.as<std::string>();
}

bool YamlReader::boolean(const YAML::Node& n, const std::string& key) const {
  bool v;
  if (!n.IsScalar() || !YAML::convert<bool>::decode(n, v)) fail(n, key, "expected true or false");
  return v;
}

int64_t YamlReader::integer(const YAML::Node& n, const std::string& key, int64_t min) const {
  int64_t v;
  if (!n.IsScalar() || !YAML::convert<int64_t>::decode(n, v)) fail(n, key, "expected an integer");
  if (v < min) fail(n, key, "must be >= " + std::to_string(min) + ", got " + std::to_string(v));
  return v;
}

double YamlReader::number(const YAML::Node& n, const std::string& key) const {
  double v;
  if (!n.IsScalar() || !YAML::convert<double>::decode(n, v) || !std::isfinite(v))
    fail(n, key, "expected a finite number" + (n.IsScalar() ? ", got " + n.Scalar() : std::string()));
  return v;
}

std::vector<std::string> YamlReader::distinct_strings(const YAML::Node& n, const std::string& key,
                                                      const std::string& expected, const std::string& what) const {
  if (!n.IsSequence()) fail(n, key, expected);
  std::vector<std::string> out;
  std::set<std::string> seen;
  for (const auto& e : n) {
    std::string v = str(e, key);
    if (!seen.insert(v).second) fail(e, key, what + "\"" + v + "\" listed twice");
    out.push_back(v);
  }
  return out;
}

std::string YamlReader::path_relative_to_config(const std::string& p) const {
  std::filesystem::path q(p);
  if (q.is_relative()) q = std::filesystem::path(path_).parent_path() / q;
  return std::filesystem::absolute(q).lexically_normal().string();
}

std::string YamlReader::one_of(const std::vector<std::string>& names) {
  std::string s;
  for (size_t i = 0; i < names.size(); ++i) s += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  return s;
}

}  // namespace crosskv
