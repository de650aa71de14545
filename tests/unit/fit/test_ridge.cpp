#include <cmath>
#include <cstring>
#include <numeric>
#include <random>

#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/memory.hpp"
#include "fit/moments.hpp"
#include "fit/ridge.hpp"
#include "core/structure.hpp"
#include "fit/select.hpp"
#include "helpers.hpp"

using namespace crosskv;
using crosskv::test::expect_error;

namespace {

struct Data {
  PairDims d;
  int64_t N;
  std::vector<float> X, Y;  // [N x Ls*F], [N x Lt*G]
};

// Y = sum over source layers of X_a A_a + c + noise.
Data planted_data(PairDims d, int64_t N, uint64_t seed, double noise = 0.1, double offset = 0.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0, 1);
  Data r{d, N, std::vector<float>(N * d.X()), std::vector<float>(N * d.Y())};
  std::vector<double> A(d.X() * d.Y());
  for (auto& a : A) a = n(rng) / std::sqrt(double(d.X()));
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t c = 0; c < d.X(); ++c) r.X[t * d.X() + c] = static_cast<float>(n(rng) + (c % 7 == 0 ? offset : 0.0));
    for (int64_t j = 0; j < d.Y(); ++j) {
      double y = 0.5 + noise * n(rng);
      for (int64_t c = 0; c < d.X(); ++c) y += (r.X[t * d.X() + c] - (c % 7 == 0 ? offset : 0.0)) * A[c * d.Y() + j];
      r.Y[t * d.Y() + j] = static_cast<float>(y);
    }
  }
  return r;
}

Moments accumulate(const Data& data, int64_t block = 97, int repeat = 1, const std::vector<float>* weights = nullptr) {
  const PairDims& d = data.d;
  std::vector<float> sx(data.X.begin(), data.X.begin() + d.X()), sy(data.Y.begin(), data.Y.begin() + d.Y());
  Moments m(d, sx, sy);
  m.add_plan(MomentPlan::full(d, d.Hs == d.Ht));
  auto be = make_cpu_backend();
  for (int r = 0; r < repeat; ++r)
    for (int64_t t0 = 0; t0 < data.N; t0 += block) {
      const int64_t rows = std::min(block, data.N - t0);
      std::vector<float> X(data.X.begin() + t0 * d.X(), data.X.begin() + (t0 + rows) * d.X());
      std::vector<float> Y(data.Y.begin() + t0 * d.Y(), data.Y.begin() + (t0 + rows) * d.Y());
      m.accumulate(*be, X.data(), Y.data(), rows, weights ? weights->data() + t0 : nullptr);
    }
  auto comm = make_single_comm();
  m.mark_pass_complete();  // one rank: nothing to sum
  return m;
}

// Independent reference: centred normal equations in long double, Gauss-Jordan with partial pivoting; with token
// weights w, the weighted means and covariances (Σ w (x - m)(x - m)ᵀ / Σ w), λ on that scale.
struct RefFit {
  std::vector<long double> W, b;
};
RefFit reference_ridge(const Data& data, const std::vector<int>& layers, int l, double lambda,
                       const std::vector<float>& weights = {}) {
  const PairDims& d = data.d;
  const int64_t F = d.F(), G = d.G(), n = layers.size() * F;
  std::vector<long double> mx(n, 0), my(G, 0);
  auto xcol = [&](int64_t t, int64_t i) -> long double { return data.X[t * d.X() + layers[i / F] * F + i % F]; };
  auto ycol = [&](int64_t t, int64_t c) -> long double { return data.Y[t * d.Y() + l * G + c]; };
  auto w = [&](int64_t t) -> long double { return weights.empty() ? 1.0L : weights[t]; };
  long double W = 0;
  for (int64_t t = 0; t < data.N; ++t) W += w(t);
  for (int64_t t = 0; t < data.N; ++t) {
    for (int64_t i = 0; i < n; ++i) mx[i] += w(t) * xcol(t, i) / W;
    for (int64_t c = 0; c < G; ++c) my[c] += w(t) * ycol(t, c) / W;
  }
  std::vector<long double> M(n * (n + G), 0);  // [A | B]
  for (int64_t t = 0; t < data.N; ++t)
    for (int64_t i = 0; i < n; ++i) {
      const long double xi = w(t) * (xcol(t, i) - mx[i]);
      for (int64_t j = 0; j < n; ++j) M[i * (n + G) + j] += xi * (xcol(t, j) - mx[j]) / W;
      for (int64_t c = 0; c < G; ++c) M[i * (n + G) + n + c] += xi * (ycol(t, c) - my[c]) / W;
    }
  for (int64_t i = 0; i < n; ++i) M[i * (n + G) + i] += lambda;
  for (int64_t col = 0; col < n; ++col) {
    int64_t p = col;
    for (int64_t r = col + 1; r < n; ++r)
      if (std::fabs(M[r * (n + G) + col]) > std::fabs(M[p * (n + G) + col])) p = r;
    for (int64_t c = 0; c < n + G; ++c) std::swap(M[col * (n + G) + c], M[p * (n + G) + c]);
    const long double piv = M[col * (n + G) + col];
    for (int64_t c = 0; c < n + G; ++c) M[col * (n + G) + c] /= piv;
    for (int64_t r = 0; r < n; ++r)
      if (r != col) {
        const long double f = M[r * (n + G) + col];
        for (int64_t c = 0; c < n + G; ++c) M[r * (n + G) + c] -= f * M[col * (n + G) + c];
      }
  }
  RefFit out{std::vector<long double>(n * G), my};
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < G; ++c) {
      out.W[i * G + c] = M[i * (n + G) + n + c];
      out.b[c] -= mx[i] * out.W[i * G + c];
    }
  return out;
}

