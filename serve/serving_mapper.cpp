#include "serve/serving_mapper.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <memory>
#include <tuple>
#include <utility>

#include "core/error.hpp"
#include "core/mlp.hpp"

namespace crosskv {

namespace {

// Columns [c0, c0 + n) of a row-major [rows x cols] matrix.
std::vector<float> columns(const float* a, int64_t rows, int64_t cols, int64_t c0, int64_t n) {
  std::vector<float> out(rows * n);
  for (int64_t r = 0; r < rows; ++r) std::copy_n(a + r * cols + c0, n, out.data() + r * n);
  return out;
}

// Layer x's weights, biases and residual MLPs cut to the target heads `h` (their output columns; per_head: their
// weight slabs). Every output column depends on its own weights alone, so the cut maps those heads exactly.
void keep_heads(const MapperManifest& m, MapperLayer& x, TargetHeads h) {
  const int64_t Dt = m.target.head_dim, G = m.target.features_per_layer(), c0 = h.first * Dt, n = h.count * Dt;
  if (n == G) return;
  const int64_t K = m.weight_rows();
  for (auto [w, b, mlp] : {std::tuple{&x.wk, &x.bk, &x.mlp_k}, {&x.wv, &x.bv, &x.mlp_v}}) {
    if (m.structure == Structure::per_head)  // [Ht][K x Dt]: the heads' slabs, contiguous
      *w = std::vector<float>(w->begin() + h.first * K * Dt, w->begin() + (h.first + h.count) * K * Dt);
    else
      *w = columns(w->data(), K, G, c0, n);
    *b = std::vector<float>(b->begin() + c0, b->begin() + c0 + n);
    if (mlp->flat.empty()) continue;
    const MlpShape full = mlp->shape;
    MlpParams cut(MlpShape{full.in, full.hidden, n});
    const std::vector<MlpTensor> from = mlp_tensors(full), to = mlp_tensors(cut.shape);  // w1 b1 w2 b2 w3 b3
    std::copy_n(mlp->flat.data(), from[4].offset, cut.flat.data());  // w1 b1 w2 b2 as they are
    const std::vector<float> w3 = columns(mlp->flat.data() + from[4].offset, full.hidden, full.out, c0, n);
    std::copy(w3.begin(), w3.end(), cut.flat.begin() + to[4].offset);
    std::copy_n(mlp->flat.data() + from[5].offset + c0, n, cut.flat.begin() + to[5].offset);
    *mlp = std::move(cut);
  }
}

// The serving kernels as an MLP's forward pass uses them.
class ServingAffine final : public AffineKernels {
 public:
  explicit ServingAffine(ServingKernels& be) : be_(be) {}
  void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) override {
    be_.broadcast_rows(b, n, rows, Y, ldy);
  }
  void gemm(const DenseMaths::BatchedGemm& g) override { be_.serving_gemm(g); }
  void relu(float* X, int64_t n) override { be_.relu(X, n); }

