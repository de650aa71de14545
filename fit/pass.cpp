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
void log_rank_memory(Context& ctx, const std::string& label, const PassMoments& ms, double extra) {
  double mine = extra;
  ms.each([&](Moments& m) { mine += static_cast<double>(m.bytes()); });
  std::vector<double> per_rank(ctx.comm.size(), 0.0);
  per_rank[ctx.comm.rank()] = mine;
  ctx.comm.allreduce_sum(per_rank.data(), per_rank.size());
  if (ctx.comm.size() == 1) return;
  for (int r = 0; r < ctx.comm.size(); ++r) spdlog::info("{}: rank {} holds {}", label, r, human_bytes(per_rank[r]));
}

namespace {

// One streaming pass: its number, moments and label, the job's checkpoint store and state, and this rank's share of
// the pass's sums (the state's vectors of this pass: empty, or what the checkpoints hold).
struct PassScope {
  int pass;
  const Calibration& cal;
  Context& ctx;
  CheckpointStore& store;
  PassState& state;
  PassMoments ms;
  std::string label;
  std::vector<float>& share_f() { return pass == 1 ? state.pass1_f : state.pass2_f; }
  std::vector<double>& share_d() { return pass == 1 ? state.pass1_d : state.pass2_d; }
  bool has_share() { return !(share_f().empty() && share_d().empty()); }
};

// How a pass's sums are kept between its rounds and brought together at its end: the pass runs in rounds,
// checkpointed after each (run_pass).
class PassStrategy {
 public:
  explicit PassStrategy(PassScope& p) : p_(p), live_{&p.ctx.backend, {}, {}} {
    name_live();
    nf_ = static_cast<size_t>(flat_size(live_.f)), nd_ = static_cast<size_t>(flat_size(live_.d));
  }
  virtual ~PassStrategy() = default;
  // Before streaming: a checkpoint's sums of this pass, where this strategy keeps them.
  virtual void restore() = 0;
  // After each round, the moments' sums held where they accumulate: reduced, and checkpointed unless it was the last.
  virtual void end_round(int64_t round, int64_t rounds) = 0;
  // After the last round, or at once when a checkpoint held the pass complete: the pass's complete moments on this
  // rank, committed unless they came from a commit. `keep_share`: a later pass's checkpoints need this pass's sums.
  virtual void end_pass(bool keep_share, bool was_complete) = 0;
  // Names the live sums again (after the moments were held or released).
  void name_live() {
    live_.f.clear();
    live_.d.clear();
    p_.ms.each([&](Moments& m) { LiveState::pieces(m, live_.f, live_.d); });
  }

 protected:
  void unpack_doubles(const double* d) {
    p_.ms.each([&](Moments& m) {
      LiveState::unpack_doubles(m, d);
      d += LiveState::doubles(m);
    });
  }
  PassScope& p_;
  LiveSums live_;  // the sums where they are current: on the host, or the held copies while the moments hold them
  size_t nf_ = 0, nd_ = 0;
};

// One reader: its share of the pass is its moments. Nothing to reduce, and checkpoints read the sums where they are
// (a device's held copies), so the sums are never held twice.
class OneReader final : public PassStrategy {
 public:
  using PassStrategy::PassStrategy;

  void restore() override {
    PassState& st = p_.state;
    if (st.deferred && st.pass == p_.pass) {  // the state's latest pass, straight in
      const std::vector<double> d = read_deferred(*st.deferred, live_.f);
      check_state_size(st.deferred->path, d.size(), nd_);
      unpack_doubles(d.data());
      st.deferred.reset();
    } else if (p_.has_share()) {
      check_state_size(p_.store.dir(), p_.share_f().size(), nf_);
      check_state_size(p_.store.dir(), p_.share_d().size(), nd_);
      place_sums(live_.f, 0, static_cast<int64_t>(nf_), p_.share_f().data());
      unpack_doubles(p_.share_d().data());
    }
    // A state of a later pass keeps this one for that pass's checkpoints; in this pass the moments are current.
    if (st.pass == p_.pass) {
      std::vector<float>().swap(p_.share_f());
      std::vector<double>().swap(p_.share_d());
    }
  }

  void end_round(int64_t round, int64_t rounds) override {
    const auto t = std::chrono::steady_clock::now();
    p_.state.rounds_done = round + 1;
    if (round + 1 < rounds) p_.store.save(p_.state, &live_);
    spdlog::info("{}: round {}/{} ended: checkpoint {} (one reader: read from its moments)", p_.label, round + 1,
                 rounds, round + 1 < rounds ? human_seconds(seconds_since(t)) : std::string("at the pass's end"));
  }

