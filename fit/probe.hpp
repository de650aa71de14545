#pragma once
// Stage 4: the R² probe (the paper's Eq. 2) over the pass-1 moments, its matrices and heatmaps, and the selection
// of the top-k source layers per target layer; for two-pass fits, the blocks pass 2 must accumulate.
#include <map>
#include <string>
#include <vector>

#include "fit/ridge.hpp"
#include "fit/pass.hpp"
#include "fit/plan.hpp"

namespace crosskv {

struct Probe {
  std::map<Kind, ProbeR2> r2;  // k_rope (raw keys), k (RoPE-stripped), v
  std::string r2_path, heatmap_path;  // <output.dir>/r2.h5 and r2_heatmap.svg (written by rank 0)
};

// The probe of every (source, target) layer pair, shared out over the ranks and summed; frees the raw-key moments.
Probe run_probes(const Calibration& cal, const FitPlan& plan, Context& ctx, FitMoments& m);

// Source layers per target layer, most predictive first (keys' and values' R² together).
std::vector<std::vector<int>> select_sources(const Probe& probe, const PairDims& d, int kmax);

// The blocks the top-kmax selections need (two-pass fits accumulate them in pass 2).
MomentPlan selection_plan(const std::vector<std::vector<int>>& rankings, int kmax);

}  // namespace crosskv
