#include "fit/fit_pipeline.hpp"

#include <chrono>
#include <filesystem>
#include <sstream>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "core/mlp.hpp"
#include "io/output_lock.hpp"
#include "eval/held_out.hpp"
#include "fit/export.hpp"
#include "fit/grid.hpp"
#include "fit/lambda.hpp"
#include "fit/mlp.hpp"
#include "fit/pass.hpp"
#include "fit/probe.hpp"
#include "fit/solve.hpp"
#include "fit/validate.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

// The residual MLPs' size, training flops and memory (fit.mapper: mlp | auto), for --plan.
std::string format_mlp_plan(const Calibration& cal, const FitPlan& plan) {
  const MlpSettings& c = cal.cfg.fit.mlp;
  const int64_t G = cal.target.features_per_layer(), h = c.hidden, Lt = cal.target.n_layers;
  const double train_tokens = static_cast<double>(cal.tokens_used) * (1.0 - c.val_fraction);
  double flops = 0, params_total = 0;
  int64_t widest = 0;
  for (const KPlan& k : plan.ks) {
    const int64_t K = k.features;
    const double params = static_cast<double>(MlpShape{K, h, G}.parameters());
    params_total += 2.0 * Lt * params;
    flops += 2.0 * Lt * c.epochs * train_tokens * 6.0 * static_cast<double>(K * h + h * h + h * G);
    widest = std::max(widest, K);
  }
  // A rank holds its token group's share of one (layer, kind): features, their standardised copy, target, residual.
  const int token_groups = std::max(1, plan.ranks / std::max(1, plan.layer_groups));
  const double per_rank = 4.0 * static_cast<double>(cal.tokens_used) * (2 * widest + 2 * G) / token_groups;
  char buf[400];
  std::snprintf(buf, sizeof buf,
                "  residual MLPs (fit.mapper: %s): %d hidden, %s parameters over every k and kind if all are kept; "
                "training %.3g flops (%d epochs); in memory per rank %s (one layer and kind, 1/%d of the tokens)\n",
                mapper_kind_name(cal.cfg.fit.mapper).c_str(), c.hidden, human_count(params_total).c_str(), flops, c.epochs,
                human_bytes(per_rank).c_str(), token_groups);
  return buf;
}

HeldOut held_out_shards(const Calibration& cal) {
  HeldOut h;
  for (const auto& p : cal.eval_shards) {
    h.source_shards.push_back(p.source_path);
    h.target_shards.push_back(p.target_path);
    h.names += (h.names.empty() ? "" : ", ") + p.rel;
  }
  return h;
}

class StageClock {
 public:
  void start(const std::string& name) {
    stop();
    name_ = name;
    t0_ = std::chrono::steady_clock::now();
    spdlog::info("== {} ==", name);
  }
  void stop() {
    if (name_.empty()) return;
    times_.emplace_back(name_, seconds_since(t0_));
    name_.clear();
  }
  // Each stage's seconds and their total.
  std::vector<std::pair<std::string, double>> timings() const {
    std::vector<std::pair<std::string, double>> t;
    double total = 0;
    for (const auto& [n, s] : times_) t.emplace_back(n, s), total += s;
    t.emplace_back("total", total);
    return t;
  }
  void summary() const {
    double total = 0;
    for (const auto& [n, s] : times_) total += s;
    spdlog::info("summary: stage times");
    for (const auto& [n, s] : times_)
      spdlog::info("  {:<12} {:>10}  {:5.1f}%", n, human_seconds(s), total > 0 ? 100.0 * s / total : 0.0);
    spdlog::info("  {:<12} {:>10}", "total", human_seconds(total));
  }

 private:
  std::string name_;
  std::chrono::steady_clock::time_point t0_;
  std::vector<std::pair<std::string, double>> times_;
};

void log_lines(const std::string& text) {
  std::string line;
  for (const char c : text + "\n") {
    if (c != '\n') {
      line += c;
    } else if (!line.empty()) {
      spdlog::info("{}", line);
      line.clear();
    }
  }
}

// One job per output folder: rank 0 holds the lock for the job's lifetime.
void lock_output(Context& ctx, const std::string& dir, OutputLock& lock) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) throw InputError("output.dir: cannot create " + dir + ": " + ec.message());
  const bool root = ctx.comm.rank() == 0;
  if (root) lock.acquire(dir);
  if (!ctx.comm.all_ok(!root || lock.held()))
    throw InputError("output.dir: " + dir + " is in use by another crosskv-fit (" + lock.holder() + ")");
}

