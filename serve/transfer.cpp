#include "serve/transfer.hpp"

#include <algorithm>

#include "core/rope.hpp"

namespace crosskv {

Transfer::Transfer(const std::string& mapper_dir, ServingKernels& be, TransferOptions opts)
    : m_(read_mapper_manifest(mapper_dir)), be_(be), opts_(opts), verified_(m_.target.n_layers, false) {
  // Both RoPE settings are checked (dynamic and unknown types are refused) before any data is touched.
  Rope(m_.source, m_.path + " (source.kv_spec)");
  Rope(m_.target, m_.path + " (target.kv_spec)");
}

void Transfer::map_windows(const ContentBatch& b) {
  const int Lt = m_.target.n_layers;
  check_target_layers(b.layers, Lt);
  if (opts_.resident) {
    if (!resident_) {
      resident_ = std::make_unique<ServingMapper>(m_.dir, be_, opts_.verify);
      loads_ += Lt;
    }
    resident_->map_content_host(b);
    return;
  }
  const int64_t G = m_.target.features_per_layer(), YW = b.layers.size(Lt) * G;
  one_k_.resize(b.rows * G), one_v_.resize(b.rows * G);
  for (int l = b.layers.first; l < b.layers.end(Lt); ++l) {
    std::vector<MapperLayer> one;
    one.push_back(load_mapper_layer(m_, l, opts_.verify && !verified_[l]));
    verified_[l] = true;
    ++loads_;
    ServingMapper window(m_, std::move(one), be_, {}, {l, 1});
    ContentBatch c = b;
    c.layers = {l, 1};
    c.out_keys = b.out_keys ? one_k_.data() : nullptr, c.out_values = b.out_values ? one_v_.data() : nullptr;
    window.map_content_host(c);
    const int64_t at = (l - b.layers.first) * G;
    for (auto [from, to] : {std::pair{c.out_keys, b.out_keys}, std::pair{c.out_values, b.out_values}})
      if (to)
        for (int64_t t = 0; t < b.rows; ++t) std::copy_n(from + t * G, G, to + t * YW + at);
  }
}

void Transfer::map_content(Kind kind, const float* X, int64_t rows, float* out) {
  ContentBatch c;
  c.rows = rows;
  const bool keys = kind == Kind::k;
  CROSSKV_ASSERT(kind != Kind::k_rope, "raw keys are never mapped");
  (keys ? c.keys : c.values) = X;
  (keys ? c.out_keys : c.out_values) = out;
  map_windows(c);
}

void Transfer::map_content(const float* Xk, const float* Xv, int64_t rows, float* out_k, float* out_v,
                           TargetLayers layers) {
  ContentBatch c;
  c.keys = Xk, c.values = Xv, c.rows = rows, c.out_keys = out_k, c.out_values = out_v, c.layers = layers;
  map_windows(c);
}

void Transfer::apply(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos,
                     int64_t rows, float* out_keys, float* out_values, TargetLayers layers) {
  check_target_layers(layers, m_.target.n_layers);
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  content_.assign(keys, keys + rows * XW);
  const Rope source_rope(m_.source);
  source_rope.strip_block(content_.data(), rows, source_rope.all(), src_pos);
  map_content(content_.data(), values, rows, out_keys, out_values, layers);
  if (opts_.target_rope)
    Rope(m_.target).apply_block(out_keys, rows, {layers.first, layers.size(m_.target.n_layers), m_.target.n_kv_heads},
                                tgt_pos);
}

}  // namespace crosskv
