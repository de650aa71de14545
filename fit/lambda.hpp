#pragma once
// fit.lambda: auto. The ridge strength chosen from the moments by generalized cross-validation (docs/METHOD.md,
// Choosing λ): λ = ρ × the system's mean feature variance, ρ from a grid, so that λ has no unit of the KV (scaling the
// source by any factor gives the same predictions).
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "artifact/manifest.hpp"

#include "core/kind.hpp"
#include "core/r2.hpp"

namespace crosskv {

class Covariances;
class DenseMaths;
struct LambdaSetting;

// The relative strengths ρ that auto tries, ascending (1e-9 ... 1).
const std::vector<double>& lambda_grid();

// One ridge system's figures over the grid, from the eigendecomposition of its Cxx [n x n] (ridge_eigen): for each output group
// (a head), GCV(ρ) = (SSE/N) / (1 - df/N)² and R² = 1 - SSE/SST, SSE/N = Σ var_y - Σ_i |(QᵀCxy)_i|² (w_i + 2λ) /
// (w_i + λ)² and df = Σ_i w_i / (w_i + λ), λ = ρ × mean(w). ridge_eigen overwrites A = Cxx; B = Cxy [n x cols]
// (row-major, ldb), columns grouped by `groups` consecutive equal groups; var_y [cols]; `tokens` the N of df.
// The system's side, computed once however many right-hand sides it meets: Cxx = Q diag(w) Qᵀ.
struct RidgeEigen {
  int64_t n = 0;
  std::vector<float> q;   // Q, row-major [n x n] (fp32: a criterion over a grid of decades)
  std::vector<double> w;  // eigenvalues, clamped at 0
  double noise = 0;       // the fp32 moments' noise on them
  double mean = 0;        // mean eigenvalue: tr(Cxx)/n
};
RidgeEigen ridge_eigen(DenseMaths& be, int64_t n, double* A);
struct RidgeCurves {
  std::vector<double> gcv;  // [groups x grid]
  std::vector<double> r2;   // [groups x grid]
};
RidgeCurves ridge_curves(DenseMaths& be, const RidgeEigen& e, const double* B, int64_t cols, int64_t ldb,
                         const double* var_y, int groups, double tokens);

// The probe's auto figures into r: r.gcv and r.r2_grid sized for [Ls x Lt x H x grid] (zero where this rank does
// not compute the entry).
void size_probe_curves(ProbeR2& r);
// After the probe's curves are summed over the ranks: each (source, target) pair's ρ minimises its heads' summed
// GCV, and its R² per head (r.per_head, r.mean) are those at that ρ.
void probe_at_chosen_lambda(ProbeR2& r);

// The λ of every system the solve factors.
class Lambdas {
 public:
  // One fixed λ for every system.
  static Lambdas fixed(double value);
  // auto: target layer l's ρ (per kind) is the one that minimises the summed GCV of its top source layer's system in
  // the probe; its systems' λ is ρ × the top source layer's mean feature variance. The k = all system is shared by
  // every target layer: its ρ is the median of the layers'.
  static Lambdas chosen(const std::map<Kind, ProbeR2>& probe, const std::vector<std::vector<int>>& rankings);
  static Lambdas from(const LambdaSetting& setting, const std::map<Kind, ProbeR2>& probe,
                      const std::vector<std::vector<int>>& rankings);

  bool automatic() const { return automatic_; }
  // λ of target layer l's top-k systems (k < all), and of the k = all system.
  double nested(Kind kind, int l, const Covariances& m) const;
  double all(Kind kind, const Covariances& m) const;
  double rho(Kind kind, int l) const { return rho_.at(kind)[l]; }
  double rho_all(Kind kind) const { return rho_all_.at(kind); }
  // Target layer l's choice for its manifest entry: the source layer, ρ and the GCV curve per kind (the λ each k got
  // is the writer's to add); empty for a fixed λ.
  std::optional<ManifestLambda> layer_choice(int l) const;
  // The fit's: the criterion, the grid and k = all's ρ; empty for a fixed λ.
  std::optional<ManifestLambdaChoice> choice() const;
  // One line for the log: per kind, the layers' ρ (median, range, how many at the grid's ends) and k = all's.
  std::string summary() const;

 private:
  bool automatic_ = false;
  double value_ = 0;
  std::map<Kind, std::vector<double>> rho_;                 // per target layer
  std::map<Kind, std::vector<std::vector<double>>> curve_;  // per target layer: summed GCV over the grid
  std::map<Kind, double> rho_all_;
  std::vector<int> top_;  // per target layer: the source layer its ρ was chosen on
};

// Mean variance of the features of the listed source layers (tr(Cxx)/n).
double mean_feature_variance(const Covariances& m, const std::vector<int>& layers);

}  // namespace crosskv