const PairDims kDims{3, 2, 3, 2, 2, 4};  // Ls, Hs, Ds, Lt, Ht, Dt: F = 6, G = 8

}  // namespace

TEST(Ridge, MatchesIndependentSolverOnRandomData) {
  Data data = planted_data(kDims, 600, 11);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  const std::vector<int> ranking = {2, 0, 1};
  for (double lambda : {0.0, 0.01, 0.5}) {
    auto fits = fit_sweep(m.covariances(), *be, 1, ranking, {1, 2, 3}, lambda, "test");
    ASSERT_EQ(fits.size(), 3u);
    for (const auto& f : fits) {
      RefFit ref = reference_ridge(data, f.layers, 1, lambda);
      for (size_t i = 0; i < f.W.size(); ++i) EXPECT_NEAR(f.W[i], static_cast<double>(ref.W[i]), 2e-4) << "k " << f.k;
      for (size_t c = 0; c < f.b.size(); ++c) EXPECT_NEAR(f.b[c], static_cast<double>(ref.b[c]), 2e-4);
    }
    EXPECT_EQ(fits[1].layers, (std::vector<int>{0, 2}));  // top-2 of the ranking, ascending
  }
}

// Token weights spread over two decades, a few exactly zero.
std::vector<float> spread_weights(int64_t N, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(-1.0, 1.0);
  std::vector<float> w(N);
  for (int64_t t = 0; t < N; ++t) w[t] = t % 13 == 5 ? 0.0f : static_cast<float>(std::pow(10.0, u(rng)));
  return w;
}

TEST(WeightedRidge, MatchesAnIndependentWeightedSolverPerTargetLayer) {
  Data data = planted_data(kDims, 600, 17, 0.3);
  const std::vector<float> w = spread_weights(data.N, 5);
  Moments m = accumulate(data, 97, 1, &w);
  auto be = make_cpu_backend();
  for (double lambda : {0.0, 0.01, 0.5})
    for (int l = 0; l < kDims.Lt; ++l) {
      auto fits = fit_sweep(m.covariances(), *be, l, {2, 0, 1}, {1, 3}, lambda, "test");
      for (const auto& f : fits) {
        RefFit ref = reference_ridge(data, f.layers, l, lambda, w);
        for (size_t i = 0; i < f.W.size(); ++i)
          EXPECT_NEAR(f.W[i], static_cast<double>(ref.W[i]), 2e-4) << "lambda " << lambda << " layer " << l;
        for (size_t c = 0; c < f.b.size(); ++c) EXPECT_NEAR(f.b[c], static_cast<double>(ref.b[c]), 2e-4);
        // And not the unweighted solution (the weights matter at this noise level).
        RefFit plain = reference_ridge(data, f.layers, l, lambda);
        double diff = 0;
        for (size_t i = 0; i < f.W.size(); ++i) diff = std::max(diff, std::fabs(double(ref.W[i] - plain.W[i])));
        EXPECT_GT(diff, 1e-2) << "lambda " << lambda << " layer " << l;
      }
    }
}