 private:
  ServingKernels& be_;
};

// A host vector kept as a host backend's memory (no copy: host memory is that backend's).
struct AdoptedWeights final : ServingKernels::Memory {
  explicit AdoptedWeights(std::vector<float> v) : values(std::move(v)) {
    data = values.data(), bytes = static_cast<int64_t>(values.size()) * 4;
  }
  std::vector<float> values;
};

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

ServingMapper::ServingMapper(const std::string& mapper_dir, ServingKernels& be, bool verify, TargetHeads heads,
                             TargetLayers window)
    : m_(read_mapper_manifest(mapper_dir)),
      be_(be),
      src_rope_(m_.source, m_.path + " (source.kv_spec)"),
      tgt_rope_(m_.target, m_.path + " (target.kv_spec)") {
  check_target_heads(heads, m_.target.n_kv_heads);
  check_target_layers(window, m_.target.n_layers);
  std::vector<MapperLayer> layers;
  for (int l = window.first; l < window.end(m_.target.n_layers); ++l)
    layers.push_back(load_mapper_layer(m_, l, verify));
  upload(std::move(layers), heads, window);
}

ServingMapper::ServingMapper(MapperManifest m, std::vector<MapperLayer> layers, ServingKernels& be,
                             TargetHeads heads, TargetLayers window)
    : m_(std::move(m)),
      be_(be),
      src_rope_(m_.source, m_.path + " (source.kv_spec)"),
      tgt_rope_(m_.target, m_.path + " (target.kv_spec)") {
  check_target_heads(heads, m_.target.n_kv_heads);
  check_target_layers(window, m_.target.n_layers);
  upload(std::move(layers), heads, window);
}

template <class T>
T* ServingMapper::scratch(ServingKernels::MemoryPtr& m, int64_t count) {
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  if (!m || m->bytes < bytes) {
    m.reset();  // the old one first: a device keeps one at a time
    m = be_.allocate(bytes);
  }
  return m->as<T>();
}

void ServingMapper::upload(std::vector<MapperLayer> layers, TargetHeads heads, TargetLayers window) {
  window_ = {window.first, window.size(m_.target.n_layers)};
  const int n = window_.count;
  heads_ = {heads.first, heads.size(m_.target.n_kv_heads)};
  const int64_t G_full = m_.target.features_per_layer(), G = G_ = int64_t{heads_.count} * m_.target.head_dim;
  CROSSKV_ASSERT(static_cast<int>(layers.size()) == n, "serving mapper: one entry per layer of its window");
  k_ = static_cast<int64_t>(layers[0].source_layers.size());
  per_head_ = m_.structure == Structure::per_head;
  const int64_t K = m_.weight_rows();  // rows of a layer's weight (per head, for per_head)
  auto put = [&](const void* host, int64_t bytes, ServingKernels::MemoryPtr& into, int64_t at) {
    be_.copy_from_host(host, bytes, static_cast<char*>(into->data) + at);
  };
  // A one-layer window on a host backend (the streamed Transfer's) keeps the layer's weight vectors as they are.
  const bool adopt = n == 1 && !be_.memory_on_device();
  for (Kind* kd : {&keys_, &values_}) {
    if (!adopt) kd->w = be_.allocate(n * K * G * 4);
    kd->b = be_.allocate(n * G * 4);
    kd->mlp.resize(n), kd->mlp_shape.resize(n);
    weight_bytes_ += (n * K * G + n * G) * 4;
  }
  for (int i = 0; i < n; ++i) {
    MapperLayer& x = layers[i];
    CROSSKV_ASSERT(x.target_layer == window_.first + i && static_cast<int64_t>(x.source_layers.size()) == k_ &&
                       static_cast<int64_t>(x.wk.size()) == K * G_full &&
                       static_cast<int64_t>(x.wv.size()) == K * G_full &&
                       static_cast<int64_t>(x.bk.size()) == G_full && static_cast<int64_t>(x.bv.size()) == G_full,
                   "serving mapper: layer " + std::to_string(window_.first + i) + " has the wrong shapes");
    keep_heads(m_, x, heads_);
    selected_.push_back(x.source_layers);
    for (auto [kd, wt, bias, mlp] : {std::tuple{&keys_, &x.wk, &x.bk, &x.mlp_k}, {&values_, &x.wv, &x.bv, &x.mlp_v}}) {
      CROSSKV_ASSERT(static_cast<int64_t>(wt->size()) == K * G, "serving mapper: weights cut to their heads");
      if (adopt)
        kd->w = std::make_unique<AdoptedWeights>(std::move(*wt));
      else
        put(wt->data(), K * G * 4, kd->w, i * K * G * 4);
      put(bias->data(), G * 4, kd->b, i * G * 4);
      if (!mlp->flat.empty()) {
        const int64_t bytes = static_cast<int64_t>(mlp->flat.size()) * 4;
        kd->mlp[i] = be_.allocate(bytes);
        put(mlp->flat.data(), bytes, kd->mlp[i], 0);
        kd->mlp_shape[i] = mlp->shape;
        weight_bytes_ += bytes;
      }
    }
    x = MapperLayer{};  // the host copy goes as soon as the backend holds it
  }
  std::vector<int> every(m_.source.n_layers);
  for (int a = 0; a < m_.source.n_layers; ++a) every[a] = a;
  all_layers_ = std::all_of(selected_.begin(), selected_.end(), [&](const auto& s) { return s == every; });
}

TargetLayers ServingMapper::checked(TargetLayers layers) const {
  check_target_layers(layers, m_.target.n_layers);
  const TargetLayers r{layers.first, layers.size(m_.target.n_layers)};
  if (r.first < window_.first || r.first + r.count > window_.first + window_.count)
    throw InputError("layers: target layers [" + std::to_string(r.first) + ", " + std::to_string(r.first + r.count) +
                     ") lie outside this mapper's window [" + std::to_string(window_.first) + ", " +
                     std::to_string(window_.first + window_.count) + ")");
  return r;
}

void ServingMapper::add_mlp(const MlpShape& s, const float* p, const float* X, int64_t rows, float* Y, int64_t ldy) {
  float* h1 = scratch<float>(h1_, rows * s.hidden);
  float* h2 = scratch<float>(h2_, rows * s.hidden);
  float* out = scratch<float>(mlp_out_, rows * s.out);
  ServingAffine k(be_);
  mlp_forward(k, s, p, X, rows, h1, h2, out);
  be_.add_rows(out, s.out, rows, Y, ldy);
}

void ServingMapper::map_kind(const Kind& kd, const float* X, int64_t XW, bool gathered, bool with_mlp, int64_t rows,
                             int l0, int l1, float* Y) {
  const int64_t F = m_.source.features_per_layer(), G = G_;
  const int64_t YW = (l1 - l0) * G, K = k_ * F;
  const int w0 = window_.first;
  float* const Y0 = Y - l0 * G;  // layer l's columns are Y0 + l * G (row stride YW)
  const float* const W = kd.w->as<float>();  // window layer i = l - w0 at W + i * (rows of a layer's weight) * G
  be_.broadcast_rows(kd.b->as<float>() + (l0 - w0) * G, YW, rows, Y, YW);  // every layer's bias in one call
  if (per_head_) {  // per layer, k GEMMs batched over heads, reading the cache in place
    const int64_t per_layer = m_.weight_rows() * G;
    for (int l = l0; l < l1; ++l)
      for (int j = 0; j < static_cast<int>(k_); ++j)
        be_.serving_gemm(per_head_slot(X, XW, gathered ? j : selected_[l - w0][j], j, static_cast<int>(k_),
                                       m_.target.n_kv_heads, m_.source.head_dim, m_.target.head_dim,
                                       W + (l - w0) * per_layer, rows, Y0 + l * G, YW, heads_));
    return;  // per_head layers keep no residual MLP (artifact/mapper refuses one)
  }
  // Layer l's residual MLP (if any) on its gathered input Xl [rows x K], after its product.
  auto mlp = [&](int l, const float* Xl) {
    const auto& p = kd.mlp[l - w0];
    if (with_mlp && p) add_mlp(kd.mlp_shape[l - w0], p->as<float>(), Xl, rows, Y0 + l * G, YW);
  };
  DenseMaths::BatchedGemm g;  // Y[:, l*G..] += X[:, selected(l)] W_l for a run of layers
  g.m = rows, g.n = G, g.k = K, g.beta = 1.0f;
  g.ldb = G, g.stride_b = K * G, g.ldc = YW, g.stride_c = G;
  if (all_layers_ || gathered) {  // every layer's input is X itself (XW == K): one product for the whole range
    CROSSKV_ASSERT(XW == K, "serving mapper: an input that is not the layers' own");
    g.A = X, g.lda = XW, g.stride_a = 0;
    g.B = W + (l0 - w0) * K * G, g.C = Y, g.batch = l1 - l0;
    be_.serving_gemm(g);
    for (int l = l0; l < l1; ++l) mlp(l, X);
  } else if (k_ == 1) {  // X's columns of the one selected layer, read in place
    for (int l = l0; l < l1; ++l) {
      g.A = X + int64_t{selected_[l - w0][0]} * F, g.lda = XW;
      g.B = W + (l - w0) * K * G, g.C = Y0 + l * G, g.batch = 1;
      be_.serving_gemm(g);
      if (!with_mlp || !kd.mlp[l - w0]) continue;
      float* in = scratch<float>(gathered_, rows * K);  // the MLP reads its input contiguous
      be_.gather_layers(X, XW, {selected_[l - w0]}, F, rows, in);
      mlp(l, in);
    }
  } else {  // chunks of layers: their selections gathered side by side in one call, then one batched product
    const int64_t chunk = std::max<int64_t>(
        1, std::min<int64_t>({l1 - l0, 256 / k_, gather_bytes_ / std::max<int64_t>(1, rows * K * 4)}));
    float* gathered_x = scratch<float>(gathered_, chunk * rows * K);
    for (int a = l0; a < l1; a += static_cast<int>(chunk)) {
      const int b = static_cast<int>(std::min<int64_t>(l1, a + chunk));
      be_.gather_layers(X, XW, {selected_.begin() + (a - w0), selected_.begin() + (b - w0)}, F, rows, gathered_x);
      g.A = gathered_x, g.lda = K, g.stride_a = rows * K;
      g.B = W + (a - w0) * K * G, g.C = Y0 + a * G, g.batch = b - a;
      be_.serving_gemm(g);
      for (int l = a; l < b; ++l) mlp(l, gathered_x + (l - a) * rows * K);  // the gather the product read
    }
  }
}

void ServingMapper::map_content(const ContentBatch& b) {
  const TargetLayers r = checked(b.layers);
  if (b.gathered && r.count != 1)
    throw InputError("layers: a gathered input serves one target layer, got " + std::to_string(r.count));
  if (b.rows == 0) return;
  const int64_t XW = b.gathered ? k_ * m_.source.features_per_layer()
                                : int64_t{m_.source.n_layers} * m_.source.features_per_layer();
  if (b.keys && b.out_keys) map_kind(keys_, b.keys, XW, b.gathered, b.residual_mlp, b.rows, r.first, r.first + r.count, b.out_keys);
  if (b.values && b.out_values)
    map_kind(values_, b.values, XW, b.gathered, b.residual_mlp, b.rows, r.first, r.first + r.count, b.out_values);
}

void ServingMapper::apply(const ServingBatch& b, std::optional<void*> stream) {
  const TargetLayers r = checked(b.layers);
  if (b.rows == 0) return;
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  if (stream) be_.begin_after(*stream);
  float* content = scratch<float>(content_, b.rows * XW);
  be_.copy_within(b.keys, b.rows * XW * static_cast<int64_t>(sizeof(float)), content);
  be_.rope_rows(src_rope_, src_rope_.all(), true, content, b.rows, b.source_positions);
  ContentBatch c;
  c.keys = content, c.values = b.values, c.rows = b.rows, c.out_keys = b.out_keys, c.out_values = b.out_values;
  c.layers = r;
  map_content(c);
  if (b.target_rope)
    be_.rope_rows(tgt_rope_, {r.first, r.count, heads_.count}, false, b.out_keys, b.rows, b.target_positions);
  if (stream) be_.end_before(*stream);
}

void ServingMapper::apply_host(const float* keys, const float* values, const int32_t* src_pos,
                               const int32_t* tgt_pos, int64_t rows, float* out_keys, float* out_values,
                               TargetLayers layers, bool target_rope) {
  const TargetLayers r = checked(layers);
  if (rows == 0) return;
  if (!be_.memory_on_device()) {
    apply({keys, values, src_pos, tgt_pos, rows, out_keys, out_values, r, target_rope});
    return;
  }
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  const int64_t YW = r.count * G_;
  // One device array for the call: keys, values, out keys, out values (floats), then both positions (int32).
  float* d = scratch<float>(io_, rows * (2 * XW + 2 * YW + 2));
  ServingBatch b;
  float *k = d, *v = k + rows * XW, *ok = v + rows * XW, *ov = ok + rows * YW;
  auto* pos = reinterpret_cast<int32_t*>(ov + rows * YW);
  b.keys = k, b.values = v, b.out_keys = ok, b.out_values = ov, b.rows = rows;
  b.source_positions = pos, b.target_positions = pos + rows, b.layers = r, b.target_rope = target_rope;
  const int64_t in = rows * XW * 4, out = rows * YW * 4, np = rows * 4;
  be_.copy_from_host(keys, in, k);
  be_.copy_from_host(values, in, v);
  be_.copy_from_host(src_pos, np, pos);
  be_.copy_from_host(tgt_pos, np, pos + rows);
  apply(b);
  be_.copy_to_host(ok, out, out_keys);
  be_.copy_to_host(ov, out, out_values);
}

void ServingMapper::map_content_host(const ContentBatch& h) {
  const TargetLayers r = checked(h.layers);
  if (h.rows == 0) return;
  if (!be_.memory_on_device()) {
    map_content(h);
    return;
  }
  const int64_t XW = h.gathered ? k_ * m_.source.features_per_layer()
                                : int64_t{m_.source.n_layers} * m_.source.features_per_layer();
  const int64_t YW = r.count * G_, in = h.rows * XW * 4, out = h.rows * YW * 4;
  float* d = scratch<float>(io_, h.rows * (2 * XW + 2 * YW));
  ContentBatch b = h;
  b.keys = h.keys ? d : nullptr, b.values = h.values ? d + h.rows * XW : nullptr;
  b.out_keys = h.out_keys ? d + 2 * h.rows * XW : nullptr;
  b.out_values = h.out_values ? d + 2 * h.rows * XW + h.rows * YW : nullptr;
  if (b.keys) be_.copy_from_host(h.keys, in, const_cast<float*>(b.keys));
  if (b.values) be_.copy_from_host(h.values, in, const_cast<float*>(b.values));
  map_content(b);
  if (b.out_keys) be_.copy_to_host(b.out_keys, out, h.out_keys);
  if (b.out_values) be_.copy_to_host(b.out_values, out, h.out_values);
}

}  // namespace crosskv
