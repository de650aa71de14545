#include "core/kv_spec.hpp"

#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace crosskv {
namespace {

std::optional<double> opt_number(const nlohmann::json& j, const char* key, const std::string& where,
                                 const std::string& at) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  if (!j.at(key).is_number()) throw InputError(where + ": " + at + "." + key + " must be a number or null");
  return j.at(key).get<double>();
}

int positive_int(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || !j.at(key).is_number_integer() || j.at(key).get<long long>() <= 0)
    throw InputError(where + ": kv_spec." + key + " must be a positive integer");
  return j.at(key).get<int>();
}

std::string number_text(double v) {
  std::ostringstream os;
  os << v;
  return os.str();
}

// A rope parameter that the frequencies use: finite and above `min` (or at least, with `inclusive`).
void check_param(const std::optional<double>& v, const char* key, double min, bool inclusive, const std::string& type,
                 const std::string& where, const std::string& at) {
  if (!v) return;  // a missing parameter the type needs is named by Rope()
  const bool ok = std::isfinite(*v) && (inclusive ? *v >= min : *v > min);
  if (!ok)
    throw InputError(where + ": " + at + "." + key + " must be a finite number " + (inclusive ? ">= " : "> ") +
                     number_text(min) + " for rope type \"" + type + "\", got " + number_text(*v));
}

// Every parameter the rope type reads, so that no frequency comes out 0, negative, infinite or NaN (docs/METHOD.md, RoPE).
void validate_rope(const RopeSpec& r, const std::string& where, const std::string& at) {
  const std::string& t = r.type;
  if (t == "none") return;
  check_param(r.theta, "theta", 1.0, false, t, where, at);
  if (t == "linear" || t == "llama3" || t == "yarn") check_param(r.factor, "factor", 0.0, false, t, where, at);
  if (t == "llama3" || t == "yarn")
    check_param(r.original_max_position_embeddings, "original_max_position_embeddings", 0.0, false, t, where, at);
  if (t == "llama3") {
    check_param(r.low_freq_factor, "low_freq_factor", 0.0, false, t, where, at);
    check_param(r.high_freq_factor, "high_freq_factor", 0.0, false, t, where, at);
    if (r.low_freq_factor && r.high_freq_factor && !(*r.high_freq_factor > *r.low_freq_factor))
      throw InputError(where + ": " + at + ".high_freq_factor must be greater than low_freq_factor for rope type "
                               "\"llama3\", got " + number_text(*r.high_freq_factor) + " and " +
                       number_text(*r.low_freq_factor));
  }
  if (t == "yarn") {
    check_param(r.beta_fast, "beta_fast", 0.0, false, t, where, at);
    check_param(r.beta_slow, "beta_slow", 0.0, false, t, where, at);
    check_param(r.mscale, "mscale", 0.0, true, t, where, at);
    check_param(r.mscale_all_dim, "mscale_all_dim", 0.0, true, t, where, at);
    check_param(r.attention_factor, "attention_factor", 0.0, false, t, where, at);
  }
}

nlohmann::json rope_to_json(const RopeSpec& r) {
  auto opt = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  return {{"type", r.type},
          {"theta", r.theta},
          {"rotary_dim", r.rotary_dim},
          {"convention", r.convention == RopeConvention::half ? "half" : "interleaved"},
          {"factor", opt(r.factor)},
          {"low_freq_factor", opt(r.low_freq_factor)},
          {"high_freq_factor", opt(r.high_freq_factor)},
          {"original_max_position_embeddings", opt(r.original_max_position_embeddings)},
          {"beta_fast", opt(r.beta_fast)},
          {"beta_slow", opt(r.beta_slow)},
          {"mscale", opt(r.mscale)},
          {"mscale_all_dim", opt(r.mscale_all_dim)},
          {"attention_factor", opt(r.attention_factor)},
          {"truncate", r.truncate}};
}