TEST(WeightedRidge, WeightsOfOneGiveTheUnweightedBytes) {
  Data data = planted_data(kDims, 500, 23, 0.2, 3.0);
  const std::vector<float> ones(data.N, 1.0f);
  Moments a = accumulate(data), b = accumulate(data, 97, 1, &ones);
  EXPECT_EQ(a.weight_sum(), b.weight_sum());
  auto be = make_cpu_backend();
  for (int l = 0; l < kDims.Lt; ++l) {
    auto fa = fit_sweep(a.covariances(), *be, l, {2, 0, 1}, {1, 2, 3}, 0.01, "test");
    auto fb = fit_sweep(b.covariances(), *be, l, {2, 0, 1}, {1, 2, 3}, 0.01, "test");
    for (size_t i = 0; i < fa.size(); ++i) {
      EXPECT_EQ(0, std::memcmp(fa[i].W.data(), fb[i].W.data(), fa[i].W.size() * sizeof(fa[i].W[0])));
      EXPECT_EQ(0, std::memcmp(fa[i].b.data(), fb[i].b.data(), fa[i].b.size() * sizeof(fa[i].b[0])));
    }
  }
}

TEST(WeightedRidge, ZeroWeightsRemoveTokensThatFollowAnotherMap) {
  // Half the tokens follow Y = X A + c, the other half Y = X B + c; the second half carries weight 0. The weighted
  // fit recovers A (the noise is small); the unweighted one lands between A and B.
  Data a = planted_data(kDims, 800, 31, 0.01), b = planted_data(kDims, 800, 32, 0.01);
  Data mixed{kDims, 1600, a.X, a.Y};
  mixed.X.insert(mixed.X.end(), b.X.begin(), b.X.end());
  mixed.Y.insert(mixed.Y.end(), b.Y.begin(), b.Y.end());
  std::vector<float> w(1600, 1.0f);
  std::fill(w.begin() + 800, w.end(), 0.0f);
  auto be = make_cpu_backend();
  Moments weighted = accumulate(mixed, 97, 1, &w), plain = accumulate(mixed), clean = accumulate(a);
  EXPECT_EQ(weighted.weight_sum(), 800.0);
  auto err = [&](const Moments& m) {
    const LayerFit f = fit_sweep(m.covariances(), *be, 0, {0, 1, 2}, {3}, 0.0, "test")[0];
    const LayerFit want = fit_sweep(clean.covariances(), *be, 0, {0, 1, 2}, {3}, 0.0, "test")[0];
    double e = 0;
    for (size_t i = 0; i < f.W.size(); ++i) e = std::max(e, double(std::fabs(f.W[i] - want.W[i])));
    return e;
  };
  EXPECT_LT(err(weighted), 1e-3);
  EXPECT_GT(err(plain), 0.1);
}

TEST(Ridge, InSampleR2MatchesDirectComputation) {
  Data data = planted_data(kDims, 500, 5, 0.5);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  auto f = fit_sweep(m.covariances(), *be, 0, {0, 1, 2}, {3}, 0.05, "test")[0];
  const int64_t F = kDims.F(), G = kDims.G();
  for (int h = 0; h < kDims.Ht; ++h) {
    long double sse = 0, sst = 0;
    std::vector<long double> mean(G, 0);
    for (int64_t t = 0; t < data.N; ++t)
      for (int64_t c = 0; c < G; ++c) mean[c] += data.Y[t * kDims.Y() + c] / (long double)data.N;
    for (int64_t t = 0; t < data.N; ++t)
      for (int64_t c = h * kDims.Dt; c < (h + 1) * kDims.Dt; ++c) {
        long double pred = f.b[c];
        for (int64_t i = 0; i < 3 * F; ++i) pred += data.X[t * kDims.X() + i] * (long double)f.W[i * G + c];
        const long double y = data.Y[t * kDims.Y() + c];
        sse += (y - pred) * (y - pred);
        sst += (y - mean[c]) * (y - mean[c]);
      }
    EXPECT_NEAR(f.r2[h], static_cast<double>(1 - sse / sst), 1e-4);
  }
}

TEST(Ridge, LambdaIsOnTheCovarianceScale) {
  Data data = planted_data(kDims, 300, 9);
  Moments once = accumulate(data), twice = accumulate(data, 97, 2);
  EXPECT_EQ(twice.tokens(), 2 * once.tokens());
  auto be = make_cpu_backend();
  auto a = fit_sweep(once.covariances(), *be, 1, {0, 1, 2}, {3}, 0.3, "t")[0];
  auto b = fit_sweep(twice.covariances(), *be, 1, {0, 1, 2}, {3}, 0.3, "t")[0];
  for (size_t i = 0; i < a.W.size(); ++i) EXPECT_NEAR(a.W[i], b.W[i], 1e-6);
  for (size_t i = 0; i < a.b.size(); ++i) EXPECT_NEAR(a.b[i], b.b[i], 1e-6);
}

