#include "serve/transfer.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>

#include "core/error.hpp"
#include "core/host_kernels.hpp"
#include "core/rope.hpp"

namespace crosskv {

int64_t first_non_finite(const float* x, int64_t n) {
  constexpr int64_t kChunk = 4096;
  for (int64_t at = 0; at < n; at += kChunk) {
    const int64_t len = std::min(kChunk, n - at);
    uint32_t any = 0;  // an exponent of all ones (NaN or infinity) in the chunk
    for (int64_t i = 0; i < len; ++i) {
      uint32_t b;
      std::memcpy(&b, x + at + i, 4);
      any |= static_cast<uint32_t>((b & 0x7f800000u) == 0x7f800000u);
    }
    if (any)
      for (int64_t i = 0; i < len; ++i)
        if (!std::isfinite(x[at + i])) return at + i;
  }
  return -1;
}

void check_finite_caches(const float* keys, const float* values, int64_t values_per_token, int64_t rows) {
  for (auto [name, x] : {std::pair{"keys", keys}, std::pair{"values", values}}) {
    const int64_t i = first_non_finite(x, rows * values_per_token);
    if (i >= 0)
      throw InputError(std::string(name) + ": element " + std::to_string(i) + " (token " +
                       std::to_string(i / values_per_token) + ") is " + (std::isnan(x[i]) ? "NaN" : "infinite") +
                       "; a source cache must be finite (the request should re-prefill)");
  }
}

void map_gathered(DenseMaths& be, const float* X, int64_t K, const float* W, const float* b, int64_t G, int64_t rows,
                  float* Y, int64_t YW) {
  for (int64_t t = 0; t < rows; ++t) std::copy(b, b + G, Y + t * YW);
  be.matmul_acc(rows, K, G, X, K, W, G, Y, YW);
}

void map_one_layer(ComputeBackend& be, const float* X, int64_t XW, const std::vector<int>& layers, int64_t F,
                   const float* W, const float* b, int64_t G, int64_t rows, float* Y, int64_t YW,
                   std::vector<float>& scratch) {
  const int64_t K = static_cast<int64_t>(layers.size()) * F;
  if (layers.size() == 1) {  // one source layer: read in place
    for (int64_t t = 0; t < rows; ++t) std::copy(b, b + G, Y + t * YW);
    be.matmul_acc(rows, F, G, X + layers[0] * F, XW, W, G, Y, YW);
    return;
  }
  scratch.resize(rows * K);
  gather_layers_on_host(X, XW, layers, F, rows, scratch.data());
  map_gathered(be, scratch.data(), K, W, b, G, rows, Y, YW);
}

DenseMaths::BatchedGemm per_head_slot(const float* X, int64_t XW, int a, int j, int k, int heads, int64_t Ds,
                                      int64_t Dt, const float* W, int64_t rows, float* Y, int64_t YW,
                                      TargetHeads only) {
  DenseMaths::BatchedGemm g;
  g.m = rows, g.n = Dt, g.k = Ds, g.beta = 1.0f, g.batch = only.size(heads);
  g.A = X + (int64_t{a} * heads + only.first) * Ds, g.lda = XW, g.stride_a = Ds;
  g.B = W + int64_t{j} * Ds * Dt, g.ldb = Dt, g.stride_b = int64_t{k} * Ds * Dt;
  g.C = Y, g.ldc = YW, g.stride_c = Dt;
  return g;
}

void add_residual_mlp(ComputeBackend& be, const MlpParams& mlp, const float* X, int64_t rows, float* Y, int64_t YW,
                      MlpWorkspace& ws) {
  if (mlp.flat.empty() || rows == 0) return;
  mlp_forward(be, mlp, X, rows, ws);
  const int64_t G = mlp.shape.out;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < G; ++c) Y[t * YW + c] += ws.out[t * G + c];
}

Transfer::Transfer(const std::string& mapper_dir, ComputeBackend& be, TransferOptions opts)
    : m_(read_mapper_manifest(mapper_dir)), be_(be), opts_(opts), verified_(m_.target.n_layers, false) {
  // Both RoPE settings are checked (dynamic and unknown types are refused) before any data is touched.
  Rope(m_.source, m_.path + " (source.kv_spec)");
  Rope(m_.target, m_.path + " (target.kv_spec)");
}

Transfer::~Transfer() {
  for (auto& [l, w] : loaded_) {
    be_.forget_constant(w.wk.data());
    be_.forget_constant(w.wv.data());
  }
}

