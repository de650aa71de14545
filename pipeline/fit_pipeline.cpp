#include "pipeline/fit_pipeline.hpp"

#include <fcntl.h>
#include <sys/file.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <numeric>

#include "core/comm.hpp"
#include "core/backend.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "core/ridge.hpp"
#include "core/select.hpp"
#include "core/config.hpp"
#include "core/sha256.hpp"
#include "io/atomic_file.hpp"
#include "io/heatmap.hpp"
#include "io/r2_file.hpp"
#include "stages/checkpoint.hpp"
#include "stages/export.hpp"
#include "stages/grid.hpp"
#include "stages/solve.hpp"
#include "apply/diagnose.hpp"
#include "apply/report.hpp"
#include "apply/transfer.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

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
  nlohmann::json json() const {
    nlohmann::json j = nlohmann::json::object();
    double total = 0;
    for (const auto& [n, s] : times_) {
      j[n] = s;
      total += s;
    }
    j["total"] = total;
    return j;
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

// The probe, shared out over every rank: entries of the layer group's targets (or, for same-head blocks accumulated
// per head, of its heads), source layer a on the group's reader a mod T; then summed over the job.
ProbeR2 run_probe(const Moments& m, Context& ctx, ProbeMode mode, double lambda, const std::string& kind,
                  bool by_head) {
  const Grid& g = *ctx.grid;
  const ProbeShare mine = [&g, by_head](int a, int l, int h) {
    return (by_head ? g.owns_head(h) : g.owns_target(l)) && a % g.token_groups == g.token_group;
  };
  ProbeR2 r = mode == ProbeMode::same_head ? probe_same_head(m, ctx.backend, lambda, kind, mine)
                                           : probe_all_heads(m, ctx.backend, lambda, kind, mine);
  ctx.comm.allreduce_sum(r.per_head.data(), r.per_head.size());
  probe_means(r);
  return r;
}

// Every rank's memory, logged by rank 0: the moments it holds, plus `extra` bytes.
void log_rank_memory(Context& ctx, const std::string& label, const std::vector<Moments*>& ms, double extra = 0) {
  double mine = extra;
  for (auto* m : ms) mine += static_cast<double>(m->bytes());
  std::vector<double> per_rank(ctx.comm.size(), 0.0);
  per_rank[ctx.comm.rank()] = mine;
  ctx.comm.allreduce_sum(per_rank.data(), per_rank.size());
  if (ctx.comm.size() == 1) return;
  for (int r = 0; r < ctx.comm.size(); ++r) spdlog::info("{}: rank {} holds {}", label, r, human_bytes(per_rank[r]));
}

// One streaming pass in rounds, checkpointed after each. Several readers reduce their round's sums (fixed order) into
// this rank's share of the pass and gather the shares back into complete moments at the end. One reader's share is
// its moments: nothing to reduce, and checkpoints read the sums where they are (a device's, without a flush), so the
// sums are never held twice. With a checkpoint of this pass, reading resumes after its last round (or not at all if
// the pass was complete). `keep_share`: a one-reader state keeps a copy of the pass's sums for a later pass's
// checkpoints.
PassStats run_pass(int pass, const Calibration& cal, Context& ctx, CheckpointStore& store, PassState& state,
                   const std::vector<Moments*>& ms, const std::string& label, bool keep_share = false) {
  auto& base_f = pass == 1 ? state.pass1_f : state.pass2_f;
  auto& base_d = pass == 1 ? state.pass1_d : state.pass2_d;
  if (state.pass < pass) {
    state.pass = pass;
    state.rounds_done = 0;
    base_f.clear();
    base_d.clear();
    state.deferred.reset();
  }
  Comm& readers = ctx.readers();
  const bool one_reader = readers.size() == 1;
  LiveSums live{&ctx.backend, {}, {}};
  for (auto* m : ms) m->live_pieces(live.f, live.d);
  const auto nf = static_cast<size_t>(flat_size(live.f)), nd = static_cast<size_t>(flat_size(live.d));
  auto unpack_doubles = [&ms](const double* pd) {
    for (auto* m : ms) {
      m->unpack_live_doubles(pd);
      pd += m->live_doubles();
    }
  };
  CROSSKV_ASSERT(one_reader || !state.deferred, "only one reader defers a checkpoint's sums");
  if (one_reader && state.deferred && state.pass == pass) {  // the state's latest pass, straight into the moments
    const std::vector<double> d = read_deferred(*state.deferred, live.f);
    check_state_size(state.deferred->path, d.size(), nd);
    unpack_doubles(d.data());
    state.deferred.reset();
  } else if (one_reader && !(base_f.empty() && base_d.empty())) {
    check_state_size(store.dir(), base_f.size(), nf);
    check_state_size(store.dir(), base_d.size(), nd);
    place_sums(live.f, 0, static_cast<int64_t>(nf), base_f.data());
    unpack_doubles(base_d.data());
  }
  // A state of a later pass holds this one complete (its rounds_done counts the later pass's rounds) and keeps it
  // for that pass's checkpoints; in this pass a reader's moments are current from here on.
  const int64_t rounds = pass_rounds(cal, readers.size());
  const bool was_complete = state.pass > pass || state.rounds_done == rounds;
  if (one_reader && state.pass == pass) {
    std::vector<float>().swap(base_f);
    std::vector<double>().swap(base_d);
  }
  PassStats st;
  if (!was_complete) {
    if (state.rounds_done > 0)
      spdlog::info("{}: resuming after round {} of {}", label, state.rounds_done, rounds);
    auto on_round = [&](int64_t round, int64_t R, bool abandoned) {
      if (!ctx.comm.all_ok(!abandoned))
        throw Interrupted("stopped by a signal in round " + std::to_string(round + 1) + " of pass " +
                          std::to_string(pass) + "; the last committed checkpoint in " + store.dir() + " stands");
      const auto t_round = std::chrono::steady_clock::now();
      if (!one_reader) reduce_round(ms, ctx.backend, readers, base_f, base_d);
      state.rounds_done = round + 1;
      const double reduce_s = seconds_since(t_round);
      if (round + 1 < R) store.save(state, one_reader ? &live : nullptr);
      const std::string ckpt =
          round + 1 < R ? human_seconds(seconds_since(t_round) - reduce_s) : std::string("at the pass's end");
      if (one_reader)
        spdlog::info("{}: round {}/{} ended: checkpoint {} (one reader: read from its moments)", label, round + 1, R,
                     ckpt);
      else
        spdlog::info("{}: round {}/{} ended: reduced into the share {}, checkpoint {}", label, round + 1, R,
                     human_seconds(reduce_s), ckpt);
    };
    st = stream_pass(cal, ctx, *ms.front(), ms.size() == 3 ? ms[1] : nullptr, *ms.back(), label, state.rounds_done,
                     on_round);
  } else {
    spdlog::info("{}: restored from the committed checkpoint in {} (no calibration data read)", label, store.dir());
  }
  const auto t_end = std::chrono::steady_clock::now();
  double to_host_s = 0;
  if (one_reader) {
    ctx.backend.flush();  // a device's sums to the host moments, once per pass
    to_host_s = seconds_since(t_end);
    if (!was_complete) store.save(state, &live);
    if (keep_share && base_f.empty() && base_d.empty()) {
      base_f.resize(nf);
      base_d.resize(nd);
      ctx.backend.copy_sums(live.f, 0, static_cast<int64_t>(nf), base_f.data(), false);
      ctx.backend.copy_sums(live.d, 0, static_cast<int64_t>(nd), base_d.data(), false);
    }
  } else {
    ctx.backend.drop_resident();  // zeros after the last round's reduction: the host copies are overwritten below
    // The shares gathered back a segment at a time straight into the blocks (no copy of all of them), then the token
    // statistics (small).
    readers.allgather_drained(base_f, nf, [&](size_t off, size_t len, const float* values) {
      place_sums(live.f, static_cast<int64_t>(off), static_cast<int64_t>(len), values);
    });
    std::vector<double> D(nd);
    readers.allgather(base_d, D.data(), nd);
    unpack_doubles(D.data());
    to_host_s = seconds_since(t_end);
    if (!was_complete) store.save(state);
  }
  if (!was_complete)
    spdlog::info("{}: pass end: {} {}, checkpoint {}", label,
                 one_reader ? "sums to the host moments" : "shares gathered into the moments",
                 human_seconds(to_host_s), human_seconds(seconds_since(t_end) - to_host_s));
  for (auto* m : ms) m->mark_pass_complete();
  double share = static_cast<double>(base_f.size() * sizeof(float) + base_d.size() * sizeof(double));
  log_rank_memory(ctx, label + " (moments + checkpointed share)", ms, share);
  return st;
}

// Every rank's string, on every rank (lengths summed over ranks, then one broadcast per rank).
std::vector<std::string> gather_strings(Comm& comm, const std::string& mine) {
  std::vector<double> len(comm.size(), 0.0);
  len[comm.rank()] = static_cast<double>(mine.size());
  comm.allreduce_sum(len.data(), len.size());
  std::vector<std::string> out(comm.size());
  for (int r = 0; r < comm.size(); ++r) {
    out[r] = r == comm.rank() ? mine : std::string(static_cast<size_t>(len[r]), '\0');
    comm.broadcast(out[r].data(), out[r].size(), r);
  }
  return out;
}

class OutputLock {
 public:
  void acquire(const std::string& dir) {
    path_ = (fs::path(dir) / ".crosskv-fit.lock").string();
    fd_ = ::open(path_.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
    if (fd_ < 0) throw InputError("output.dir: cannot create " + path_);
    held_ = ::flock(fd_, LOCK_EX | LOCK_NB) == 0;
    if (held_) {
      const std::string who = "pid " + std::to_string(::getpid()) + " on " + host_name();
      if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) < 0)
        spdlog::warn("cannot record the holder in {}", path_);
    } else {
      char buf[128] = {0};
      if (::pread(fd_, buf, sizeof buf - 1, 0) > 0) holder_ = buf;
      while (!holder_.empty() && std::isspace(static_cast<unsigned char>(holder_.back()))) holder_.pop_back();
    }
  }
  bool held() const { return held_; }
  std::string holder() const { return holder_.empty() ? "see " + path_ : holder_; }
  ~OutputLock() {
    if (fd_ >= 0) ::close(fd_);
  }

 private:
  std::string path_, holder_;
  int fd_ = -1;
  bool held_ = false;
};