TEST(Ridge, InterceptIsNotPenalised) {
  Data data = planted_data(kDims, 400, 13);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  const auto ybar = m.covariances().mean_y(1);
  // A huge λ shrinks W to ~0 but the intercept still carries the target's mean.
  auto f = fit_sweep(m.covariances(), *be, 1, {0, 1, 2}, {3}, 1e8, "t")[0];
  for (float w : f.W) EXPECT_NEAR(w, 0.0f, 1e-6);
  for (int64_t c = 0; c < kDims.G(); ++c) EXPECT_NEAR(f.b[c], ybar[c], 1e-4);
  // For any λ the fit passes through the means: x̄ W + b = ȳ.
  auto g = fit_sweep(m.covariances(), *be, 1, {0, 1, 2}, {3}, 0.7, "t")[0];
  std::vector<double> xbar;
  for (int a : g.layers) {
    auto mx = m.covariances().mean_x(a);
    xbar.insert(xbar.end(), mx.begin(), mx.end());
  }
  for (int64_t c = 0; c < kDims.G(); ++c) {
    double p = g.b[c];
    for (size_t i = 0; i < xbar.size(); ++i) p += xbar[i] * g.W[i * kDims.G() + c];
    EXPECT_NEAR(p, ybar[c], 1e-4);
  }
}

TEST(Ridge, LargeMeanChannelsKeepTheirAccuracy) {
  // Channels with mean 3e3 and unit variance: fp32 moments without the provisional shift would lose the covariance.
  Data plain = planted_data(kDims, 500, 21, 0.1, 0.0), shifted = planted_data(kDims, 500, 21, 0.1, 3000.0);
  Moments mp = accumulate(plain), ms = accumulate(shifted);
  auto be = make_cpu_backend();
  auto a = fit_sweep(mp.covariances(), *be, 0, {0, 1, 2}, {3}, 0.01, "t")[0];
  auto b = fit_sweep(ms.covariances(), *be, 0, {0, 1, 2}, {3}, 0.01, "t")[0];
  for (size_t i = 0; i < a.W.size(); ++i) EXPECT_NEAR(a.W[i], b.W[i], 1e-3) << i;
  for (size_t h = 0; h < a.r2.size(); ++h) EXPECT_NEAR(a.r2[h], b.r2[h], 1e-4);
}

TEST(Ridge, SweepEqualsSeparateSingleKFits) {
  Data data = planted_data(kDims, 400, 17);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  const std::vector<int> ranking = {1, 2, 0};
  auto sweep = fit_sweep(m.covariances(), *be, 0, ranking, {1, 2, 3}, 0.02, "t");
  for (int k : {1, 2, 3}) {
    auto single = fit_sweep(m.covariances(), *be, 0, ranking, {k}, 0.02, "t")[0];
    const auto& s = sweep[k - 1];
    EXPECT_EQ(single.layers, s.layers);
    for (size_t i = 0; i < s.W.size(); ++i) EXPECT_NEAR(single.W[i], s.W[i], 1e-6);
    for (size_t i = 0; i < s.b.size(); ++i) EXPECT_NEAR(single.b[i], s.b[i], 1e-6);
  }
}

TEST(Ridge, SharedAllLayersFactorGivesTheSameFits) {
  Data data = planted_data(kDims, 300, 29);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  const Factor all = factor_layers(m.covariances(), *be, {0, 1, 2}, 0.05);
  for (int l = 0; l < kDims.Lt; ++l) {
    auto a = fit_sweep(m.covariances(), *be, l, {2, 0, 1}, {1, 3}, 0.05, "t", &all);
    auto b = fit_sweep(m.covariances(), *be, l, {2, 0, 1}, {1, 3}, 0.05, "t");
    for (size_t i = 0; i < a[1].W.size(); ++i) EXPECT_NEAR(a[1].W[i], b[1].W[i], 1e-6);
    EXPECT_EQ(a[1].layers, (std::vector<int>{0, 1, 2}));
  }
}

