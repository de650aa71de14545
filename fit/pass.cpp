#include "fit/pass.hpp"
#include "fit/round.hpp"

#include <chrono>
#include <filesystem>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "core/sha256.hpp"
#include "fit/grid.hpp"

namespace fs = std::filesystem;

namespace crosskv {

MomentPlan probe_plan(const PairDims& d, ProbeMode mode) {
  MomentPlan p;
  if (mode == ProbeMode::same_head) {
    p.probe_heads = MomentPlan::all_heads(d);
    return p;
  }
  for (int a = 0; a < d.Ls; ++a) p.gram.emplace_back(a, a);
  for (int a = 0; a < d.Ls; ++a)
    for (int l = 0; l < d.Lt; ++l) p.cross.emplace_back(a, l);
  return p;
}

// Every rank's memory, logged by rank 0: the moments it holds, plus `extra` bytes.
void log_rank_memory(Context& ctx, const std::string& label, const std::vector<Moments*>& ms, double extra) {
  double mine = extra;
  for (auto* m : ms) mine += static_cast<double>(m->bytes());
  std::vector<double> per_rank(ctx.comm.size(), 0.0);
  per_rank[ctx.comm.rank()] = mine;
  ctx.comm.allreduce_sum(per_rank.data(), per_rank.size());
  if (ctx.comm.size() == 1) return;
  for (int r = 0; r < ctx.comm.size(); ++r) spdlog::info("{}: rank {} holds {}", label, r, human_bytes(per_rank[r]));
}

namespace {

// One streaming pass in rounds, checkpointed after each. Several readers reduce their round's sums (fixed order) into
// this rank's share of the pass and gather the shares back into complete moments at the end. One reader's share is
// its moments: nothing to reduce, and checkpoints read the sums where they are (a device's held copies), so the
// sums are never held twice. With a checkpoint of this pass, reading resumes after its last round (or not at all if
// the pass was complete). `keep_share`: a one-reader state keeps a copy of the pass's sums for a later pass's
// checkpoints.
class PassRun {
 public:
  PassRun(int pass, const Calibration& cal, Context& ctx, CheckpointStore& store, PassState& state,
          const std::vector<Moments*>& ms, const std::string& label)
      : pass_(pass), cal_(cal), ctx_(ctx), store_(store), state_(state), ms_(ms), label_(label),
        base_f_(pass == 1 ? state.pass1_f : state.pass2_f), base_d_(pass == 1 ? state.pass1_d : state.pass2_d),
        readers_(ctx.readers()), one_reader_(readers_.size() == 1), live_{&ctx.backend, {}, {}} {}

  PassStats run(bool keep_share) {
    if (state_.pass < pass_) {
      state_.pass = pass_;
      state_.rounds_done = 0;
      base_f_.clear();
      base_d_.clear();
      state_.deferred.reset();
    }
    name_live();
    nf_ = static_cast<size_t>(flat_size(live_.f)), nd_ = static_cast<size_t>(flat_size(live_.d));
    restore();
    // A state of a later pass holds this one complete (its rounds_done counts the later pass's rounds) and keeps it
    // for that pass's checkpoints; in this pass a reader's moments are current from here on.
    const int64_t rounds = pass_rounds(cal_, readers_.size());
    const bool was_complete = state_.pass > pass_ || state_.rounds_done == rounds;
    if (one_reader_ && state_.pass == pass_) {
      std::vector<float>().swap(base_f_);
      std::vector<double>().swap(base_d_);
    }
    PassStats st;
    if (!was_complete)
      st = stream(rounds);
    else
      spdlog::info("{}: restored from the committed checkpoint in {} (no calibration data read)", label_, store_.dir());
    end(keep_share, was_complete);
    for (auto* m : ms_) m->mark_pass_complete();
    double share = static_cast<double>(base_f_.size() * sizeof(float) + base_d_.size() * sizeof(double));
    log_rank_memory(ctx_, label_ + " (moments + checkpointed share)", ms_, share);
    return st;
  }

 private:
  // The live sums as pieces where they are current: on the host, or the held copies while the moments hold them.
  void name_live() {
    live_.f.clear();
    live_.d.clear();
    for (auto* m : ms_) m->live_pieces(live_.f, live_.d);
  }
  void unpack_doubles(const double* pd) {
    for (auto* m : ms_) {
      m->unpack_live_doubles(pd);
      pd += m->live_doubles();
    }
  }

