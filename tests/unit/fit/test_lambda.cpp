// fit.lambda: auto (fit/lambda.hpp): GCV from the moments against GCV from the data, a choice that follows the data,
// and predictions that do not depend on the source's units.
#include <cmath>
#include <map>
#include <random>

#include <nlohmann/json.hpp>

#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "fit/lambda.hpp"
#include "fit/moments.hpp"
#include "fit/ridge.hpp"
#include "fit/select.hpp"
#include "helpers.hpp"

using namespace crosskv;

namespace auto_lambda_test {  // its own helpers' names (Data, kDims, accumulate) are test_ridge.cpp's too
namespace {

const PairDims kDims{3, 2, 3, 2, 2, 4};  // Ls, Hs, Ds, Lt, Ht, Dt: F = 6, G = 8

struct Data {
  int64_t N;
  std::vector<float> X, Y;  // [N x Ls*F], [N x Lt*G]
};

// Target layer l = source layer l's features through a random map, plus noise; source layer 2 is noise only.
Data make_data(int64_t N, double noise, uint64_t seed, double source_scale = 1.0) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<double> n(0, 1);
  const int64_t F = kDims.F(), G = kDims.G(), X = kDims.X(), Y = kDims.Y();
  std::vector<double> A(F * G);
  for (double& a : A) a = n(rng) / std::sqrt(double(F));
  Data d{N, std::vector<float>(N * X), std::vector<float>(N * Y)};
  for (int64_t t = 0; t < N; ++t) {
    std::vector<double> x(X);
    for (int64_t c = 0; c < X; ++c) x[c] = n(rng) * (1.0 + 0.5 * (c % F)) + 0.3;
    for (int64_t c = 0; c < X; ++c) d.X[t * X + c] = static_cast<float>(source_scale * x[c]);
    for (int l = 0; l < kDims.Lt; ++l)
      for (int64_t j = 0; j < G; ++j) {
        double y = 0.1 * j + noise * n(rng);
        for (int64_t p = 0; p < F; ++p) y += x[l * F + p] * A[p * G + j];
        d.Y[t * Y + l * G + j] = static_cast<float>(y);
      }
  }
  return d;
}

Moments accumulate(const Data& data) {
  std::vector<float> sx(data.X.begin(), data.X.begin() + kDims.X()), sy(data.Y.begin(), data.Y.begin() + kDims.Y());
  Moments m(kDims, sx, sy);
  m.add_plan(MomentPlan::full(kDims, true));
  auto be = make_cpu_backend();
  std::vector<float> X = data.X, Y = data.Y;
  m.accumulate(*be, X.data(), Y.data(), data.N);
  m.mark_pass_complete();
  return m;
}

// GCV(ρ) of source layer a onto target layer l, all heads together, straight from the data in fp64: the ridge
// solution of the centred data, its residuals, and df = tr((C + λI)^-1 C) by solving for C's columns.
std::vector<double> direct_gcv(const Data& data, int a, int l, int head) {
  const int64_t F = kDims.F(), G = kDims.G(), N = data.N, Dt = kDims.Dt;
  std::vector<double> mx(F, 0), my(G, 0);
  for (int64_t t = 0; t < N; ++t) {
    for (int64_t p = 0; p < F; ++p) mx[p] += data.X[t * kDims.X() + a * F + p] / double(N);
    for (int64_t j = 0; j < G; ++j) my[j] += data.Y[t * kDims.Y() + l * G + j] / double(N);
  }
  auto x = [&](int64_t t, int64_t p) { return data.X[t * kDims.X() + a * F + p] - mx[p]; };
  auto y = [&](int64_t t, int64_t j) { return data.Y[t * kDims.Y() + l * G + j] - my[j]; };
  std::vector<double> C(F * F, 0), B(F * G, 0);
  for (int64_t t = 0; t < N; ++t)
    for (int64_t p = 0; p < F; ++p) {
      for (int64_t q = 0; q < F; ++q) C[p * F + q] += x(t, p) * x(t, q) / N;
      for (int64_t j = 0; j < G; ++j) B[p * G + j] += x(t, p) * y(t, j) / N;
    }
  double mean = 0;
  for (int64_t p = 0; p < F; ++p) mean += C[p * F + p] / F;
  // Solves (C + λI) Z = R for R [F x cols] by Gaussian elimination (small, well conditioned).
  auto solve = [&](double lambda, std::vector<double> R, int64_t cols) {
    std::vector<double> M = C;
    for (int64_t p = 0; p < F; ++p) M[p * F + p] += lambda;
    for (int64_t k = 0; k < F; ++k)
      for (int64_t i = k + 1; i < F; ++i) {
        const double f = M[i * F + k] / M[k * F + k];
        for (int64_t j = k; j < F; ++j) M[i * F + j] -= f * M[k * F + j];
        for (int64_t c = 0; c < cols; ++c) R[i * cols + c] -= f * R[k * cols + c];
      }
    for (int64_t k = F - 1; k >= 0; --k)
      for (int64_t c = 0; c < cols; ++c) {
        double s = R[k * cols + c];
        for (int64_t j = k + 1; j < F; ++j) s -= M[k * F + j] * R[j * cols + c];
        R[k * cols + c] = s / M[k * F + k];
      }
    return R;
  };
  std::vector<double> out;
  for (double rho : lambda_grid()) {
    const double lambda = rho * mean;
    const std::vector<double> W = solve(lambda, B, G), Z = solve(lambda, C, F);
    double df = 0, sse = 0;
    for (int64_t p = 0; p < F; ++p) df += Z[p * F + p];
    for (int64_t t = 0; t < N; ++t)
      for (int64_t j = head * Dt; j < (head + 1) * Dt; ++j) {
        double r = y(t, j);
        for (int64_t p = 0; p < F; ++p) r -= x(t, p) * W[p * G + j];
        sse += r * r / N;
      }
    out.push_back(sse / ((1 - df / N) * (1 - df / N)));
  }
  return out;
}

std::map<Kind, ProbeR2> probe(const Moments& m, double tokens) {
  auto be = make_cpu_backend();
  std::map<Kind, ProbeR2> r;
  for (Kind kind : kMappedKinds) {
    r[kind] = probe_all_heads(m.covariances(), *be, 0.0, kind, {}, tokens);
    probe_at_chosen_lambda(r[kind]);
  }
  return r;
}

}  // namespace

