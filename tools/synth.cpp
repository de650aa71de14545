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

namespace {

constexpr int kPlantedHidden = 32;  // the nonlinear relation's planted ReLU layers

// The planted relation of a pair: latent z -> content per layer (keys and values; layer-private latents), the
// direct maps of the linear and nonlinear relations, the targets' constant offsets and the depth mixing weights.
struct Planted {
  std::vector<Mat> As_k, As_v, Ps, At_k, At_v, Pt, Ml_k, Ml_v, N1_k, N2_k, N1_v, N2_v;
  std::vector<std::vector<float>> ct_k, ct_v, ws, wt;
};

Planted plant(const SynthOptions& o, int64_t F, int64_t G, std::mt19937_64& rng) {
  const int Ls = o.source.n_layers, Lt = o.target.n_layers;
  Planted p;
  for (auto* v : {&p.As_k, &p.As_v, &p.Ps}) v->resize(Ls);
  for (auto* v : {&p.At_k, &p.At_v, &p.Pt, &p.Ml_k, &p.Ml_v, &p.N1_k, &p.N2_k, &p.N1_v, &p.N2_v}) v->resize(Lt);
  p.ct_k.resize(Lt), p.ct_v.resize(Lt), p.ws.resize(Ls), p.wt.resize(Lt);
  const double zs = 1.0 / std::sqrt(static_cast<double>(kLatent));
  for (int a = 0; a < Ls; ++a) {
    p.As_k[a] = random_matrix(rng, kLatent, static_cast<int>(F), zs);
    p.As_v[a] = random_matrix(rng, kLatent, static_cast<int>(F), zs);
    p.Ps[a] = random_matrix(rng, kLatent, static_cast<int>(F), zs * o.noise);
  }
  for (int l = 0; l < Lt; ++l) {
    p.At_k[l] = random_matrix(rng, kLatent, static_cast<int>(G), zs);
    p.At_v[l] = random_matrix(rng, kLatent, static_cast<int>(G), zs);
    p.Pt[l] = random_matrix(rng, kLatent, static_cast<int>(G), zs * o.noise);
    if (o.relation != SynthRelation::family) {
      p.Ml_k[l] = random_matrix(rng, static_cast<int>(F), static_cast<int>(G), 1.0 / std::sqrt(double(F)));
      p.Ml_v[l] = random_matrix(rng, static_cast<int>(F), static_cast<int>(G), 1.0 / std::sqrt(double(F)));
    }
    if (o.relation == SynthRelation::per_head) {  // only the head-diagonal blocks of M_l stay
      const int Ds = o.source.head_dim, Dt = o.target.head_dim;
      for (Mat* m : {&p.Ml_k[l], &p.Ml_v[l]})
        for (int64_t r = 0; r < F; ++r)
          for (int64_t c = 0; c < G; ++c)
            if (r / Ds != c / Dt) (*m)[r * G + c] = 0.0f;
    }
    if (o.relation == SynthRelation::nonlinear) {
      for (auto* n1 : {&p.N1_k[l], &p.N1_v[l]})
        *n1 = random_matrix(rng, static_cast<int>(F), kPlantedHidden, 1.0 / std::sqrt(double(F)));
      for (auto* n2 : {&p.N2_k[l], &p.N2_v[l]})
        *n2 = random_matrix(rng, kPlantedHidden, static_cast<int>(G), 2.0 / std::sqrt(double(kPlantedHidden)));
    }
    p.ct_k[l] = random_matrix(rng, 1, static_cast<int>(G), 1.0);
    p.ct_v[l] = random_matrix(rng, 1, static_cast<int>(G), 1.0);
  }
  for (int a = 0; a < Ls; ++a) p.ws[a] = depth_weights(Ls == 1 ? 0.0 : double(a) / (Ls - 1));
  for (int l = 0; l < Lt; ++l) p.wt[l] = depth_weights(Lt == 1 ? 0.0 : double(l) / (Lt - 1));
  return p;
}

// One token's keys and values of both sides (content space, before RoPE) and its queries, drawn from the planted
// relation with the pair's one generator and normal distribution, in a fixed order.
class TokenMaker {
 public:
  TokenMaker(const SynthOptions& o, const Planted& p, std::mt19937_64& rng, std::normal_distribution<float>& normal)
      : o_(o), p_(p), rng_(rng), normal_(normal), F_(Side{&o.source}.per_layer()), G_(Side{&o.target}.per_layer()),
        Z_(kComponents * kLatent), zmix_(kLatent), zk_(kLatent), priv_(kLatent) {}

