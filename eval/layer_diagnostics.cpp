#include "eval/layer_diagnostics.hpp"

#if CROSSKV_HAVE_MVEC
#include <immintrin.h>
#endif

#include <algorithm>
#include <cmath>
#include <limits>
#include <optional>

#include <omp.h>

#include "core/error.hpp"
#include "core/r2.hpp"
#include "core/rope.hpp"
#include "core/threads.hpp"

namespace crosskv {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();
// The scores of one tile (a group of query heads, some rows, the columns up to the last row) hold at most
// `tile_floats` floats: long sequences go through in row tiles, and only the causal part of each is computed.
// Tiles of about a quarter of the sequence compute about 5/8 of its n^2 scores instead of all of them.
// row[u] = exp(row[u] - mx) for u < n; returns their sum (fp64). With glibc's vector maths (libmvec) 8 or 4 lanes
// at a time, else the scalar expf.
#if CROSSKV_HAVE_MVEC
extern "C" __m128 _ZGVbN4v_expf(__m128);
extern "C" __m256 _ZGVdN8v_expf(__m256);

__attribute__((target("avx2"))) double exp_shifted_avx2(float* row, int64_t n, float mx) {
  const __m256 m = _mm256_set1_ps(mx);
  __m256d z0 = _mm256_setzero_pd(), z1 = _mm256_setzero_pd();
  int64_t u = 0;
  for (; u + 8 <= n; u += 8) {
    const __m256 e = _ZGVdN8v_expf(_mm256_sub_ps(_mm256_loadu_ps(row + u), m));
    _mm256_storeu_ps(row + u, e);
    z0 = _mm256_add_pd(z0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
    z1 = _mm256_add_pd(z1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
  }
  alignas(32) double lanes[4];
  _mm256_store_pd(lanes, _mm256_add_pd(z0, z1));
  double z = lanes[0] + lanes[1] + lanes[2] + lanes[3];
  for (; u < n; ++u) z += (row[u] = std::exp(row[u] - mx));
  return z;
}
#endif

double exp_shifted(float* row, int64_t n, float mx) {
#if CROSSKV_HAVE_MVEC
  static const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (avx2) return exp_shifted_avx2(row, n, mx);
  const __m128 m = _mm_set1_ps(mx);
  __m128d z0 = _mm_setzero_pd(), z1 = _mm_setzero_pd();
  int64_t u = 0;
  for (; u + 4 <= n; u += 4) {
    const __m128 e = _ZGVbN4v_expf(_mm_sub_ps(_mm_loadu_ps(row + u), m));
    _mm_storeu_ps(row + u, e);
    z0 = _mm_add_pd(z0, _mm_cvtps_pd(e));
    z1 = _mm_add_pd(z1, _mm_cvtps_pd(_mm_movehl_ps(e, e)));
  }
  alignas(16) double lanes[2];
  _mm_store_pd(lanes, _mm_add_pd(z0, z1));
  double z = lanes[0] + lanes[1];
#else
  double z = 0;
  int64_t u = 0;
#endif
  for (; u < n; ++u) z += (row[u] = std::exp(row[u] - mx));
  return z;
}

int64_t tile_rows(int64_t n, int64_t group, int64_t tile_floats = LayerDiagnoser::kDefaultTileFloats) {
  return std::clamp<int64_t>(std::min(tile_floats / (group * n), std::max<int64_t>(64, (n + 3) / 4)), 1, n);
}

}  // namespace

LayerDiagnosticsCost layer_diagnostics_cost(const KvSpec& s, int64_t tokens, const std::vector<int64_t>& seq_offsets,
                                            bool attention) {
  LayerDiagnosticsCost c;
  const double D = s.head_dim, H = s.n_kv_heads, Hq = s.n_q_heads, T = static_cast<double>(tokens);
  const int64_t group = std::max(1, s.n_q_heads / std::max(1, s.n_kv_heads));
  c.scratch_bytes = int64_t{4} * 3 * tokens * s.features_per_layer();  // content keys, a stripped prediction
  if (!attention) return c;
  double att = 0;  // multiply-adds of scores and outputs for one query head
  int64_t longest = 0;
  for (size_t i = 0; i + 1 < seq_offsets.size(); ++i) {
    const int64_t n = seq_offsets[i + 1] - seq_offsets[i];
    longest = std::max(longest, n);
    if (n == 0) continue;
    const int64_t R = tile_rows(n, group);
    for (int64_t r0 = 0; r0 < n; r0 += R) att += 2.0 * static_cast<double>(std::min(n, r0 + R) - r0) *
                                                   static_cast<double>(std::min(n, r0 + R)) * D;
  }
  c.truth_flops = 2.0 * (Hq * att + Hq * T * D * D);
  c.prediction_flops = 2.0 * (Hq * att + H * T * D * D + Hq * D * D * D);
  const int64_t tile = longest ? group * tile_rows(longest, group) * longest : 0;
  // A tile of scores per host thread (a device backend holds one), the truth's and a prediction's outputs.
  c.scratch_bytes += int64_t{4} * tile * std::max(1, omp_get_max_threads()) +
                     int64_t{4} * 2 * tokens * s.n_q_heads * s.head_dim +
                     int64_t{8} * s.n_q_heads * tokens;
  return c;
}

LayerDiagnoser::LayerDiagnoser(DenseMaths& be, const LayerTruth& truth, int64_t tile_floats)
    : be_(be), t_(truth), tile_floats_(tile_floats) {
  const KvSpec& s = truth.spec;
  H_ = s.n_kv_heads, Hq_ = s.n_q_heads, D_ = s.head_dim;
  T_ = truth.tokens, G_ = s.features_per_layer();
  CROSSKV_ASSERT(static_cast<int64_t>(truth.keys.size()) == T_ * G_ &&
                     static_cast<int64_t>(truth.values.size()) == T_ * G_,
                 "layer truth shape");
  attention_ = !truth.queries.empty();
  if (attention_ && (Hq_ < H_ || Hq_ % H_ != 0))
    throw InputError("target kv_spec: n_q_heads " + std::to_string(Hq_) + " is not a multiple of n_kv_heads " +
                     std::to_string(H_) + " (needed for the attention diagnostics)");
  group_ = attention_ ? Hq_ / H_ : 1;
  window_ = s.window(truth.layer);
  // R² in content space, SST about each column's mean (two passes, in fp64).
  content_keys_ = truth.keys;
  const Rope rope(s);
  rope.strip_block(content_keys_.data(), T_, rope.one(truth.layer), truth.positions);
  mean_k_.assign(G_, 0.0), mean_v_.assign(G_, 0.0), sst_k_.assign(H_, 0.0), sst_v_.assign(H_, 0.0);
  const float *ck = content_keys_.data(), *tv = truth.values.data();
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H_; ++h) {
    for (int64_t c = int64_t{h} * D_; c < int64_t{h + 1} * D_; ++c) {
      double mk = 0, mv = 0;
      for (int64_t t = 0; t < T_; ++t) mk += ck[t * G_ + c], mv += tv[t * G_ + c];
      mean_k_[c] = mk / static_cast<double>(T_), mean_v_[c] = mv / static_cast<double>(T_);
    }
    double sk = 0, sv = 0;
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t c = int64_t{h} * D_; c < int64_t{h + 1} * D_; ++c) {
        const double dk = ck[t * G_ + c] - mean_k_[c], dv = tv[t * G_ + c] - mean_v_[c];
        sk += dk * dk, sv += dv * dv;
      }
    sst_k_[h] = sk, sst_v_[h] = sv;
  }
  if (!attention_) return;
  out_.assign(T_ * Hq_ * D_, 0.0f);
  wsq_.assign(Hq_ * T_, 0.0);
  attention(truth.keys.data(), truth.values.data(), out_.data(), wsq_.data());
  // Q_j^T Q_j of every query head, then its eigen-decomposition (fp64).
  const int64_t QW = int64_t{Hq_} * D_, DD = int64_t{D_} * D_;
  std::vector<float> M(Hq_ * DD);
  DenseMaths::BatchedGemm g;
  g.trans_a = true, g.m = D_, g.n = D_, g.k = T_;
  g.A = truth.queries.data(), g.lda = QW, g.stride_a = D_;
  g.B = truth.queries.data(), g.ldb = QW, g.stride_b = D_;
  g.C = M.data(), g.ldc = D_, g.stride_c = DD, g.batch = Hq_;
  be_.gemm_batched(g);
  sig2_.assign(Hq_ * D_, 0.0);
  vecs_.assign(Hq_ * DD, 0.0f);
  std::vector<double> A(DD);
  for (int j = 0; j < Hq_; ++j) {
    std::copy_n(M.data() + j * DD, DD, A.begin());
    be_.symmetric_eigen(D_, A.data(), D_, sig2_.data() + int64_t{j} * D_);
    std::copy(A.begin(), A.end(), vecs_.begin() + j * DD);
  }
}

