#include "scalar_oracle.hpp"

#include <lapacke.h>

#include <cmath>
#include <limits>

#include "core/error.hpp"
#include "core/r2.hpp"
#include "core/rope.hpp"
#include "eval/layer_diagnostics.hpp"
#include "io/shard.hpp"

namespace crosskv {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

double mean_of(const std::vector<double>& v) { return mean_ignoring_nan(v); }

// 1 - SSE/SST per head over tokens and the head's dims (SST about the per-column mean). NaN where SST = 0.
std::vector<double> r2_heads(const float* pred, const float* truth, int64_t T, int64_t row, int64_t col0, int H,
                             int D) {
  std::vector<double> out(H);
  for (int h = 0; h < H; ++h) {
    double sse = 0, sst = 0;
    for (int d = 0; d < D; ++d) {
      const int64_t c = col0 + int64_t{h} * D + d;
      double mean = 0;
      for (int64_t t = 0; t < T; ++t) mean += truth[t * row + c];
      mean /= static_cast<double>(T);
      for (int64_t t = 0; t < T; ++t) {
        const double y = truth[t * row + c], e = pred[t * row + c] - y;
        sse += e * e;
        sst += (y - mean) * (y - mean);
      }
    }
    out[h] = sst > 0 ? 1.0 - sse / sst : kNaN;
  }
  return out;
}

}  // namespace

Cache read_cache(const std::string& path, bool want_queries) {
  ShardReader r(path);
  const ShardHeader& h = r.header();
  Cache c;
  c.path = path;
  c.spec = h.spec;
  c.tokens = h.tokens;
  const int64_t W = int64_t{h.spec.n_layers} * h.spec.features_per_layer();
  std::vector<uint16_t> scratch;
  c.keys.resize(c.tokens * W);
  c.values.resize(c.tokens * W);
  r.read_rows("keys", 0, c.tokens, 1, c.keys.data(), scratch);
  r.read_rows("values", 0, c.tokens, 1, c.values.data(), scratch);
  if (want_queries && h.has_queries) {
    c.queries.resize(c.tokens * int64_t{h.spec.n_layers} * h.spec.n_q_heads * h.spec.head_dim);
    r.read_rows("queries", 0, c.tokens, 1, c.queries.data(), scratch);
  }
  c.positions = r.positions();
  c.seq_offsets = r.seq_offsets();
  return c;
}

Cache read_caches(const std::vector<std::string>& paths, bool want_queries) {
  CROSSKV_ASSERT(!paths.empty(), "no shards");
  Cache all = read_cache(paths[0], want_queries);
  for (size_t i = 1; i < paths.size(); ++i) {
    Cache c = read_cache(paths[i], want_queries);
    if (c.spec != all.spec) throw InputError(paths[i] + ": kv_spec differs from " + paths[0]);
    if (c.queries.empty() != all.queries.empty())
      throw InputError(paths[i] + ": has " + (c.queries.empty() ? "no " : "") + "queries, unlike " + paths[0]);
    all.keys.insert(all.keys.end(), c.keys.begin(), c.keys.end());
    all.values.insert(all.values.end(), c.values.begin(), c.values.end());
    all.queries.insert(all.queries.end(), c.queries.begin(), c.queries.end());
    all.positions.insert(all.positions.end(), c.positions.begin(), c.positions.end());
    for (size_t s = 1; s < c.seq_offsets.size(); ++s) all.seq_offsets.push_back(all.tokens + c.seq_offsets[s]);
    all.tokens += c.tokens;
    all.path += ", " + paths[i];
  }
  return all;
}