  void make(std::vector<float>& ks, std::vector<float>& vs, std::vector<float>& kt, std::vector<float>& vt) {
    for (auto* v : {&ks, &vs, &kt, &vt}) std::fill(v->begin(), v->end(), 0.0f);
    if (o_.relation == SynthRelation::family)
      family(ks, vs, kt, vt);
    else
      related(ks, vs, kt, vt);
  }

  // Queries (content space): half the token's own key content in its KV group, large-mean channels left out, plus
  // noise. Tokens attend to tokens with similar keys.
  void queries(const std::vector<float>& k, const KvSpec& spec, std::vector<float>& q) {
    const int H = spec.n_kv_heads, Hq = spec.n_q_heads, D = spec.head_dim;
    const int r = spec.rope.rotary_dim > 0 ? spec.rope.rotary_dim : D, grp = std::max(1, Hq / H);
    for (int l = 0; l < spec.n_layers; ++l)
      for (int j = 0; j < Hq; ++j)
        for (int d = 0; d < D; ++d) {
          const bool big = d < r / 2 && d >= r / 2 - o_.large_mean_channels;
          const float kc = big ? 0.0f : k[(int64_t{l} * H + std::min(j / grp, H - 1)) * D + d];
          q[(int64_t{l} * Hq + j) * D + d] = 0.5f * kc + normal_(rng_);
        }
  }

 private:
  float draw() { return normal_(rng_); }
  void mix(const std::vector<float>& w) {
    std::fill(zmix_.begin(), zmix_.end(), 0.0f);
    for (int j = 0; j < kComponents; ++j)
      for (int i = 0; i < kLatent; ++i) zmix_[i] += w[j] * Z_[j * kLatent + i];
  }
  // Layer-private latents through P into content (a fresh draw each).
  void add_private(const Mat& P, int cols, float* out) {
    for (auto& x : priv_) x = draw();
    gemv_acc(priv_.data(), P, kLatent, cols, out);
  }
  // Large-mean key channels: the first channels of every head's lowest-frequency pair.
  void add_large_mean(float* content, const KvSpec& spec) const {
    const int D = spec.head_dim, r = spec.rope.rotary_dim > 0 ? spec.rope.rotary_dim : D;
    for (int64_t h = 0; h < int64_t{spec.n_layers} * spec.n_kv_heads; ++h)
      for (int c = 0; c < o_.large_mean_channels && c < r / 2; ++c)
        content[h * D + (r / 2 - 1 - c)] += static_cast<float>(o_.large_mean * (1.0 + 0.1 * c));
  }

  // The family relation: shared latent components mixed by depth, a mild non-linearity on the target side.
  void family(std::vector<float>& ks, std::vector<float>& vs, std::vector<float>& kt, std::vector<float>& vt) {
    const int F = static_cast<int>(F_), G = static_cast<int>(G_);
    for (auto& z : Z_) z = draw();
    for (int a = 0; a < o_.source.n_layers; ++a) {
      mix(p_.ws[a]);
      gemv_acc(zmix_.data(), p_.As_k[a], kLatent, F, ks.data() + a * F_);
      gemv_acc(zmix_.data(), p_.As_v[a], kLatent, F, vs.data() + a * F_);
      add_private(p_.Ps[a], F, ks.data() + a * F_);
      add_private(p_.Ps[a], F, vs.data() + a * F_);
      for (int64_t c = 0; c < F_; ++c) {
        ks[a * F_ + c] += 0.05f * draw();
        vs[a * F_ + c] += 0.05f * draw();
      }
    }
    for (int l = 0; l < o_.target.n_layers; ++l) {
      mix(p_.wt[l]);
      for (int i = 0; i < kLatent; ++i) zk_[i] = zmix_[i] + 0.3f * std::tanh(2.0f * zmix_[i]);  // mild non-linearity
      gemv_acc(zk_.data(), p_.At_k[l], kLatent, G, kt.data() + l * G_);
      for (int i = 0; i < kLatent; ++i) zk_[i] = zmix_[i] + 0.5f * zmix_[i] * zmix_[i] * (i % 2 ? 1.0f : -0.5f) * 0.3f;
      gemv_acc(zk_.data(), p_.At_v[l], kLatent, G, vt.data() + l * G_);
      add_private(p_.Pt[l], G, kt.data() + l * G_);
      add_private(p_.Pt[l], G, vt.data() + l * G_);
      for (int64_t c = 0; c < G_; ++c) {
        kt[l * G_ + c] += p_.ct_k[l][c];
        vt[l * G_ + c] += p_.ct_v[l][c];
      }
    }
    add_large_mean(ks.data(), o_.source);
    add_large_mean(kt.data(), o_.target);
  }