void LayerDiagnoser::attention(const float* keys, const float* values, float* out, double* wsq) {
  // Units of work: a KV head's group of query heads over one sequence, in row tiles. Units write disjoint outputs;
  // a host backend runs them on OpenMP threads with single-threaded BLAS, a device backend one after another.
  const int64_t S = t_.sequences;
  const bool concurrent = be_.concurrent_calls();
  std::optional<SingleThreadedBlas> one_thread;
  if (concurrent) one_thread.emplace();
#pragma omp parallel for schedule(dynamic) if (concurrent)
  for (int64_t unit = 0; unit < int64_t{H_} * S; ++unit) {
    thread_local std::vector<float> scores;
    attention_unit(static_cast<int>(unit / S), unit % S, keys, values, out, wsq, scores);
  }
}

void LayerDiagnoser::attention_unit(int g, int64_t s, const float* keys, const float* values, float* out, double* wsq,
                                    std::vector<float>& scores) {
  const int64_t QW = int64_t{Hq_} * D_, group = group_;
  const float scale = static_cast<float>(t_.spec.attention_scale());
  const int64_t a = t_.seq_offsets[s], n = t_.seq_offsets[s + 1] - a;
  if (n == 0) return;
  const int64_t R = tile_rows(n, group, tile_floats_);
  for (int64_t r0 = 0; r0 < n; r0 += R) {
    const int64_t rows = std::min(n, r0 + R) - r0, cols = r0 + rows;  // the causal part: columns up to the last row
    scores.resize(group * rows * cols);
    float* P = scores.data();
    DenseMaths::BatchedGemm qk;  // S_j = scale Q_j K^T over the tile
    qk.trans_b = true, qk.m = rows, qk.n = cols, qk.k = D_, qk.alpha = scale;
    qk.A = t_.queries.data() + (a + r0) * QW + int64_t{g} * group * D_, qk.lda = QW, qk.stride_a = D_;
    qk.B = keys + a * G_ + int64_t{g} * D_, qk.ldb = G_, qk.stride_b = 0;
    qk.C = P, qk.ldc = cols, qk.stride_c = rows * cols, qk.batch = group;
    be_.gemm_batched(qk);
    // Causal softmax of each row (fp32 exponentials of the scores less the row's maximum, fp64 sums), zero beyond
    // the diagonal, and before the window of a sliding layer (keys less than `window_` positions back).
    for (int64_t jr = 0; jr < group * rows; ++jr) {
      float* row = P + jr * cols;
      const int64_t i = r0 + jr % rows, valid = i + 1;
      int64_t lo = 0;
      if (window_ > 0) {
        const int32_t* pos = t_.positions + a;
        lo = std::upper_bound(pos, pos + i, pos[i] - window_) - pos;
      }
      float mx = -INFINITY;
#pragma omp simd reduction(max : mx)
      for (int64_t u = lo; u < valid; ++u) mx = mx > row[u] ? mx : row[u];
      const double z = exp_shifted(row + lo, valid - lo, mx);
      const float inv = static_cast<float>(1.0 / z);
      for (int64_t u = lo; u < valid; ++u) row[u] *= inv;
      std::fill(row, row + lo, 0.0f);
      std::fill(row + valid, row + cols, 0.0f);
    }
    if (wsq)  // the truth: each key's squared weights summed over the tile's queries, per query head
      for (int64_t j = 0; j < group; ++j) {
        double* w = wsq + (int64_t{g} * group + j) * T_ + a;
        for (int64_t t = 0; t < rows; ++t) {
          const float* row = P + (j * rows + t) * cols;
          for (int64_t u = 0; u <= r0 + t; ++u) w[u] += static_cast<double>(row[u]) * row[u];
        }
      }
    DenseMaths::BatchedGemm pv;  // O_j = P_j V
    pv.m = rows, pv.n = D_, pv.k = cols;
    pv.A = P, pv.lda = cols, pv.stride_a = rows * cols;
    pv.B = values + a * G_ + int64_t{g} * D_, pv.ldb = G_, pv.stride_b = 0;
    pv.C = out + (a + r0) * QW + int64_t{g} * group * D_, pv.ldc = QW, pv.stride_c = D_, pv.batch = group;
    be_.gemm_batched(pv);
  }
}

