#include "fit/solve.hpp"

#include <chrono>
#include <algorithm>
#include <cstring>
#include <memory>
#include <numeric>

#include "core/bytes.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "fit/ridge.hpp"
#include "fit/checkpoint.hpp"
#include "fit/export.hpp"
#include "fit/grid.hpp"
#include "fit/lambda.hpp"

namespace crosskv {
namespace {

constexpr int kLambdaRetries = 6;  // auto λ: at most 10^6 times the chosen one before a system counts as singular

// A rank's part in the solve (see solve_layers): a member of a pair of its layer group's readers (0: keys, 1: values), or
// a reader alone (both kinds; an odd last reader, or a layer group of one).
struct SolveUnit {
  SolveUnit(const Grid& g, Comm& comm) {
    const int pairs = g.token_groups / 2;
    paired = g.token_group < 2 * pairs;
    index = paired ? g.token_group / 2 : pairs;
    units = pairs + g.token_groups % 2;
    member = paired ? g.token_group % 2 : 0;
    const int color = paired ? g.layer_group * g.token_groups + index : g.layer_groups * g.token_groups + comm.rank();
    pair = comm.split(color, comm.rank());
    CROSSKV_ASSERT(!paired || pair->rank() == member, "a pair's ranks are its members in token-group order");
  }
  bool solves_keys() const { return !paired || member == 0; }
  bool solves_values() const { return !paired || member == 1; }
  bool writes(size_t i) const { return !paired || static_cast<int>(i % 2) == member; }  // the unit's i-th layer
  bool paired = false;
  int index = 0, units = 1, member = 0;
  std::unique_ptr<Comm> pair;  // the pair (or this rank alone)
};

// A layer fit's fields, as a pair's message carries them (core/bytes.hpp).
template <class Fit, class IO>
void fit_fields(Fit& f, IO& io) {
  io(f.k, f.structure, f.layers, f.W, f.b, f.r2, f.lambda);
}

// One kind's fits of a target layer, from pair member `from` to the other (a broadcast over the pair).
void send_fits(Comm& pair, int from, std::vector<LayerFit>& fits) {
  ByteWriter w;
  if (pair.rank() == from) {
    w(uint64_t{fits.size()});
    for (const LayerFit& f : fits) fit_fields(f, w);
  }
  broadcast_string(pair, w.bytes(), from);
  if (pair.rank() == from) return;
  ByteReader r(w.bytes(), "a pair's fits");
  uint64_t count = 0;
  r(count);
  fits.assign(count, LayerFit{});
  for (LayerFit& f : fits) fit_fields(f, r);
  CROSSKV_ASSERT(r.done(), "a pair's fits have bytes left over");
}

// This unit's target layers still to solve, each with whether this rank writes it: layers an interrupted run already
// wrote are checked by the rank that writes them, and a pair agrees.
std::vector<std::pair<int, bool>> layers_to_solve(const SolveUnit& unit, const Grid& grid, const PairDims& d,
                                                  ArtifactWriter& writer) {
  std::vector<int> unit_layers;
  for (int l = 0, j = 0; l < d.Lt; ++l)
    if (grid.owns_target(l) && j++ % unit.units == unit.index) unit_layers.push_back(l);
  std::vector<char> written(unit_layers.size(), 0);
  for (size_t i = 0; i < unit_layers.size(); ++i)
    if (unit.writes(i)) written[i] = writer.resume_layer(unit_layers[i]) ? 1 : 0;
  for (int from = 0; unit.paired && from < 2; ++from) {
    std::vector<char> theirs = written;
    unit.pair->broadcast(theirs.data(), theirs.size(), from);
    for (size_t i = 0; i < theirs.size(); ++i)
      if (static_cast<int>(i % 2) == from) written[i] = theirs[i];
  }
  std::vector<std::pair<int, bool>> todo;
  for (size_t i = 0; i < unit_layers.size(); ++i)
    if (!written[i]) todo.emplace_back(unit_layers[i], unit.writes(i));
  if (todo.size() < unit_layers.size())
    spdlog::info("export: {} target layer(s) already written by an interrupted run of this job; solving {}",
                 unit_layers.size() - todo.size(), todo.size());
  return todo;
}

}  // namespace

namespace {

// The k = all system is the same for every target layer: factored once per kind solved here (per head: on first use).
struct AllSystems {
  std::unique_ptr<Factor> k, v;
  std::vector<Factor> head_k, head_v;
  double lambda[2] = {0, 0};  // per mapped kind: the λ k / v were factored with
};

AllSystems factor_all_systems(Context& ctx, const PairDims& d, const SolveUnit& unit, const Lambdas& lambdas,
                              Moments& mk, Moments& mv) {
  AllSystems all;
  const auto t_factor = std::chrono::steady_clock::now();
  std::vector<int> asc(d.Ls);
  std::iota(asc.begin(), asc.end(), 0);
  // auto: the smallest of λ, 10λ, 100λ... that the solver accepts (below the fp32 moments' noise a rank-deficient
  // system is indefinite); a fixed λ as given.
  auto factor = [&](Moments& m, Kind kind) {
    double lambda = lambdas.all(kind, m.covariances());
    auto f = std::make_unique<Factor>(factor_layers(m.covariances(), ctx.backend, asc, lambda));
    for (int i = 0; lambdas.automatic() && f->bad_minor > 0 && i < kLambdaRetries; ++i) {
      lambda *= 10;
      f = std::make_unique<Factor>(factor_layers(m.covariances(), ctx.backend, asc, lambda));
    }
    all.lambda[mapped_index(kind)] = lambda;
    return f;
  };
  if (unit.solves_keys()) all.k = factor(mk, Kind::k);
  if (unit.solves_values()) all.v = factor(mv, Kind::v);
  spdlog::info("factored the k = all system {} ({} features) in {}",
               unit.paired ? "of one kind (keys and values solved by a pair of ranks)" : "once per kind",
               (all.k ? all.k : all.v)->n, human_seconds(seconds_since(t_factor)));
  return all;
}

// What every target layer's sweep shares.
struct SweepInputs {
  Context& ctx;
  const FitPlan& plan;
  const std::vector<int>& counts;
  const std::vector<std::vector<int>>& rankings;
  const Lambdas& lambdas;
  SolveWorkspace& workspace;
};

// Every structure's fits of target layer l and one kind, in the plan's slot order (structure-major).
void sweep_kind(const SweepInputs& in, int l, const Covariances& m, Kind kind, const Factor* all, double all_lambda,
                std::vector<Factor>& head_all, std::vector<LayerFit>& into) {
  const std::string what = "target layer " + std::to_string(l) + ", " + kind_dataset(kind);
  LayerLambda lambda{in.lambdas.nested(kind, l, m), all ? all_lambda : in.lambdas.all(kind, m)};
  for (const Structure s : in.plan.structures) {
    for (int attempt = 0;; ++attempt) {
      try {
        std::vector<LayerFit> f =
            s == Structure::cross_head
                ? fit_sweep(m, in.ctx.backend, l, in.rankings[l], in.counts, lambda, what, all, &in.workspace)
                : fit_sweep_per_head(m, in.ctx.backend, l, in.rankings[l], in.counts, lambda, what + ", per_head",
                                     &head_all, &in.workspace);
        for (auto& x : f) into.push_back(std::move(x));
        break;
      } catch (const SolveError& e) {  // auto: a larger λ, as for the k = all system
        if (!in.lambdas.automatic() || attempt == kLambdaRetries) throw;
        spdlog::warn("{}; trying 10x its auto lambda", e.what());
        lambda = LayerLambda{lambda.nested * 10, lambda.all * 10};
        all = nullptr;     // factored here with the larger λ
        head_all.clear();  // the same for the per-head k = all systems
      }
    }
  }
}

void log_solve_times(const SolveTimes& st, const ArtifactWriter& writer) {
  spdlog::info("solve: {} assembling right-hand sides, {} assembling and factoring systems, {} substituting, {} "
               "R²/biases/weights; files "
               "converted and written in {} ({} converting; {} of it behind the solves)",
               human_seconds(st.assemble), human_seconds(st.factor), human_seconds(st.substitute),
               human_seconds(st.finish), human_seconds(writer.write_seconds()), human_seconds(writer.convert_seconds()),
               human_seconds(std::max(0.0, writer.write_seconds() - writer.wait_seconds())));
}

}  // namespace

void solve_layers(Context& ctx, const FitPlan& plan, Moments& mk, Moments& mv,
                  const std::vector<std::vector<int>>& rankings, const Lambdas& lambdas, ArtifactWriter& writer,
                  const std::string& ckpt_dir) {
  const Grid& grid = *ctx.grid;
  const PairDims& d = plan.dims;
  std::vector<int> counts;
  for (const auto& k : plan.ks) counts.push_back(k.count);
  const SolveUnit unit(grid, ctx.comm);
  const std::vector<std::pair<int, bool>> todo = layers_to_solve(unit, grid, d, writer);
  // A pair member solves one kind: the other kind's moments are not needed here any more.
  if (unit.paired) (unit.solves_keys() ? mv : mk) = Moments{};
  AllSystems all;
  if (has_structure(plan.structures, Structure::cross_head) && counts.back() == d.Ls && todo.size() > 1)
    all = factor_all_systems(ctx, d, unit, lambdas, mk, mv);
  Progress progress(ctx.comm.size() > 1 ? "solve (rank 0's share)" : "solve", static_cast<int64_t>(todo.size()), 0,
                    "target layers");
  SolveWorkspace workspace;  // reused by every target layer, keys and values
  const SweepInputs in{ctx, plan, counts, rankings, lambdas, workspace};
  for (const auto& [l, writes] : todo) {
    if (!unit.pair->all_ok(!ctx.stop.requested()))
      throw Interrupted("stopped by a signal while solving; the moments are committed in " + ckpt_dir);
    std::vector<LayerFit> fk, fv;
    if (unit.solves_keys()) sweep_kind(in, l, mk.covariances(), Kind::k, all.k.get(), all.lambda[0], all.head_k, fk);
    if (unit.solves_values())
      sweep_kind(in, l, mv.covariances(), Kind::v, all.v.get(), all.lambda[1], all.head_v, fv);
    if (unit.paired) {  // the member that does not write this layer sends its kind to the one that does
      const int from = writes ? 1 - unit.member : unit.member;
      send_fits(*unit.pair, from, from == 0 ? fk : fv);
    }
    if (writes) writer.write_layer(l, std::move(fk), std::move(fv), lambdas.layer_choice(l));  // while the next solves
    progress.add(1);
  }
  writer.drain();
  progress.finish();
  log_solve_times(workspace.times, writer);
}

nlohmann::json export_identity(const Calibration& cal, const FitPlan& plan, int ranks) {
  const FitConfig& cfg = cal.cfg;
  std::vector<int> counts;
  for (const auto& k : plan.ks) counts.push_back(k.count);
  nlohmann::json id = checkpoint_identity(cal, plan, ranks);
  id["fit"] = {{"k", counts}, {"lambda", cfg.fit.lambda.json()}, {"dtype", weight_dtype_name(cfg.fit.dtype)},
               {"weights", cfg.calibration.weights}, {"version", CROSSKV_VERSION}};
  // Recorded only when it differs from the paper's, so that an export interrupted before this field resumes.
  if (plan.structures != std::vector<Structure>{Structure::cross_head}) {
    nlohmann::json s = nlohmann::json::array();
    for (const Structure x : plan.structures) s.push_back(to_string(x));
    id["fit"]["structure"] = s;
  }
  // The residual-MLP stage rewrites layer files before they are published: an interrupted export of another
  // mapper setting is another job's (its rewritten layers carry MLPs).
  if (cfg.fit.mapper != MapperKind::ridge) {
    id["fit"]["mapper"] = mapper_kind_name(cfg.fit.mapper);
    id["fit"]["mlp"] = mlp_settings_json(cfg.fit.mlp);
    nlohmann::json held = nlohmann::json::array();
    for (const auto& e : cal.eval_shards) held.push_back(e.rel);
    id["fit"]["mlp"]["eval_shards"] = held;
  }
  return id;
}

std::vector<std::string> solve_and_export(Context& ctx, const Calibration& cal, const FitPlan& plan, Moments& mk,
                                          Moments& mv, const std::vector<std::vector<int>>& rankings,
                                          const Lambdas& lambdas, const std::string& ckpt_dir,
                                          const std::function<ManifestRun()>& manifest_run, bool publish) {
  ArtifactWriter writer(cal, plan, ctx.comm.rank());
  if (ctx.comm.rank() == 0) writer.begin(export_identity(cal, plan, ctx.comm.size()));
  ctx.comm.barrier();
  writer.set_lambda_choice(lambdas.choice());
  solve_layers(ctx, plan, mk, mv, rankings, lambdas, writer, ckpt_dir);
  const auto entries = gather_strings(ctx.comm, writer.layer_entries());
  if (ctx.comm.rank() != 0) return {};
  for (size_t r = 1; r < entries.size(); ++r) writer.add_layer_entries(entries[r]);
  return writer.finish(manifest_run(), publish);
}

}  // namespace crosskv