TEST(Ridge, SingularSystemWithZeroLambdaIsReportedNotPerturbed) {
  Data data = planted_data(kDims, 200, 23);
  // Source layer 1 duplicates layer 0: the k = 3 system is singular, k = 1 is not.
  for (int64_t t = 0; t < data.N; ++t)
    for (int64_t c = 0; c < kDims.F(); ++c) data.X[t * kDims.X() + kDims.F() + c] = data.X[t * kDims.X() + c];
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  EXPECT_NO_THROW(fit_sweep(m.covariances(), *be, 0, {0, 1, 2}, {1}, 0.0, "target layer 0, keys"));
  expect_error<SolveError>([&] { fit_sweep(m.covariances(), *be, 0, {0, 1, 2}, {1, 3}, 0.0, "target layer 0, keys"); },
                           {"target layer 0, keys", "k = 3", "singular", "lambda"});
  EXPECT_NO_THROW(fit_sweep(m.covariances(), *be, 0, {0, 1, 2}, {3}, 0.01, "t"));
}

TEST(Ridge, SameHeadProbeFindsThePlantedSourceLayer) {
  // Target layer l's head h is source layer (2 - l)'s head h, linearly; other layers are unrelated.
  const PairDims d{3, 2, 4, 2, 2, 4};
  std::mt19937_64 rng(3);
  std::normal_distribution<double> n(0, 1);
  Data data{d, 800, std::vector<float>(800 * d.X()), std::vector<float>(800 * d.Y())};
  for (int64_t t = 0; t < data.N; ++t) {
    for (int64_t c = 0; c < d.X(); ++c) data.X[t * d.X() + c] = static_cast<float>(n(rng));
    for (int l = 0; l < d.Lt; ++l)
      for (int64_t c = 0; c < d.G(); ++c)
        data.Y[t * d.Y() + l * d.G() + c] =
            static_cast<float>(2.0 * data.X[t * d.X() + (2 - l) * d.F() + (c / d.Dt) * d.Dt + (c + 1) % d.Dt] + 0.1 * n(rng));
  }
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  // Extracted from the full blocks, and accumulated directly: the same probe.
  Moments direct(d, std::vector<float>(d.X(), 0.f), std::vector<float>(d.Y(), 0.f));
  direct.add_plan({{}, {}, MomentPlan::all_heads(d)});
  {
    auto X = data.X;
    auto Y = data.Y;
    direct.accumulate(*be, X.data(), Y.data(), data.N);
    auto comm = make_single_comm();
    direct.mark_pass_complete();  // one rank: nothing to sum
  }
  m.derive_head_probe();
  ProbeR2 a = probe_same_head(m.covariances(), *be, 0.01, Kind::k), b = probe_same_head(direct.covariances(), *be, 0.01, Kind::k);
  for (size_t i = 0; i < a.per_head.size(); ++i) EXPECT_NEAR(a.per_head[i], b.per_head[i], 1e-4);
  auto rankings = rank_sources(a.mean, a.mean, d.Ls, d.Lt);
  EXPECT_EQ(rankings[0][0], 2);
  EXPECT_EQ(rankings[1][0], 1);
  EXPECT_GT(a.mean[2 * d.Lt + 0], 0.99);
  EXPECT_LT(a.mean[0 * d.Lt + 0], 0.05);
  ProbeR2 all = probe_all_heads(m.covariances(), *be, 0.01, Kind::k);
  EXPECT_GT(all.mean[2 * d.Lt + 0], 0.99);
  EXPECT_GT(all.mean[1 * d.Lt + 1], 0.99);
}

TEST(Select, TopKTiesGoToTheLowerIndexAndSortAscending) {
  // Ls = 4, Lt = 1: scores 0.5, 0.9, 0.5, 0.9.
  std::vector<double> k = {0.5, 0.9, 0.5, 0.9}, v = k;
  auto r = rank_sources(k, v, 4, 1);
  EXPECT_EQ(r[0], (std::vector<int>{1, 3, 0, 2}));
  EXPECT_EQ(top_k(r[0], 3), (std::vector<int>{0, 1, 3}));
  std::vector<double> nan = {NAN, 0.1, 0.2, 0.3};
  EXPECT_EQ(rank_sources(nan, nan, 4, 1)[0].back(), 0);
}

