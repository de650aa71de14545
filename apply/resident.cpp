#include "apply/resident.hpp"

#include <utility>

#include "core/error.hpp"

namespace crosskv {

ResidentTransfer::ResidentTransfer(const std::string& mapper_dir, ComputeBackend& be, bool verify)
    : m_(read_mapper_manifest(mapper_dir)),
      be_(be),
      src_rope_(m_.source, m_.path + " (source.kv_spec)"),
      tgt_rope_(m_.target, m_.path + " (target.kv_spec)") {
  std::vector<MapperLayer> layers;
  layers.reserve(m_.target.n_layers);
  for (int l = 0; l < m_.target.n_layers; ++l) layers.push_back(load_mapper_layer(m_, l, verify));
  upload(std::move(layers));
}

ResidentTransfer::ResidentTransfer(MapperManifest m, std::vector<MapperLayer> layers, ComputeBackend& be)
    : m_(std::move(m)),
      be_(be),
      src_rope_(m_.source, m_.path + " (source.kv_spec)"),
      tgt_rope_(m_.target, m_.path + " (target.kv_spec)") {
  upload(std::move(layers));
}

template <class T>
T* ResidentTransfer::scratch(ResidentKernels::MemoryPtr& m, int64_t count) {
  const int64_t bytes = count * static_cast<int64_t>(sizeof(T));
  if (!m || m->bytes < bytes) {
    m.reset();  // the old one first: a device keeps one at a time
    m = be_.allocate(bytes);
  }
  return m->as<T>();
}

ResidentTransfer::Kind ResidentTransfer::upload_kind(const std::vector<float>& w, const std::vector<float>& b,
                                                     const MlpParams& mlp) {
  auto put = [&](const std::vector<float>& host) {
    const int64_t bytes = static_cast<int64_t>(host.size() * sizeof(float));
    ResidentKernels::MemoryPtr m = be_.allocate(bytes);
    be_.copy_from_host(host.data(), bytes, m->data);
    weight_bytes_ += bytes;
    return m;
  };
  Kind k;
  k.w = put(w), k.b = put(b);
  if (!mlp.flat.empty()) k.mlp = put(mlp.flat), k.mlp_shape = mlp.shape;
  return k;
}

void ResidentTransfer::upload(std::vector<MapperLayer> layers) {
  const int64_t F = m_.source.features_per_layer(), G = m_.target.features_per_layer();
  CROSSKV_ASSERT(static_cast<int>(layers.size()) == m_.target.n_layers, "resident transfer: one entry per layer");
  for (int l = 0; l < m_.target.n_layers; ++l) {
    MapperLayer& w = layers[l];
    const int64_t K = static_cast<int64_t>(w.source_layers.size()) * F;
    CROSSKV_ASSERT(w.target_layer == l && !w.source_layers.empty() &&
                       static_cast<int64_t>(w.wk.size()) == K * G && static_cast<int64_t>(w.wv.size()) == K * G &&
                       static_cast<int64_t>(w.bk.size()) == G && static_cast<int64_t>(w.bv.size()) == G,
                   "resident transfer: layer " + std::to_string(l) + " has the wrong shapes");
    Layer r;
    r.source_layers = w.source_layers;
    r.k = upload_kind(w.wk, w.bk, w.mlp_k);
    r.v = upload_kind(w.wv, w.bv, w.mlp_v);
    layers_.push_back(std::move(r));
    w = MapperLayer{};  // the host copy goes as soon as the backend holds it
  }
}

void ResidentTransfer::map_kind(const Layer& l, const Kind& kd, const float* X, int64_t rows, float* Y) {
  const int64_t F = m_.source.features_per_layer(), G = m_.target.features_per_layer();
  const int64_t XW = m_.source.n_layers * F, YW = m_.target.n_layers * G;
  const int64_t K = static_cast<int64_t>(l.source_layers.size()) * F;
  const bool mlp = kd.mlp != nullptr;
  be_.broadcast_rows(kd.b->as<float>(), G, rows, Y, YW);
  DenseMaths::BatchedGemm g;  // Y += X[:, selected] W (map_one_layer's product)
  g.m = rows, g.n = G, g.k = K, g.beta = 1.0f;
  g.B = kd.w->as<float>(), g.ldb = G, g.C = Y, g.ldc = YW;
  const float* gathered = nullptr;
  if (l.source_layers.size() > 1 || mlp) {
    float* out = scratch<float>(gathered_, rows * K);
    be_.gather_layers(X, XW, l.source_layers, F, rows, out);
    gathered = out;
  }
  if (l.source_layers.size() == 1)
    g.A = X + int64_t{l.source_layers[0]} * F, g.lda = XW;
  else
    g.A = gathered, g.lda = K;
  be_.resident_gemm(g);
  if (!mlp) return;
  // f(x) = relu(relu(x W1 + b1) W2 + b2) W3 + b3 on the gathered features (core/mlp's forward), added to Y.
  const MlpShape& s = kd.mlp_shape;
  const float* p = kd.mlp->as<float>();
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
    be_.resident_gemm(a);
    if (relu) be_.relu(C, rows * n);
  };
  affine(gathered, s.in, t[0], t[1], s.hidden, true, h1);
  affine(h1, s.hidden, t[2], t[3], s.hidden, true, h2);
  affine(h2, s.hidden, t[4], t[5], s.out, false, out);
  be_.add_rows(out, s.out, rows, Y, YW);
}

void ResidentTransfer::apply(const ResidentBatch& b, std::optional<void*> stream) {
  if (b.rows == 0) return;
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  const int64_t G = m_.target.features_per_layer();
  if (stream) be_.begin_after(*stream);
  float* content = scratch<float>(content_, b.rows * XW);
  be_.copy_within(b.keys, b.rows * XW * static_cast<int64_t>(sizeof(float)), content);
  be_.rope_rows(src_rope_, true, content, b.rows, int64_t{m_.source.n_layers} * m_.source.n_kv_heads,
                b.source_positions);
  for (int l = 0; l < m_.target.n_layers; ++l) {
    const Layer& w = layers_[l];
    map_kind(w, w.k, content, b.rows, b.out_keys + l * G);
    map_kind(w, w.v, b.values, b.rows, b.out_values + l * G);
  }
  be_.rope_rows(tgt_rope_, false, b.out_keys, b.rows, int64_t{m_.target.n_layers} * m_.target.n_kv_heads,
                b.target_positions);
  if (stream) be_.end_before(*stream);
}

void ResidentTransfer::apply_host(const float* keys, const float* values, const int32_t* src_pos,
                                  const int32_t* tgt_pos, int64_t rows, float* out_keys, float* out_values) {
  if (rows == 0) return;
  if (!be_.memory_on_device()) {
    apply({keys, values, src_pos, tgt_pos, rows, out_keys, out_values});
    return;
  }
  const int64_t XW = m_.source.n_layers * m_.source.features_per_layer();
  const int64_t YW = m_.target.n_layers * m_.target.features_per_layer();
  // One device array for the call: keys, values, out keys, out values (floats), then both positions (int32).
  float* d = scratch<float>(io_, rows * (2 * XW + 2 * YW + 2));
  ResidentBatch b;
  float *k = d, *v = k + rows * XW, *ok = v + rows * XW, *ov = ok + rows * YW;
  auto* pos = reinterpret_cast<int32_t*>(ov + rows * YW);
  b.keys = k, b.values = v, b.out_keys = ok, b.out_values = ov, b.rows = rows;
  b.source_positions = pos, b.target_positions = pos + rows;
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