  // One reader's checkpointed sums of this pass into its moments (several readers restore their shares instead).
  void restore() {
    CROSSKV_ASSERT(one_reader_ || !state_.deferred, "only one reader defers a checkpoint's sums");
    if (one_reader_ && state_.deferred && state_.pass == pass_) {  // the state's latest pass, straight in
      const std::vector<double> d = read_deferred(*state_.deferred, live_.f);
      check_state_size(state_.deferred->path, d.size(), nd_);
      unpack_doubles(d.data());
      state_.deferred.reset();
    } else if (one_reader_ && !(base_f_.empty() && base_d_.empty())) {
      check_state_size(store_.dir(), base_f_.size(), nf_);
      check_state_size(store_.dir(), base_d_.size(), nd_);
      place_sums(live_.f, 0, static_cast<int64_t>(nf_), base_f_.data());
      unpack_doubles(base_d_.data());
    }
  }

  // The rounds left, each ended by a reduction (several readers) and a checkpoint.
  PassStats stream(int64_t rounds) {
    if (state_.rounds_done > 0) spdlog::info("{}: resuming after round {} of {}", label_, state_.rounds_done, rounds);
    for (auto* m : ms_) m->hold_sums(ctx_.backend);  // the rounds reduce and checkpoint the held copies
    name_live();
    auto on_round = [&](int64_t round, int64_t R, bool abandoned) {
      if (!ctx_.comm.all_ok(!abandoned))
        throw Interrupted("stopped by a signal in round " + std::to_string(round + 1) + " of pass " +
                          std::to_string(pass_) + "; the last committed checkpoint in " + store_.dir() + " stands");
      const auto t_round = std::chrono::steady_clock::now();
      if (!one_reader_) reduce_round(ms_, ctx_.backend, readers_, base_f_, base_d_);
      state_.rounds_done = round + 1;
      const double reduce_s = seconds_since(t_round);
      if (round + 1 < R) store_.save(state_, one_reader_ ? &live_ : nullptr);
      const std::string ckpt =
          round + 1 < R ? human_seconds(seconds_since(t_round) - reduce_s) : std::string("at the pass's end");
      if (one_reader_)
        spdlog::info("{}: round {}/{} ended: checkpoint {} (one reader: read from its moments)", label_, round + 1, R,
                     ckpt);
      else
        spdlog::info("{}: round {}/{} ended: reduced into the share {}, checkpoint {}", label_, round + 1, R,
                     human_seconds(reduce_s), ckpt);
    };
    return stream_pass(cal_, ctx_, *ms_.front(), ms_.size() == 3 ? ms_[1] : nullptr, *ms_.back(), label_,
                       state_.rounds_done, on_round);
  }

  // The pass's end: one reader's held sums to its host moments; several readers' shares gathered into theirs.
  void end(bool keep_share, bool was_complete) {
    const auto t_end = std::chrono::steady_clock::now();
    double to_host_s = 0;
    if (one_reader_) {
      for (auto* m : ms_) m->release_sums(true);  // a device's sums to the host moments, once per pass
      name_live();
      to_host_s = seconds_since(t_end);
      if (!was_complete) store_.save(state_, &live_);
      if (keep_share && base_f_.empty() && base_d_.empty()) {
        base_f_.resize(nf_);
        base_d_.resize(nd_);
        ctx_.backend.copy_sums(live_.f, 0, static_cast<int64_t>(nf_), base_f_.data(), false);
        ctx_.backend.copy_sums(live_.d, 0, static_cast<int64_t>(nd_), base_d_.data(), false);
      }
    } else {
      for (auto* m : ms_) m->release_sums(false);  // zeros after the last round's reduction: overwritten below
      name_live();
      // The shares gathered back a segment at a time straight into the blocks (no copy of all of them), then the
      // token statistics (small).
      readers_.allgather_drained(base_f_, nf_, [&](size_t off, size_t len, const float* values) {
        place_sums(live_.f, static_cast<int64_t>(off), static_cast<int64_t>(len), values);
      });
      std::vector<double> D(nd_);
      readers_.allgather(base_d_, D.data(), nd_);
      unpack_doubles(D.data());
      to_host_s = seconds_since(t_end);
      if (!was_complete) store_.save(state_);
    }
    if (!was_complete)
      spdlog::info("{}: pass end: {} {}, checkpoint {}", label_,
                   one_reader_ ? "sums to the host moments" : "shares gathered into the moments",
                   human_seconds(to_host_s), human_seconds(seconds_since(t_end) - to_host_s));
  }