LayerDiagnostics LayerDiagnoser::diagnose(const float* keys, const float* values) {
  LayerDiagnostics ld;
  ld.layer = t_.layer;
  r2_per_head(keys, values, ld);
  if (!attention_) return ld;
  cosine_per_query_head(keys, values, ld);
  errors(keys, values);
  project_key_error();
  concentrations(ld);
  ld.cosine_mean = mean_ignoring_nan(ld.cosine);
  ld.k_concentration_mean = mean_ignoring_nan(ld.k_concentration);
  ld.v_concentration_mean = mean_ignoring_nan(ld.v_concentration);
  return ld;
}

// R² per KV head in content space.
void LayerDiagnoser::r2_per_head(const float* keys, const float* values, LayerDiagnostics& ld) {
  scratch_.assign(keys, keys + T_ * G_);
  const Rope rope(t_.spec);
  rope.strip_block(scratch_.data(), T_, rope.one(t_.layer), t_.positions);
  ld.r2_k.assign(H_, kNaN), ld.r2_v.assign(H_, kNaN);
  const float *ck = content_keys_.data(), *pk = scratch_.data(), *tv = t_.values.data();
#pragma omp parallel for schedule(static)
  for (int h = 0; h < H_; ++h) {
    double ek = 0, ev = 0;
    for (int64_t t = 0; t < T_; ++t)
      for (int64_t c = int64_t{h} * D_; c < int64_t{h + 1} * D_; ++c) {
        const double dk = static_cast<double>(pk[t * G_ + c]) - ck[t * G_ + c],
                     dv = static_cast<double>(values[t * G_ + c]) - tv[t * G_ + c];
        ek += dk * dk, ev += dv * dv;
      }
    ld.r2_k[h] = sst_k_[h] > 0 ? 1.0 - ek / sst_k_[h] : kNaN;
    ld.r2_v[h] = sst_v_[h] > 0 ? 1.0 - ev / sst_v_[h] : kNaN;
  }
  ld.r2_k_mean = mean_ignoring_nan(ld.r2_k);
  ld.r2_v_mean = mean_ignoring_nan(ld.r2_v);
}