// Diagnoses every k on the held-out shards (eval.shards): <output.dir>/eval-k<K>.json and report.html.
std::string evaluate_held_out(const Calibration& cal, const std::vector<std::string>& artifacts,
                              const std::string& heatmap_path, ComputeBackend& be) {
  std::vector<std::string> src, tgt;
  std::string names;
  for (const auto& p : cal.eval_shards) {
    src.push_back(p.source_path);
    tgt.push_back(p.target_path);
    names += (names.empty() ? "" : ", ") + p.rel;
  }
  const Cache s = read_caches(src, false), t = read_caches(tgt, true);
  ReportInput in;
  in.eval_source = names;
  for (const auto& dir : artifacts) {
    Transfer tr(dir, be, TransferOptions{true, true, false});
    Evaluation ev = evaluate(tr, s, t);
    const std::string k = fs::path(dir).filename().string();
    nlohmann::json j = ev.json();
    j["mapper"] = dir;
    j["held_out_shards"] = names;
    write_file_atomic((fs::path(cal.cfg.output_dir) / ("eval-" + k + ".json")).string(), j.dump(2) + "\n");
    spdlog::info("held-out {} ({} tokens): {}", k, s.tokens, ev.verdict);
    if (in.title.empty()) in.title = tr.manifest().source_model + " -> " + tr.manifest().target_model;
    in.manifests.push_back(tr.manifest().json);
    in.evaluations.push_back(std::move(ev));
  }
  std::ifstream svg(heatmap_path);
  in.heatmap_svg.assign(std::istreambuf_iterator<char>(svg), std::istreambuf_iterator<char>());
  const std::string report = (fs::path(cal.cfg.output_dir) / "report.html").string();
  write_file_atomic(report, render_report(in));
  return report;
}

}  // namespace

