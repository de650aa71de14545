#include "tools/synth.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>
#include <random>
#include <tuple>

#include "core/error.hpp"
#include "core/rope.hpp"

namespace fs = std::filesystem;

namespace crosskv {

SynthOptions default_synth_options() {
  SynthOptions o;
  o.source.n_layers = 8;
  o.source.n_kv_heads = 4;
  o.source.head_dim = 32;
  o.source.n_q_heads = 8;
  o.source.rope.type = "default";
  o.source.rope.theta = 10000.0;
  o.source.rope.rotary_dim = 32;
  o.target = o.source;
  o.target.n_layers = 12;
  o.target.n_q_heads = 16;
  o.target.rope.type = "llama3";
  o.target.rope.theta = 500000.0;
  o.target.rope.factor = 8.0;
  o.target.rope.low_freq_factor = 1.0;
  o.target.rope.high_freq_factor = 4.0;
  o.target.rope.original_max_position_embeddings = 8192.0;
  return o;
}

namespace {

using Mat = std::vector<float>;  // row-major

Mat random_matrix(std::mt19937_64& rng, int rows, int cols, double scale) {
  std::normal_distribution<float> n(0.0f, static_cast<float>(scale));
  Mat m(static_cast<size_t>(rows) * cols);
  for (auto& v : m) v = n(rng);
  return m;
}

// y[cols] += x[rows] . M[rows x cols]
void gemv_acc(const float* x, const Mat& M, int rows, int cols, float* y) {
  for (int r = 0; r < rows; ++r) {
    const float xr = x[r];
    const float* m = M.data() + static_cast<size_t>(r) * cols;
    for (int c = 0; c < cols; ++c) y[c] += xr * m[c];
  }
}

constexpr int kLatent = 12;     // dims per latent component
constexpr int kComponents = 6;  // components along depth

// Depth mixing weights of the latent components at relative depth u in [0, 1].
std::vector<float> depth_weights(double u) {
  std::vector<float> w(kComponents);
  double s = 0;
  for (int j = 0; j < kComponents; ++j) {
    const double c = static_cast<double>(j) / (kComponents - 1), width = 0.7 / (kComponents - 1);
    w[j] = static_cast<float>(std::exp(-0.5 * std::pow((u - c) / width, 2)));
    s += w[j] * w[j];
  }
  for (auto& x : w) x = static_cast<float>(x / std::sqrt(s));
  return w;
}

struct Side {
  const KvSpec* spec;
  int64_t width() const { return int64_t{spec->n_layers} * spec->n_kv_heads * spec->head_dim; }
  int64_t per_layer() const { return int64_t{spec->n_kv_heads} * spec->head_dim; }
};

}  // namespace

int64_t synthesize(const SynthOptions& o) {
  Rope rope_s(o.source, "source"), rope_t(o.target, "target");
  const Side S{&o.source}, T{&o.target};
  const int Ls = o.source.n_layers, Lt = o.target.n_layers;
  const int64_t F = S.per_layer(), G = T.per_layer();
  std::mt19937_64 rng(o.seed);
  // Maps: latent z (kLatent) -> content, per layer, for keys and values; extra layer-private latents.
  std::vector<Mat> As_k(Ls), As_v(Ls), Ps(Ls), At_k(Lt), At_v(Lt), Pt(Lt), Ml_k(Lt), Ml_v(Lt);
  std::vector<Mat> N1_k(Lt), N2_k(Lt), N1_v(Lt), N2_v(Lt);  // the nonlinear relation's planted ReLU layers
  constexpr int kPlantedHidden = 32;
  std::vector<std::vector<float>> ct_k(Lt), ct_v(Lt);
  const double zs = 1.0 / std::sqrt(static_cast<double>(kLatent));
  for (int a = 0; a < Ls; ++a) {
    As_k[a] = random_matrix(rng, kLatent, static_cast<int>(F), zs);
    As_v[a] = random_matrix(rng, kLatent, static_cast<int>(F), zs);
    Ps[a] = random_matrix(rng, kLatent, static_cast<int>(F), zs * o.noise);
  }
  for (int l = 0; l < Lt; ++l) {
    At_k[l] = random_matrix(rng, kLatent, static_cast<int>(G), zs);
    At_v[l] = random_matrix(rng, kLatent, static_cast<int>(G), zs);
    Pt[l] = random_matrix(rng, kLatent, static_cast<int>(G), zs * o.noise);
    if (o.relation != SynthRelation::family) {
      Ml_k[l] = random_matrix(rng, static_cast<int>(F), static_cast<int>(G), 1.0 / std::sqrt(double(F)));
      Ml_v[l] = random_matrix(rng, static_cast<int>(F), static_cast<int>(G), 1.0 / std::sqrt(double(F)));
    }
    if (o.relation == SynthRelation::nonlinear) {
      for (auto* n1 : {&N1_k[l], &N1_v[l]}) *n1 = random_matrix(rng, static_cast<int>(F), kPlantedHidden, 1.0 / std::sqrt(double(F)));
      for (auto* n2 : {&N2_k[l], &N2_v[l]})
        *n2 = random_matrix(rng, kPlantedHidden, static_cast<int>(G), 2.0 / std::sqrt(double(kPlantedHidden)));
    }
    ct_k[l] = random_matrix(rng, 1, static_cast<int>(G), 1.0);
    ct_v[l] = random_matrix(rng, 1, static_cast<int>(G), 1.0);
  }
  std::vector<std::vector<float>> ws(Ls), wt(Lt);
  for (int a = 0; a < Ls; ++a) ws[a] = depth_weights(Ls == 1 ? 0.0 : double(a) / (Ls - 1));
  for (int l = 0; l < Lt; ++l) wt[l] = depth_weights(Lt == 1 ? 0.0 : double(l) / (Lt - 1));
  // Large-mean key channels: the first channels of every head's lowest-frequency pair.
  auto add_large_mean = [&](float* content, const KvSpec& spec) {
    const int D = spec.head_dim, r = spec.rope.rotary_dim > 0 ? spec.rope.rotary_dim : D;
    for (int64_t h = 0; h < int64_t{spec.n_layers} * spec.n_kv_heads; ++h)
      for (int c = 0; c < o.large_mean_channels && c < r / 2; ++c)
        content[h * D + (r / 2 - 1 - c)] += static_cast<float>(o.large_mean * (1.0 + 0.1 * c));
  };

  rng.seed(o.data_seed ? o.data_seed : o.seed * 0x9E3779B97F4A7C15ull + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::uniform_int_distribution<int> token(0, 150000), offset(0, 4000), step(1, 3);
  int64_t total = 0;
  for (const auto& domain : o.domains) {
    for (const char* side : {"source", "target"}) fs::create_directories(fs::path(o.out) / side / domain);
    for (int sh = 0; sh < o.shards_per_domain; ++sh) {
      char name[32];
      std::snprintf(name, sizeof name, "shard-%03d.h5", sh);
      const int64_t Tn = int64_t{o.sequences_per_shard} * o.seq_len;
      ShardWriter ws_(((fs::path(o.out) / "source" / domain) / name).string(), o.source_model, domain, o.source, Tn,
                      o.dtype, o.with_queries, o.chunk_tokens);
      ShardWriter wt_(((fs::path(o.out) / "target" / domain) / name).string(), o.target_model, domain, o.target, Tn,
                      o.dtype, o.with_queries, o.chunk_tokens);
      std::vector<int32_t> ids(Tn), pos_s(Tn), pos_t(Tn);
      std::vector<int64_t> offs = {0};
      std::vector<float> ks(S.width()), vs(S.width()), kt(T.width()), vt(T.width());
      std::vector<float> qs, qt;
      if (o.with_queries) {
        qs.resize(int64_t{Ls} * o.source.n_q_heads * o.source.head_dim);
        qt.resize(int64_t{Lt} * o.target.n_q_heads * o.target.head_dim);
      }
      for (int s = 0; s < o.sequences_per_shard; ++s) {
        int p = o.gapped_positions ? offset(rng) : 0;
        for (int j = 0; j < o.seq_len; ++j) {
          const int64_t t = int64_t{s} * o.seq_len + j;
          ids[t] = token(rng);
          pos_s[t] = pos_t[t] = p;
          p += o.gapped_positions ? step(rng) : 1;
        }
        offs.push_back(offs.back() + o.seq_len);
      }
      ws_.write_token_ids(ids);
      wt_.write_token_ids(ids);
      ws_.write_positions(pos_s);
      wt_.write_positions(pos_t);
      ws_.write_seq_offsets(offs);
      wt_.write_seq_offsets(offs);
      std::vector<float> Z(kComponents * kLatent), zmix(kLatent), zk(kLatent), priv(kLatent);
      const int64_t B = std::max<int64_t>(1, o.chunk_tokens);
      std::vector<float> bks(B * S.width()), bvs(B * S.width()), bkt(B * T.width()), bvt(B * T.width()), bqs, bqt;
      if (o.with_queries) {
        bqs.resize(B * qs.size());
        bqt.resize(B * qt.size());
      }
      int64_t filled = 0, t_block = 0;
      auto flush = [&] {
        if (filled == 0) return;
        ws_.write_rows("keys", t_block, filled, bks.data());
        ws_.write_rows("values", t_block, filled, bvs.data());
        wt_.write_rows("keys", t_block, filled, bkt.data());
        wt_.write_rows("values", t_block, filled, bvt.data());
        if (o.with_queries) {
          ws_.write_rows("queries", t_block, filled, bqs.data());
          wt_.write_rows("queries", t_block, filled, bqt.data());
        }
        t_block += filled;
        filled = 0;
      };
      for (int64_t t = 0; t < Tn; ++t) {
        std::fill(ks.begin(), ks.end(), 0.0f);
        std::fill(vs.begin(), vs.end(), 0.0f);
        std::fill(kt.begin(), kt.end(), 0.0f);
        std::fill(vt.begin(), vt.end(), 0.0f);
        if (o.relation == SynthRelation::family) {
          for (auto& z : Z) z = normal(rng);
          for (int a = 0; a < Ls; ++a) {
            std::fill(zmix.begin(), zmix.end(), 0.0f);
            for (int j = 0; j < kComponents; ++j)
              for (int i = 0; i < kLatent; ++i) zmix[i] += ws[a][j] * Z[j * kLatent + i];
            gemv_acc(zmix.data(), As_k[a], kLatent, static_cast<int>(F), ks.data() + a * F);
            gemv_acc(zmix.data(), As_v[a], kLatent, static_cast<int>(F), vs.data() + a * F);
            for (auto& x : priv) x = normal(rng);
            gemv_acc(priv.data(), Ps[a], kLatent, static_cast<int>(F), ks.data() + a * F);
            for (auto& x : priv) x = normal(rng);
            gemv_acc(priv.data(), Ps[a], kLatent, static_cast<int>(F), vs.data() + a * F);
            for (int64_t c = 0; c < F; ++c) {
              ks[a * F + c] += 0.05f * normal(rng);
              vs[a * F + c] += 0.05f * normal(rng);
            }
          }
          for (int l = 0; l < Lt; ++l) {
            std::fill(zmix.begin(), zmix.end(), 0.0f);
            for (int j = 0; j < kComponents; ++j)
              for (int i = 0; i < kLatent; ++i) zmix[i] += wt[l][j] * Z[j * kLatent + i];
            for (int i = 0; i < kLatent; ++i) zk[i] = zmix[i] + 0.3f * std::tanh(2.0f * zmix[i]);  // mild non-linearity
            gemv_acc(zk.data(), At_k[l], kLatent, static_cast<int>(G), kt.data() + l * G);
            for (int i = 0; i < kLatent; ++i) zk[i] = zmix[i] + 0.5f * zmix[i] * zmix[i] * (i % 2 ? 1.0f : -0.5f) * 0.3f;
            gemv_acc(zk.data(), At_v[l], kLatent, static_cast<int>(G), vt.data() + l * G);
            for (auto& x : priv) x = normal(rng);
            gemv_acc(priv.data(), Pt[l], kLatent, static_cast<int>(G), kt.data() + l * G);
            for (auto& x : priv) x = normal(rng);
            gemv_acc(priv.data(), Pt[l], kLatent, static_cast<int>(G), vt.data() + l * G);
            for (int64_t c = 0; c < G; ++c) {
              kt[l * G + c] += ct_k[l][c];
              vt[l * G + c] += ct_v[l][c];
            }
          }
          add_large_mean(ks.data(), o.source);
          add_large_mean(kt.data(), o.target);
        } else {
          for (auto& x : ks) x = normal(rng);
          for (auto& x : vs) x = normal(rng);
          if (o.relation == SynthRelation::nonlinear)  // relu(x N1) N2 of the source content (before the large mean)
            for (int l = 0; l < Lt; ++l) {
              const int a = l % Ls;
              for (auto [x, n1, n2, y] : {std::tuple{&ks, &N1_k[l], &N2_k[l], &kt}, std::tuple{&vs, &N1_v[l], &N2_v[l], &vt}}) {
                std::vector<float> h(kPlantedHidden, 0.0f);
                gemv_acc(x->data() + a * F, *n1, static_cast<int>(F), kPlantedHidden, h.data());
                for (auto& v : h) v = std::max(v, 0.0f);
                gemv_acc(h.data(), *n2, kPlantedHidden, static_cast<int>(G), y->data() + l * G);
              }
            }
          add_large_mean(ks.data(), o.source);
          for (int l = 0; l < Lt; ++l) {
            const int a = l % Ls;
            gemv_acc(ks.data() + a * F, Ml_k[l], static_cast<int>(F), static_cast<int>(G), kt.data() + l * G);
            gemv_acc(vs.data() + a * F, Ml_v[l], static_cast<int>(F), static_cast<int>(G), vt.data() + l * G);
            for (int64_t c = 0; c < G; ++c) {
              kt[l * G + c] += ct_k[l][c];
              vt[l * G + c] += ct_v[l][c];
            }
          }
        }
        if (o.with_queries) {
          // Queries (content space): half the token's own key content in its KV group, large-mean channels left
          // out, plus noise; then RoPE as for the keys. Tokens attend to tokens with similar keys.
          auto make_q = [&](const std::vector<float>& k, const KvSpec& spec, std::vector<float>& q) {
            const int H = spec.n_kv_heads, Hq = spec.n_q_heads, D = spec.head_dim;
            const int r = spec.rope.rotary_dim > 0 ? spec.rope.rotary_dim : D, grp = std::max(1, Hq / H);
            for (int l = 0; l < spec.n_layers; ++l)
              for (int j = 0; j < Hq; ++j)
                for (int d = 0; d < D; ++d) {
                  const bool big = d < r / 2 && d >= r / 2 - o.large_mean_channels;
                  const float kc = big ? 0.0f : k[(int64_t{l} * H + std::min(j / grp, H - 1)) * D + d];
                  q[(int64_t{l} * Hq + j) * D + d] = 0.5f * kc + normal(rng);
                }
          };
          make_q(ks, o.source, qs);
          make_q(kt, o.target, qt);
          rope_s.apply_block(qs.data(), 1, int64_t{Ls} * o.source.n_q_heads, &pos_s[t]);
          rope_t.apply_block(qt.data(), 1, int64_t{Lt} * o.target.n_q_heads, &pos_t[t]);
        }
        rope_s.apply_block(ks.data(), 1, int64_t{Ls} * o.source.n_kv_heads, &pos_s[t]);
        rope_t.apply_block(kt.data(), 1, int64_t{Lt} * o.target.n_kv_heads, &pos_t[t]);
        std::copy(ks.begin(), ks.end(), bks.begin() + filled * S.width());
        std::copy(vs.begin(), vs.end(), bvs.begin() + filled * S.width());
        std::copy(kt.begin(), kt.end(), bkt.begin() + filled * T.width());
        std::copy(vt.begin(), vt.end(), bvt.begin() + filled * T.width());
        if (o.with_queries) {
          std::copy(qs.begin(), qs.end(), bqs.begin() + filled * qs.size());
          std::copy(qt.begin(), qt.end(), bqt.begin() + filled * qt.size());
        }
        if (++filled == B) flush();
      }
      flush();
      ws_.close();
      wt_.close();
      total += Tn;
    }
  }
  return total;
}

}  // namespace crosskv