  const int pass_;
  const Calibration& cal_;
  Context& ctx_;
  CheckpointStore& store_;
  PassState& state_;
  const std::vector<Moments*>& ms_;
  const std::string& label_;
  std::vector<float>& base_f_;
  std::vector<double>& base_d_;
  Comm& readers_;
  const bool one_reader_;
  LiveSums live_;
  size_t nf_ = 0, nd_ = 0;
};

PassStats run_pass(int pass, const Calibration& cal, Context& ctx, CheckpointStore& store, PassState& state,
                   const std::vector<Moments*>& ms, const std::string& label, bool keep_share) {
  return PassRun(pass, cal, ctx, store, state, ms, label).run(keep_share);
}

// The moments of one pass-1 accumulation over `plan`'s blocks (this rank's layer group's share of them).
FitMoments pass1_moments(const Shifts& sh, const PairDims& d, const Grid& grid, const MomentPlan& blocks,
                         const MomentPlan& probe) {
  FitMoments m{Moments(d, sh.xk, sh.yk), Moments(d, sh.xv, sh.yv), std::make_unique<Moments>(d, sh.xk_raw, sh.yk_raw)};
  m.k_raw->add_plan(grid.share(probe, d));
  m.k.add_plan(grid.share(blocks, d));
  m.v.add_plan(grid.share(blocks, d));
  return m;
}

void add_stats(PassStats& to, const PassStats& s) {
  to.tokens += s.tokens;
  to.seconds += s.seconds;
  to.bytes += s.bytes;
}

// Where moments of this weighting are committed: <ckpt_dir> for uniform ones, <ckpt_dir>/weighted for weighted ones
// (kept apart: a refit that switches the weighting back reads nothing). The provisional shifts stay in <ckpt_dir>.
std::string moments_dir(const std::string& ckpt_dir, const FitConfig& c) {
  return c.weighting == Weighting::uniform ? ckpt_dir : (fs::path(ckpt_dir) / "weighted").string();
}

// Pass 1 domain by domain, each with complete moments of its own (<moments_dir>/domain-<name>) over `full` and the
// probe's `pp`, summed with the domains' weights into `into`.
PassStats per_domain_pass(const Calibration& cal, const FitPlan& plan, Context& ctx, const std::string& ckpt_dir,
                          bool fresh, const Shifts& sh, const MomentPlan& full, const MomentPlan& pp,
                          FitMoments& into) {
  const PairDims d = cal.dims();
  Sha256 shift_hash;
  for (const auto* v : {&sh.xk, &sh.yk, &sh.xk_raw, &sh.yk_raw, &sh.xv, &sh.yv})
    shift_hash.update(v->data(), v->size() * sizeof(float));
  const std::string shift_sha = shift_hash.hex();
  const bool one_reader = ctx.readers().size() == 1;
  PassStats stats;
  bool first = true;
  for (const auto& dom : cal.domains) {
    Calibration sub = cal;
    sub.shards.clear();
    sub.tokens_used = 0;
    for (const auto& p : cal.shards)
      if (p.domain == dom) {
        sub.shards.push_back(p);
        sub.tokens_used += p.used;
      }
    sub.domains = {dom};
    nlohmann::json id = checkpoint_identity(sub, plan, ctx.comm.size());
    id["shift_sha256"] = shift_sha;
    CheckpointStore ds((fs::path(moments_dir(ckpt_dir, cal.cfg)) / ("domain-" + dom)).string(), id, ctx.comm,
                       ctx.stop);
    PassState st = ds.load({.fresh = fresh, .reread_other_shift = true, .defer_latest_sums = one_reader}).value_or(PassState{});
    FitMoments dm = pass1_moments(sh, d, *ctx.grid, full, pp);
    add_stats(stats, run_pass(1, sub, ctx, ds, st, {&dm.k, dm.k_raw.get(), &dm.v}, "pass 1/1 [domain " + dom + "]",
                              false));
    const auto it = cal.cfg.weights.find(dom);
    const double w = it == cal.cfg.weights.end() ? 1.0 : it->second;
    if (first) {
      into.k = std::move(dm.k);
      *into.k_raw = std::move(*dm.k_raw);
      into.v = std::move(dm.v);
      into.k.scale(w);
      into.k_raw->scale(w);
      into.v.scale(w);
      first = false;
    } else {
      into.k.add(dm.k, w);
      into.k_raw->add(*dm.k_raw, w);
      into.v.add(dm.v, w);
    }
  }
  return stats;
}

}  // namespace

FirstPass first_pass(const Calibration& cal, const FitPlan& plan, Context& ctx, const std::string& ckpt_dir,
                     bool fresh) {
  const PairDims d = cal.dims();
  const Shifts sh = provisional_shifts(cal, ckpt_dir, ctx.comm.rank() == 0, fresh);  // kept: a refit reads nothing
  const MomentPlan pp = probe_plan(d, cal.cfg.probe), full = MomentPlan::full(d, false);
  const MomentPlan& blocks = plan.single_pass ? full : pp;
  FirstPass p1{pass1_moments(sh, d, *ctx.grid, blocks, pp), {}, nullptr, {}};
  spdlog::info("memory: moments {} (keys) + {} (values) + {} (raw keys, probe only), input blocks and segments {}",
               human_bytes(p1.m.k.bytes()), human_bytes(p1.m.v.bytes()), human_bytes(p1.m.k_raw->bytes()),
               human_bytes(plan.host.buffers));
  // max_tokens makes a domain's tokens depend on the others: such fits, and two-pass fits, are checkpointed whole.
  const bool per_domain = plan.single_pass && !cal.cfg.max_tokens;
  if (!cal.cfg.weights.empty() && !per_domain)
    throw ConfigError(cal.cfg.config_path +
                      ": calibration.weights needs a single-pass fit (raise runtime.max_moment_gib)");
  if (per_domain) {
    p1.stats = per_domain_pass(cal, plan, ctx, ckpt_dir, fresh, sh, full, pp, p1.m);
  } else {
    const bool one_reader = ctx.readers().size() == 1;  // its checkpointed sums are read straight into its moments
    p1.store = std::make_unique<CheckpointStore>(moments_dir(ckpt_dir, cal.cfg),
                                                 checkpoint_identity(cal, plan, ctx.comm.size()), ctx.comm,
                                                 ctx.stop);
    p1.state = p1.store->load({.fresh = fresh, .defer_latest_sums = one_reader}).value_or(PassState{});
    p1.stats = run_pass(1, cal, ctx, *p1.store, p1.state, {&p1.m.k, p1.m.k_raw.get(), &p1.m.v},
                        plan.single_pass ? "pass 1/1" : "pass 1/2 (probe)", !plan.single_pass);
    // The share is committed and the moments hold it: only a second pass's checkpoints still need it.
    if (plan.single_pass) p1.state = PassState{};
  }
  share_gram(*ctx.grid, pp, *p1.m.k_raw);
  share_gram(*ctx.grid, blocks, p1.m.k);
  share_gram(*ctx.grid, blocks, p1.m.v);
  if (ctx.grid->layer_groups > 1) log_rank_memory(ctx, "after the Gram exchange", {&p1.m.k, p1.m.k_raw.get(), &p1.m.v});
  if (plan.single_pass && cal.cfg.probe == ProbeMode::same_head) {
    p1.m.k.derive_head_probe();
    p1.m.v.derive_head_probe();
  }
  return p1;
}

PassStats second_pass(const Calibration& cal, const MomentPlan& selected, Context& ctx, FirstPass& p1) {
  const PairDims d = cal.dims();
  p1.m.k.add_plan(ctx.grid->share(selected, d));
  p1.m.v.add_plan(ctx.grid->share(selected, d));
  spdlog::info("second pass for the selected blocks; moments now {} + {}", human_bytes(p1.m.k.bytes()),
               human_bytes(p1.m.v.bytes()));
  const PassStats st = run_pass(2, cal, ctx, *p1.store, p1.state, {&p1.m.k, &p1.m.v}, "pass 2/2 (selected blocks)",
                                false);
  p1.state = PassState{};  // committed, and held by the moments: the solve does not need the shares
  share_gram(*ctx.grid, selected, p1.m.k);
  share_gram(*ctx.grid, selected, p1.m.v);
  if (ctx.grid->layer_groups > 1) log_rank_memory(ctx, "after the Gram exchange", {&p1.m.k, &p1.m.v});
  return st;
}

}  // namespace crosskv