FitResult run_fit(const FitConfig& cfg, const FitOptions& opts, Context& world) {
  FitResult res;
  StageClock clock;
  const bool root = world.comm.rank() == 0;
  const int P = world.comm.size();
  const int planned = opts.plan_only && opts.plan_ranks > 0 ? opts.plan_ranks : P;
  clock.start("validate");
  // Every rank validates the same files: a mistake is agreed on and reported once (by rank 0).
  Calibration cal = agreed(world.comm, [&] {
    if (cfg.layer_groups > 0 && planned % cfg.layer_groups != 0)
      throw ConfigError(cfg.config_path + ": runtime.layer_groups: " + std::to_string(cfg.layer_groups) +
                        " does not divide the job's " + std::to_string(planned) + " ranks");
    return validate(cfg);
  });
  if (root)
    for (const auto& line : cal.skipped) spdlog::warn("{}", line);
  const PairDims d = cal.dims();
  spdlog::info("{} shard pairs in {} domain(s), {} tokens used (stride {}); source {} [{}x{}x{}], target {} [{}x{}x{}]",
               cal.shards.size(), cal.domains.size(), cal.tokens_used, cfg.token_stride, cal.source_model, d.Ls, d.Hs,
               d.Ds, cal.target_model, d.Lt, d.Ht, d.Dt);

  clock.start("plan");
  const double read_bpt = cal.stored_bytes_per_token;
  // On a device the moments stay resident for a whole round: a rank's share must fit the device's free memory beside
  // two rounds of inputs (stored bf16 keys and values of both models, and their fp32 conversions: 16 bytes per
  // value). The smallest free memory over the ranks caps max_moment_gib (more layer groups, or two passes).
  double max_gib = cfg.max_moment_gib;
  double device_gib = -1, least_free_gib = -1;
  if (!opts.plan_only) {
    std::vector<double> free_gib(P, 0.0);
    const int64_t mine = world.backend.device_memory_free();
    free_gib[world.comm.rank()] = mine < 0 ? -1.0 : static_cast<double>(mine) / (1ull << 30);
    world.comm.allreduce_sum(free_gib.data(), free_gib.size());
    least_free_gib = *std::min_element(free_gib.begin(), free_gib.end());
  }
  // The same figures on every rank from here to the plan: its mistakes are agreed on and reported once.
  const FitPlan plan = agreed(world.comm, [&] {
    const double least = least_free_gib;
    if (least >= 0) {
      const double inputs_gib = 2.0 * cfg.block_tokens * static_cast<double>(d.X() + d.Y()) * 16.0 / (1ull << 30);
      device_gib = 0.9 * least - inputs_gib;
      if (device_gib <= 0)
        throw ConfigError(cfg.config_path + ": runtime.block_tokens: " + std::to_string(cfg.block_tokens) +
                          " tokens per block need " + human_bytes(inputs_gib * (1ull << 30)) +
                          " of device memory for inputs alone; the device has " + human_bytes(least * (1ull << 30)) +
                          " free");
      if (device_gib < max_gib) {
        spdlog::info("moments per rank capped at {} by the device's free memory ({} free, {} for two rounds of "
                     "inputs; runtime.max_moment_gib is {} GiB)",
                     human_bytes(device_gib * (1ull << 30)), human_bytes(least * (1ull << 30)),
                     human_bytes(inputs_gib * (1ull << 30)), cfg.max_moment_gib);
        max_gib = device_gib;
      }
    }
    FitPlan p = make_plan(d, cal.tokens_used, cfg.ks, cfg.probe, max_gib, read_bpt, planned, cfg.layer_groups);
    if (device_gib >= 0 && p.rank_moment_bytes > device_gib * (1ull << 30))
      throw ConfigError(cfg.config_path + ": runtime.layer_groups: a rank's moments need " +
                        human_bytes(static_cast<double>(p.rank_moment_bytes)) + " but the device has room for " +
                        human_bytes(device_gib * (1ull << 30)) + " beside its inputs; use more layer groups (or " +
                        "auto), more ranks, or smaller runtime.block_tokens");
    return p;
  });
  res.plan_text = format_plan(plan) +
                  format_host_memory(estimate_host_memory(plan, cfg.block_tokens, cal.stored_bytes_per_token,
                                                       world.backend.prepares_on_device()));
  for (std::string line; const char c : res.plan_text + "\n") {
    if (c == '\n') {
      if (!line.empty()) spdlog::info("{}", line);
      line.clear();
    } else {
      line += c;
    }
  }
  if (opts.plan_only) return res;
  Grid grid = make_grid(world.comm, plan.layer_groups);
  Context ctx{world.comm, world.backend, &grid};
  if (P > 1) spdlog::info("grid: {}", grid.describe());

  std::error_code ec;
  fs::create_directories(cfg.output_dir, ec);
  if (ec) throw InputError("output.dir: cannot create " + cfg.output_dir + ": " + ec.message());
  // One job per output folder: rank 0 holds an flock (released by the kernel however the job ends).
  OutputLock lock;
  if (root) lock.acquire(cfg.output_dir);
  if (!ctx.comm.all_ok(!root || lock.held()))
    throw InputError("output.dir: " + cfg.output_dir + " is in use by another crosskv-fit (" + lock.holder() + ")");

  clock.start("probe-pass");
  Shifts sh = compute_shifts(cal);
  Moments mk(d, sh.xk, sh.yk), mv(d, sh.xv, sh.yv);
  auto mraw = std::make_unique<Moments>(d, sh.xk_raw, sh.yk_raw);
  // Job-wide plans; each rank accumulates its layer group's share of them.
  const MomentPlan pp = probe_plan(d, cfg.probe);
  const MomentPlan full = MomentPlan::full(d, false);
  const MomentPlan& pass1 = plan.single_pass ? full : pp;
  mraw->add_plan(grid.share(pp, d));
  mk.add_plan(grid.share(pass1, d));
  mv.add_plan(grid.share(pass1, d));
  // Blocks in flight: the one being folded in and the one read ahead, each with raw and stripped keys and values.
  const double block_bytes = 2.0 * cfg.block_tokens * 3.0 * (d.X() + d.Y()) * sizeof(float);
  spdlog::info("memory: moments {} (keys) + {} (values) + {} (raw keys, probe only), blocks {}",
               human_bytes(mk.bytes()), human_bytes(mv.bytes()), human_bytes(mraw->bytes()), human_bytes(block_bytes));
  const std::string ckpt_dir =
      cfg.checkpoint_dir.empty() ? (fs::path(cfg.output_dir) / "checkpoint").string() : cfg.checkpoint_dir;
  // Single-pass fits keep complete moments per calibration domain (in <checkpoint>/domain-<name>), so a later fit
  // over other domains reads only the domains it has not read before. Two-pass fits and max_tokens (which makes a
  // domain's tokens depend on the others) checkpoint the job as a whole.
  const bool per_domain = plan.single_pass && !cfg.max_tokens;
  if (!cfg.weights.empty() && !per_domain)
    throw ConfigError(cfg.config_path + ": calibration.weights needs a single-pass fit (raise runtime.max_moment_gib)");
  auto weight_of = [&](const std::string& dom) {
    auto it = cfg.weights.find(dom);
    return it == cfg.weights.end() ? 1.0 : it->second;
  };
  std::unique_ptr<CheckpointStore> job_store;
  const bool one_reader = ctx.readers().size() == 1;  // its checkpointed sums are read straight into its moments
  PassState state;
  PassStats p1;
  if (per_domain) {
    Sha256 shift_hash;
    for (const auto* v : {&sh.xk, &sh.yk, &sh.xk_raw, &sh.yk_raw, &sh.xv, &sh.yv})
      shift_hash.update(v->data(), v->size() * sizeof(float));
    const std::string shift_sha = shift_hash.hex();
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
      nlohmann::json id = checkpoint_identity(sub, plan, P);
      id["shift_sha256"] = shift_sha;
      CheckpointStore ds((fs::path(ckpt_dir) / ("domain-" + dom)).string(), id, ctx.comm);
      PassState st = ds.load(opts.fresh, /*cache=*/true, one_reader).value_or(PassState{});
      Moments dk(d, sh.xk, sh.yk), draw(d, sh.xk_raw, sh.yk_raw), dv(d, sh.xv, sh.yv);
      dk.add_plan(grid.share(full, d));
      dv.add_plan(grid.share(full, d));
      draw.add_plan(grid.share(pp, d));
      const PassStats ps = run_pass(1, sub, ctx, ds, st, {&dk, &draw, &dv}, "pass 1/1 [domain " + dom + "]");
      p1.tokens += ps.tokens;
      p1.seconds += ps.seconds;
      p1.bytes += ps.bytes;
      const double w = weight_of(dom);
      if (first) {
        mk = std::move(dk);
        *mraw = std::move(draw);
        mv = std::move(dv);
        mk.scale(w);
        mraw->scale(w);
        mv.scale(w);
        first = false;
      } else {
        mk.add(dk, w);
        mraw->add(draw, w);
        mv.add(dv, w);
      }
    }
  } else {
    job_store = std::make_unique<CheckpointStore>(ckpt_dir, checkpoint_identity(cal, plan, P), ctx.comm);
    state = job_store->load(opts.fresh, false, one_reader).value_or(PassState{});
    p1 = run_pass(1, cal, ctx, *job_store, state, {&mk, mraw.get(), &mv},
                  plan.single_pass ? "pass 1/1" : "pass 1/2 (probe)", !plan.single_pass);
    // The share is committed and the moments hold it: only a second pass's checkpoints still need it.
    if (plan.single_pass) state = PassState{};
  }
  res.tokens_read += p1.tokens;
  res.passes = 1;
  share_gram(grid, pp, *mraw);
  share_gram(grid, pass1, mk);
  share_gram(grid, pass1, mv);
  if (grid.layer_groups > 1) log_rank_memory(ctx, "after the Gram exchange", {&mk, mraw.get(), &mv});
  const bool same_head = cfg.probe == ProbeMode::same_head;
  if (plan.single_pass && same_head) {
    mk.derive_head_probe();
    mv.derive_head_probe();
  }

  clock.start("probe");
  std::map<std::string, ProbeR2> probes;
  probes["k_rope"] = run_probe(*mraw, ctx, cfg.probe, cfg.lambda, "k_rope", same_head);
  mraw.reset();
  probes["k"] = run_probe(mk, ctx, cfg.probe, cfg.lambda, "k", same_head && !plan.single_pass);
  probes["v"] = run_probe(mv, ctx, cfg.probe, cfg.lambda, "v", same_head && !plan.single_pass);
  res.r2_path = (fs::path(cfg.output_dir) / "r2.h5").string();
  res.heatmap_path = (fs::path(cfg.output_dir) / "r2_heatmap.svg").string();
  if (root) {
    write_r2_file(res.r2_path, probes,
                  {{"source_model", cal.source_model}, {"target_model", cal.target_model},
                   {"probe", to_string(cfg.probe)}, {"lambda", std::to_string(cfg.lambda)},
                   {"rows", "source layer"}, {"columns", "target layer"}});
    write_file_atomic(res.heatmap_path,
                      render_heatmaps_svg({{"K_rope (raw keys)", &probes["k_rope"]},
                                           {"K (RoPE-stripped)", &probes["k"]},
                                           {"V", &probes["v"]}},
                                          cal.source_model + " -> " + cal.target_model + ": head-averaged R² (" +
                                              to_string(cfg.probe) + " probe, " + std::to_string(cal.tokens_used) +
                                              " tokens)"));
  }

  clock.start("select");
  const auto rankings = rank_sources(probes["k"].mean, probes["v"].mean, d.Ls, d.Lt);
  const int kmax = plan.ks.back().count;
  for (int l = 0; l < d.Lt; ++l) {
    const auto top = top_k(rankings[l], std::min(kmax, 4));
    std::string s;
    for (int a : top) s += (s.empty() ? "" : " ") + std::to_string(a);
    spdlog::debug("target layer {}: best source layers {}", l, s);
  }

  if (!plan.single_pass) {
    clock.start("gram-pass");
    const MomentPlan sel = selection_plan(rankings, kmax);
    const double sel_bytes = 2.0 * sizeof(float) * sel.floats(d);
    if (sel_bytes > cfg.max_moment_gib * (1ull << 30))
      spdlog::warn("the selected blocks need {} (over runtime.max_moment_gib = {} GiB); k = {} needs them all",
                   human_bytes(sel_bytes), cfg.max_moment_gib, plan.ks.back().label);
    mk.add_plan(grid.share(sel, d));
    mv.add_plan(grid.share(sel, d));
    spdlog::info("second pass for the selected blocks; moments now {} + {}", human_bytes(mk.bytes()),
                 human_bytes(mv.bytes()));
    res.tokens_read += run_pass(2, cal, ctx, *job_store, state, {&mk, &mv}, "pass 2/2 (selected blocks)").tokens;
    state = PassState{};  // committed, and held by the moments: the solve does not need the shares
    share_gram(grid, sel, mk);
    share_gram(grid, sel, mv);
    if (grid.layer_groups > 1) log_rank_memory(ctx, "after the Gram exchange", {&mk, &mv});
    res.passes = 2;
  }

  clock.start("solve+export");
  std::vector<int> counts;
  for (const auto& k : plan.ks) counts.push_back(k.count);
  // Target layers go to their layer group, and within it to its solve units (stages/solve.hpp); rank 0 collects the
  // manifest entries and writes the manifests last.
  ArtifactWriter writer(cal, plan, ctx.comm.rank());
  // What the layers' files depend on: the data and how it was read (the checkpoint's identity, with the grid), the
  // solve's settings and this version. An interrupted export of the same job keeps the layers it wrote.
  nlohmann::json export_id = checkpoint_identity(cal, plan, P);
  export_id["fit"] = {{"k", counts}, {"lambda", cfg.lambda}, {"dtype", to_string(cfg.dtype)},
                      {"weights", cfg.weights}, {"version", CROSSKV_VERSION}};
  if (root) writer.begin(export_id);
  ctx.comm.barrier();
  solve_layers(ctx, plan, mk, mv, rankings, cfg.lambda, writer, ckpt_dir);
  const auto entries = gather_strings(ctx.comm, writer.layer_entries().dump());
  if (root) {
    for (size_t r = 1; r < entries.size(); ++r) writer.add_layer_entries(nlohmann::json::parse(entries[r]));
    clock.stop();
    nlohmann::json extra = {
        {"timings_s", clock.json()},
        {"grid", {{"ranks", P}, {"layer_groups", grid.layer_groups}, {"token_groups", grid.token_groups},
                  {"collectives", ctx.comm.name()}, {"backend", ctx.backend.name()},
                  {"targets", "layer l to layer group l mod G, round-robin over its token groups"}}},
        {"passes", res.passes},
        {"r2_file", "../r2.h5"}};
    res.artifacts = writer.finish(extra);
    if (!cal.eval_shards.empty()) {
      clock.start("eval");
      res.report_path = evaluate_held_out(cal, res.artifacts, res.heatmap_path, ctx.backend);
    }
  }
  clock.stop();
  ctx.comm.barrier();
  if (root) {
    clock.summary();
    if (res.tokens_read == 0)
      spdlog::info("refit from the stored moments in {}: no calibration data was read", ckpt_dir);
    else
      spdlog::info("read {} tokens in pass 1 ({}/s)", p1.tokens, human_bytes(p1.bytes / std::max(p1.seconds, 1e-9)));
    for (const auto& a : res.artifacts) spdlog::info("artifact: {}", a);
    spdlog::info("R² matrices: {}  heatmaps: {}", res.r2_path, res.heatmap_path);
    if (!res.report_path.empty()) spdlog::info("report: {}", res.report_path);
  }
  return res;
}

}  // namespace crosskv