  void end_pass(bool keep_share, bool was_complete) override {
    const auto t = std::chrono::steady_clock::now();
    p_.ms.each([](Moments& m) { m.release_sums(true); });  // a device's sums to the host moments, once per pass
    name_live();
    const double to_host_s = seconds_since(t);
    if (!was_complete) p_.store.save(p_.state, &live_);
    if (keep_share && !p_.has_share()) {
      p_.share_f().resize(nf_);
      p_.share_d().resize(nd_);
      p_.ctx.backend.copy_sums(live_.f, 0, static_cast<int64_t>(nf_), p_.share_f().data(), false);
      p_.ctx.backend.copy_sums(live_.d, 0, static_cast<int64_t>(nd_), p_.share_d().data(), false);
    }
    if (!was_complete)
      spdlog::info("{}: pass end: sums to the host moments {}, checkpoint {}", p_.label, human_seconds(to_host_s),
                   human_seconds(seconds_since(t) - to_host_s));
  }
};

// Several readers reduce each round's sums (in a fixed order) into this rank's share of the pass, and gather the
// shares back into complete moments at the pass's end.
class ReaderGroup final : public PassStrategy {
 public:
  using PassStrategy::PassStrategy;

  void restore() override {
    CROSSKV_ASSERT(!p_.state.deferred, "only one reader defers a checkpoint's sums");
  }

  void end_round(int64_t round, int64_t rounds) override {
    const auto t = std::chrono::steady_clock::now();
    reduce_round(p_.ms, p_.ctx.backend, p_.ctx.readers(), p_.share_f(), p_.share_d());
    p_.state.rounds_done = round + 1;
    const double reduce_s = seconds_since(t);
    if (round + 1 < rounds) p_.store.save(p_.state);
    spdlog::info("{}: round {}/{} ended: reduced into the share {}, checkpoint {}", p_.label, round + 1, rounds,
                 human_seconds(reduce_s),
                 round + 1 < rounds ? human_seconds(seconds_since(t) - reduce_s) : std::string("at the pass's end"));
  }