// Blocks accumulated as panels (a plan that adds a source layer's whole Gram or cross row: one wide GEMM each) and
// block by block (the same blocks added in pieces that break every panel) give the same covariances; a layout that
// mixes both (every Gram row but only some cross rows whole) too.
TEST(Moments, PanelsAndSingleBlocksGiveTheSameCovariances) {
  const PairDims d{4, 2, 6, 5, 2, 4};
  const Data data = planted_data(d, 300, 17);
  auto be = make_cpu_backend();
  auto comm = make_single_comm();
  auto run = [&](const std::vector<MomentPlan>& plans) {
    std::vector<float> sx(data.X.begin(), data.X.begin() + d.X()), sy(data.Y.begin(), data.Y.begin() + d.Y());
    Moments m(d, sx, sy);
    for (const auto& p : plans) m.add_plan(p);
    for (int64_t t0 = 0; t0 < data.N; t0 += 128) {
      const int64_t rows = std::min<int64_t>(128, data.N - t0);
      std::vector<float> X(data.X.begin() + t0 * d.X(), data.X.begin() + (t0 + rows) * d.X());
      std::vector<float> Y(data.Y.begin() + t0 * d.Y(), data.Y.begin() + (t0 + rows) * d.Y());
      m.accumulate(*be, X.data(), Y.data(), rows);
    }
    m.mark_pass_complete();  // one rank: nothing to sum
    return m;
  };
  const MomentPlan full = MomentPlan::full(d, false);
  MomentPlan even, odd, mixed_a, mixed_b;  // pieces: no source layer's row whole in any one plan
  for (size_t i = 0; i < full.gram.size(); ++i) (i % 2 ? odd : even).gram.push_back(full.gram[i]);
  for (size_t i = 0; i < full.cross.size(); ++i) (i % 2 ? odd : even).cross.push_back(full.cross[i]);
  mixed_a.gram = full.gram;
  for (const auto& [a, l] : full.cross) (a == 1 || a == 2 ? mixed_a : mixed_b).cross.emplace_back(a, l);
  mixed_b.cross.erase(std::remove_if(mixed_b.cross.begin(), mixed_b.cross.end(),
                                     [](const auto& p) { return p.second == 3; }),
                      mixed_b.cross.end());
  for (const auto& [a, l] : full.cross)
    if ((a == 0 || a == 3) && l == 3) mixed_a.cross.emplace_back(a, l);
  const Moments panels = run({full}), singles = run({even, odd}), mixed = run({mixed_a, mixed_b});
  std::vector<int> all(d.Ls), some = {2, 0};
  std::iota(all.begin(), all.end(), 0);
  for (const auto* layers : {&all, &some}) {
    const int64_t n = static_cast<int64_t>(layers->size()) * d.F();
    std::vector<double> A(n * n), B(n * n), C(n * d.G()), D(n * d.G());
    for (const Moments* other : {&singles, &mixed}) {
      panels.covariances().cov_xx(*layers, A.data(), n);
      other->covariances().cov_xx(*layers, B.data(), n);
      for (int64_t i = 0; i < n * n; ++i) ASSERT_NEAR(A[i], B[i], 1e-5 * (1 + std::fabs(A[i]))) << "Cxx " << i;
      for (int l = 0; l < d.Lt; ++l) {
        panels.covariances().cov_xy(*layers, l, C.data(), d.G());
        other->covariances().cov_xy(*layers, l, D.data(), d.G());
        for (int64_t i = 0; i < n * d.G(); ++i)
          ASSERT_NEAR(C[i], D[i], 1e-5 * (1 + std::fabs(C[i]))) << "Cxy of target layer " << l << ", " << i;
      }
    }
  }
}

// Large buffers come zeroed from the kernel (on huge pages where allowed), small ones from the heap; BigVector's
// resize leaves fresh elements as the allocation made them (zero), without writing them.
TEST(Memory, BigBuffersAreZeroedAndReleased) {
  for (size_t bytes : {size_t{0}, size_t{100}, size_t{8} << 20, (size_t{64} << 20) + 12}) {
    auto* p = static_cast<unsigned char*>(allocate_zeroed(bytes));
    ASSERT_NE(p, nullptr);
    for (size_t i = 0; i < bytes; i += 4093) ASSERT_EQ(p[i], 0) << bytes << " bytes, byte " << i;
    if (bytes) p[bytes - 1] = 7;  // writable to the end
    release_zeroed(p, bytes);
  }
  BigVector<double> v;
  v.resize(size_t{4} << 20);  // 32 MB: mapped
  EXPECT_EQ(v[12345], 0.0);
  v.assign(v.size(), 2.5);
  v.resize(v.size() + 10);
  EXPECT_EQ(v[100], 2.5);
}