  // The linear and nonlinear relations: target layer l from source layer l mod Ls by a planted map (plus, for the
  // nonlinear one, relu(x N1) N2 of the source content before its large mean).
  void related(std::vector<float>& ks, std::vector<float>& vs, std::vector<float>& kt, std::vector<float>& vt) {
    const int F = static_cast<int>(F_), G = static_cast<int>(G_), Ls = o_.source.n_layers, Lt = o_.target.n_layers;
    for (auto& x : ks) x = draw();
    for (auto& x : vs) x = draw();
    if (o_.relation == SynthRelation::nonlinear)
      for (int l = 0; l < Lt; ++l) {
        const int a = l % Ls;
        for (auto [x, n1, n2, y] : {std::tuple{&ks, &p_.N1_k[l], &p_.N2_k[l], &kt}, std::tuple{&vs, &p_.N1_v[l], &p_.N2_v[l], &vt}}) {
          std::vector<float> h(kPlantedHidden, 0.0f);
          gemv_acc(x->data() + a * F_, *n1, F, kPlantedHidden, h.data());
          for (auto& v : h) v = std::max(v, 0.0f);
          gemv_acc(h.data(), *n2, kPlantedHidden, G, y->data() + l * G_);
        }
      }
    add_large_mean(ks.data(), o_.source);
    for (int l = 0; l < Lt; ++l) {
      const int a = l % Ls;
      gemv_acc(ks.data() + a * F_, p_.Ml_k[l], F, G, kt.data() + l * G_);
      gemv_acc(vs.data() + a * F_, p_.Ml_v[l], F, G, vt.data() + l * G_);
      for (int64_t c = 0; c < G_; ++c) {
        kt[l * G_ + c] += p_.ct_k[l][c];
        vt[l * G_ + c] += p_.ct_v[l][c];
      }
    }
  }