void log_summary(const FitResult& res, const StageClock& clock, const PassStats& p1, const std::string& ckpt_dir) {
  clock.summary();
  if (res.tokens_read == 0)
    spdlog::info("refit from the stored moments in {}: no calibration data was read", ckpt_dir);
  else
    spdlog::info("read {} tokens in pass 1 ({}/s)", p1.tokens, human_bytes(p1.bytes / std::max(p1.seconds, 1e-9)));
  for (const auto& a : res.artifacts) spdlog::info("artifact: {}", a);
  spdlog::info("R² matrices: {}  heatmaps: {}", res.r2_path, res.heatmap_path);
  if (!res.report_path.empty()) spdlog::info("report: {}", res.report_path);
}

// The manifests' record of the run: stage times so far, the grid, the passes.
ManifestRun manifest_run(const StageClock& clock, const Context& ctx, const Grid& grid, int passes) {
  ManifestRun r;
  r.timings_s = clock.timings();
  r.ranks = ctx.comm.size(), r.layer_groups = grid.layer_groups, r.token_groups = grid.token_groups;
  r.collectives = ctx.comm.name(), r.backend = ctx.backend.name();
  r.targets = "layer l to layer group l mod G, round-robin over its token groups";
  r.passes = passes, r.r2_file = "../r2.h5";
  return r;
}

// Rank 0's list of folders, on every rank.
std::vector<std::string> on_every_rank(Comm& comm, const std::vector<std::string>& on_root) {
  std::string listed;
  for (const auto& a : on_root) listed += a + "\n";
  std::vector<std::string> out;
  std::istringstream lines(gather_strings(comm, listed).front());
  for (std::string a; std::getline(lines, a);) out.push_back(a);
  return out;
}

// Every rank validates the same files: a mistake is agreed on and reported once (by rank 0), as are the store
// entries passed over.
Calibration validate_on_every_rank(const FitConfig& cfg, bool fresh, Comm& comm, int planned) {
  const Calibration cal = agreed(comm, [&] {
    if (cfg.runtime.layer_groups > 0 && planned % cfg.runtime.layer_groups != 0)
      throw ConfigError(cfg.config_path + ": runtime.layer_groups: " + std::to_string(cfg.runtime.layer_groups) +
                        " does not divide the job's " + std::to_string(planned) + " ranks");
    return validate(cfg, fresh);
  });
  if (comm.rank() == 0)
    for (const auto& line : cal.skipped) spdlog::warn("{}", line);
  const PairDims d = cal.dims();
  spdlog::info("{} shard pairs in {} domain(s), {} tokens used (stride {}); source {} [{}x{}x{}], target {} [{}x{}x{}]",
               cal.shards.size(), cal.domains.size(), cal.tokens_used, cfg.calibration.token_stride, cal.source_model,
               d.Ls, d.Hs, d.Ds, cal.target_model, d.Lt, d.Ht, d.Dt);
  return cal;
}

// The plan as --plan prints it and the run logs it: passes, grid, memory, the shards' checksums, the held-out eval's
// cost and the residual MLPs'.
std::string plan_text(const Calibration& cal, const FitPlan& plan, const HeldOut& held_out, Comm& comm, int planned) {
  std::string text = format_plan(plan) + format_host_memory(plan.host);
  text += cal.unchecked_files == 0
              ? "  checksums: all " + std::to_string(cal.shard_files) + " shard files (Fletcher-32)\n"
              : "  checksums: " + std::to_string(cal.unchecked_files) + " of " + std::to_string(cal.shard_files) +
                    " shard files unchecked (no Fletcher-32 on keys/values: damage to their data goes "
                    "unnoticed; crosskv-capture and crosskv-synth write checksummed shards)\n";
  if (!cal.eval_shards.empty())
    text += "  held-out eval (every k): " +
            agreed(comm, [&] {
              return held_out_cost(held_out, cal.source, cal.target, static_cast<int>(plan.slots()), planned);
            }).text() +
            "\n";
  if (cal.cfg.fit.mapper != MapperKind::ridge) text += format_mlp_plan(cal, plan);
  return text;
}

}  // namespace

