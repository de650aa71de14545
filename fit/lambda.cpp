#include "fit/lambda.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>


#include "core/backend.hpp"
#include "core/error.hpp"
#include "fit/config.hpp"
#include "fit/moments.hpp"

namespace crosskv {
namespace {

constexpr double kNaN = std::numeric_limits<double>::quiet_NaN();

// A (source, target) pair's GCV over the grid: its heads' summed.
std::vector<double> pair_curve(const ProbeR2& r, int64_t pair) {
  const int64_t P = static_cast<int64_t>(lambda_grid().size());
  std::vector<double> total(P, 0.0);
  for (int64_t h = 0; h < r.H; ++h)
    for (int64_t p = 0; p < P; ++p) total[p] += r.gcv[(pair * r.H + h) * P + p];
  return total;
}

size_t argmin_finite(const std::vector<double>& v) {
  size_t best = v.size();
  for (size_t i = 0; i < v.size(); ++i)
    if (std::isfinite(v[i]) && (best == v.size() || v[i] < v[best])) best = i;
  return best;
}

}  // namespace

const std::vector<double>& lambda_grid() {
  static const std::vector<double> grid = {1e-9, 1e-8, 1e-7, 1e-6, 1e-5, 1e-4, 1e-3, 1e-2, 1e-1, 1.0};
  return grid;
}

RidgeEigen ridge_eigen(DenseMaths& be, int64_t n, double* A) {
  RidgeEigen e{n, std::vector<float>(n * n), std::vector<double>(n)};
  be.symmetric_eigen(n, A, n, e.w.data());  // A: eigenvectors as columns, w ascending
  // fp32 moments put Cxx's eigenvalues within about ε32 |Cxx| of the truth (a null direction can come out negative):
  // a λ below ten times that is noise, not regularisation, and is not a candidate.
  e.noise = n ? std::max(-e.w.front(), 6e-8 * e.w.back()) : 0.0;
  for (double& x : e.w) x = std::max(x, 0.0);
  for (int64_t i = 0; i < n * n; ++i) e.q[i] = static_cast<float>(A[i]);
  for (double x : e.w) e.mean += x;
  e.mean /= std::max<int64_t>(n, 1);
  return e;
}

RidgeCurves ridge_curves(DenseMaths& be, const RidgeEigen& e, const double* B, int64_t cols, int64_t ldb,
                         const double* var_y, int groups, double tokens) {
  CROSSKV_ASSERT(groups > 0 && cols % groups == 0, "ridge_curves: columns not in equal groups");
  const std::vector<double>& grid = lambda_grid();
  const int64_t n = e.n, per = cols / groups, P = static_cast<int64_t>(grid.size());
  const std::vector<double>& w = e.w;
  std::vector<float> b(n * cols), bt(n * cols);  // Qᵀ Cxy in fp32; the solve itself stays fp64
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < cols; ++c) b[i * cols + c] = static_cast<float>(B[i * ldb + c]);
  DenseMaths::BatchedGemm g;
  g.trans_a = true, g.m = n, g.n = cols, g.k = n, g.A = e.q.data(), g.lda = n, g.B = b.data(), g.ldb = cols,
  g.C = bt.data(), g.ldc = cols;
  be.gemm_batched(g);
  std::vector<double> bt2(n * groups, 0.0), sst(groups, 0.0);  // per eigen-direction and group: |(QᵀCxy)_i|²
  for (int64_t i = 0; i < n; ++i)
    for (int64_t c = 0; c < cols; ++c) bt2[i * groups + c / per] += double{bt[i * cols + c]} * bt[i * cols + c];
  for (int64_t c = 0; c < cols; ++c) sst[c / per] += var_y[c];
  RidgeCurves out{std::vector<double>(groups * P, kNaN), std::vector<double>(groups * P, kNaN)};
  if (!(e.mean > 0)) return out;  // no variance: nothing to choose
  for (int64_t p = 0; p < P; ++p) {
    const double lambda = grid[p] * e.mean;
    if (lambda < 10 * e.noise) continue;  // NaN: not a candidate
    double df = 0;
    for (int64_t i = 0; i < n; ++i) df += w[i] / (w[i] + lambda);
    const double denom = 1.0 - df / tokens;
    for (int h = 0; h < groups; ++h) {
      double explained = 0;
      for (int64_t i = 0; i < n; ++i)
        explained += bt2[i * groups + h] * (w[i] + 2 * lambda) / ((w[i] + lambda) * (w[i] + lambda));
      const double sse = std::max(0.0, sst[h] - explained);
      out.gcv[h * P + p] = denom > 0 ? sse / (denom * denom) : std::numeric_limits<double>::infinity();
      out.r2[h * P + p] = sst[h] > 0 ? 1.0 - sse / sst[h] : kNaN;
    }
  }
  return out;
}

