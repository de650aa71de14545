#pragma once
// Stage 2 of a fit: which moments each pass accumulates, the rank grid's layer groups, the memory it takes.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "fit/calibration.hpp"
#include "fit/context.hpp"

namespace crosskv {

struct KPlan {
  std::string label;  // "4" or "all"
  int count = 0;      // source layers used
  int64_t features = 0;
  int64_t params = 0;  // 2 * Lt * Ht * ds * Dt (+ biases, counted separately)
  int64_t bias_params = 0;
  int64_t head_features = 0;  // per_head: count * Ds features per system
  int64_t head_params = 0;    // per_head: 2 * Lt * Ht * count * Ds * Dt
  int64_t features_of(Structure s) const { return s == Structure::per_head ? head_features : features; }
  int64_t params_of(Structure s) const { return s == Structure::per_head ? head_params : params; }
};

// Host memory of one rank, estimated from its plan (the program and its libraries not included): the peak of a pass
// and of the solve. For sizing a batch job's memory request; the log's "holds" lines and max RSS are the measure.
struct HostMemory {
  bool device = false;    // a device backend: inputs prepared and systems factored there
  double moments = 0;     // the rank's moment blocks (FitPlan::rank_moment_bytes)
  double share = 0;       // its checkpointed share of the pass (several readers), or pass 1's copy (one reader)
  double buffers = 0;     // input blocks in flight (two), and a reduction's segments (several readers)
  double solve_moments = 0;  // the moments a rank solves from: one kind when readers pair up for the solve
  double factors = 0;     // systems factored on the host: k = all (one per kind solved) and one layer's nested k
  double workspace = 0;   // one target layer's fp64 Cxy, substitution and solution, at the largest k
  double pass() const { return moments + share + buffers; }
  double solve() const { return solve_moments + factors + workspace; }
};
struct FitPlan {
  PairDims dims;
  int64_t tokens = 0;
  std::vector<KPlan> ks;  // ascending by count
  std::vector<Structure> structures = {Structure::cross_head};
  // The artifacts: one per structure and k, structure-major (slot i is ks[i % ks.size()] of structures[i / ...]).
  size_t slots() const { return ks.size() * structures.size(); }
  const KPlan& slot_k(size_t i) const { return ks[i % ks.size()]; }
  Structure slot_structure(size_t i) const { return structures[i / ks.size()]; }
  std::string slot_folder(size_t i) const { return mapper_folder_name(slot_k(i).label, slot_structure(i)); }
  bool single_pass = true;
  int ranks = 1, layer_groups = 1;  // the grid (fit/grid.hpp)
  bool layer_groups_auto = false;
  int64_t full_moment_bytes = 0, probe_moment_bytes = 0;  // the job's
  int64_t rank_moment_bytes = 0;  // most moment memory of a rank (its share of the blocks + exchanged Gram blocks)
  double accumulate_flops = 0, solve_flops = 0;
  double head_solve_flops = 0;  // of solve_flops: the per_head systems
  double read_bytes_per_token = 0;
  int64_t selected_moment_bytes = 0;  // two passes: the job's blocks of the top-kmax selections (keys and values)
  HostMemory host;  // one rank's host memory (plan_job fills it in)
};

HostMemory estimate_host_memory(const FitPlan& plan, int64_t block_tokens, double stored_bytes_per_token, bool device);
std::string format_host_memory(const HostMemory& m);

// Stage 2. One pass (every block) when each rank's share of them fits `max_moment_gib`, else two (probe, then the
// blocks the selections need). `layer_groups` 0 (auto): the fewest layer groups dividing `ranks` for which one pass
// fits, else two passes fit, else as many as ranks (fewer layer groups read the calibration data fewer times).
FitPlan make_plan(const PairDims& dims, int64_t tokens, const std::vector<KChoice>& ks, ProbeMode probe,
                  double max_moment_gib, double read_bytes_per_token, int ranks = 1, int layer_groups = 1,
                  const std::vector<Structure>& structures = {Structure::cross_head});
std::string format_plan(const FitPlan& plan);
// Stage 2 for a job of `ranks` ranks: make_plan with runtime.max_moment_gib capped by the smallest free device memory
// over the job's ranks (asked collectively, unless `plan_only`: a plan needs no device), and the host memory
// estimate. Every rank computes the same plan: its mistakes are agreed on and reported once (core/comm.hpp).
FitPlan plan_job(const Calibration& cal, Context& ctx, int ranks, bool plan_only);
double weight_bytes(Dtype d);

}  // namespace crosskv
