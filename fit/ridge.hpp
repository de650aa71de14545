#pragma once
// Closed-form ridge in fp64 from stored moments (docs/METHOD.md, The fit; Probe and selection): the k sweep and the R² probe (the fit's maths).
#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "core/kind.hpp"
#include "core/backend.hpp"
#include "core/memory.hpp"
#include "core/r2.hpp"
#include "core/structure.hpp"

namespace crosskv {

class Covariances;

struct LayerFit {
  int k = 0;                 // number of source layers used
  std::vector<int> layers;   // ascending: the column order of X
  Structure structure = Structure::cross_head;
  BigVector<float> W;        // cross_head: [k*F x G] row-major, rows in `layers` order;
                             // per_head: [H][k*Ds x Dt], head h's rows in `layers` order
  std::vector<float> b;      // [G]
  std::vector<double> r2;    // in-sample R² per target head (NaN where every column has SST = 0)
  double lambda = 0;         // the λ its system was solved with
};

// λ of one target layer's systems: its nested top-k systems (k < Ls) and the k = all system.
struct LayerLambda {
  LayerLambda(double both = 0) : nested(both), all(both) {}  // NOLINT: one λ for every system (a fixed fit.lambda)
  LayerLambda(double nested_, double all_) : nested(nested_), all(all_) {}
  double nested, all;
  double of(int k, int Ls) const { return k < Ls ? nested : all; }
};

// In-sample R² per head: 1 - SSE/SST with SSE/N = tr(Cyy) - tr(W^T Cxy) - λ|W|² (exact for the ridge solution).
std::vector<double> r2_per_head(const double* W, const double* Cxy, int64_t n, int64_t G, int64_t ld,
                                const std::vector<double>& var_y, double lambda, int heads);
// The same from SSE/N per column (var_y less what the fit explains).
std::vector<double> r2_from_sse(const std::vector<double>& sse, const std::vector<double>& var_y, int heads);

// Cholesky factor of Cxx + λI over source layers in the given order.
struct Factor {
  std::vector<int> order;  // source layers, in factor order
  int64_t n = 0;           // order.size() * F
  DenseMaths::FactorPtr system;  // held by the backend that factored it (on a device backend, in its memory)
  int64_t bad_minor = 0;   // 0, or the first leading minor that is not positive definite
};
// Where solving time goes (seconds, summed over calls): right-hand sides (Cxy) assembled from the moments, the
// systems Cxx + λI assembled and factored by the backend, substitutions, and the finish (R², biases, weights
// rounded and put in source-layer order).
struct SolveTimes {
  double assemble = 0, factor = 0, substitute = 0, finish = 0;
};
Factor factor_layers(const Covariances& m, DenseMaths& be, const std::vector<int>& order, double lambda);
// The same into `f`, reusing its memory.
void factor_layers(const Covariances& m, DenseMaths& be, const std::vector<int>& order, double lambda, Factor& f,
                   SolveTimes* times = nullptr);

// Buffers fit_sweep reuses from one target layer to the next (at paper scale hundreds of MB each: allocating them
// per layer costs a page fault per page every time).
struct SolveWorkspace {
  Factor nested;
  BigVector<double> cxy, z, w;
  SolveTimes times;
};

// Fits target layer `l` for every k in `ks` (ascending counts, each <= ranking.size()).
// k < Ls: one factorisation in rank order serves every k (the top-k system is its leading block) and one forward
// substitution serves every k; only the back substitution is per k. k = Ls: `all_layers` (a Factor over every source
// layer in ascending order, the same system for every target layer) is used when given, else factored here.
// Throws SolveError naming `what` (e.g. "target layer 3, keys") when a needed system is not positive definite.
std::vector<LayerFit> fit_sweep(const Covariances& m, DenseMaths& be, int l, const std::vector<int>& ranking,
                                const std::vector<int>& ks, const LayerLambda& lambda, const std::string& what,
                                const Factor* all_layers = nullptr, SolveWorkspace* workspace = nullptr);

// The same for the head-matched structure (docs/METHOD.md, The fit): per target head h, a system of width k*Ds over source head h of
// the selected layers, nested over k as above. k = Ls uses `all_layers` (one Factor per head over every source layer
// in ascending order, filled here on first use and reused for the next target layer of the same kind) when given.
std::vector<LayerFit> fit_sweep_per_head(const Covariances& m, DenseMaths& be, int l, const std::vector<int>& ranking,
                                         const std::vector<int>& ks, const LayerLambda& lambda, const std::string& what,
                                         std::vector<Factor>* all_layers = nullptr,
                                         SolveWorkspace* workspace = nullptr);

// Which probe entries this rank computes: (source layer a, target layer l, head h) for the same-head probe,
// (a, l, -1) for the all-heads probe. Empty: all. Entries not computed are 0, so that the sum over ranks that
// share the entries out is exact; probe_means() then recomputes the head averages.
using ProbeShare = std::function<bool(int a, int l, int h)>;
// Single-source probe (docs/METHOD.md, Probe and selection): target head h of l from source head h of a (same_head) or all heads of a.
// With `curve_tokens` > 0 (fit.lambda: auto; the calibration's token count, GCV's N) λ is not used: each entry's
// GCV and R² over the λ grid go into r.gcv and r.r2_grid (fit/lambda.hpp), and per_head stays zero until
// probe_at_chosen_lambda.
ProbeR2 probe_same_head(const Covariances& m, DenseMaths& be, double lambda, Kind kind,
                        const ProbeShare& mine = {}, double curve_tokens = 0);
ProbeR2 probe_all_heads(const Covariances& m, DenseMaths& be, double lambda, Kind kind,
                        const ProbeShare& mine = {}, double curve_tokens = 0);

}  // namespace crosskv