namespace {

// Head h of every layer alone: source head h of each source layer, target head h of each target layer.
Data head_slice(const Data& data, int h) {
  const PairDims& d = data.d;
  const PairDims s{d.Ls, 1, d.Ds, d.Lt, 1, d.Dt};
  Data r{s, data.N, std::vector<float>(data.N * s.X()), std::vector<float>(data.N * s.Y())};
  for (int64_t t = 0; t < data.N; ++t) {
    for (int a = 0; a < d.Ls; ++a)
      for (int p = 0; p < d.Ds; ++p)
        r.X[t * s.X() + a * d.Ds + p] = data.X[t * d.X() + a * d.F() + h * d.Ds + p];
    for (int l = 0; l < d.Lt; ++l)
      for (int c = 0; c < d.Dt; ++c)
        r.Y[t * s.Y() + l * d.Dt + c] = data.Y[t * d.Y() + l * d.G() + h * d.Dt + c];
  }
  return r;
}

// Y = X A + c with A planted head-matched (block-diagonal over heads) or dense (heads mixed).
Data head_planted_data(PairDims d, int64_t N, uint64_t seed, bool head_matched, double noise = 0.0) {
  Data r = planted_data(d, N, seed, 0.0);
  std::mt19937_64 rng(seed + 1);
  std::normal_distribution<double> n(0, 1);
  std::vector<double> A(d.X() * d.Y());
  for (int64_t i = 0; i < d.X(); ++i)
    for (int64_t j = 0; j < d.Y(); ++j) {
      const bool same = (i % d.F()) / d.Ds == (j % d.G()) / d.Dt;
      A[i * d.Y() + j] = head_matched && !same ? 0.0 : n(rng) / std::sqrt(double(d.X()));
    }
  for (int64_t t = 0; t < N; ++t)
    for (int64_t j = 0; j < d.Y(); ++j) {
      double y = 0.25 + noise * n(rng);
      for (int64_t i = 0; i < d.X(); ++i) y += r.X[t * d.X() + i] * A[i * d.Y() + j];
      r.Y[t * d.Y() + j] = static_cast<float>(y);
    }
  return r;
}

// The per_head prediction of target layer l from `data` (fit f, weights [H][k*Ds x Dt]), and its in-sample R² per
// head computed directly.
std::vector<double> direct_r2(const Data& data, const LayerFit& f, int l) {
  const PairDims& d = data.d;
  const int64_t k = static_cast<int64_t>(f.layers.size()), G = d.G();
  std::vector<double> r2(d.Ht);
  for (int h = 0; h < d.Ht; ++h) {
    long double sse = 0, sst = 0;
    std::vector<long double> mean(d.Dt, 0);
    for (int64_t t = 0; t < data.N; ++t)
      for (int c = 0; c < d.Dt; ++c) mean[c] += data.Y[t * d.Y() + l * G + h * d.Dt + c] / (long double)data.N;
    for (int64_t t = 0; t < data.N; ++t)
      for (int c = 0; c < d.Dt; ++c) {
        long double pred = f.b[h * d.Dt + c];
        for (int64_t j = 0; j < k; ++j)
          for (int p = 0; p < d.Ds; ++p)
            pred += data.X[t * d.X() + f.layers[j] * d.F() + h * d.Ds + p] *
                    (long double)f.W[((h * k + j) * d.Ds + p) * d.Dt + c];
        const long double y = data.Y[t * d.Y() + l * G + h * d.Dt + c];
        sse += (y - pred) * (y - pred);
        sst += (y - mean[c]) * (y - mean[c]);
      }
    r2[h] = static_cast<double>(1 - sse / sst);
  }
  return r2;
}

}  // namespace

TEST(PerHead, MatchesAnIndependentSolvePerHead) {
  Data data = planted_data(kDims, 600, 31, 0.3);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  const std::vector<int> ranking = {2, 0, 1};
  const int64_t Ds = kDims.Ds, Dt = kDims.Dt;
  for (double lambda : {0.0, 0.01, 0.5})
    for (int l = 0; l < kDims.Lt; ++l) {
      auto fits = fit_sweep_per_head(m.covariances(), *be, l, ranking, {1, 2, 3}, lambda, "test");
      ASSERT_EQ(fits.size(), 3u);
      for (const auto& f : fits) {
        EXPECT_EQ(f.structure, Structure::per_head);
        const int64_t k = f.k;
        ASSERT_EQ(static_cast<int64_t>(f.W.size()), kDims.Ht * k * Ds * Dt);
        for (int h = 0; h < kDims.Ht; ++h) {
          RefFit ref = reference_ridge(head_slice(data, h), f.layers, l, lambda);
          for (int64_t i = 0; i < k * Ds * Dt; ++i)
            EXPECT_NEAR(f.W[h * k * Ds * Dt + i], static_cast<double>(ref.W[i]), 2e-4) << "k " << k << " head " << h;
          for (int c = 0; c < Dt; ++c) EXPECT_NEAR(f.b[h * Dt + c], static_cast<double>(ref.b[c]), 2e-4);
        }
        const auto r2 = direct_r2(data, f, l);
        for (int h = 0; h < kDims.Ht; ++h) EXPECT_NEAR(f.r2[h], r2[h], 1e-4) << "head " << h;
      }
      EXPECT_EQ(fits[1].layers, (std::vector<int>{0, 2}));
    }
}