// Attention-output cosine per query head, averaged over tokens.
void LayerDiagnoser::cosine_per_query_head(const float* keys, const float* values, LayerDiagnostics& ld) {
  const int64_t QW = int64_t{Hq_} * D_;
  pred_out_.assign(T_ * QW, 0.0f);
  attention(keys, values, pred_out_.data(), nullptr);
  ld.cosine.assign(Hq_, 0.0);
#pragma omp parallel for schedule(static)
  for (int j = 0; j < Hq_; ++j) {
    double sum = 0;
    for (int64_t t = 0; t < T_; ++t) {
      const float *o1 = out_.data() + t * QW + int64_t{j} * D_, *o2 = pred_out_.data() + t * QW + int64_t{j} * D_;
      double dot = 0, n1 = 0, n2 = 0;
      for (int d = 0; d < D_; ++d) {
        dot += static_cast<double>(o1[d]) * o2[d];
        n1 += static_cast<double>(o1[d]) * o1[d];
        n2 += static_cast<double>(o2[d]) * o2[d];
      }
      sum += (n1 > 0 && n2 > 0) ? dot / std::sqrt(n1 * n2) : (n1 == n2 ? 1.0 : 0.0);
    }
    ld.cosine[j] = sum / static_cast<double>(T_);
  }
}

// The key error dk_ = keys - truth, and the squared value error e2_ per KV head and token.
void LayerDiagnoser::errors(const float* keys, const float* values) {
  dk_.resize(T_ * G_), e2_.assign(H_ * T_, 0.0);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < T_; ++t) {
    for (int64_t c = 0; c < G_; ++c) dk_[t * G_ + c] = keys[t * G_ + c] - t_.keys[t * G_ + c];
    for (int h = 0; h < H_; ++h) {
      double e = 0;
      for (int64_t c = int64_t{h} * D_; c < int64_t{h + 1} * D_; ++c) {
        const double d = static_cast<double>(values[t * G_ + c]) - t_.values[t * G_ + c];
        e += d * d;
      }
      e2_[h * T_ + t] = e;
    }
  }
}

