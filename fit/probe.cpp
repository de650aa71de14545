#include "fit/probe.hpp"

#include <algorithm>
#include <filesystem>

#include "core/comm.hpp"
#include "runtime/log.hpp"
#include "fit/select.hpp"
#include "core/atomic_file.hpp"
#include "io/heatmap.hpp"
#include "io/r2_file.hpp"
#include "fit/grid.hpp"
#include "fit/lambda.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

// The probe, shared out over every rank: entries of the layer group's targets (or, for same-head blocks accumulated
// per head, of its heads), source layer a on the group's reader a mod T; then summed over the job.
// fit.lambda auto: each entry's GCV and R² over the λ grid are summed, then its R² is the one at its chosen λ.
ProbeR2 run_probe(const Covariances& m, Context& ctx, ProbeMode mode, const LambdaSetting& lambda, Kind kind,
                  bool by_head, double tokens) {
  const Grid& g = *ctx.grid;
  const ProbeShare mine = [&g, by_head](int a, int l, int h) {
    return (by_head ? g.owns_head(h) : g.owns_target(l)) && a % g.token_groups == g.token_group;
  };
  ProbeR2 r = mode == ProbeMode::same_head
                  ? probe_same_head(m, ctx.backend, lambda.value, kind, mine, lambda.automatic ? tokens : 0.0)
                  : probe_all_heads(m, ctx.backend, lambda.value, kind, mine, lambda.automatic ? tokens : 0.0);
  if (lambda.automatic) {
    ctx.comm.allreduce_sum(r.gcv.data(), r.gcv.size());
    ctx.comm.allreduce_sum(r.r2_grid.data(), r.r2_grid.size());
    probe_at_chosen_lambda(r);
    return r;
  }
  ctx.comm.allreduce_sum(r.per_head.data(), r.per_head.size());
  probe_means(r);
  return r;
}

}  // namespace

Probe run_probes(const Calibration& cal, const FitPlan& plan, Context& ctx, FitMoments& m) {
  const FitConfig& cfg = cal.cfg;
  const bool same_head = cfg.fit.probe == ProbeMode::same_head;
  Probe p;
  p.r2[Kind::k_rope] = run_probe(m.k_rope->covariances(), ctx, cfg.fit.probe, cfg.fit.lambda, Kind::k_rope, same_head,
                                 static_cast<double>(cal.tokens_used));
  m.k_rope.reset();
  for (Kind kind : kMappedKinds)
    p.r2[kind] = run_probe(m.mapped().of(kind)->covariances(), ctx, cfg.fit.probe, cfg.fit.lambda, kind,
                           same_head && !plan.single_pass, static_cast<double>(cal.tokens_used));
  p.r2_path = (fs::path(cfg.output.dir) / "r2.h5").string();
  p.heatmap_path = (fs::path(cfg.output.dir) / "r2_heatmap.svg").string();
  if (ctx.comm.rank() == 0) {
    write_r2_file(p.r2_path, p.r2,
                  {{"source_model", cal.source_model}, {"target_model", cal.target_model},
                   {"probe", to_string(cfg.fit.probe)}, {"lambda", cfg.fit.lambda.automatic ? std::string("auto") : std::to_string(cfg.fit.lambda.value)},
                   {"rows", "source layer"}, {"columns", "target layer"}});
    write_file_atomic(p.heatmap_path,
                      render_heatmaps_svg({{"K_rope (raw keys)", &p.r2[Kind::k_rope]},
                                           {"K (RoPE-stripped)", &p.r2[Kind::k]},
                                           {"V", &p.r2[Kind::v]}},
                                          cal.source_model + " -> " + cal.target_model + ": head-averaged R² (" +
                                              to_string(cfg.fit.probe) + " probe, " + std::to_string(cal.tokens_used) +
                                              " tokens)"));
  }
  return p;
}

std::vector<std::vector<int>> select_sources(const Probe& probe, const PairDims& d, int kmax) {
  const auto rankings = rank_sources(probe.r2.at(Kind::k).mean, probe.r2.at(Kind::v).mean, d.Ls, d.Lt);
  for (int l = 0; l < d.Lt; ++l) {
    const auto top = top_k(rankings[l], std::min(kmax, 4));
    std::string s;
    for (int a : top) s += (s.empty() ? "" : " ") + std::to_string(a);
    spdlog::debug("target layer {}: best source layers {}", l, s);
  }
  return rankings;
}

MomentPlan selection_plan(const std::vector<std::vector<int>>& rankings, int kmax) {
  MomentPlan p;
  for (size_t l = 0; l < rankings.size(); ++l) {
    const auto top = top_k(rankings[l], kmax);
    for (size_t i = 0; i < top.size(); ++i) {
      for (size_t j = i; j < top.size(); ++j) p.gram.emplace_back(std::min(top[i], top[j]), std::max(top[i], top[j]));
      p.cross.emplace_back(top[i], static_cast<int>(l));
    }
  }
  std::sort(p.gram.begin(), p.gram.end());
  p.gram.erase(std::unique(p.gram.begin(), p.gram.end()), p.gram.end());
  return p;
}

}  // namespace crosskv