TEST(PerHead, SweepAndSharedAllLayersFactorsEqualSeparateFits) {
  Data data = planted_data(kDims, 400, 37);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  std::vector<Factor> shared;
  for (int l = 0; l < kDims.Lt; ++l) {
    auto sweep = fit_sweep_per_head(m.covariances(), *be, l, {1, 2, 0}, {1, 2, 3}, 0.02, "t", &shared);
    EXPECT_EQ(shared.size(), static_cast<size_t>(kDims.Ht));
    for (int k : {1, 2, 3}) {
      auto single = fit_sweep_per_head(m.covariances(), *be, l, {1, 2, 0}, {k}, 0.02, "t")[0];
      EXPECT_EQ(single.layers, sweep[k - 1].layers);
      for (size_t i = 0; i < single.W.size(); ++i) EXPECT_NEAR(single.W[i], sweep[k - 1].W[i], 1e-6);
      for (size_t i = 0; i < single.b.size(); ++i) EXPECT_NEAR(single.b[i], sweep[k - 1].b[i], 1e-6);
    }
  }
}

TEST(PerHead, RecoversAHeadMatchedPlantedMapExactly) {
  const Data data = head_planted_data(kDims, 500, 41, /*head_matched=*/true);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  for (int l = 0; l < kDims.Lt; ++l) {
    auto ph = fit_sweep_per_head(m.covariances(), *be, l, {0, 1, 2}, {3}, 0.0, "t")[0];
    auto ch = fit_sweep(m.covariances(), *be, l, {0, 1, 2}, {3}, 0.0, "t")[0];
    for (double r : ph.r2) EXPECT_GT(r, 1.0 - 1e-6);
    for (double r : ch.r2) EXPECT_GT(r, 1.0 - 1e-6);
    // The cross-head fit finds the heads unmixed: its weights across heads vanish.
    for (int64_t i = 0; i < 3 * kDims.F(); ++i)
      for (int64_t c = 0; c < kDims.G(); ++c)
        if ((i % kDims.F()) / kDims.Ds != c / kDims.Dt) {
          EXPECT_NEAR(ch.W[i * kDims.G() + c], 0.0, 1e-3);
        }
  }
}

TEST(PerHead, FallsShortWhereThePlantedMapMixesHeads) {
  const Data data = head_planted_data(kDims, 500, 43, /*head_matched=*/false);
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  for (int l = 0; l < kDims.Lt; ++l) {
    auto ph = fit_sweep_per_head(m.covariances(), *be, l, {0, 1, 2}, {3}, 0.01, "t")[0];
    auto ch = fit_sweep(m.covariances(), *be, l, {0, 1, 2}, {3}, 0.01, "t")[0];
    for (int h = 0; h < kDims.Ht; ++h) {
      EXPECT_GT(ch.r2[h], 0.999);
      EXPECT_LT(ph.r2[h], 0.8) << "head " << h;  // about half the planted signal comes from the other head
    }
  }
}

TEST(PerHead, SingularSystemNamesTheHead) {
  Data data = planted_data(kDims, 200, 47);
  for (int64_t t = 0; t < data.N; ++t)  // source layer 1's head 1 duplicates layer 0's
    for (int64_t p = 0; p < kDims.Ds; ++p)
      data.X[t * kDims.X() + kDims.F() + kDims.Ds + p] = data.X[t * kDims.X() + kDims.Ds + p];
  Moments m = accumulate(data);
  auto be = make_cpu_backend();
  expect_error<SolveError>([&] { fit_sweep_per_head(m.covariances(), *be, 0, {0, 1, 2}, {3}, 0.0, "target layer 0, keys"); },
                           {"target layer 0, keys", "head 1", "k = 3", "singular"});
  EXPECT_NO_THROW(fit_sweep_per_head(m.covariances(), *be, 0, {0, 1, 2}, {3}, 0.01, "t"));
}