// The key error's covariance per KV head, C_g = dK^T dK / T (cov_), and W_j = C_g V_j for each of the group's
// query heads (proj_), V_j the eigenvectors of the query head's covariance.
void LayerDiagnoser::project_key_error() {
  const int64_t DD = int64_t{D_} * D_;
  cov_.resize(H_ * DD), proj_.resize(Hq_ * DD);
  DenseMaths::BatchedGemm cg;
  cg.trans_a = true, cg.m = D_, cg.n = D_, cg.k = T_, cg.alpha = static_cast<float>(1.0 / static_cast<double>(T_));
  cg.A = dk_.data(), cg.lda = G_, cg.stride_a = D_, cg.B = dk_.data(), cg.ldb = G_, cg.stride_b = D_;
  cg.C = cov_.data(), cg.ldc = D_, cg.stride_c = DD, cg.batch = H_;
  be_.gemm_batched(cg);
  for (int g = 0; g < H_; ++g) {
    DenseMaths::BatchedGemm cv;
    cv.m = D_, cv.n = D_, cv.k = D_;
    cv.A = cov_.data() + g * DD, cv.lda = D_, cv.stride_a = 0;
    cv.B = vecs_.data() + int64_t{g} * group_ * DD, cv.ldb = D_, cv.stride_b = DD;
    cv.C = proj_.data() + int64_t{g} * group_ * DD, cv.ldc = D_, cv.stride_c = DD, cv.batch = group_;
    be_.gemm_batched(cv);
  }
}

// K-concentration: the key error along the eigenvectors v_i of each query head's covariance, E_i = v_i^T C_g v_i,
// weighted by the eigenvalues; V-concentration: the value error where the true attention reads.
void LayerDiagnoser::concentrations(LayerDiagnostics& ld) const {
  const int64_t DD = int64_t{D_} * D_;
  ld.k_concentration.assign(Hq_, 1.0), ld.v_concentration.assign(Hq_, 1.0);
  for (int j = 0; j < Hq_; ++j) {
    const float *V = vecs_.data() + j * DD, *Wj = proj_.data() + j * DD;
    const double* sig2 = sig2_.data() + int64_t{j} * D_;
    double num_k = 0, den_k = 0, mean_e = 0;
    for (int i = 0; i < D_; ++i) {
      double E = 0;
      for (int d = 0; d < D_; ++d) E += static_cast<double>(V[d * D_ + i]) * Wj[d * D_ + i];
      num_k += std::max(sig2[i], 0.0) * E;
      den_k += std::max(sig2[i], 0.0);
      mean_e += E / D_;
    }
    ld.k_concentration[j] = mean_e > 0 && den_k > 0 ? (num_k / den_k) / mean_e : 1.0;
    const double *w = wsq_.data() + int64_t{j} * T_, *e = e2_.data() + int64_t{j / group_} * T_;
    double num_v = 0, den_v = 0, mean_v = 0;
    for (int64_t t = 0; t < T_; ++t) {
      num_v += w[t] * e[t];
      den_v += w[t];
      mean_v += e[t] / static_cast<double>(T_);
    }
    ld.v_concentration[j] = mean_v > 0 && den_v > 0 ? (num_v / den_v) / mean_v : 1.0;
  }
}

Diagnostics summarize_layers(std::vector<LayerDiagnostics> layers, int64_t tokens, bool attention) {
  Diagnostics out;
  out.tokens = tokens;
  out.layers = std::move(layers);
  std::vector<double> rk, rv, c, kc, vc;
  for (const auto& ld : out.layers) {
    rk.push_back(ld.r2_k_mean);
    rv.push_back(ld.r2_v_mean);
    c.push_back(ld.cosine_mean);
    kc.push_back(ld.k_concentration_mean);
    vc.push_back(ld.v_concentration_mean);
  }
  out.r2_k = mean_ignoring_nan(rk);
  out.r2_v = mean_ignoring_nan(rv);
  if (attention) {
    out.attention_cosine = mean_ignoring_nan(c);
    out.k_concentration = mean_ignoring_nan(kc);
    out.v_concentration = mean_ignoring_nan(vc);
  }
  return out;
}

}  // namespace crosskv