const MapperLayer& Transfer::layer(int l) {
  auto it = loaded_.find(l);
  if (it != loaded_.end()) return it->second;
  MapperLayer w = load_mapper_layer(m_, l, opts_.verify && !verified_[l]);
  verified_[l] = true;
  ++loads_;
  const MapperLayer& kept = loaded_.emplace(l, std::move(w)).first->second;
  if (opts_.resident) {  // the weights stay put from now on: a device backend keeps them too
    be_.keep_constant(kept.wk.data(), static_cast<int64_t>(kept.wk.size()));
    be_.keep_constant(kept.wv.data(), static_cast<int64_t>(kept.wv.size()));
  }
  return kept;
}

void Transfer::release(int l) {
  if (!opts_.resident) loaded_.erase(l);
}

void Transfer::map_layer(const MapperLayer& w, bool keys, const float* X, int64_t rows, float* out, int64_t at,
                         int64_t YW) {
  const int64_t F = m_.source.features_per_layer(), G = m_.target.features_per_layer();
  const int64_t XW = m_.source.n_layers * F;
  if (w.structure == Structure::per_head) {
    const float* b = (keys ? w.bk : w.bv).data();
    for (int64_t t = 0; t < rows; ++t) std::copy(b, b + G, out + at + t * YW);
    const int k = static_cast<int>(w.source_layers.size());
    for (int j = 0; j < k; ++j)
      be_.gemm_batched(per_head_slot(X, XW, w.source_layers[j], j, k, m_.target.n_kv_heads, m_.source.head_dim,
                                     m_.target.head_dim, (keys ? w.wk : w.wv).data(), rows, out + at, YW));
    return;  // per_head layers keep no residual MLP (artifact/mapper refuses one)
  }
  map_one_layer(be_, X, XW, w.source_layers, F, (keys ? w.wk : w.wv).data(), (keys ? w.bk : w.bv).data(), G, rows,
                out + at, YW, scratch_);
  const MlpParams& mlp = keys ? w.mlp_k : w.mlp_v;
  if (mlp.flat.empty()) return;
  gathered_.resize(rows * static_cast<int64_t>(w.source_layers.size()) * F);
  gather_layers_on_host(X, XW, w.source_layers, F, rows, gathered_.data());
  add_residual_mlp(be_, mlp, gathered_.data(), rows, out + at, YW, mlp_ws_);
}

void Transfer::map_content(bool keys, const float* X, int64_t rows, float* out) {
  const int64_t G = m_.target.features_per_layer(), YW = m_.target.n_layers * G;
  for (int l = 0; l < m_.target.n_layers; ++l) {
    map_layer(layer(l), keys, X, rows, out, l * G, YW);
    release(l);
  }
}

void Transfer::map_content(const float* Xk, const float* Xv, int64_t rows, float* out_k, float* out_v,
                           TargetLayers layers) {
  check_target_layers(layers, m_.target.n_layers);
  const int64_t G = m_.target.features_per_layer(), YW = layers.size(m_.target.n_layers) * G;
  for (int l = layers.first; l < layers.end(m_.target.n_layers); ++l) {
    const MapperLayer& w = layer(l);
    map_layer(w, true, Xk, rows, out_k, (l - layers.first) * G, YW);
    map_layer(w, false, Xv, rows, out_v, (l - layers.first) * G, YW);
    release(l);
  }
}

void Transfer::apply(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos,
                     int64_t rows, float* out_keys, float* out_values, TargetLayers layers) {
  check_target_layers(layers, m_.target.n_layers);
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  std::vector<float> content(keys, keys + rows * XW);
  Rope(m_.source).strip_block(content.data(), rows, int64_t{m_.source.n_layers} * m_.source.n_kv_heads, src_pos);
  map_content(content.data(), values, rows, out_keys, out_values, layers);
  if (opts_.target_rope)
    Rope(m_.target).apply_block(out_keys, rows, int64_t{layers.size(m_.target.n_layers)} * m_.target.n_kv_heads,
                                tgt_pos);
}

namespace {
void check_range(const char* name, const char* what, int first, int count, int n) {
  if (first < 0 || first >= n || (count >= 0 && (count == 0 || first + count > n)))
    throw InputError(std::string(name) + ": expected a non-empty range of the target's " + what + " [0, " +
                     std::to_string(n) + "), got first " + std::to_string(first) + ", count " + std::to_string(count));
}
}  // namespace

void check_target_layers(const TargetLayers& r, int n_layers) {
  check_range("layers", "layers", r.first, r.count, n_layers);
}

void check_target_heads(const TargetHeads& r, int n_heads) {
  check_range("target_heads", "KV heads", r.first, r.count, n_heads);
}

}  // namespace crosskv
