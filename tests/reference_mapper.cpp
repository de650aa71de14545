#include "reference_mapper.hpp"

#include <cblas.h>

#include <algorithm>

namespace crosskv {

MapperWeights load_mapper(const std::string& dir) {
  MapperManifest mm = read_mapper_manifest(dir);
  MapperWeights m;
  m.dir = dir;
  m.manifest = mm;
  m.source = mm.source;
  m.target = mm.target;
  for (int l = 0; l < mm.target.n_layers; ++l) m.layers.push_back(load_mapper_layer(mm, l));
  return m;
}

void map_content(const MapperWeights& m, Kind kind, const float* X, int64_t rows, float* out) {
  const bool keys = kind == Kind::k;
  const int64_t F = m.source.features_per_layer(), G = m.target.features_per_layer();
  const int64_t XW = m.source.n_layers * F, YW = m.target.n_layers * G;
  for (const auto& l : m.layers) {
    const auto& W = keys ? l.wk : l.wv;
    const auto& b = keys ? l.bk : l.bv;
    float* Y = out + l.target_layer * G;
    if (l.structure == Structure::per_head) {  // by loops: target head h from source head h of the layers
      const int64_t H = m.target.n_kv_heads, Ds = m.source.head_dim, Dt = m.target.head_dim;
      const int64_t k = static_cast<int64_t>(l.source_layers.size());
      for (int64_t t = 0; t < rows; ++t)
        for (int64_t h = 0; h < H; ++h)
          for (int64_t c = 0; c < Dt; ++c) {
            double a = b[h * Dt + c];
            for (int64_t j = 0; j < k; ++j)
              for (int64_t p = 0; p < Ds; ++p)
                a += double(X[t * XW + l.source_layers[j] * F + h * Ds + p]) * W[((h * k + j) * Ds + p) * Dt + c];
            Y[t * YW + h * Dt + c] = static_cast<float>(a);
          }
      continue;
    }
    for (int64_t t = 0; t < rows; ++t) std::copy(b.begin(), b.end(), Y + t * YW);
    for (size_t j = 0; j < l.source_layers.size(); ++j)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, G, F, 1.0f, X + l.source_layers[j] * F, XW,
                  W.data() + j * F * G, G, 1.0f, Y, YW);
    const MlpParams& mlp = keys ? l.mlp_k : l.mlp_v;
    if (mlp.flat.empty()) continue;
    // The residual MLP by loops (a reference): f(x) = relu(relu(x W1 + b1) W2 + b2) W3 + b3.
    const int64_t H = mlp.shape.hidden, K = mlp.shape.in;
    std::vector<float> x(K), h1(H), h2(H);
    for (int64_t t = 0; t < rows; ++t) {
      for (size_t j = 0; j < l.source_layers.size(); ++j)
        std::copy_n(X + t * XW + l.source_layers[j] * F, F, x.begin() + static_cast<int64_t>(j) * F);
      auto layer = [](const float* in, int64_t n_in, const float* w, const float* b, int64_t n_out, bool relu,
                      float* o) {
        for (int64_t c = 0; c < n_out; ++c) {
          double a = b[c];
          for (int64_t i = 0; i < n_in; ++i) a += double(in[i]) * w[i * n_out + c];
          o[c] = relu && a < 0 ? 0.0f : static_cast<float>(a);
        }
      };
      layer(x.data(), K, mlp.w1(), mlp.b1(), H, true, h1.data());
      layer(h1.data(), H, mlp.w2(), mlp.b2(), H, true, h2.data());
      std::vector<float> f(G);
      layer(h2.data(), H, mlp.w3(), mlp.b3(), G, false, f.data());
      for (int64_t c = 0; c < G; ++c) Y[t * YW + c] += f[c];
    }
  }
}

}  // namespace crosskv
