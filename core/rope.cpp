#include "core/rope.hpp"

#include <algorithm>
#include <cmath>

#include "core/error.hpp"

namespace crosskv {
namespace {

double require(const std::optional<double>& v, const char* key, const std::string& type, const std::string& where,
               const std::string& at) {
  if (!v) throw InputError(where + ": rope type \"" + type + "\" needs " + at + "." + key);
  return *v;
}

std::vector<double> default_inv_freq(double theta, int r) {
  std::vector<double> f(r / 2);
  for (int i = 0; i < r / 2; ++i) f[i] = 1.0 / std::pow(theta, (2.0 * i) / r);
  return f;
}

}  // namespace

double yarn_get_mscale(double scale, double mscale) {
  return scale <= 1.0 ? 1.0 : 0.1 * mscale * std::log(scale) + 1.0;
}

RopeTable::RopeTable(const RopeSpec& r, int head_dim, const std::string& where, const std::string& at)
    : head_dim_(head_dim), rotary_dim_(r.rotary_dim), convention_(r.convention) {
  if (rotary_dim_ <= 0) rotary_dim_ = head_dim_;
  const int dim = rotary_dim_;
  if (r.type == "none") {
    identity_ = true;
    return;
  }
  if (r.type == "default") {
    inv_freq_ = default_inv_freq(r.theta, dim);
  } else if (r.type == "linear") {
    double factor = require(r.factor, "factor", r.type, where, at);
    inv_freq_ = default_inv_freq(r.theta, dim);
    for (double& f : inv_freq_) f /= factor;
  } else if (r.type == "llama3") {
    double factor = require(r.factor, "factor", r.type, where, at);
    double low = require(r.low_freq_factor, "low_freq_factor", r.type, where, at);
    double high = require(r.high_freq_factor, "high_freq_factor", r.type, where, at);
    double orig = require(r.original_max_position_embeddings, "original_max_position_embeddings", r.type, where, at);
    inv_freq_ = default_inv_freq(r.theta, dim);
    const double low_wl = orig / low, high_wl = orig / high;
    for (double& f : inv_freq_) {
      const double wl = 2.0 * M_PI / f;
      if (wl < high_wl) continue;
      if (wl > low_wl) {
        f = f / factor;
      } else {
        const double s = (orig / wl - low) / (high - low);
        f = (1.0 - s) * f / factor + s * f;
      }
    }
  } else if (r.type == "yarn") {
    double factor = require(r.factor, "factor", r.type, where, at);
    double orig = require(r.original_max_position_embeddings, "original_max_position_embeddings", r.type, where, at);
    double beta_fast = r.beta_fast.value_or(32.0), beta_slow = r.beta_slow.value_or(1.0);
    if (r.attention_factor) {
      attention_factor_ = *r.attention_factor;
    } else if (r.mscale && r.mscale_all_dim && *r.mscale != 0.0 && *r.mscale_all_dim != 0.0) {
      attention_factor_ = yarn_get_mscale(factor, *r.mscale) / yarn_get_mscale(factor, *r.mscale_all_dim);
    } else {
      attention_factor_ = yarn_get_mscale(factor, 1.0);
    }
    auto correction_dim = [&](double rotations) {
      return (dim * std::log(orig / (rotations * 2.0 * M_PI))) / (2.0 * std::log(r.theta));
    };
    double lo = correction_dim(beta_fast), hi = correction_dim(beta_slow);
    if (r.truncate) {
      lo = std::floor(lo);
      hi = std::ceil(hi);
    }
    lo = std::max(lo, 0.0);
    hi = std::min(hi, static_cast<double>(dim - 1));
    if (lo == hi) hi += 0.001;
    inv_freq_.resize(dim / 2);
    for (int i = 0; i < dim / 2; ++i) {
      const double pos_freq = std::pow(r.theta, (2.0 * i) / dim);
      const double extrapolation = 1.0 / pos_freq, interpolation = 1.0 / (factor * pos_freq);
      const double ramp = std::clamp((i - lo) / (hi - lo), 0.0, 1.0);
      const double extrapolation_weight = 1.0 - ramp;
      inv_freq_[i] = interpolation * (1.0 - extrapolation_weight) + extrapolation * extrapolation_weight;
    }
  } else if (r.type == "dynamic") {
    throw InputError(where + ": rope type \"dynamic\" is not supported (its frequencies depend on the sequence "
                             "length, so a position-free mapper cannot be fitted)");
  } else {
    throw InputError(where + ": unknown rope type \"" + r.type +
                     "\" (expected default, linear, llama3, yarn or none)");
  }
  // Hugging Face keeps inv_freq as an fp32 buffer; round the same way so stripping matches the model.
  for (double& f : inv_freq_) f = static_cast<double>(static_cast<float>(f));
  for (size_t i = 0; i < inv_freq_.size(); ++i)
    if (!std::isfinite(inv_freq_[i]) || !(inv_freq_[i] > 0.0))
      throw InputError(where + ": " + at + " (type \"" + r.type + "\", theta " + std::to_string(r.theta) +
                       ") gives frequency " + std::to_string(inv_freq_[i]) + " for dimension pair " + std::to_string(i) +
                       " (expected finite and > 0)");
  if (!std::isfinite(attention_factor_) || !(attention_factor_ > 0.0))
    throw InputError(where + ": " + at + " gives attention factor " + std::to_string(attention_factor_) +
                     " (expected finite and > 0)");
}

void RopeTable::angles(int64_t pos, float* c, float* s) const {
  const int h = rotary_dim_ / 2;
  for (int i = 0; i < h; ++i) {
    const double a = static_cast<double>(pos) * inv_freq_[i];
    c[i] = static_cast<float>(std::cos(a));
    s[i] = static_cast<float>(std::sin(a));
  }
}

template <bool Strip>
void RopeTable::rotate_head(float* x, const float* c, const float* s) const {
  const int h = rotary_dim_ / 2;
  const float a = static_cast<float>(attention_factor_);
  const float inv_a = static_cast<float>(1.0 / attention_factor_);
  // Pair (i, j): half -> (i, i+h); interleaved -> (2i, 2i+1).
  const int stride_pair = convention_ == RopeConvention::half ? h : 1;
  const int step = convention_ == RopeConvention::half ? 1 : 2;
  for (int i = 0; i < h; ++i) {
    float* x1 = x + i * step;
    float* x2 = x1 + stride_pair;
    const float u = *x1, v = *x2;
    if constexpr (Strip) {
      *x1 = (u * c[i] + v * s[i]) * inv_a;
      *x2 = (v * c[i] - u * s[i]) * inv_a;
    } else {
      *x1 = a * (u * c[i] - v * s[i]);
      *x2 = a * (v * c[i] + u * s[i]);
    }
  }
  // Dims >= rotary_dim pass through (attention_factor applies to the rotated part only, as in HF cos/sin scaling).
}

void RopeTable::apply_head(float* x, const float* c, const float* s) const {
  if (!identity_) rotate_head<false>(x, c, s);
}
void RopeTable::strip_head(float* x, const float* c, const float* s) const {
  if (!identity_) rotate_head<true>(x, c, s);
}

bool RopeTable::same_rotation(const RopeTable& o) const {
  return identity_ == o.identity_ && rotary_dim_ == o.rotary_dim_ && convention_ == o.convention_ &&
         attention_factor_ == o.attention_factor_ && inv_freq_ == o.inv_freq_;
}

template <bool Strip>
void RopeTable::rotate_rows(float* data, int64_t tokens, int64_t heads, int64_t ld, const int32_t* positions) const {
  if (identity_) return;
  std::vector<float> c(rotary_dim_ / 2), s(rotary_dim_ / 2);
  for (int64_t t = 0; t < tokens; ++t) {
    angles(positions[t], c.data(), s.data());
    float* row = data + t * ld;
    for (int64_t h = 0; h < heads; ++h) rotate_head<Strip>(row + h * head_dim_, c.data(), s.data());
  }
}
template void RopeTable::rotate_rows<true>(float*, int64_t, int64_t, int64_t, const int32_t*) const;
template void RopeTable::rotate_rows<false>(float*, int64_t, int64_t, int64_t, const int32_t*) const;

Rope::Rope(const KvSpec& spec, const std::string& where) : head_dim_(spec.head_dim), n_kv_heads_(spec.n_kv_heads) {
  tables_.emplace_back(spec.rope, spec.head_dim, where);
  of_layer_.assign(static_cast<size_t>(spec.n_layers), 0);
  for (int l = 0; l < static_cast<int>(spec.layers.size()); ++l) {
    RopeTable t(spec.layers[l].rope, spec.head_dim, where, "kv_spec.layers[" + std::to_string(l) + "].rope");
    auto same = std::find_if(tables_.begin(), tables_.end(), [&](const RopeTable& u) { return u.same_rotation(t); });
    of_layer_[l] = static_cast<int>(same - tables_.begin());
    if (same == tables_.end()) tables_.push_back(std::move(t));
  }
}

bool Rope::identity() const {
  for (int i : of_layer_)
    if (!tables_[i].identity()) return false;
  return true;
}

std::vector<Rope::Run> Rope::runs(const LayerHeads& lh) const {
  CROSSKV_ASSERT(lh.first >= 0 && lh.count >= 0 && lh.first + lh.count <= n_layers(),
                 "Rope: layers " + std::to_string(lh.first) + " + " + std::to_string(lh.count) + " of " +
                     std::to_string(n_layers()));
  std::vector<Run> out;
  for (int l = lh.first; l < lh.first + lh.count; ++l) {
    if (!out.empty() && of_layer_[l] == of_layer_[l - 1]) ++out.back().count;
    else out.push_back({l, 1, &tables_[of_layer_[l]]});
  }
  return out;
}

template <bool Strip>
void Rope::rotate_block(float* data, int64_t tokens, const LayerHeads& lh, const int32_t* positions) const {
  const int64_t ld = lh.count * lh.heads * head_dim_;
  for (const Run& r : runs(lh))
    r.table->rotate_rows<Strip>(data + (r.first - lh.first) * lh.heads * head_dim_, tokens, r.count * lh.heads, ld,
                                positions);
}

void Rope::apply_block(float* d, int64_t t, const LayerHeads& lh, const int32_t* p) const {
  rotate_block<false>(d, t, lh, p);
}
void Rope::strip_block(float* d, int64_t t, const LayerHeads& lh, const int32_t* p) const {
  rotate_block<true>(d, t, lh, p);
}

}  // namespace crosskv