// The RoPE object `key` of `j`; `at` names it in messages (kv_spec.rope, kv_spec.layers[3].rope).
RopeSpec parse_rope(const nlohmann::json& j, const char* key, int head_dim, const std::string& where,
                    const std::string& at) {
  if (!j.contains(key) || !j[key].is_object()) throw InputError(where + ": " + at + " must be an object");
  const auto& r = j[key];
  RopeSpec rope;
  if (!r.contains("type") || !r["type"].is_string()) throw InputError(where + ": " + at + ".type must be a string");
  rope.type = r["type"].get<std::string>();
  if (auto theta = opt_number(r, "theta", where, at)) rope.theta = *theta;
  rope.rotary_dim = head_dim;
  if (r.contains("rotary_dim") && !r["rotary_dim"].is_null()) {
    if (!r["rotary_dim"].is_number_integer()) throw InputError(where + ": " + at + ".rotary_dim must be an integer");
    rope.rotary_dim = r["rotary_dim"].get<int>();
  }
  if (rope.rotary_dim <= 0 || rope.rotary_dim > head_dim || rope.rotary_dim % 2 != 0)
    throw InputError(where + ": " + at + ".rotary_dim must be even and in (0, head_dim]");
  std::string conv = r.contains("convention") && r["convention"].is_string() ? r["convention"].get<std::string>() : "half";
  if (conv == "half") rope.convention = RopeConvention::half;
  else if (conv == "interleaved") rope.convention = RopeConvention::interleaved;
  else throw InputError(where + ": " + at + ".convention must be \"half\" or \"interleaved\", got \"" + conv + "\"");
  rope.factor = opt_number(r, "factor", where, at);
  rope.low_freq_factor = opt_number(r, "low_freq_factor", where, at);
  rope.high_freq_factor = opt_number(r, "high_freq_factor", where, at);
  rope.original_max_position_embeddings = opt_number(r, "original_max_position_embeddings", where, at);
  rope.beta_fast = opt_number(r, "beta_fast", where, at);
  rope.beta_slow = opt_number(r, "beta_slow", where, at);
  rope.mscale = opt_number(r, "mscale", where, at);
  rope.mscale_all_dim = opt_number(r, "mscale_all_dim", where, at);
  rope.attention_factor = opt_number(r, "attention_factor", where, at);
  if (r.contains("truncate") && r["truncate"].is_boolean()) rope.truncate = r["truncate"].get<bool>();
  validate_rope(rope, where, at);
  return rope;
}

std::string attention_name(Attention a) { return a == Attention::sliding ? "sliding" : "full"; }

// kv_spec.layers: one object per layer ({attention, window, rope}; rope absent: the default). Layers that all equal
// the default read as none (so a spec written with them compares equal to one written without).
std::vector<LayerSpec> parse_layers(const nlohmann::json& j, const KvSpec& s, const std::string& where) {
  if (!j.is_array() || static_cast<int>(j.size()) != s.n_layers)
    throw InputError(where + ": kv_spec.layers must be an array of n_layers (" + std::to_string(s.n_layers) +
                     ") objects");
  std::vector<LayerSpec> out(s.n_layers);
  bool any = false;
  for (int l = 0; l < s.n_layers; ++l) {
    const std::string at = "kv_spec.layers[" + std::to_string(l) + "]";
    const auto& o = j[l];
    if (!o.is_object()) throw InputError(where + ": " + at + " must be an object");
    LayerSpec& ls = out[l];
    const std::string kind = o.contains("attention") && o["attention"].is_string() ? o["attention"].get<std::string>()
                                                                                      : "";
    if (kind == "sliding") ls.attention = Attention::sliding;
    else if (kind != "full")
      throw InputError(where + ": " + at + ".attention must be \"full\" or \"sliding\", got " +
                       (o.contains("attention") ? o["attention"].dump() : "nothing"));
    if (ls.attention == Attention::sliding) {
      if (!o.contains("window") || !o["window"].is_number_integer() || o["window"].get<long long>() <= 0)
        throw InputError(where + ": " + at + ".window must be a positive integer for a sliding layer");
      ls.window = o["window"].get<int>();
    } else if (o.contains("window") && !o["window"].is_null()) {
      throw InputError(where + ": " + at + ".window must be null for a full-attention layer");
    }
    ls.rope = o.contains("rope") ? parse_rope(o, "rope", s.head_dim, where, at + ".rope") : s.rope;
    if (ls.rope.rotary_dim != s.rope.rotary_dim || ls.rope.convention != s.rope.convention)
      throw InputError(where + ": " + at + ".rope has rotary_dim " + std::to_string(ls.rope.rotary_dim) +
                       " and convention " + (ls.rope.convention == RopeConvention::half ? "half" : "interleaved") +
                       ", kv_spec.rope " + std::to_string(s.rope.rotary_dim) + " and " +
                       (s.rope.convention == RopeConvention::half ? "half" : "interleaved") +
                       " (layers may differ in attention and in RoPE frequencies only)");
    any = any || ls.attention != Attention::full || rope_to_json(ls.rope) != rope_to_json(s.rope);
  }
  if (!any) out.clear();
  return out;
}

}  // namespace