  void end_pass(bool, bool was_complete) override {
    const auto t = std::chrono::steady_clock::now();
    p_.ms.each([](Moments& m) { m.release_sums(false); });  // zeros after the last reduction: overwritten below
    name_live();
    // The shares gathered back a segment at a time straight into the blocks (no copy of all of them), then the
    // token statistics (small).
    Comm& readers = p_.ctx.readers();
    readers.allgather_drained(p_.share_f(), nf_, [&](size_t off, size_t len, const float* values) {
      place_sums(live_.f, static_cast<int64_t>(off), static_cast<int64_t>(len), values);
    });
    std::vector<double> D(nd_);
    readers.allgather(p_.share_d(), D.data(), nd_);
    unpack_doubles(D.data());
    const double gather_s = seconds_since(t);
    if (was_complete) return;
    p_.store.save(p_.state);
    spdlog::info("{}: pass end: shares gathered into the moments {}, checkpoint {}", p_.label,
                 human_seconds(gather_s), human_seconds(seconds_since(t) - gather_s));
  }
};

// One streaming pass in rounds, checkpointed after each. With a checkpoint of this pass, reading resumes after its
// last round (or not at all if the pass was complete).
PassStats run_pass(PassScope scope, bool keep_share) {
  PassState& state = scope.state;
  if (state.pass < scope.pass) {
    state.pass = scope.pass;
    state.rounds_done = 0;
    scope.share_f().clear();
    scope.share_d().clear();
    state.deferred.reset();
  }
  const bool one_reader = scope.ctx.readers().size() == 1;
  std::unique_ptr<PassStrategy> strategy;
  if (one_reader)
    strategy = std::make_unique<OneReader>(scope);
  else
    strategy = std::make_unique<ReaderGroup>(scope);
  strategy->restore();
  // A state of a later pass holds this one complete (its rounds_done counts the later pass's rounds).
  const int64_t rounds = ShardSchedule(scope.cal, scope.ctx.readers().size(), scope.ctx.readers().rank()).rounds();
  const bool was_complete = state.pass > scope.pass || state.rounds_done == rounds;
  PassStats st;
  if (was_complete) {
    spdlog::info("{}: restored from the committed checkpoint in {} (no calibration data read)", scope.label,
                 scope.store.dir());
  } else {
    if (state.rounds_done > 0)
      spdlog::info("{}: resuming after round {} of {}", scope.label, state.rounds_done, rounds);
    scope.ms.each([&](Moments& m) { m.hold_sums(scope.ctx.backend); });  // rounds reduce and save the held copies
    strategy->name_live();
    st = stream_pass(scope.cal, scope.ctx, scope.ms, scope.label, state.rounds_done,
                     [&](int64_t round, int64_t R, bool abandoned) {
                       if (!scope.ctx.comm.all_ok(!abandoned))
                         throw Interrupted("stopped by a signal in round " + std::to_string(round + 1) + " of pass " +
                                           std::to_string(scope.pass) + "; the last committed checkpoint in " +
                                           scope.store.dir() + " stands");
                       strategy->end_round(round, R);
                     });
  }
  strategy->end_pass(keep_share, was_complete);
  scope.ms.each([](Moments& m) { m.mark_pass_complete(); });
  const double share = static_cast<double>(scope.share_f().size() * sizeof(float) +
                                           scope.share_d().size() * sizeof(double));
  log_rank_memory(scope.ctx, scope.label + " (moments + checkpointed share)", scope.ms, share);
  return st;
}

// The moments of one pass-1 accumulation over `plan`'s blocks (this rank's layer group's share of them).
FitMoments pass1_moments(const Shifts& sh, const PairDims& d, const Grid& grid, const MomentPlan& blocks,
                         const MomentPlan& probe) {
  auto of = [&](Kind kind) { return Moments(d, sh[kind].x, sh[kind].y); };
  FitMoments m{of(Kind::k), of(Kind::v), std::make_unique<Moments>(of(Kind::k_rope))};
  m.k_rope->add_plan(grid.share(probe, d));
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
  return c.fit.weighting == Weighting::uniform ? ckpt_dir : (fs::path(ckpt_dir) / "weighted").string();
}

// Pass 1 domain by domain, each with complete moments of its own (<moments_dir>/domain-<name>) over `full` and the
// probe's `pp`, summed with the domains' weights into `into`.
PassStats per_domain_pass(const Calibration& cal, const FitPlan& plan, Context& ctx, const std::string& ckpt_dir,
                          bool fresh, const Shifts& sh, const MomentPlan& full, const MomentPlan& pp,
                          FitMoments& into) {
  const PairDims d = cal.dims();
  Sha256 shift_hash;
  for (const Shift& k : sh.by_kind)
    for (const auto* v : {&k.x, &k.y}) shift_hash.update(v->data(), v->size() * sizeof(float));
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
    add_stats(stats, run_pass({1, sub, ctx, ds, st, dm.with_raw_keys(), "pass 1/1 [domain " + dom + "]"}, false));
    const auto it = cal.cfg.calibration.weights.find(dom);
    const double w = it == cal.cfg.calibration.weights.end() ? 1.0 : it->second;
    if (first) {
      into.k = std::move(dm.k);
      *into.k_rope = std::move(*dm.k_rope);
      into.v = std::move(dm.v);
      into.k.scale(w);
      into.k_rope->scale(w);
      into.v.scale(w);
      first = false;
    } else {
      into.k.add(dm.k, w);
      into.k_rope->add(*dm.k_rope, w);
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
  const MomentPlan pp = probe_plan(d, cal.cfg.fit.probe), full = MomentPlan::full(d, false);
  const MomentPlan& blocks = plan.single_pass ? full : pp;
  FirstPass p1{pass1_moments(sh, d, *ctx.grid, blocks, pp), {}, nullptr, {}};
  spdlog::info("memory: moments {} (keys) + {} (values) + {} (raw keys, probe only), input blocks and segments {}",
               human_bytes(p1.m.k.bytes()), human_bytes(p1.m.v.bytes()), human_bytes(p1.m.k_rope->bytes()),
               human_bytes(plan.host.buffers));
  // max_tokens makes a domain's tokens depend on the others: such fits, and two-pass fits, are checkpointed whole.
  const bool per_domain = plan.single_pass && !cal.cfg.calibration.max_tokens;
  if (!cal.cfg.calibration.weights.empty() && !per_domain)
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
    p1.stats = run_pass({1, cal, ctx, *p1.store, p1.state, p1.m.with_raw_keys(),
                         plan.single_pass ? "pass 1/1" : "pass 1/2 (probe)"},
                        !plan.single_pass);
    // The share is committed and the moments hold it: only a second pass's checkpoints still need it.
    if (plan.single_pass) p1.state = PassState{};
  }
  share_gram(*ctx.grid, pp, *p1.m.k_rope);
  share_gram(*ctx.grid, blocks, p1.m.k);
  share_gram(*ctx.grid, blocks, p1.m.v);
  if (ctx.grid->layer_groups > 1) log_rank_memory(ctx, "after the Gram exchange", p1.m.with_raw_keys());
  if (plan.single_pass && cal.cfg.fit.probe == ProbeMode::same_head) {
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
  const PassStats st = run_pass({2, cal, ctx, *p1.store, p1.state, p1.m.mapped(), "pass 2/2 (selected blocks)"}, false);
  p1.state = PassState{};  // committed, and held by the moments: the solve does not need the shares
  share_gram(*ctx.grid, selected, p1.m.k);
  share_gram(*ctx.grid, selected, p1.m.v);
  if (ctx.grid->layer_groups > 1) log_rank_memory(ctx, "after the Gram exchange", p1.m.mapped());
  return st;
}

}  // namespace crosskv
