#pragma once
// Rotary position embedding (docs/METHOD.md, RoPE): inverse frequencies per rope type, layer by layer, and
// apply/strip on [tokens, layers, heads, head_dim] blocks.
#include <cstdint>
#include <string>
#include <vector>

#include "core/kv_spec.hpp"

namespace crosskv {

// One RoPE's rotation (a RopeSpec's frequencies at one head_dim).
class RopeTable {
 public:
  // Throws InputError for `dynamic` and unknown types; `where` names the file, `at` the spec's key.
  RopeTable(const RopeSpec& rope, int head_dim, const std::string& where, const std::string& at = "kv_spec.rope");

  const std::vector<double>& inv_freq() const { return inv_freq_; }
  double attention_factor() const { return attention_factor_; }
  bool identity() const { return identity_; }
  int half() const { return rotary_dim_ / 2; }
  int head_dim() const { return head_dim_; }
  int rotary_dim() const { return rotary_dim_; }
  RopeConvention convention() const { return convention_; }
  bool same_rotation(const RopeTable& o) const;

  // cos/sin of position `pos` for each frequency (rotary_dim/2 values each); angles in fp64.
  void angles(int64_t pos, float* cos_out, float* sin_out) const;
  // One head vector of head_dim values, in place.
  void apply_head(float* x, const float* cos, const float* sin) const;
  void strip_head(float* x, const float* cos, const float* sin) const;
  // `heads` consecutive heads of each of `tokens` rows, row t at data + t * ld, in place.
  template <bool Strip>
  void rotate_rows(float* data, int64_t tokens, int64_t heads, int64_t ld, const int32_t* positions) const;

 private:
  template <bool Strip>
  void rotate_head(float* x, const float* cos, const float* sin) const;

  int head_dim_;
  int rotary_dim_;
  RopeConvention convention_;
  bool identity_ = false;
  double attention_factor_ = 1.0;
  std::vector<double> inv_freq_;
};

// A block's layers: `count` layers from `first`, `heads` heads of each per token ([tokens, count, heads, head_dim]).
struct LayerHeads {
  int first = 0;
  int count = 0;
  int64_t heads = 0;
};

// A model's RoPE, layer by layer (KvSpec::layer_rope): one table per distinct rotation.
class Rope {
 public:
  Rope(const KvSpec& spec, const std::string& where = "kv_spec");

  int n_layers() const { return static_cast<int>(of_layer_.size()); }
  int head_dim() const { return head_dim_; }
  const RopeTable& layer(int l) const { return tables_[of_layer_.at(l)]; }
  bool identity() const;  // no layer rotates
  LayerHeads all() const { return {0, n_layers(), n_kv_heads_}; }
  LayerHeads one(int l) const { return {l, 1, n_kv_heads_}; }

  // Consecutive layers of `lh` that share one rotation (one run for a model whose layers all rotate alike).
  struct Run {
    int first, count;
    const RopeTable* table;
  };
  std::vector<Run> runs(const LayerHeads& lh) const;

  // A block [tokens, lh.count, lh.heads, head_dim], in place.
  void apply_block(float* data, int64_t tokens, const LayerHeads& lh, const int32_t* positions) const;
  void strip_block(float* data, int64_t tokens, const LayerHeads& lh, const int32_t* positions) const;

 private:
  template <bool Strip>
  void rotate_block(float* data, int64_t tokens, const LayerHeads& lh, const int32_t* positions) const;

  int head_dim_;
  int64_t n_kv_heads_;
  std::vector<RopeTable> tables_;
  std::vector<int> of_layer_;
};

// HF's get_mscale: 1 if scale <= 1 else 0.1*m*ln(scale)+1.
double yarn_get_mscale(double scale, double mscale);

}  // namespace crosskv