KvSpec parse_kv_spec(const std::string& json_text, const std::string& where) {
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(json_text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(where + ": attribute kv_spec is not valid JSON (" + e.what() + ")");
  }
  if (!j.is_object()) throw InputError(where + ": attribute kv_spec must be a JSON object");
  KvSpec s;
  s.n_layers = positive_int(j, "n_layers", where);
  s.n_kv_heads = positive_int(j, "n_kv_heads", where);
  s.head_dim = positive_int(j, "head_dim", where);
  s.n_q_heads = j.contains("n_q_heads") && j["n_q_heads"].is_number_integer() ? j["n_q_heads"].get<int>()
                                                                                : s.n_kv_heads;
  s.rope = parse_rope(j, "rope", s.head_dim, where, "kv_spec.rope");
  if (j.contains("layers") && !j["layers"].is_null()) s.layers = parse_layers(j["layers"], s, where);
  if (j.contains("query_scale") && !j["query_scale"].is_null()) {
    const nlohmann::json& q = j["query_scale"];
    if (!q.is_number() || !(q.get<double>() > 0) || !std::isfinite(q.get<double>()))
      throw InputError(where + ": kv_spec.query_scale must be a positive number (the attention's score scale)");
    // The default scale is no field, so a spec that states it reads (and writes) as one that does not.
    if (std::abs(q.get<double>() * std::sqrt(static_cast<double>(s.head_dim)) - 1.0) > 1e-12)
      s.query_scale = q.get<double>();
  }
  return s;
}

nlohmann::json kv_spec_to_json(const KvSpec& s) {
  nlohmann::json j = {{"n_layers", s.n_layers},
                      {"n_kv_heads", s.n_kv_heads},
                      {"head_dim", s.head_dim},
                      {"n_q_heads", s.n_q_heads},
                      {"rope", rope_to_json(s.rope)}};
  if (!s.layers.empty()) {
    nlohmann::json layers = nlohmann::json::array();
    for (const LayerSpec& l : s.layers)
      layers.push_back({{"attention", attention_name(l.attention)},
                        {"window", l.attention == Attention::sliding ? nlohmann::json(l.window) : nlohmann::json()},
                        {"rope", rope_to_json(l.rope)}});
    j["layers"] = std::move(layers);
  }
  if (s.query_scale) j["query_scale"] = *s.query_scale;
  return j;
}

std::string kv_spec_to_string(const KvSpec& s) { return kv_spec_to_json(s).dump(); }

bool operator==(const KvSpec& a, const KvSpec& b) { return kv_spec_to_json(a) == kv_spec_to_json(b); }

}  // namespace crosskv
