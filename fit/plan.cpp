#include "fit/plan.hpp"

#include <algorithm>
#include <cstdio>
#include <sstream>
#include <vector>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "fit/calibration.hpp"

namespace crosskv {

double weight_bytes(Dtype d) { return d == Dtype::f32 ? 4.0 : 2.0; }

namespace {

// The solve's flops per kind: k < Ls share one rank-ordered factor and forward substitution per target layer; k = Ls
// shares one factor across every target layer. Head-matched systems: Ht of width count*Ds per target layer.
void set_solve_flops(FitPlan& p, const std::vector<Structure>& structures) {
  const PairDims& d = p.dims;
  double nested_max = 0, back = 0, all = 0;
  for (const auto& k : p.ks) {
    const double n = static_cast<double>(k.features);
    if (k.count < d.Ls) {
      nested_max = n;
      back += n * n * d.G();
    } else {
      all = n;
    }
  }
  const double per_layer = nested_max * nested_max * nested_max / 3.0 + nested_max * nested_max * d.G() + back +
                           (all > 0 ? 2.0 * all * all * d.G() : 0.0);
  p.solve_flops = has_structure(structures, Structure::cross_head) ? 2.0 * (d.Lt * per_layer + all * all * all / 3.0) : 0.0;
  if (has_structure(structures, Structure::per_head)) {
    // Ht systems of width count*Ds per target layer (Dt right-hand sides); k = Ls: one factor per head for all.
    const double h = d.Ht, nm = nested_max / d.Hs, a = all / d.Hs, bk = back / (static_cast<double>(d.Hs) * d.Hs * d.Ht);
    const double head_layer = nm * nm * nm / 3.0 + nm * nm * d.Dt + bk + (a > 0 ? 2.0 * a * a * d.Dt : 0.0);
    p.head_solve_flops = 2.0 * h * (d.Lt * head_layer + a * a * a / 3.0);
    p.solve_flops += p.head_solve_flops;
  }
}

}  // namespace

FitPlan make_plan(const PairDims& d, int64_t tokens, const std::vector<KChoice>& ks, ProbeMode probe,
                  double max_moment_gib, double read_bytes_per_token, int ranks, int layer_groups,
                  const std::vector<Structure>& structures) {
  FitPlan p;
  p.dims = d;
  p.structures = structures;
  p.tokens = tokens;
  p.read_bytes_per_token = read_bytes_per_token;
  for (const auto& k : ks) {
    KPlan kp;
    kp.label = k.label();
    kp.count = k.is_all() ? d.Ls : k.value;
    kp.features = kp.count * d.F();
    kp.params = 2 * int64_t{d.Lt} * d.Ht * kp.features * d.Dt;
    kp.bias_params = 2 * int64_t{d.Lt} * d.Ht * d.Dt;
    kp.head_features = int64_t{kp.count} * d.Ds;
    kp.head_params = 2 * int64_t{d.Lt} * d.Ht * kp.head_features * d.Dt;
    p.ks.push_back(kp);
  }
  std::sort(p.ks.begin(), p.ks.end(), [](const KPlan& a, const KPlan& b) { return a.count < b.count; });
  MomentPlan head;
  if (probe == ProbeMode::same_head) head.probe_heads = MomentPlan::all_heads(d);
  const MomentPlan full = MomentPlan::full(d, false);
  // Probe blocks of one kind: same-head blocks, or diagonal Gram + every cross block for all_heads.
  MomentPlan probe_plan = head;
  if (probe == ProbeMode::all_heads) {
    for (int a = 0; a < d.Ls; ++a) probe_plan.gram.emplace_back(a, a);
    probe_plan.cross = full.cross;
  }
  const double f4 = sizeof(float);
  p.full_moment_bytes = static_cast<int64_t>(f4 * (2 * full.floats(d) + probe_plan.floats(d)));
  p.probe_moment_bytes = static_cast<int64_t>(f4 * 3 * probe_plan.floats(d));
  // Per rank with G layer groups: every Gram block (exchanged after the pass), 1/G of the cross and probe blocks.
  // One pass holds every block; two hold the probe blocks, then the blocks the top-kmax selections need.
  const double gram = f4 * 2 * static_cast<double>(full.gram.size()) * d.F() * d.F();
  const double kmax = p.ks.back().count;
  const double sel_gram =
      f4 * 2 * std::min<double>(full.gram.size(), d.Lt * kmax * (kmax + 1) / 2) * d.F() * d.F();
  const double sel_cross = f4 * 2 * d.Lt * kmax * d.F() * d.G();
  const double probe_bytes = f4 * 3 * probe_plan.floats(d);
  auto one_pass = [&](int groups) { return static_cast<int64_t>(gram + (p.full_moment_bytes - gram) / groups); };
  auto two_pass = [&](int groups) {
    return static_cast<int64_t>(
        std::max(probe_bytes / groups + f4 * 3 * d.Ls * d.F() * d.F(), sel_gram + sel_cross / groups));
  };
  const double limit = max_moment_gib * (1ull << 30);
  p.ranks = ranks;
  p.layer_groups_auto = layer_groups == 0;
  if (layer_groups == 0) {
    layer_groups = 0;
    for (int groups = 1; groups <= ranks && !layer_groups; ++groups)
      if (ranks % groups == 0 && one_pass(groups) <= limit) layer_groups = groups;
    for (int groups = 1; groups <= ranks && !layer_groups; ++groups)
      if (ranks % groups == 0 && two_pass(groups) <= limit) layer_groups = groups;
    if (!layer_groups) layer_groups = ranks;
  }
  p.layer_groups = layer_groups;
  p.single_pass = one_pass(layer_groups) <= limit;
  p.selected_moment_bytes = static_cast<int64_t>(sel_gram + sel_cross);
  p.rank_moment_bytes = p.single_pass ? one_pass(layer_groups) : two_pass(layer_groups);
  const double X = static_cast<double>(d.X()), Y = static_cast<double>(d.Y());
  const double head_flops = 2.0 * d.Hs * (d.Ls * d.Ds) * (d.Lt * d.Dt) + 1.0 * d.Ls * d.Hs * d.Ds * d.Ds;
  const double full_flops = X * X + 2.0 * X * Y;  // syrk (half of X^2 MACs) + cross
  const double kmax_features = static_cast<double>(p.ks.back().features);
  const double sel_flops = d.Lt * (2.0 * kmax_features * d.G()) + std::min(X * X, d.Lt * kmax_features * kmax_features);
  p.accumulate_flops = tokens * (p.single_pass ? 2 * full_flops + head_flops : 3 * head_flops + 2 * sel_flops);
  set_solve_flops(p, structures);
  return p;
}

HostMemory estimate_host_memory(const FitPlan& p, int64_t block_tokens, double stored_bytes_per_token, bool device) {
  const PairDims& d = p.dims;
  const int groups = p.layer_groups, T = p.ranks / p.layer_groups;
  const double X = static_cast<double>(d.X()), Y = static_cast<double>(d.Y()), B = static_cast<double>(block_tokens);
  HostMemory m;
  m.device = device;
  m.moments = static_cast<double>(p.rank_moment_bytes);
  // What a reader accumulates in a pass: its layer group's share of the pass's blocks.
  const double live = p.single_pass ? static_cast<double>(p.full_moment_bytes) / groups
                                    : static_cast<double>(std::max(p.probe_moment_bytes, p.selected_moment_bytes)) / groups;
  if (T > 1)  // 1/T of the live blocks; a pass-2 state also keeps pass 1's share
    m.share = (p.single_pass ? live : static_cast<double>(p.probe_moment_bytes + p.selected_moment_bytes) / groups) / T;
  else if (!p.single_pass)
    m.share = static_cast<double>(p.probe_moment_bytes) / groups;
  // Two blocks in flight: stored keys and values of both models, and on the host their fp32 inputs (stripped and raw
  // keys, values); a device backend stages the stored bytes in pinned memory instead.
  const double stored = stored_bytes_per_token;
  m.buffers = 2.0 * B * (device ? 2.0 * stored : stored + 3.0 * (X + Y) * 4.0);
  if (T > 1) m.buffers += std::min(live, 2.0 * T * (double{1 << 24} * 4.0));
  // The solve: readers in pairs hold one kind's moments and factor one k = all system (an odd last reader, or a
  // layer group of one, holds and factors both); the raw-key probe blocks are gone.
  const bool pairs = T % 2 == 0;
  m.solve_moments = (m.moments - static_cast<double>(p.probe_moment_bytes) / 3.0 / groups) / (pairs ? 2.0 : 1.0);
  double nested = 0, all = 0;
  for (const auto& k : p.ks) (k.count < d.Ls ? nested : all) = static_cast<double>(k.features);
  const double n = std::max(nested, all);
  if (!device) m.factors = 8.0 * ((pairs ? 1.0 : 2.0) * all * all + nested * nested);
  m.workspace = 8.0 * 3.0 * n * static_cast<double>(d.G());
  return m;
}

std::string format_host_memory(const HostMemory& m) {
  std::ostringstream o;
  o << "  host memory per rank (estimate, " << (m.device ? "GPU" : "CPU") << " backend): pass "
    << human_bytes(m.pass()) << " (moments " << human_bytes(m.moments) << ", checkpointed share "
    << human_bytes(m.share) << ", buffers " << human_bytes(m.buffers) << "); solve " << human_bytes(m.solve())
    << " (moments " << human_bytes(m.solve_moments) << ", " << (m.device ? "factors on the device" : "factors " + human_bytes(m.factors))
    << ", workspace " << human_bytes(m.workspace) << "); peak " << human_bytes(std::max(m.pass(), m.solve()))
    << "\n";
  return o.str();
}

std::string format_plan(const FitPlan& p) {
  std::ostringstream o;
  const auto& d = p.dims;
  char buf[256];
  o << "plan:\n";
  std::snprintf(buf, sizeof buf, "  source: %d layers x %d KV heads x %d  -> %lld features per layer\n", d.Ls, d.Hs,
                d.Ds, static_cast<long long>(d.F()));
  o << buf;
  std::snprintf(buf, sizeof buf, "  target: %d layers x %d KV heads x %d  -> %lld targets per layer\n", d.Lt, d.Ht,
                d.Dt, static_cast<long long>(d.G()));
  o << buf;
  o << "  calibration tokens: " << p.tokens << " (" << human_bytes(p.tokens * p.read_bytes_per_token) << " to read per pass)\n";
  o << "  passes over the data: " << (p.single_pass ? "1 (every moment block fits)" : "2 (probe, then the selected blocks)")
    << "\n";
  o << "  moment memory: all blocks " << human_bytes(p.full_moment_bytes) << ", probe " << human_bytes(p.probe_moment_bytes)
    << "\n";
  o << "  grid: " << p.ranks << " rank(s) = " << p.layer_groups << " layer group(s) x " << p.ranks / p.layer_groups
    << " token group(s)" << (p.layer_groups_auto ? " (auto)" : "") << "; moments per rank at most "
    << human_bytes(p.rank_moment_bytes) << "\n";
  std::snprintf(buf, sizeof buf, "  flops: accumulate %.3g, solve %.3g (fp64)", p.accumulate_flops, p.solve_flops);
  o << buf;
  if (p.head_solve_flops > 0) {
    std::snprintf(buf, sizeof buf, "; per_head's share %.3g", p.head_solve_flops);
    o << buf;
  }
  o << "\n";
  o << "  artifact        features  mapper params        fp32          bf16/fp16\n";
  for (size_t i = 0; i < p.slots(); ++i) {
    const KPlan& k = p.slot_k(i);
    const Structure s = p.slot_structure(i);
    const double params = static_cast<double>(k.params_of(s)), all = params + static_cast<double>(k.bias_params);
    std::snprintf(buf, sizeof buf, "  %-14s %8lld  %-12s (%lld)  %-12s  %-12s\n", p.slot_folder(i).c_str(),
                  static_cast<long long>(k.features_of(s)), human_count(params).c_str(),
                  static_cast<long long>(k.params_of(s)), human_bytes(4.0 * all).c_str(),
                  human_bytes(2.0 * params + 4.0 * static_cast<double>(k.bias_params)).c_str());
    o << buf;
  }
  return o.str();
}

FitPlan plan_job(const Calibration& cal, Context& ctx, int ranks, bool plan_only) {
  const FitConfig& cfg = cal.cfg;
  const PairDims d = cal.dims();
  // On a device the moments stay resident for a whole round: a rank's share must fit the device's free memory beside
  // two rounds of inputs (stored bf16 keys and values of both models, and their fp32 conversions: 16 bytes per
  // value). The smallest free memory over the ranks caps max_moment_gib (more layer groups, or two passes).
  double least_free_gib = -1;
  if (!plan_only) {
    std::vector<double> free_gib(ctx.comm.size(), 0.0);
    const int64_t mine = ctx.backend.device_memory_free();
    free_gib[ctx.comm.rank()] = mine < 0 ? -1.0 : static_cast<double>(mine) / (1ull << 30);
    ctx.comm.allreduce_sum(free_gib.data(), free_gib.size());
    least_free_gib = *std::min_element(free_gib.begin(), free_gib.end());
  }
  return agreed(ctx.comm, [&] {
    double max_gib = cfg.runtime.max_moment_gib, device_gib = -1;
    const double least = least_free_gib;  // GiB, -1 for host backends
    if (least >= 0) {
      const double inputs_gib = 2.0 * cfg.runtime.block_tokens * static_cast<double>(d.X() + d.Y()) * 16.0 / (1ull << 30);
      device_gib = 0.9 * least - inputs_gib;
      if (device_gib <= 0)
        throw ConfigError(cfg.config_path + ": runtime.block_tokens: " + std::to_string(cfg.runtime.block_tokens) +
                          " tokens per block need " + human_bytes(inputs_gib * (1ull << 30)) +
                          " of device memory for inputs alone; the device has " + human_bytes(least * (1ull << 30)) +
                          " free");
      if (device_gib < max_gib) {
        spdlog::info("moments per rank capped at {} by the device's free memory ({} free, {} for two rounds of "
                     "inputs; runtime.max_moment_gib is {} GiB)",
                     human_bytes(device_gib * (1ull << 30)), human_bytes(least * (1ull << 30)),
                     human_bytes(inputs_gib * (1ull << 30)), cfg.runtime.max_moment_gib);
        max_gib = device_gib;
      }
    }
    FitPlan p = make_plan(d, cal.tokens_used, cfg.fit.ks, cfg.fit.probe, max_gib, cal.stored_bytes_per_token, ranks,
                          cfg.runtime.layer_groups, cfg.fit.structures);
    if (device_gib >= 0 && p.rank_moment_bytes > device_gib * (1ull << 30))
      throw ConfigError(cfg.config_path + ": runtime.layer_groups: a rank's moments need " +
                        human_bytes(static_cast<double>(p.rank_moment_bytes)) + " but the device has room for " +
                        human_bytes(device_gib * (1ull << 30)) + " beside its inputs; use more layer groups (or " +
                        "auto), more ranks, or smaller runtime.block_tokens");
    p.host = estimate_host_memory(p, cfg.runtime.block_tokens, cal.stored_bytes_per_token, ctx.backend.prepares_on_device());
    return p;
  });
}

}  // namespace crosskv