Diagnostics diagnose(const Cache& truth, const std::vector<float>& keys, const std::vector<float>& values) {
  const KvSpec& s = truth.spec;
  const int L = s.n_layers, H = s.n_kv_heads, D = s.head_dim, Hq = s.n_q_heads;
  const int64_t T = truth.tokens, G = s.features_per_layer(), W = L * G;
  CROSSKV_ASSERT(static_cast<int64_t>(keys.size()) == T * W && static_cast<int64_t>(values.size()) == T * W,
                 "prediction shape");
  // R² in content space: both sides' keys with the target RoPE stripped at the same positions.
  Rope rope(s);
  std::vector<float> ck = keys, tk = truth.keys;
  rope.strip_block(ck.data(), T, rope.all(), truth.positions.data());
  rope.strip_block(tk.data(), T, rope.all(), truth.positions.data());
  const bool attention = !truth.queries.empty();
  if (attention && (Hq < H || Hq % H != 0))
    throw InputError("target kv_spec: n_q_heads " + std::to_string(Hq) + " is not a multiple of n_kv_heads " +
                     std::to_string(H) + " (needed for the attention diagnostics)");
  const int group = attention ? Hq / H : 1;
  const double scale = s.attention_scale();  // 1/sqrt(D) unless the spec gives query_scale
  std::vector<LayerDiagnostics> layers;
  std::vector<double> wq(T), p_true, p_pred;
  for (int l = 0; l < L; ++l) {
    LayerDiagnostics ld;
    ld.layer = l;
    ld.r2_k = r2_heads(ck.data(), tk.data(), T, W, int64_t{l} * G, H, D);
    ld.r2_v = r2_heads(values.data(), truth.values.data(), T, W, int64_t{l} * G, H, D);
    ld.r2_k_mean = mean_of(ld.r2_k);
    ld.r2_v_mean = mean_of(ld.r2_v);
    if (attention) {
      const int64_t QW = int64_t{L} * Hq * D;
      for (int j = 0; j < Hq; ++j) {
        const int g = j / group;
        const float* q = truth.queries.data() + (int64_t{l} * Hq + j) * D;
        auto kt = [&](int64_t t) { return truth.keys.data() + t * W + l * G + int64_t{g} * D; };
        auto kp = [&](int64_t t) { return keys.data() + t * W + l * G + int64_t{g} * D; };
        auto vt = [&](int64_t t) { return truth.values.data() + t * W + l * G + int64_t{g} * D; };
        auto vp = [&](int64_t t) { return values.data() + t * W + l * G + int64_t{g} * D; };
        // Attention outputs over the true and the predicted cache; cosine per token; w_s for V-concentration.
        std::fill(wq.begin(), wq.end(), 0.0);
        double cos_sum = 0;
        std::vector<double> ot(D), op(D);
        for (size_t sq = 0; sq + 1 < truth.seq_offsets.size(); ++sq) {
          const int64_t a = truth.seq_offsets[sq], b = truth.seq_offsets[sq + 1];
          for (int64_t t = a; t < b; ++t) {
            const float* qt = q + t * QW;
            const int64_t n = t - a + 1;
            p_true.assign(n, 0.0);
            p_pred.assign(n, 0.0);
            double mt = -INFINITY, mp = -INFINITY;
            for (int64_t u = 0; u < n; ++u) {
              double st = 0, sp = 0;
              const float* k1 = kt(a + u);
              const float* k2 = kp(a + u);
              for (int d = 0; d < D; ++d) {
                st += static_cast<double>(qt[d]) * k1[d];
                sp += static_cast<double>(qt[d]) * k2[d];
              }
              const bool outside = s.window(l) > 0 && truth.positions[t] - truth.positions[a + u] >= s.window(l);
              p_true[u] = outside ? -INFINITY : st * scale;  // a sliding layer: keys less than window back only
              p_pred[u] = outside ? -INFINITY : sp * scale;
              mt = std::max(mt, p_true[u]);
              mp = std::max(mp, p_pred[u]);
            }
            double zt = 0, zp = 0;
            for (int64_t u = 0; u < n; ++u) {
              p_true[u] = std::exp(p_true[u] - mt);
              p_pred[u] = std::exp(p_pred[u] - mp);
              zt += p_true[u];
              zp += p_pred[u];
            }
            std::fill(ot.begin(), ot.end(), 0.0);
            std::fill(op.begin(), op.end(), 0.0);
            for (int64_t u = 0; u < n; ++u) {
              const double at = p_true[u] / zt, ap = p_pred[u] / zp;
              wq[a + u] += at * at;
              const float* v1 = vt(a + u);
              const float* v2 = vp(a + u);
              for (int d = 0; d < D; ++d) {
                ot[d] += at * v1[d];
                op[d] += ap * v2[d];
              }
            }
            double dot = 0, n1 = 0, n2 = 0;
            for (int d = 0; d < D; ++d) {
              dot += ot[d] * op[d];
              n1 += ot[d] * ot[d];
              n2 += op[d] * op[d];
            }
            cos_sum += (n1 > 0 && n2 > 0) ? dot / std::sqrt(n1 * n2) : (n1 == n2 ? 1.0 : 0.0);
          }
        }
        ld.cosine.push_back(cos_sum / static_cast<double>(T));
        // K-concentration: the key error along the right singular vectors of this head's queries.
        std::vector<double> M(int64_t{D} * D, 0.0), sig2(D);
        for (int64_t t = 0; t < T; ++t) {
          const float* qt = q + t * QW;
          for (int d = 0; d < D; ++d)
            for (int e = d; e < D; ++e) M[int64_t{d} * D + e] += static_cast<double>(qt[d]) * qt[e];
        }
        const lapack_int info = LAPACKE_dsyev(LAPACK_ROW_MAJOR, 'V', 'U', D, M.data(), D, sig2.data());
        CROSSKV_ASSERT(info == 0, "dsyev failed (" + std::to_string(info) + ")");
        std::vector<double> E(D, 0.0);
        for (int64_t t = 0; t < T; ++t) {
          const float* k1 = kt(t);
          const float* k2 = kp(t);
          for (int i = 0; i < D; ++i) {  // eigenvector i is column i
            double proj = 0;
            for (int d = 0; d < D; ++d) proj += (static_cast<double>(k2[d]) - k1[d]) * M[int64_t{d} * D + i];
            E[i] += proj * proj / static_cast<double>(T);
          }
        }
        double num_k = 0, den_k = 0, mean_e = 0;
        for (int i = 0; i < D; ++i) {
          num_k += std::max(sig2[i], 0.0) * E[i];
          den_k += std::max(sig2[i], 0.0);
          mean_e += E[i] / D;
        }
        ld.k_concentration.push_back(mean_e > 0 && den_k > 0 ? (num_k / den_k) / mean_e : 1.0);
        // V-concentration: the value error where the true attention reads.
        double num_v = 0, den_v = 0, mean_v = 0;
        for (int64_t t = 0; t < T; ++t) {
          const float* v1 = vt(t);
          const float* v2 = vp(t);
          double e = 0;
          for (int d = 0; d < D; ++d) e += (static_cast<double>(v2[d]) - v1[d]) * (static_cast<double>(v2[d]) - v1[d]);
          num_v += wq[t] * e;
          den_v += wq[t];
          mean_v += e / static_cast<double>(T);
        }
        ld.v_concentration.push_back(mean_v > 0 && den_v > 0 ? (num_v / den_v) / mean_v : 1.0);
      }
      ld.cosine_mean = mean_of(ld.cosine);
      ld.k_concentration_mean = mean_of(ld.k_concentration);
      ld.v_concentration_mean = mean_of(ld.v_concentration);
    }
    layers.push_back(std::move(ld));
  }
  return summarize_layers(std::move(layers), T, attention);
}

