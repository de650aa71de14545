#include "core/kv_spec.hpp"

#include <cmath>
#include <sstream>

#include <nlohmann/json.hpp>

#include "core/error.hpp"

namespace crosskv {
namespace {

std::optional<double> opt_number(const nlohmann::json& j, const char* key, const std::string& where) {
  if (!j.contains(key) || j.at(key).is_null()) return std::nullopt;
  if (!j.at(key).is_number())
    throw InputError(where + ": kv_spec.rope." + key + " must be a number or null");
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
                 const std::string& where) {
  if (!v) return;  // a missing parameter the type needs is named by Rope()
  const bool ok = std::isfinite(*v) && (inclusive ? *v >= min : *v > min);
  if (!ok)
    throw InputError(where + ": kv_spec.rope." + key + " must be a finite number " + (inclusive ? ">= " : "> ") +
                     number_text(min) + " for rope type \"" + type + "\", got " + number_text(*v));
}

// Every parameter the rope type reads, so that no frequency comes out 0, negative, infinite or NaN (docs/METHOD.md, RoPE).
void validate_rope(const RopeSpec& r, const std::string& where) {
  const std::string& t = r.type;
  if (t == "none") return;
  check_param(r.theta, "theta", 1.0, false, t, where);
  if (t == "linear" || t == "llama3" || t == "yarn") check_param(r.factor, "factor", 0.0, false, t, where);
  if (t == "llama3" || t == "yarn")
    check_param(r.original_max_position_embeddings, "original_max_position_embeddings", 0.0, false, t, where);
  if (t == "llama3") {
    check_param(r.low_freq_factor, "low_freq_factor", 0.0, false, t, where);
    check_param(r.high_freq_factor, "high_freq_factor", 0.0, false, t, where);
    if (r.low_freq_factor && r.high_freq_factor && !(*r.high_freq_factor > *r.low_freq_factor))
      throw InputError(where + ": kv_spec.rope.high_freq_factor must be greater than low_freq_factor for rope type "
                               "\"llama3\", got " + number_text(*r.high_freq_factor) + " and " +
                       number_text(*r.low_freq_factor));
  }
  if (t == "yarn") {
    check_param(r.beta_fast, "beta_fast", 0.0, false, t, where);
    check_param(r.beta_slow, "beta_slow", 0.0, false, t, where);
    check_param(r.mscale, "mscale", 0.0, true, t, where);
    check_param(r.mscale_all_dim, "mscale_all_dim", 0.0, true, t, where);
    check_param(r.attention_factor, "attention_factor", 0.0, false, t, where);
  }
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
  if (!j.contains("rope") || !j["rope"].is_object())
    throw InputError(where + ": kv_spec.rope must be an object");
  const auto& r = j["rope"];
  if (!r.contains("type") || !r["type"].is_string()) throw InputError(where + ": kv_spec.rope.type must be a string");
  s.rope.type = r["type"].get<std::string>();
  if (auto theta = opt_number(r, "theta", where)) s.rope.theta = *theta;
  s.rope.rotary_dim = s.head_dim;
  if (r.contains("rotary_dim") && !r["rotary_dim"].is_null()) {
    if (!r["rotary_dim"].is_number_integer()) throw InputError(where + ": kv_spec.rope.rotary_dim must be an integer");
    s.rope.rotary_dim = r["rotary_dim"].get<int>();
  }
  if (s.rope.rotary_dim <= 0 || s.rope.rotary_dim > s.head_dim || s.rope.rotary_dim % 2 != 0)
    throw InputError(where + ": kv_spec.rope.rotary_dim must be even and in (0, head_dim]");
  std::string conv = r.contains("convention") && r["convention"].is_string() ? r["convention"].get<std::string>() : "half";
  if (conv == "half") s.rope.convention = RopeConvention::half;
  else if (conv == "interleaved") s.rope.convention = RopeConvention::interleaved;
  else throw InputError(where + ": kv_spec.rope.convention must be \"half\" or \"interleaved\", got \"" + conv + "\"");
  s.rope.factor = opt_number(r, "factor", where);
  s.rope.low_freq_factor = opt_number(r, "low_freq_factor", where);
  s.rope.high_freq_factor = opt_number(r, "high_freq_factor", where);
  s.rope.original_max_position_embeddings = opt_number(r, "original_max_position_embeddings", where);
  s.rope.beta_fast = opt_number(r, "beta_fast", where);
  s.rope.beta_slow = opt_number(r, "beta_slow", where);
  s.rope.mscale = opt_number(r, "mscale", where);
  s.rope.mscale_all_dim = opt_number(r, "mscale_all_dim", where);
  s.rope.attention_factor = opt_number(r, "attention_factor", where);
  if (r.contains("truncate") && r["truncate"].is_boolean()) s.rope.truncate = r["truncate"].get<bool>();
  validate_rope(s.rope, where);
  return s;
}

nlohmann::json kv_spec_to_json(const KvSpec& s) {
  auto opt = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  nlohmann::json rope = {
      {"type", s.rope.type},
      {"theta", s.rope.theta},
      {"rotary_dim", s.rope.rotary_dim},
      {"convention", s.rope.convention == RopeConvention::half ? "half" : "interleaved"},
      {"factor", opt(s.rope.factor)},
      {"low_freq_factor", opt(s.rope.low_freq_factor)},
      {"high_freq_factor", opt(s.rope.high_freq_factor)},
      {"original_max_position_embeddings", opt(s.rope.original_max_position_embeddings)},
      {"beta_fast", opt(s.rope.beta_fast)},
      {"beta_slow", opt(s.rope.beta_slow)},
      {"mscale", opt(s.rope.mscale)},
      {"mscale_all_dim", opt(s.rope.mscale_all_dim)},
      {"attention_factor", opt(s.rope.attention_factor)},
      {"truncate", s.rope.truncate}};
  return {{"n_layers", s.n_layers},
          {"n_kv_heads", s.n_kv_heads},
          {"head_dim", s.head_dim},
          {"n_q_heads", s.n_q_heads},
          {"rope", rope}};
}

std::string kv_spec_to_string(const KvSpec& s) { return kv_spec_to_json(s).dump(); }

bool operator==(const KvSpec& a, const KvSpec& b) { return kv_spec_to_json(a) == kv_spec_to_json(b); }

}  // namespace crosskv
