#include "fit/config.hpp"

#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/error.hpp"
#include "runtime/yaml_reader.hpp"

namespace crosskv {

nlohmann::json LambdaSetting::json() const { return automatic ? nlohmann::json("auto") : nlohmann::json(value); }

const char* to_string(ProbeMode p) { return p == ProbeMode::same_head ? "same_head" : "all_heads"; }
const char* to_string(Weighting w) { return w == Weighting::uniform ? "uniform" : "dataset"; }
std::string mapper_kind_name(MapperKind k) {
  return k == MapperKind::ridge ? "ridge" : k == MapperKind::mlp ? "mlp" : "auto";
}
std::string KChoice::label() const { return is_all() ? "all" : std::to_string(value); }

std::string checkpoint_path(const FitConfig& cfg) {
  return cfg.runtime.checkpoint.dir.empty() ? (std::filesystem::path(cfg.output.dir) / "checkpoint").string()
                                            : cfg.runtime.checkpoint.dir;
}

namespace {

KChoice k_value(const YamlReader& r, const YAML::Node& n, const std::string& key) {
  if (n.IsScalar() && n.as<std::string>() == "all") return {0};
  return {static_cast<int>(r.integer(n, key, 1))};
}

// A number that `ok` accepts, else the key's error saying what it must be.
template <class Ok>
double number_where(const YamlReader& r, const YAML::Node& n, const std::string& key, Ok ok, const std::string& must) {
  const double v = r.number(n, key);
  if (!ok(v)) r.fail(n, key, must);
  return v;
}

std::string store(const YamlReader& r, const YAML::Node& root, const std::string& side) {
  if (!root[side]) r.fail(root, side, "missing (expected {store: PATH})");
  r.only_keys(root[side], side, {"store"});
  if (!root[side]["store"]) r.fail(root[side], side + ".store", "missing (expected a path)");
  return r.path_relative_to_config(r.str(root[side]["store"], side + ".store"));
}

CalibrationConfig parse_calibration(const YamlReader& r, const YAML::Node& cal) {
  CalibrationConfig c;
  r.only_keys(cal, "calibration", {"domains", "token_stride", "max_tokens", "weights"});
  if (auto w = cal["weights"]; w && !w.IsNull()) {
    if (!w.IsMap()) r.fail(w, "calibration.weights", "expected a mapping {domain: weight}");
    for (const auto& kv : w) {
      const std::string dom = kv.first.as<std::string>();
      c.weights[dom] = number_where(r, kv.second, "calibration.weights." + dom, [](double v) { return v >= 0; },
                                    "must be >= 0");
    }
  }
  if (auto d = cal["domains"]; d && !d.IsNull())
    c.domains = r.distinct_strings(d, "calibration.domains", "expected a list of domain names", "domain ");
  if (auto s = cal["token_stride"]) c.token_stride = r.integer(s, "calibration.token_stride", 1);
  if (auto m = cal["max_tokens"]; m && !m.IsNull()) c.max_tokens = r.integer(m, "calibration.max_tokens", 1);
  return c;
}

MlpSettings parse_mlp(const YamlReader& r, const YAML::Node& m) {
  MlpSettings s;
  r.only_keys(m, "fit.mlp", {"hidden", "epochs", "lr", "batch_tokens", "weight_decay", "val_fraction", "seed"});
  if (auto x = m["hidden"]) s.hidden = static_cast<int>(r.integer(x, "fit.mlp.hidden", 1));
  if (auto x = m["epochs"]) s.epochs = static_cast<int>(r.integer(x, "fit.mlp.epochs", 1));
  if (auto x = m["batch_tokens"]) s.batch_tokens = r.integer(x, "fit.mlp.batch_tokens", 1);
  if (auto x = m["seed"]) s.seed = static_cast<uint64_t>(r.integer(x, "fit.mlp.seed", 0));
  if (auto x = m["lr"]) s.lr = number_where(r, x, "fit.mlp.lr", [](double v) { return v > 0; }, "must be > 0");
  if (auto x = m["weight_decay"])
    s.weight_decay = number_where(r, x, "fit.mlp.weight_decay", [](double v) { return v >= 0; }, "must be >= 0");
  if (auto x = m["val_fraction"])
    s.val_fraction = number_where(r, x, "fit.mlp.val_fraction", [](double v) { return v > 0 && v < 1; },
                                  "must be between 0 and 1 (exclusive)");
  return s;
}

std::vector<KChoice> parse_ks(const YamlReader& r, const YAML::Node& k) {
  std::vector<KChoice> ks;
  if (k.IsSequence()) {
    if (k.size() == 0) r.fail(k, "fit.k", "expected a number, \"all\" or a non-empty list");
    for (const auto& e : k) ks.push_back(k_value(r, e, "fit.k"));
  } else {
    ks.push_back(k_value(r, k, "fit.k"));
  }
  std::set<int> seen;
  for (const auto& kc : ks)
    if (!seen.insert(kc.value).second) r.fail(k, "fit.k", "k = " + kc.label() + " listed twice");
  return ks;
}

std::vector<Structure> parse_structures(const YamlReader& r, const YAML::Node& s) {
  const std::vector<std::string> names = {"cross_head", "per_head"};
  const std::vector<Structure> values = {Structure::cross_head, Structure::per_head};
  if (!s.IsSequence()) return {r.choice<Structure>(s, "fit.structure", names, values)};
  if (s.size() == 0) r.fail(s, "fit.structure", "expected cross_head, per_head or a non-empty list of them");
  std::vector<Structure> out;
  for (const auto& e : s) {
    const Structure v = r.choice<Structure>(e, "fit.structure", names, values);
    if (has_structure(out, v)) r.fail(e, "fit.structure", std::string(to_string(v)) + " listed twice");
    out.push_back(v);
  }
  return out;
}

SolveConfig parse_fit(const YamlReader& r, const YAML::Node& fit) {
  SolveConfig c;
  r.only_keys(fit, "fit", {"k", "lambda", "probe", "structure", "dtype", "mapper", "mlp", "weighting"});
  if (auto k = fit["k"]) c.ks = parse_ks(r, k);
  if (auto l = fit["lambda"]) {
    if (l.IsScalar() && l.Scalar() == "auto")
      c.lambda = LambdaSetting{};
    else
      c.lambda = {false, number_where(r, l, "fit.lambda", [](double v) { return v >= 0; }, "must be auto or >= 0")};
  }
  if (auto p = fit["probe"])
    c.probe = r.choice<ProbeMode>(p, "fit.probe", {"same_head", "all_heads"}, {ProbeMode::same_head, ProbeMode::all_heads});
  if (auto s = fit["structure"]) c.structures = parse_structures(r, s);
  if (auto d = fit["dtype"])
    c.dtype = r.choice<Dtype>(d, "fit.dtype", {"fp32", "bf16", "fp16"}, {Dtype::f32, Dtype::bf16, Dtype::f16});
  if (auto m = fit["mapper"])
    c.mapper = r.choice<MapperKind>(m, "fit.mapper", {"ridge", "mlp", "auto"},
                                    {MapperKind::ridge, MapperKind::mlp, MapperKind::auto_});
  if (auto m = fit["mlp"]) c.mlp = parse_mlp(r, m);
  if (auto w = fit["weighting"])
    c.weighting = r.choice<Weighting>(w, "fit.weighting", {"uniform", "dataset"}, {Weighting::uniform, Weighting::dataset});
  if (c.weighting == Weighting::dataset && c.mapper != MapperKind::ridge)
    r.fail(fit["weighting"], "fit.weighting",
           "dataset weights the ridge's moments; the residual MLP's training is not weighted: use mapper: ridge");
  if (c.mapper != MapperKind::ridge && has_structure(c.structures, Structure::per_head))
    r.fail(fit["mapper"], "fit.mapper",
           "the residual MLP reads every head of the selected layers, so it is fitted for structure: cross_head "
           "only; use mapper: ridge with per_head, or structure: cross_head");
  return c;
}

EvalConfig parse_eval(const YamlReader& r, const YAML::Node& ev) {
  EvalConfig c;
  r.only_keys(ev, "eval", {"shards", "min_retention"});
  if (auto sh = ev["shards"]; sh && !sh.IsNull())
    c.shards = r.distinct_strings(sh, "eval.shards", "expected a list of shard paths (<domain>/<name>.h5)", "");
  if (auto m = ev["min_retention"])
    c.min_retention = number_where(r, m, "eval.min_retention", [](double v) { return v > 0.0 && v <= 1.0; },
                                   "expected a share in (0, 1] (the default is 0.8)");
  return c;
}

RuntimeConfig parse_runtime(const YamlReader& r, const YAML::Node& rt) {
  RuntimeConfig c;
  r.only_keys(rt, "runtime", {"device", "block_tokens", "checkpoint", "max_moment_gib", "layer_groups", "tf32"});
  if (auto t = rt["tf32"]) c.tf32 = r.boolean(t, "runtime.tf32");
  if (auto d = rt["device"])
    c.device = r.choice<DeviceKind>(d, "runtime.device", {"auto", "cpu", "cuda"},
                                    {DeviceKind::auto_, DeviceKind::cpu, DeviceKind::cuda});
  if (auto g = rt["layer_groups"]) {
    int64_t v = 0;
    if (g.IsScalar() && g.Scalar() == "auto")
      c.layer_groups = 0;
    else if (!g.IsScalar() || !YAML::convert<int64_t>::decode(g, v) || v < 1 || v > 65536)
      r.fail(g, "runtime.layer_groups",
             "expected auto or an integer >= 1, got \"" + (g.IsScalar() ? g.Scalar() : "?") + "\"");
    else
      c.layer_groups = static_cast<int>(v);
  }
  if (auto b = rt["block_tokens"]) c.block_tokens = r.integer(b, "runtime.block_tokens", 1);
  if (auto m = rt["max_moment_gib"])
    c.max_moment_gib = number_where(r, m, "runtime.max_moment_gib", [](double v) { return v > 0; }, "must be > 0");
  if (auto ck = rt["checkpoint"]) {
    r.only_keys(ck, "runtime.checkpoint", {"dir", "every_shards", "mlp_seconds"});
    if (auto d = ck["dir"]) c.checkpoint.dir = r.path_relative_to_config(r.str(d, "runtime.checkpoint.dir"));
    if (auto e = ck["every_shards"]) c.checkpoint.every_shards = r.integer(e, "runtime.checkpoint.every_shards", 1);
    if (auto e = ck["mlp_seconds"]) c.checkpoint.mlp_seconds = r.integer(e, "runtime.checkpoint.mlp_seconds", 0);
  }
  return c;
}

}  // namespace

FitConfig parse_fit_config(const std::string& text, const std::string& path) {
  const YamlReader r{path};
  const YAML::Node root = r.load(text);
  FitConfig c;
  c.config_path = path;
  r.only_keys(root, "", {"source", "target", "calibration", "fit", "output", "runtime", "eval"});
  if (auto ev = root["eval"]) c.eval = parse_eval(r, ev);
  c.source.store = store(r, root, "source");
  c.target.store = store(r, root, "target");
  if (auto cal = root["calibration"]) c.calibration = parse_calibration(r, cal);
  if (auto fit = root["fit"]) c.fit = parse_fit(r, fit);
  if (!root["output"]) r.fail(root, "output", "missing (expected {dir: PATH})");
  r.only_keys(root["output"], "output", {"dir"});
  if (!root["output"]["dir"]) r.fail(root["output"], "output.dir", "missing (expected a path)");
  c.output.dir = r.path_relative_to_config(r.str(root["output"]["dir"], "output.dir"));
  if (auto rt = root["runtime"]) c.runtime = parse_runtime(r, rt);
  return c;
}

FitConfig load_fit_config(const std::string& path) {
  std::ifstream in(path);
  if (!in) throw ConfigError(path + ": cannot open config file");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_fit_config(ss.str(), path);
}

}  // namespace crosskv