void size_probe_curves(ProbeR2& r) {
  const size_t count = static_cast<size_t>(r.Ls) * r.Lt * r.H * lambda_grid().size();
  r.gcv.assign(count, 0.0);
  r.r2_grid.assign(count, 0.0);
}

void probe_at_chosen_lambda(ProbeR2& r) {
  if (r.gcv.empty()) return;
  const int64_t P = static_cast<int64_t>(lambda_grid().size()), H = r.H;
  for (int64_t pair = 0; pair < int64_t{r.Ls} * r.Lt; ++pair) {
    const size_t best = argmin_finite(pair_curve(r, pair));
    for (int64_t h = 0; h < H; ++h)
      r.per_head[pair * H + h] = best < static_cast<size_t>(P) ? r.r2_grid[(pair * H + h) * P + best] : kNaN;
  }
  probe_means(r);
}

double mean_feature_variance(const Covariances& m, const std::vector<int>& layers) {
  const int64_t F = m.dims().F();
  double sum = 0;
  for (int a : layers) {
    const std::vector<double> v = m.var_x(a);
    for (double x : v) sum += x;
  }
  return layers.empty() ? 0.0 : sum / (F * static_cast<int64_t>(layers.size()));
}

Lambdas Lambdas::fixed(double value) {
  Lambdas l;
  l.value_ = value;
  return l;
}

Lambdas Lambdas::chosen(const std::map<Kind, ProbeR2>& probe, const std::vector<std::vector<int>>& rankings) {
  Lambdas out;
  out.automatic_ = true;
  const std::vector<double>& grid = lambda_grid();
  const int Lt = static_cast<int>(rankings.size());
  for (int l = 0; l < Lt; ++l) out.top_.push_back(rankings[l].front());
  for (Kind kind : kMappedKinds) {
    const ProbeR2& r = probe.at(kind);
    CROSSKV_ASSERT(!r.gcv.empty() && r.Lt == Lt, "fit.lambda auto without the probe's GCV curves");
    std::vector<double>& rho = out.rho_[kind];
    std::vector<std::vector<double>>& curve = out.curve_[kind];
    for (int l = 0; l < Lt; ++l) {
      std::vector<double> total = pair_curve(r, int64_t{out.top_[l]} * r.Lt + l);
      const size_t best = argmin_finite(total);
      rho.push_back(best < total.size() ? grid[best] : grid.front());
      curve.push_back(std::move(total));
    }
    std::vector<double> sorted = rho;
    std::sort(sorted.begin(), sorted.end());
    out.rho_all_[kind] = sorted.empty() ? grid.front() : sorted[(sorted.size() - 1) / 2];  // the lower median
  }
  return out;
}

Lambdas Lambdas::from(const LambdaSetting& setting, const std::map<Kind, ProbeR2>& probe,
                      const std::vector<std::vector<int>>& rankings) {
  return setting.automatic ? chosen(probe, rankings) : fixed(setting.value);
}

double Lambdas::nested(Kind kind, int l, const Covariances& m) const {
  if (!automatic_) return value_;
  return rho_.at(kind)[l] * mean_feature_variance(m, {top_[l]});
}

double Lambdas::all(Kind kind, const Covariances& m) const {
  if (!automatic_) return value_;
  std::vector<int> every(m.dims().Ls);
  for (int a = 0; a < m.dims().Ls; ++a) every[a] = a;
  return rho_all_.at(kind) * mean_feature_variance(m, every);
}

std::optional<ManifestLambda> Lambdas::layer_choice(int l) const {
  if (!automatic_) return std::nullopt;
  ManifestLambda x;
  x.source_layer = top_[l];
  for (Kind kind : kMappedKinds) x.rho[kind] = rho_.at(kind)[l], x.gcv[kind] = curve_.at(kind)[l];
  return x;
}

std::string Lambdas::summary() const {
  const std::vector<double>& grid = lambda_grid();
  std::string s = "fit.lambda auto (GCV on each target layer's top source layer): ";
  for (Kind kind : kMappedKinds) {
    std::vector<double> r = rho_.at(kind);
    std::sort(r.begin(), r.end());
    const auto at_end = std::count(r.begin(), r.end(), grid.front()) + std::count(r.begin(), r.end(), grid.back());
    char buf[200];
    std::snprintf(buf, sizeof buf, "%s%s rho median %.0e in [%.0e, %.0e] (%ld at the grid's ends), k = all %.0e",
                  kind == Kind::k ? "" : "; ", kind_dataset(kind), r[(r.size() - 1) / 2], r.front(), r.back(),
                  static_cast<long>(at_end), rho_all_.at(kind));
    s += buf;
  }
  return s + " (lambda = rho x the system's mean feature variance)";
}

std::optional<ManifestLambdaChoice> Lambdas::choice() const {
  if (!automatic_) return std::nullopt;
  ManifestLambdaChoice c;
  c.grid = lambda_grid();
  for (Kind kind : kMappedKinds) c.rho_all[kind] = rho_all_.at(kind);
  return c;
}

}  // namespace crosskv
