#pragma once
// The fit's stages, each a function from explicit inputs to explicit outputs:
//   validate(config) -> Calibration; make_plan(Calibration) -> FitPlan; stream_pass(...) -> moments;
//   probe/select (core/ridge, core/select); solve_layers (stages/solve) -> ArtifactWriter (stages/export).
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "runtime/config.hpp"
#include "core/kv_spec.hpp"
#include "core/moments.hpp"
#include "runtime/stop.hpp"

namespace crosskv {

class Comm;
class ComputeBackend;

struct Grid;

struct Context {
  Comm& comm;                 // every rank of the job
  ComputeBackend& backend;
  Grid* grid = nullptr;       // the rank grid (stages/grid.hpp); none: one layer group
  StopFlag stop = {};         // a stop request (by default the process's signals): ends the job at a safe point
  Comm& readers() const;      // the ranks that share this rank's moments and split the shards among them
};

struct ShardPair {
  std::string rel, domain;
  std::string source_path, target_path;
  int64_t rows = 0;        // tokens in the shard
  int64_t used = 0;        // tokens used: rows 0, s, 2s, ... (after token_stride and max_tokens)
  std::string fingerprint; // SHA-256 over both sides' token_ids and positions
};

struct Calibration {
  FitConfig cfg;
  KvSpec source, target;
  std::string source_model, target_model;
  std::vector<std::string> domains;
  std::vector<ShardPair> shards;  // sorted by relative path
  std::vector<ShardPair> eval_shards;  // held out (eval.shards): not read by the fit
  int64_t tokens_used = 0;
  double stored_bytes_per_token = 0;  // keys and values of both models as stored (the largest over the shards)
  // The shard pair whose first block gives the provisional shift: the store's first pair over every domain, so
  // that the shift (and moments kept per domain) does not change with the domains a fit selects.
  ShardPair shift_shard;
  std::vector<std::string> skipped;  // store entries passed over ("<path>: skipped (why)"), for the log
  PairDims dims() const;
};

// Stage 1: config, stores, shards. Reads only metadata, token ids and positions.
Calibration validate(const FitConfig& cfg);

struct KPlan {
  std::string label;  // "4" or "all"
  int count = 0;      // source layers used
  int64_t features = 0;
  int64_t params = 0;  // 2 * Lt * Ht * ds * Dt (+ biases, counted separately)
  int64_t bias_params = 0;
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
  bool single_pass = true;
  int ranks = 1, layer_groups = 1;  // the grid (stages/grid.hpp)
  bool layer_groups_auto = false;
  int64_t full_moment_bytes = 0, probe_moment_bytes = 0;  // the job's
  int64_t rank_moment_bytes = 0;  // most moment memory of a rank (its share of the blocks + exchanged Gram blocks)
  double accumulate_flops = 0, solve_flops = 0;
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
                  double max_moment_gib, double read_bytes_per_token, int ranks = 1, int layer_groups = 1);
std::string format_plan(const FitPlan& plan);
// Stage 2 for a job of `ranks` ranks: make_plan with runtime.max_moment_gib capped by the smallest free device memory
// over the job's ranks (asked collectively, unless `plan_only`: a plan needs no device), and the host memory
// estimate. Every rank computes the same plan: its mistakes are agreed on and reported once (core/comm.hpp).
FitPlan plan_job(const Calibration& cal, Context& ctx, int ranks, bool plan_only);
double weight_bytes(Dtype d);

struct PassStats {
  int64_t tokens = 0;
  double seconds = 0, bytes = 0;
};

struct Shifts {
  std::vector<float> xk, yk, xk_raw, yk_raw, xv, yv;
};
// Provisional shifts: means of the first block of cal.shift_shard (the same on every rank and for every domain
// selection).
Shifts compute_shifts(const Calibration& cal);

// Stage 3/5: one streaming pass, in rounds. With T = ctx.readers().size(), round r covers the shards
// [r*T*E, (r+1)*T*E) (E = runtime.checkpoint.every_shards); reader p reads those with index % T == p. After each round `on_round` runs on
// every rank (it reduces and checkpoints); `abandoned` is true when this rank stopped reading on a stop signal.
// k_rope may be null (the pass then does not keep raw keys).
using RoundHook = std::function<void(int64_t round, int64_t rounds, bool abandoned)>;
int64_t pass_rounds(const Calibration& cal, int ranks);
PassStats stream_pass(const Calibration& cal, Context& ctx, Moments& k, Moments* k_rope, Moments& v,
                      const std::string& label, int64_t start_round = 0, const RoundHook& on_round = {});

// A round's end with several readers: the live sums of `ms` (in order) are reduced over `readers` into this rank's
// share of the pass (base_f, base_d: empty before the first round, then the running sums), and zeroed where they
// are. The sums are read where they are held, a segment at a time (ComputeBackend::copy_sums): a device backend's
// stay on the device (zeroed there) and their host copies are never written; with a device comm only this rank's
// share crosses to the host. After a pass's last round the caller drops the held copies (Moments::release_sums)
// before overwriting the moments. (One reader has nothing to reduce: its share is its moments.)
void reduce_round(const std::vector<Moments*>& ms, ComputeBackend& be, Comm& readers, std::vector<float>& base_f,
                    std::vector<double>& base_d);

}  // namespace crosskv
