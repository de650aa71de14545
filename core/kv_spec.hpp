#pragma once
// The model's KV layout and RoPE settings (docs/METHOD.md, RoPE and docs/FORMATS.md, Calibration shards kv_spec).
#include <cmath>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace crosskv {

enum class RopeConvention { half, interleaved };

struct RopeSpec {
  std::string type = "default";  // default | linear | llama3 | yarn | none
  double theta = 10000.0;
  int rotary_dim = 0;  // 0 -> head_dim
  RopeConvention convention = RopeConvention::half;
  std::optional<double> factor, low_freq_factor, high_freq_factor, original_max_position_embeddings;
  std::optional<double> beta_fast, beta_slow, mscale, mscale_all_dim, attention_factor;
  bool truncate = true;
};

enum class Attention { full, sliding };

// One layer where it differs from the model's default: its attention (sliding with its window) and its RoPE
// (Gemma 3's local layers rotate with another theta). Layers share head_dim, rotary_dim and convention.
struct LayerSpec {
  Attention attention = Attention::full;
  int window = 0;  // tokens a sliding layer attends to (its own included); 0 for full attention
  RopeSpec rope;
};

struct KvSpec {
  int n_layers = 0;
  int n_kv_heads = 0;
  int head_dim = 0;
  int n_q_heads = 0;
  RopeSpec rope;                  // the default layer's
  std::vector<LayerSpec> layers;  // n_layers entries, or empty: every layer full attention with `rope`
  std::optional<double> query_scale;  // the attention's score scale where it is not 1/sqrt(head_dim) (Gemma)

  long long features_per_layer() const { return static_cast<long long>(n_kv_heads) * head_dim; }
  const RopeSpec& layer_rope(int layer) const { return layers.empty() ? rope : layers.at(layer).rope; }
  Attention attention(int layer) const { return layers.empty() ? Attention::full : layers.at(layer).attention; }
  int window(int layer) const { return layers.empty() ? 0 : layers.at(layer).window; }
  double attention_scale() const { return query_scale ? *query_scale : 1.0 / std::sqrt(static_cast<double>(head_dim)); }
};

// Parses a kv_spec JSON string; `where` names the file for error messages.
KvSpec parse_kv_spec(const std::string& json_text, const std::string& where);
nlohmann::json kv_spec_to_json(const KvSpec& spec);
std::string kv_spec_to_string(const KvSpec& spec);
bool operator==(const KvSpec& a, const KvSpec& b);
inline bool operator!=(const KvSpec& a, const KvSpec& b) { return !(a == b); }

}  // namespace crosskv
