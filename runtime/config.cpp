#include "runtime/config.hpp"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>

#include <yaml-cpp/yaml.h>

#include "core/error.hpp"

namespace crosskv {

const char* to_string(ProbeMode p) { return p == ProbeMode::same_head ? "same_head" : "all_heads"; }
const char* to_string(Weighting w) { return w == Weighting::uniform ? "uniform" : "dataset"; }
std::string checkpoint_path(const FitConfig& cfg) {
  return cfg.checkpoint_dir.empty() ? (std::filesystem::path(cfg.output_dir) / "checkpoint").string()
                                    : cfg.checkpoint_dir;
}

std::string KChoice::label() const { return is_all() ? "all" : std::to_string(value); }

namespace {

struct Reader {
  std::string path;

  [[noreturn]] void fail(const YAML::Node& n, const std::string& key, const std::string& what) const {
    std::ostringstream os;
    os << path;
    if (n.IsDefined() && n.Mark().line >= 0) os << ":" << n.Mark().line + 1;
    os << ": " << key << ": " << what;
    throw ConfigError(os.str());
  }

  void only_keys(const YAML::Node& n, const std::string& section, const std::set<std::string>& allowed) const {
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

  std::string str(const YAML::Node& n, const std::string& key) const {
    if (!n.IsScalar()) fail(n, key, "expected a string");
    return n.as<std::string>();
  }

  bool boolean(const YAML::Node& n, const std::string& key) const {
    bool v;
    if (!n.IsScalar() || !YAML::convert<bool>::decode(n, v)) fail(n, key, "expected true or false");
    return v;
  }

  int64_t integer(const YAML::Node& n, const std::string& key, int64_t min) const {
    int64_t v;
    if (!n.IsScalar() || !YAML::convert<int64_t>::decode(n, v)) fail(n, key, "expected an integer");
    if (v < min) fail(n, key, "must be >= " + std::to_string(min) + ", got " + std::to_string(v));
    return v;
  }

  // A list of distinct strings (`what` names an entry in the message about a repeat).
  std::vector<std::string> distinct_strings(const YAML::Node& n, const std::string& key, const std::string& expected,
                                            const std::string& what) const {
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
  double number(const YAML::Node& n, const std::string& key) const {
    double v;
    if (!n.IsScalar() || !YAML::convert<double>::decode(n, v) || !std::isfinite(v))
      fail(n, key, "expected a finite number" + (n.IsScalar() ? ", got " + n.Scalar() : std::string()));
    return v;
  }

  KChoice k_value(const YAML::Node& n, const std::string& key) const {
    if (n.IsScalar() && n.as<std::string>() == "all") return {0};
    return {static_cast<int>(integer(n, key, 1))};
  }

  std::string path_relative_to_config(const std::string& p) const {
    std::filesystem::path q(p);
    if (q.is_relative()) q = std::filesystem::path(path).parent_path() / q;
    return q.lexically_normal().string();
  }
};

}  // namespace

namespace {

// One of `names` (a scalar) as its value in `values`; else the key's error listing them.
template <class T>
T choice(Reader& r, const YAML::Node& n, const std::string& key, const std::vector<std::string>& names,
         const std::vector<T>& values) {
  const std::string v = r.str(n, key);
  for (size_t i = 0; i < names.size(); ++i)
    if (v == names[i]) return values[i];
  std::string expected;
  for (size_t i = 0; i < names.size(); ++i)
    expected += (i == 0 ? "" : i + 1 == names.size() ? " or " : ", ") + names[i];
  r.fail(n, key, "expected " + expected + ", got \"" + v + "\"");
  return values[0];  // not reached: fail throws
}

void parse_calibration(Reader& r, const YAML::Node& cal, FitConfig& c) {
  r.only_keys(cal, "calibration", {"domains", "token_stride", "max_tokens", "weights"});
  if (auto w = cal["weights"]; w && !w.IsNull()) {
    if (!w.IsMap()) r.fail(w, "calibration.weights", "expected a mapping {domain: weight}");
    for (const auto& kv : w) {
      const std::string dom = kv.first.as<std::string>();
      const double v = r.number(kv.second, "calibration.weights." + dom);
      if (!(v >= 0.0)) r.fail(kv.second, "calibration.weights." + dom, "must be >= 0");
      c.weights[dom] = v;
    }
  }
  if (auto d = cal["domains"]; d && !d.IsNull())
    c.domains = r.distinct_strings(d, "calibration.domains", "expected a list of domain names", "domain ");
  if (auto s = cal["token_stride"]) c.token_stride = r.integer(s, "calibration.token_stride", 1);
  if (auto m = cal["max_tokens"]; m && !m.IsNull()) c.max_tokens = r.integer(m, "calibration.max_tokens", 1);
}

void parse_mlp(Reader& r, const YAML::Node& m, MlpConfig& mlp) {
  r.only_keys(m, "fit.mlp", {"hidden", "epochs", "lr", "batch_tokens", "weight_decay", "val_fraction", "seed"});
  if (auto x = m["hidden"]) mlp.hidden = static_cast<int>(r.integer(x, "fit.mlp.hidden", 1));
  if (auto x = m["epochs"]) mlp.epochs = static_cast<int>(r.integer(x, "fit.mlp.epochs", 1));
  if (auto x = m["batch_tokens"]) mlp.batch_tokens = r.integer(x, "fit.mlp.batch_tokens", 1);
  if (auto x = m["seed"]) mlp.seed = static_cast<uint64_t>(r.integer(x, "fit.mlp.seed", 0));
  if (auto x = m["lr"]) {
    mlp.lr = r.number(x, "fit.mlp.lr");
    if (!(mlp.lr > 0)) r.fail(x, "fit.mlp.lr", "must be > 0");
  }
  if (auto x = m["weight_decay"]) {
    mlp.weight_decay = r.number(x, "fit.mlp.weight_decay");
    if (!(mlp.weight_decay >= 0)) r.fail(x, "fit.mlp.weight_decay", "must be >= 0");
  }
  if (auto x = m["val_fraction"]) {
    mlp.val_fraction = r.number(x, "fit.mlp.val_fraction");
    if (!(mlp.val_fraction > 0 && mlp.val_fraction < 1))
      r.fail(x, "fit.mlp.val_fraction", "must be between 0 and 1 (exclusive)");
  }
}

void parse_fit(Reader& r, const YAML::Node& fit, FitConfig& c) {
  r.only_keys(fit, "fit", {"k", "lambda", "probe", "structure", "dtype", "mapper", "mlp", "weighting"});
  if (auto k = fit["k"]) {
    c.ks.clear();
    if (k.IsSequence()) {
      if (k.size() == 0) r.fail(k, "fit.k", "expected a number, \"all\" or a non-empty list");
      for (const auto& e : k) c.ks.push_back(r.k_value(e, "fit.k"));
    } else {
      c.ks.push_back(r.k_value(k, "fit.k"));
    }
    std::set<int> seen;
    for (const auto& kc : c.ks)
      if (!seen.insert(kc.value).second) r.fail(k, "fit.k", "k = " + kc.label() + " listed twice");
  }
  if (auto l = fit["lambda"]) {
    c.lambda = r.number(l, "fit.lambda");
    if (!(c.lambda >= 0.0)) r.fail(l, "fit.lambda", "must be >= 0");
  }
  if (auto p = fit["probe"])
    c.probe = choice<ProbeMode>(r, p, "fit.probe", {"same_head", "all_heads"}, {ProbeMode::same_head, ProbeMode::all_heads});
  if (auto s = fit["structure"]) {
    c.structures.clear();
    const std::vector<std::string> names = {"cross_head", "per_head"};
    const std::vector<Structure> values = {Structure::cross_head, Structure::per_head};
    if (s.IsSequence()) {
      if (s.size() == 0) r.fail(s, "fit.structure", "expected cross_head, per_head or a non-empty list of them");
      for (const auto& e : s) {
        const Structure v = choice<Structure>(r, e, "fit.structure", names, values);
        if (has_structure(c.structures, v))
          r.fail(e, "fit.structure", std::string(to_string(v)) + " listed twice");
        c.structures.push_back(v);
      }
    } else {
      c.structures.push_back(choice<Structure>(r, s, "fit.structure", names, values));
    }
  }
  if (auto d = fit["dtype"])
    c.dtype = choice<Dtype>(r, d, "fit.dtype", {"fp32", "bf16", "fp16"}, {Dtype::f32, Dtype::bf16, Dtype::f16});
  if (auto m = fit["mapper"])
    c.mapper = choice<MapperKind>(r, m, "fit.mapper", {"ridge", "mlp", "auto"}, {MapperKind::ridge, MapperKind::mlp, MapperKind::auto_});
  if (auto m = fit["mlp"]) parse_mlp(r, m, c.mlp);
  if (auto w = fit["weighting"])
    c.weighting = choice<Weighting>(r, w, "fit.weighting", {"uniform", "dataset"}, {Weighting::uniform, Weighting::dataset});
  if (c.weighting == Weighting::dataset && c.mapper != MapperKind::ridge)
    r.fail(fit["weighting"], "fit.weighting",
           "dataset weights the ridge's moments; the residual MLP's training is not weighted: use mapper: ridge");
  if (c.mapper != MapperKind::ridge && has_structure(c.structures, Structure::per_head))
    r.fail(fit["mapper"], "fit.mapper",
           "the residual MLP reads every head of the selected layers, so it is fitted for structure: cross_head "
           "only; use mapper: ridge with per_head, or structure: cross_head");
}

void parse_runtime(Reader& r, const YAML::Node& rt, FitConfig& c) {
  r.only_keys(rt, "runtime", {"device", "block_tokens", "checkpoint", "max_moment_gib", "layer_groups", "tf32"});
  if (auto t = rt["tf32"]) c.tf32 = r.boolean(t, "runtime.tf32");
  if (auto d = rt["device"])
    c.device = choice<DeviceKind>(r, d, "runtime.device", {"auto", "cpu", "cuda"}, {DeviceKind::auto_, DeviceKind::cpu, DeviceKind::cuda});
  if (auto g = rt["layer_groups"]) {
    int64_t v = 0;
    if (g.IsScalar() && g.Scalar() == "auto")
      c.layer_groups = 0;
    else if (!g.IsScalar() || !YAML::convert<int64_t>::decode(g, v) || v < 1 || v > 65536)
      r.fail(g, "runtime.layer_groups", "expected auto or an integer >= 1, got \"" + (g.IsScalar() ? g.Scalar() : "?") + "\"");
    else
      c.layer_groups = static_cast<int>(v);
  }
  if (auto b = rt["block_tokens"]) c.block_tokens = r.integer(b, "runtime.block_tokens", 1);
  if (auto m = rt["max_moment_gib"]) {
    c.max_moment_gib = r.number(m, "runtime.max_moment_gib");
    if (!(c.max_moment_gib > 0)) r.fail(m, "runtime.max_moment_gib", "must be > 0");
  }
  if (auto ck = rt["checkpoint"]) {
    r.only_keys(ck, "runtime.checkpoint", {"dir", "every_shards", "mlp_seconds"});
    if (auto d = ck["dir"]) c.checkpoint_dir = r.path_relative_to_config(r.str(d, "runtime.checkpoint.dir"));
    if (auto e = ck["every_shards"]) c.checkpoint_every_shards = r.integer(e, "runtime.checkpoint.every_shards", 1);
    if (auto e = ck["mlp_seconds"]) c.checkpoint_mlp_seconds = r.integer(e, "runtime.checkpoint.mlp_seconds", 0);
  }
}

}  // namespace

FitConfig parse_fit_config(const std::string& text, const std::string& path) {
  Reader r{path};
  YAML::Node root;
  try {
    root = YAML::Load(text);
  } catch (const YAML::Exception& e) {
    throw ConfigError(path + ":" + std::to_string(e.mark.line + 1) + ": invalid YAML: " + e.msg);
  }
  FitConfig c;
  c.config_path = path;
  r.only_keys(root, "", {"source", "target", "calibration", "fit", "output", "runtime", "eval"});
  if (auto ev = root["eval"]) {
    r.only_keys(ev, "eval", {"shards", "min_retention"});
    if (auto sh = ev["shards"]; sh && !sh.IsNull())
      c.eval_shards = r.distinct_strings(sh, "eval.shards", "expected a list of shard paths (<domain>/<name>.h5)", "");
    if (auto m = ev["min_retention"]) {
      c.min_retention = r.number(m, "eval.min_retention");
      if (!(c.min_retention > 0.0 && c.min_retention <= 1.0))
        r.fail(m, "eval.min_retention", "expected a share in (0, 1] (the default is 0.8)");
    }
  }
  for (const char* side : {"source", "target"}) {
    if (!root[side]) r.fail(root, side, "missing (expected {store: PATH})");
    r.only_keys(root[side], side, {"store"});
    if (!root[side]["store"]) r.fail(root[side], std::string(side) + ".store", "missing (expected a path)");
    std::string p = r.path_relative_to_config(r.str(root[side]["store"], std::string(side) + ".store"));
    (std::string(side) == "source" ? c.source_store : c.target_store) = p;
  }
  if (auto cal = root["calibration"]) parse_calibration(r, cal, c);
  if (auto fit = root["fit"]) parse_fit(r, fit, c);
  if (!root["output"]) r.fail(root, "output", "missing (expected {dir: PATH})");
  r.only_keys(root["output"], "output", {"dir"});
  if (!root["output"]["dir"]) r.fail(root["output"], "output.dir", "missing (expected a path)");
  c.output_dir = r.path_relative_to_config(r.str(root["output"]["dir"], "output.dir"));
  if (auto rt = root["runtime"]) parse_runtime(r, rt, c);
  return c;
}

std::string mapper_kind_name(MapperKind k) {
  return k == MapperKind::ridge ? "ridge" : k == MapperKind::mlp ? "mlp" : "auto";
}

FitConfig load_fit_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open config file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_fit_config(ss.str(), path);
}

}  // namespace crosskv