TEST(AutoLambda, GcvFromTheMomentsIsGcvFromTheData) {
  const Data data = make_data(60, 0.5, 7);  // few tokens: df/N matters
  const auto r = probe(accumulate(data), static_cast<double>(data.N));
  const int64_t P = static_cast<int64_t>(lambda_grid().size());
  for (int a = 0; a < kDims.Ls; ++a)
    for (int l = 0; l < kDims.Lt; ++l)
      for (int h = 0; h < kDims.Ht; ++h) {
        SCOPED_TRACE("source " + std::to_string(a) + ", target " + std::to_string(l) + ", head " + std::to_string(h));
        const std::vector<double> want = direct_gcv(data, a, l, h);
        int compared = 0;
        for (int64_t p = 0; p < P; ++p) {
          const double got = r.at(Kind::k).gcv[((int64_t{a} * kDims.Lt + l) * kDims.Ht + h) * P + p];
          if (std::isnan(got)) continue;  // below the moments' noise: not a candidate
          EXPECT_NEAR(got, want[p], 2e-4 * want[p]) << "rho " << lambda_grid()[p];
          ++compared;
        }
        EXPECT_GE(compared, P - 4);  // ρ < 2e-6 falls below the fp32 moments' noise (10 ε32 of the largest eigenvalue)
      }
}

