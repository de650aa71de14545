#include "serve/serving_mapper.hpp"

#include <algorithm>
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

}  // namespace

ServingMapper::ServingMapper(const std::string& mapper_dir, ServingKernels& be, bool verify, TargetHeads heads)
    : m_(read_mapper_manifest(mapper_dir)),
      be_(be),
      src_rope_(m_.source, m_.path + " (source.kv_spec)"),
      tgt_rope_(m_.target, m_.path + " (target.kv_spec)") {
  check_target_heads(heads, m_.target.n_kv_heads);
  std::vector<MapperLayer> layers;
  layers.reserve(m_.target.n_layers);
  for (int l = 0; l < m_.target.n_layers; ++l) layers.push_back(load_mapper_layer(m_, l, verify));
  upload(std::move(layers), heads);
}

ServingMapper::ServingMapper(MapperManifest m, std::vector<MapperLayer> layers, ServingKernels& be,
                             TargetHeads heads)
    : m_(std::move(m)),
      be_(be),
      src_rope_(m_.source, m_.path + " (source.kv_spec)"),
      tgt_rope_(m_.target, m_.path + " (target.kv_spec)") {
  check_target_heads(heads, m_.target.n_kv_heads);
  upload(std::move(layers), heads);
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

void ServingMapper::upload(std::vector<MapperLayer> layers, TargetHeads heads) {
  const int Lt = m_.target.n_layers;
  heads_ = {heads.first, heads.size(m_.target.n_kv_heads)};
  const int64_t G_full = m_.target.features_per_layer(), G = G_ = int64_t{heads_.count} * m_.target.head_dim;
  CROSSKV_ASSERT(static_cast<int>(layers.size()) == Lt && Lt > 0, "resident transfer: one entry per layer");
  k_ = static_cast<int64_t>(layers[0].source_layers.size());
  per_head_ = m_.structure == Structure::per_head;
  const int64_t K = m_.weight_rows();  // rows of a layer's weight (per head, for per_head)
  auto put = [&](const void* host, int64_t bytes, ServingKernels::MemoryPtr& into, int64_t at) {
    be_.copy_from_host(host, bytes, static_cast<char*>(into->data) + at);
  };
  for (Kind* kd : {&keys_, &values_}) {
    kd->w = be_.allocate(Lt * K * G * 4), kd->b = be_.allocate(Lt * G * 4);
    kd->mlp.resize(Lt), kd->mlp_shape.resize(Lt);
    weight_bytes_ += (Lt * K * G + Lt * G) * 4;
  }
  for (int l = 0; l < Lt; ++l) {
    MapperLayer& x = layers[l];
    CROSSKV_ASSERT(x.target_layer == l && static_cast<int64_t>(x.source_layers.size()) == k_ &&
                       static_cast<int64_t>(x.wk.size()) == K * G_full &&
                       static_cast<int64_t>(x.wv.size()) == K * G_full &&
                       static_cast<int64_t>(x.bk.size()) == G_full && static_cast<int64_t>(x.bv.size()) == G_full,
                   "resident transfer: layer " + std::to_string(l) + " has the wrong shapes");
    keep_heads(m_, x, heads_);
    selected_.push_back(x.source_layers);
    for (auto [kd, wt, bias, mlp] : {std::tuple{&keys_, &x.wk, &x.bk, &x.mlp_k}, {&values_, &x.wv, &x.bv, &x.mlp_v}}) {
      put(wt->data(), K * G * 4, kd->w, l * K * G * 4);
      put(bias->data(), G * 4, kd->b, l * G * 4);
      if (!mlp->flat.empty()) {
        const int64_t bytes = static_cast<int64_t>(mlp->flat.size()) * 4;
        kd->mlp[l] = be_.allocate(bytes);
        put(mlp->flat.data(), bytes, kd->mlp[l], 0);
        kd->mlp_shape[l] = mlp->shape;
        weight_bytes_ += bytes;
      }
    }
    x = MapperLayer{};  // the host copy goes as soon as the backend holds it
  }
  std::vector<int> every(m_.source.n_layers);
  for (int a = 0; a < m_.source.n_layers; ++a) every[a] = a;
  all_layers_ = std::all_of(selected_.begin(), selected_.end(), [&](const auto& s) { return s == every; });
}

void ServingMapper::add_mlp(const MlpShape& s, const float* p, const float* X, int64_t rows, float* Y, int64_t ldy) {
  // f(x) = relu(relu(x W1 + b1) W2 + b2) W3 + b3 on the gathered features X [rows x s.in] (core/mlp's forward).
  const std::vector<MlpTensor> t = mlp_tensors(s);  // w1 b1 w2 b2 w3 b3
  float* h1 = scratch<float>(h1_, rows * s.hidden);
  float* h2 = scratch<float>(h2_, rows * s.hidden);
  float* out = scratch<float>(mlp_out_, rows * s.out);
  auto affine = [&](const float* A, int64_t k, const MlpTensor& w, const MlpTensor& b, int64_t n, bool relu,
                    float* C) {
    be_.broadcast_rows(p + b.offset, n, rows, C, n);
    DenseMaths::BatchedGemm a;
    a.m = rows, a.n = n, a.k = k, a.beta = 1.0f;
    a.A = A, a.lda = k, a.B = p + w.offset, a.ldb = n, a.C = C, a.ldc = n;
    be_.serving_gemm(a);
    if (relu) be_.relu(C, rows * n);
  };
  affine(X, s.in, t[0], t[1], s.hidden, true, h1);
  affine(h1, s.hidden, t[2], t[3], s.hidden, true, h2);
  affine(h2, s.hidden, t[4], t[5], s.out, false, out);
  be_.add_rows(out, s.out, rows, Y, ldy);
}

void ServingMapper::map_kind(const Kind& kd, const float* X, int64_t rows, int l0, int l1, float* Y) {
  const int64_t F = m_.source.features_per_layer(), G = G_;
  const int64_t XW = m_.source.n_layers * F, YW = (l1 - l0) * G, K = k_ * F;
  float* const Y0 = Y - l0 * G;  // layer l's columns are Y0 + l * G (row stride YW)
  be_.broadcast_rows(kd.b->as<float>() + l0 * G, YW, rows, Y, YW);  // every layer's bias in one call
  if (per_head_) {  // per layer, k GEMMs batched over heads (Transfer's), reading the cache in place
    const int64_t per_layer = m_.weight_rows() * G;
    for (int l = l0; l < l1; ++l)
      for (int j = 0; j < static_cast<int>(k_); ++j)
        be_.serving_gemm(per_head_slot(X, XW, selected_[l][j], j, static_cast<int>(k_), m_.target.n_kv_heads,
                                       m_.source.head_dim, m_.target.head_dim, kd.w->as<float>() + l * per_layer,
                                       rows, Y0 + l * G, YW, heads_));
    return;
  }
  // Layer l's residual MLP (if any) on its gathered input Xl [rows x K], after its product.
  auto mlp = [&](int l, const float* Xl) {
    if (kd.mlp[l]) add_mlp(kd.mlp_shape[l], kd.mlp[l]->as<float>(), Xl, rows, Y0 + l * G, YW);
  };
  DenseMaths::BatchedGemm g;  // Y[:, l*G..] += X[:, selected(l)] W_l for a run of layers (map_one_layer's product)
  g.m = rows, g.n = G, g.k = K, g.beta = 1.0f;
  g.ldb = G, g.stride_b = K * G, g.ldc = YW, g.stride_c = G;
  if (all_layers_) {  // every layer's input is X itself (XW == K): one product for the whole range
    g.A = X, g.lda = XW, g.stride_a = 0;
    g.B = kd.w->as<float>() + l0 * K * G, g.C = Y, g.batch = l1 - l0;
    be_.serving_gemm(g);
    for (int l = l0; l < l1; ++l) mlp(l, X);
  } else if (k_ == 1) {  // X's columns of the one selected layer, read in place
    for (int l = l0; l < l1; ++l) {
      g.A = X + int64_t{selected_[l][0]} * F, g.lda = XW;
      g.B = kd.w->as<float>() + l * K * G, g.C = Y0 + l * G, g.batch = 1;
      be_.serving_gemm(g);
      if (!kd.mlp[l]) continue;
      float* in = scratch<float>(gathered_, rows * K);  // the MLP reads its input contiguous
      be_.gather_layers(X, XW, {selected_[l]}, F, rows, in);
      mlp(l, in);
    }
  } else {  // chunks of layers: their selections gathered side by side in one call, then one batched product
    const int64_t chunk = std::max<int64_t>(
        1, std::min<int64_t>({l1 - l0, 256 / k_, gather_bytes_ / std::max<int64_t>(1, rows * K * 4)}));
    float* gathered = scratch<float>(gathered_, chunk * rows * K);
    for (int a = l0; a < l1; a += static_cast<int>(chunk)) {
      const int b = static_cast<int>(std::min<int64_t>(l1, a + chunk));
      be_.gather_layers(X, XW, {selected_.begin() + a, selected_.begin() + b}, F, rows, gathered);
      g.A = gathered, g.lda = K, g.stride_a = rows * K;
      g.B = kd.w->as<float>() + a * K * G, g.C = Y0 + a * G, g.batch = b - a;
      be_.serving_gemm(g);
      for (int l = a; l < b; ++l) mlp(l, gathered + (l - a) * rows * K);  // the gather the product read
    }
  }
}

void ServingMapper::apply(const ServingBatch& b, std::optional<void*> stream) {
  check_target_layers(b.layers, m_.target.n_layers);
  if (b.rows == 0) return;
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  if (stream) be_.begin_after(*stream);
  float* content = scratch<float>(content_, b.rows * XW);
  be_.copy_within(b.keys, b.rows * XW * static_cast<int64_t>(sizeof(float)), content);
  be_.rope_rows(src_rope_, true, content, b.rows, int64_t{m_.source.n_layers} * m_.source.n_kv_heads,
                b.source_positions);
  const int l0 = b.layers.first, l1 = b.layers.end(m_.target.n_layers);
  map_kind(keys_, content, b.rows, l0, l1, b.out_keys);
  map_kind(values_, b.values, b.rows, l0, l1, b.out_values);
  be_.rope_rows(tgt_rope_, false, b.out_keys, b.rows, int64_t{l1 - l0} * heads_.count, b.target_positions);
  if (stream) be_.end_before(*stream);
}

void ServingMapper::apply_host(const float* keys, const float* values, const int32_t* src_pos,
                                  const int32_t* tgt_pos, int64_t rows, float* out_keys, float* out_values,
                                  TargetLayers layers) {
  check_target_layers(layers, m_.target.n_layers);
  if (rows == 0) return;
  if (!be_.memory_on_device()) {
    apply({keys, values, src_pos, tgt_pos, rows, out_keys, out_values, layers});
    return;
  }
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  const int64_t YW = layers.size(m_.target.n_layers) * G_;
  // One device array for the call: keys, values, out keys, out values (floats), then both positions (int32).
  float* d = scratch<float>(io_, rows * (2 * XW + 2 * YW + 2));
  ServingBatch b;
  float *k = d, *v = k + rows * XW, *ok = v + rows * XW, *ov = ok + rows * YW;
  auto* pos = reinterpret_cast<int32_t*>(ov + rows * YW);
  b.keys = k, b.values = v, b.out_keys = ok, b.out_values = ov, b.rows = rows;
  b.source_positions = pos, b.target_positions = pos + rows, b.layers = layers;
  const int64_t in = rows * XW * 4, out = rows * YW * 4, np = rows * 4;
  be_.copy_from_host(keys, in, k);
  be_.copy_from_host(values, in, v);
  be_.copy_from_host(src_pos, np, pos);
  be_.copy_from_host(tgt_pos, np, pos + rows);
  apply(b);
  be_.copy_to_host(ok, out, out_keys);
  be_.copy_to_host(ov, out, out_values);
}

}  // namespace crosskv