  const SynthOptions& o_;
  const Planted& p_;
  std::mt19937_64& rng_;
  std::normal_distribution<float>& normal_;
  const int64_t F_, G_;
  std::vector<float> Z_, zmix_, zk_, priv_;
};

// The shard's token ids, positions (the same on both sides: gapped, or 0, 1, 2, ... per sequence) and sequence
// offsets.
struct TokenLayout {
  std::vector<int32_t> ids, positions;
  std::vector<int64_t> seq_offsets = {0};
};

TokenLayout draw_tokens(const SynthOptions& o, int64_t Tn, std::mt19937_64& rng) {
  std::uniform_int_distribution<int> token(0, 150000), offset(0, 4000), step(1, 3);
  TokenLayout tl;
  tl.ids.resize(Tn), tl.positions.resize(Tn);
  for (int s = 0; s < o.sequences_per_shard; ++s) {
    int p = o.gapped_positions ? offset(rng) : 0;
    for (int j = 0; j < o.seq_len; ++j) {
      const int64_t t = int64_t{s} * o.seq_len + j;
      tl.ids[t] = token(rng);
      tl.positions[t] = p;
      p += o.gapped_positions ? step(rng) : 1;
    }
    tl.seq_offsets.push_back(tl.seq_offsets.back() + o.seq_len);
  }
  return tl;
}

// Both sides' shard `name` of `domain`: token ids, positions and sequences, then every token's KV (and queries),
// written a chunk of rows at a time. Returns the tokens written.
int64_t write_shard_pair(const SynthOptions& o, const std::string& domain, const std::string& name, TokenMaker& maker,
                         std::mt19937_64& rng) {
  const Side S{&o.source}, T{&o.target};
  const int Ls = o.source.n_layers, Lt = o.target.n_layers;
  Rope rope_s(o.source, "source"), rope_t(o.target, "target");
  const int64_t Tn = int64_t{o.sequences_per_shard} * o.seq_len;
  ShardWriter ws_(((fs::path(o.out) / "source" / domain) / name).string(), o.source_model, domain, o.source, Tn,
                  o.dtype, o.with_queries, o.chunk_tokens, o.checksum);
  ShardWriter wt_(((fs::path(o.out) / "target" / domain) / name).string(), o.target_model, domain, o.target, Tn,
                  o.dtype, o.with_queries, o.chunk_tokens, o.checksum);
  const TokenLayout tl = draw_tokens(o, Tn, rng);
  const std::vector<int32_t>& pos = tl.positions;
  for (ShardWriter* w : {&ws_, &wt_}) {
    w->write_token_ids(tl.ids);
    w->write_positions(tl.positions);
    w->write_seq_offsets(tl.seq_offsets);
  }
  if (o.with_weights) {
    std::uniform_real_distribution<double> u(-1.0, 1.0);
    std::vector<float> w(static_cast<size_t>(Tn));
    for (auto& x : w) x = static_cast<float>(std::pow(10.0, u(rng)));
    wt_.write_weights(w);
  }
  std::vector<float> ks(S.width()), vs(S.width()), kt(T.width()), vt(T.width()), qs, qt;
  if (o.with_queries) {
    qs.resize(int64_t{Ls} * o.source.n_q_heads * o.source.head_dim);
    qt.resize(int64_t{Lt} * o.target.n_q_heads * o.target.head_dim);
  }
  const int64_t B = std::max<int64_t>(1, o.chunk_tokens);
  std::vector<float> bks(B * S.width()), bvs(B * S.width()), bkt(B * T.width()), bvt(B * T.width()), bqs, bqt;
  if (o.with_queries) bqs.resize(B * qs.size()), bqt.resize(B * qt.size());
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
    maker.make(ks, vs, kt, vt);
    if (o.with_queries) {  // then RoPE as for the keys
      maker.queries(ks, o.source, qs);
      maker.queries(kt, o.target, qt);
      rope_s.apply_block(qs.data(), 1, {0, Ls, o.source.n_q_heads}, &pos[t]);
      rope_t.apply_block(qt.data(), 1, {0, Lt, o.target.n_q_heads}, &pos[t]);
    }
    rope_s.apply_block(ks.data(), 1, rope_s.all(), &pos[t]);
    rope_t.apply_block(kt.data(), 1, rope_t.all(), &pos[t]);
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
  return Tn;
}

}  // namespace

int64_t synthesize(const SynthOptions& o) {
  // Both kv_specs checked before anything is written.
  Rope check_source(o.source, "source");
  Rope check_target(o.target, "target");
  if (o.relation == SynthRelation::per_head && o.source.n_kv_heads != o.target.n_kv_heads)
    throw UserError("--relation per_head: needs equal KV head counts (source " + std::to_string(o.source.n_kv_heads) +
                    ", target " + std::to_string(o.target.n_kv_heads) + ")");
  std::mt19937_64 rng(o.seed);
  const Planted planted = plant(o, Side{&o.source}.per_layer(), Side{&o.target}.per_layer(), rng);
  rng.seed(o.data_seed ? o.data_seed : o.seed * 0x9E3779B97F4A7C15ull + 1);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  TokenMaker maker(o, planted, rng, normal);
  int64_t total = 0;
  for (const auto& domain : o.domains) {
    for (const char* side : {"source", "target"}) fs::create_directories(fs::path(o.out) / side / domain);
    for (int sh = 0; sh < o.shards_per_domain; ++sh) {
      char name[32];
      std::snprintf(name, sizeof name, "shard-%03d.h5", sh);
      total += write_shard_pair(o, domain, name, maker, rng);
    }
  }
  return total;
}

}  // namespace crosskv
