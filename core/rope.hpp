#pragma once
// Rotary position embedding (docs/METHOD.md, RoPE): inverse frequencies per rope type, and apply/strip on [T, L, H, D] blocks.
#include <cstdint>
#include <vector>

#include "core/kv_spec.hpp"

namespace crosskv {

class Rope {
 public:
  // Throws InputError for `dynamic` and unknown types; `where` names the file for the message.
  Rope(const KvSpec& spec, const std::string& where = "kv_spec");

  const std::vector<double>& inv_freq() const { return inv_freq_; }
  double attention_factor() const { return attention_factor_; }
  bool identity() const { return identity_; }
  int half() const { return rotary_dim_ / 2; }
  int head_dim() const { return head_dim_; }
  int rotary_dim() const { return rotary_dim_; }
  RopeConvention convention() const { return convention_; }

  // cos/sin of position `pos` for each frequency (rotary_dim/2 values each); angles in fp64.
  void angles(int64_t pos, float* cos_out, float* sin_out) const;
  // One head vector of head_dim values, in place.
  void apply_head(float* x, const float* cos, const float* sin) const;
  void strip_head(float* x, const float* cos, const float* sin) const;
  // A block [T, heads_per_token, head_dim] (heads_per_token = L*H), in place.
  void apply_block(float* data, int64_t tokens, int64_t heads_per_token, const int32_t* positions) const;
  void strip_block(float* data, int64_t tokens, int64_t heads_per_token, const int32_t* positions) const;

 private:
  template <bool Strip>
  void rotate_block(float* data, int64_t tokens, int64_t heads_per_token, const int32_t* positions) const;
  template <bool Strip>
  void rotate_head(float* x, const float* cos, const float* sin) const;

  int head_dim_;
  int rotary_dim_;
  RopeConvention convention_;
  bool identity_ = false;
  double attention_factor_ = 1.0;
  std::vector<double> inv_freq_;
};

// HF's get_mscale: 1 if scale <= 1 else 0.1*m*ln(scale)+1.
double yarn_get_mscale(double scale, double mscale);

}  // namespace crosskv