namespace {

// The second pass of a two-pass fit: the Gram blocks of the selected source layers. Returns the tokens read.
int64_t gram_pass(const FitConfig& cfg, const Calibration& cal, const FitPlan& plan,
                  const std::vector<std::vector<int>>& rankings, Context& ctx, FirstPass& p1) {
  const MomentPlan selected = selection_plan(rankings, plan.ks.back().count);
  const double sel_bytes = 2.0 * sizeof(float) * selected.floats(cal.dims());
  if (sel_bytes > cfg.runtime.max_moment_gib * (1ull << 30))
    spdlog::warn("the selected blocks need {} (over runtime.max_moment_gib = {} GiB); k = {} needs them all",
                 human_bytes(sel_bytes), cfg.runtime.max_moment_gib, plan.ks.back().label);
  return second_pass(cal, selected, ctx, p1).tokens;
}

}  // namespace

FitResult run_fit(const FitConfig& cfg, const FitOptions& opts, Context& world) {
  FitResult res;
  StageClock clock;
  const bool root = world.comm.rank() == 0;
  const int P = world.comm.size();
  const int planned = opts.plan_only && opts.plan_ranks > 0 ? opts.plan_ranks : P;

  clock.start("validate");
  const Calibration cal = validate_on_every_rank(cfg, opts.fresh, world.comm, planned);
  const PairDims d = cal.dims();

  clock.start("plan");
  const FitPlan plan = plan_job(cal, world, planned, opts.plan_only);
  const HeldOut held_out = held_out_shards(cal);
  res.plan_text = plan_text(cal, plan, held_out, world.comm, planned);
  log_lines(res.plan_text);
  if (opts.plan_only) return res;
  Grid grid = make_grid(world.comm, plan.layer_groups);
  Context ctx{world.comm, world.backend, &grid, world.stop};
  if (P > 1) spdlog::info("grid: {}", grid.describe());
  OutputLock lock;
  lock_output(ctx, cfg.output.dir, lock);
  const std::string ckpt_dir = checkpoint_path(cfg);

  clock.start("probe-pass");
  FirstPass p1 = first_pass(cal, plan, ctx, ckpt_dir, opts.fresh);
  res.tokens_read = p1.stats.tokens;
  res.passes = 1;

  clock.start("probe");
  const Probe probe = run_probes(cal, plan, ctx, p1.m);
  res.r2_path = probe.r2_path;
  res.heatmap_path = probe.heatmap_path;

  clock.start("select");
  const int kmax = plan.ks.back().count;
  const auto rankings = select_sources(probe, d, kmax);
  const Lambdas lambdas = Lambdas::from(cfg.fit.lambda, probe.r2, rankings);
  if (lambdas.automatic() && root) spdlog::info("{}", lambdas.summary());
  if (!plan.single_pass) {
    clock.start("gram-pass");
    res.tokens_read += gram_pass(cfg, cal, plan, rankings, ctx, p1);
    res.passes = 2;
  }

  clock.start("solve+export");
  // With residual MLPs the mappers are published after their stage: until then they stay in k<K>.partial.
  const bool with_mlps = cfg.fit.mapper != MapperKind::ridge;
  res.artifacts = solve_and_export(
      ctx, cal, plan, p1.m.k, p1.m.v, rankings, lambdas, ckpt_dir,
      [&] {
        clock.stop();
        return manifest_run(clock, ctx, grid, res.passes);
      },
      /*publish=*/!with_mlps);
  // Every rank takes part in the stages after the export, on every k that rank 0 exported.
  if (with_mlps) {
    clock.start("mlp");
    fit_residual_mlps(ctx, cal, on_every_rank(ctx.comm, res.artifacts), ckpt_dir, export_identity(cal, plan, P));
    if (root) {
      res.artifacts.clear();
      for (size_t i = 0; i < plan.slots(); ++i) res.artifacts.push_back(publish_artifact(cfg.output.dir, plan.slot_folder(i)));
    }
  }
  if (!cal.eval_shards.empty()) {
    const std::vector<std::string> artifacts = on_every_rank(ctx.comm, res.artifacts);
    clock.start("eval");
    res.report_path =
        evaluate_held_out(held_out, artifacts, cfg.output.dir, res.heatmap_path, ctx.backend, ctx.comm,
                          VerdictThresholds{cfg.eval.min_retention});
  }
  clock.stop();
  ctx.comm.barrier();
  if (root) log_summary(res, clock, p1.stats, ckpt_dir);
  return res;
}

}  // namespace crosskv