Evaluation evaluate(Transfer& tr, const Cache& source, const Cache& target) {
  const std::string src_name = source.path.empty() ? "the source cache" : source.path,
                    tgt_name = target.path.empty() ? "the target cache" : target.path;
  check_kv_spec(tr.manifest(), true, source.spec, src_name);
  check_kv_spec(tr.manifest(), false, target.spec, tgt_name);
  if (source.tokens != target.tokens || source.seq_offsets != target.seq_offsets)
    throw InputError(tgt_name + ": holds other tokens than " + src_name + " (" + std::to_string(target.tokens) +
                     " vs " + std::to_string(source.tokens) + ", or other sequences)");
  const KvSpec &S = tr.source(), &Tg = tr.target();
  const int64_t T = source.tokens, XW = S.n_layers * S.features_per_layer(), YW = Tg.n_layers * Tg.features_per_layer();
  std::vector<float> xk = source.keys;
  const Rope rs(S);
  rs.strip_block(xk.data(), T, rs.all(), source.positions.data());
  std::vector<float> ck(T * YW), cv(T * YW);
  tr.map_content(xk.data(), source.values.data(), T, ck.data(), cv.data());
  Rope rt(Tg);
  const LayerHeads heads = rt.all();
  Evaluation ev;
  std::vector<float> pk = ck;
  rt.apply_block(pk.data(), T, heads, target.positions.data());
  ev.mapper = diagnose(target, pk, cv);
  ev.no_target_rope = diagnose(target, ck, cv);
  // Mean-only: the mapper applied to the mean source content of these tokens, for every token.
  std::vector<float> mk(XW, 0.0f), mv(XW, 0.0f);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t c = 0; c < XW; ++c) {
      mk[c] += xk[t * XW + c] / static_cast<float>(T);
      mv[c] += source.values[t * XW + c] / static_cast<float>(T);
    }
  std::vector<float> yk(YW), yv(YW);
  tr.map_content(mk.data(), mv.data(), 1, yk.data(), yv.data());
  std::vector<float> bk(T * YW), bv(T * YW);
  for (int64_t t = 0; t < T; ++t) {
    std::copy(yk.begin(), yk.end(), bk.begin() + t * YW);
    std::copy(yv.begin(), yv.end(), bv.begin() + t * YW);
  }
  rt.apply_block(bk.data(), T, heads, target.positions.data());
  ev.mean_only = diagnose(target, bk, bv);
  judge(ev);
  return ev;
}

}  // namespace crosskv