TEST(AutoLambda, TheChoiceFollowsTheData) {
  // Clean data and many tokens: the least regularisation the moments allow; noise and few tokens: more.
  const Data clean = make_data(4000, 0.001, 11), noisy = make_data(24, 3.0, 11);
  const auto rc = probe(accumulate(clean), 4000.0), rn = probe(accumulate(noisy), 24.0);
  const std::vector<std::vector<int>> rankings = {{0, 1, 2}, {1, 0, 2}};
  const Lambdas lc = Lambdas::chosen(rc, rankings), ln = Lambdas::chosen(rn, rankings);
  for (int l = 0; l < kDims.Lt; ++l) {
    EXPECT_LE(lc.rho(Kind::v, l), 1e-5) << l;
    EXPECT_GE(ln.rho(Kind::v, l), 1e-2) << l;
  }
  const std::optional<ManifestLambda> j = lc.layer_choice(1);
  ASSERT_TRUE(j.has_value());
  EXPECT_EQ(j->source_layer, 1);
  EXPECT_EQ(j->rho.v, lc.rho(Kind::v, 1));
  EXPECT_EQ(j->gcv.v.size(), lambda_grid().size());
  EXPECT_EQ(lc.choice()->criterion, "gcv");
  EXPECT_EQ(lc.choice()->grid, lambda_grid());
  EXPECT_FALSE(Lambdas::fixed(0.01).layer_choice(0).has_value());
  EXPECT_FALSE(Lambdas::fixed(0.01).choice().has_value());
}

TEST(AutoLambda, ScalingTheSourceBy100GivesTheSamePredictions) {
  const Data a = make_data(500, 0.2, 13), b = make_data(500, 0.2, 13, 100.0);
  const Moments ma = accumulate(a), mb = accumulate(b);
  const auto ra = probe(ma, 500.0), rb = probe(mb, 500.0);
  const auto rank_a = rank_sources(ra.at(Kind::k).mean, ra.at(Kind::v).mean, kDims.Ls, kDims.Lt);
  const auto rank_b = rank_sources(rb.at(Kind::k).mean, rb.at(Kind::v).mean, kDims.Ls, kDims.Lt);
  ASSERT_EQ(rank_a, rank_b);
  const Lambdas la = Lambdas::chosen(ra, rank_a), lb = Lambdas::chosen(rb, rank_b);
  auto be = make_cpu_backend();
  for (int l = 0; l < kDims.Lt; ++l) {
    EXPECT_EQ(la.rho(Kind::v, l), lb.rho(Kind::v, l));
    const LayerLambda xa{la.nested(Kind::v, l, ma.covariances()), la.all(Kind::v, ma.covariances())};
    const LayerLambda xb{lb.nested(Kind::v, l, mb.covariances()), lb.all(Kind::v, mb.covariances())};
    EXPECT_NEAR(xb.nested, 1e4 * xa.nested, 1e-4 * xb.nested);
    const auto fa = fit_sweep(ma.covariances(), *be, l, rank_a[l], {1, 2, 3}, xa, "a");
    const auto fb = fit_sweep(mb.covariances(), *be, l, rank_b[l], {1, 2, 3}, xb, "b");
    for (size_t k = 0; k < fa.size(); ++k)  // the same map: W scaled by 1/100, the same biases
      for (size_t i = 0; i < fa[k].W.size(); ++i) EXPECT_NEAR(100 * fb[k].W[i], fa[k].W[i], 2e-3) << k << " " << i;
  }
}

TEST(AutoLambda, AFixedAbsoluteLambdaIsNotScaleFree) {
  // The control for the test above: a fixed λ of 0.01 fits the scaled source differently.
  const Data a = make_data(500, 0.2, 13, 0.01), b = make_data(500, 0.2, 13, 1.0);
  auto be = make_cpu_backend();
  const Moments ma = accumulate(a), mb = accumulate(b);
  const auto fa = fit_sweep(ma.covariances(), *be, 0, {0, 1, 2}, {1}, 0.01, "a");
  const auto fb = fit_sweep(mb.covariances(), *be, 0, {0, 1, 2}, {1}, 0.01, "b");
  double worst = 0;
  for (size_t i = 0; i < fa[0].W.size(); ++i) worst = std::max(worst, std::fabs(0.01 * fa[0].W[i] - fb[0].W[i]));
  EXPECT_GT(worst, 0.05);
}

}  // namespace auto_lambda_test
