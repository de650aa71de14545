#include "fit/mlp.hpp"
#include "fit/mlp_checkpoint.hpp"
#include "fit/mlp_data.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <optional>

#include "serve/serving_mapper.hpp"
#include "core/bytes.hpp"
#include "core/comm.hpp"
#include "runtime/fault.hpp"
#include "runtime/log.hpp"
#include "core/mlp.hpp"
#include "fit/mlp_training.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "core/atomic_file.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "artifact/mapper.hpp"
#include "io/shard.hpp"
#include "fit/checkpoint.hpp"
#include "fit/grid.hpp"
#include "fit/export.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

// The validation R² a residual MLP must add to be kept (fit.mapper: auto).
constexpr double kMinGain = 1e-3;

// One (target layer, kind)'s outcome.
struct Outcome {
  int layer = 0;
  ManifestMlpDecision d;  // its width: the kept params'
  MlpParams params;       // when kept: the standardisation folded into W1 and b1
};

// An outcome's fields, as its checkpoint file and the gather to rank 0 carry them (core/bytes.hpp): the kept MLP's
// parameters follow its shape.
template <class O, class IO>
void outcome_fields(O& o, IO& io) {
  io.template as<int32_t>(o.layer);
  io.map(o.d.kind, [](Kind k) { return int32_t{mapped_index(k)}; }, [](int32_t i) { return kMappedKinds.at(i == 1); });
  io.template as<int32_t>(o.d.kept);
  io(o.d.val_mse_ridge, o.d.val_mse_mlp, o.d.val_r2_ridge, o.d.val_r2_mlp);
  io(o.params.shape.in, o.params.shape.hidden, o.params.shape.out);
  if (o.d.kept) io.fixed(o.params.flat, static_cast<size_t>(o.params.shape.parameters()));
  if constexpr (!std::is_const_v<O>) o.d.hidden = o.d.kept ? o.params.shape.hidden : 0;
}

void serialise(const Outcome& o, ByteWriter& w) { outcome_fields(o, w); }

std::vector<Outcome> deserialise(const std::string& s) {
  std::vector<Outcome> all;
  ByteReader r(s, "a residual-MLP record");
  while (!r.done()) outcome_fields(all.emplace_back(), r);
  return all;
}

// Sums over the layer group in a fixed order.
std::vector<double> group_sum(Comm& g, std::vector<double> v) {
  g.allreduce_sum(v.data(), v.size());
  return v;
}

// Column means and 1 / standard deviations of x [rows x K] over the group.
void standardisation(Comm& g, const std::vector<float>& x, int64_t rows, int64_t K, std::vector<double>& mean,
                     std::vector<double>& inv_sd) {
  std::vector<double> s(K + 1, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < K; ++i) s[i] += x[t * K + i];
  s[K] = static_cast<double>(rows);
  s = group_sum(g, std::move(s));
  const double n = std::max(s[K], 1.0);
  mean.assign(K, 0.0);
  for (int64_t i = 0; i < K; ++i) mean[i] = s[i] / n;
  std::vector<double> q(K, 0.0);
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t i = 0; i < K; ++i) {
      const double e = x[t * K + i] - mean[i];
      q[i] += e * e;
    }
  q = group_sum(g, std::move(q));
  inv_sd.assign(K, 1.0);
  for (int64_t i = 0; i < K; ++i) inv_sd[i] = q[i] / n > 1e-12 ? 1.0 / std::sqrt(q[i] / n) : 1.0;
}

// The validation scores of ridge and ridge + MLP over the group: MSE of the residual R against 0 and against f(z),
// turned into R² by the validation targets' variance about each column's mean.
void validation_scores(Comm& g, ComputeBackend& be, const MlpParams& p, const std::vector<float>& z,
                       const std::vector<float>& R, const std::vector<float>& y, int64_t rows, int64_t G,
                       Outcome& o) {
  std::vector<float> f;
  if (rows > 0) {
    MlpWorkspace ws;
    mlp_forward(be, p, z.data(), rows, ws);
    f = std::move(ws.out);
  }
  std::vector<double> col(G + 1, 0.0);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < G; ++c) col[c] += y[r * G + c];
  col[G] = static_cast<double>(rows);
  col = group_sum(g, std::move(col));
  if (col[G] == 0) return;
  std::vector<double> e(3, 0.0);  // ridge's squared error, the MLP's, the targets' squared deviations
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < G; ++c) {
      const double res = R[r * G + c], dev = y[r * G + c] - col[c] / col[G];
      e[0] += res * res, e[1] += (res - f[r * G + c]) * (res - f[r * G + c]), e[2] += dev * dev;
    }
  e = group_sum(g, std::move(e));
  const double n = col[G] * static_cast<double>(G);
  o.d.val_mse_ridge = e[0] / n, o.d.val_mse_mlp = e[1] / n;
  if (e[2] > 0) o.d.val_r2_ridge = 1 - e[0] / e[2], o.d.val_r2_mlp = 1 - e[1] / e[2];
}

// relu(((x - mean) * inv_sd) W1 + b1) = relu(x W1' + b1'): the artifact applies the MLP to the features as they are.
void fold_standardisation(MlpParams& p, const std::vector<double>& mean, const std::vector<double>& inv_sd) {
  const int64_t K = p.shape.in, H = p.shape.hidden;
  for (int64_t j = 0; j < H; ++j) {
    double shift = 0;
    for (int64_t i = 0; i < K; ++i) shift += mean[i] * inv_sd[i] * p.w1()[i * H + j];
    p.b1()[j] = static_cast<float>(p.b1()[j] - shift);
  }
  for (int64_t i = 0; i < K; ++i)
    for (int64_t j = 0; j < H; ++j) p.w1()[i * H + j] = static_cast<float>(p.w1()[i * H + j] * inv_sd[i]);
}

// What one rank needs to train its layer group's (layer, kind) units of one mapper.
struct UnitContext {
  Context& ctx;
  Comm& group;
  const Calibration& cal;
  const std::vector<ShardRows>& share;
  const MlpCheckpoint& ck;
  Progress& progress;
  int64_t tokens_per_epoch = 0;  // the group's training rows
  int64_t states_written = 0, epochs_run = 0;  // for the kill_in_mlp and term_in_mlp fault hooks
  int resumed = 0;                               // trainings resumed from an epoch state
  std::chrono::steady_clock::time_point last_state = std::chrono::steady_clock::now();
};

// Trains and judges (layer l, kind) of the ridge layer `w` on the group, from a checkpointed state if there is one.
// `ridge` holds target layer l's ridge alone (the one apply), `selected` its source layers.
Outcome fit_unit(UnitContext& u, ServingMapper& ridge, const std::vector<int>& selected, int64_t G, int l,
                 Kind kind) {
  ComputeBackend& be = u.ctx.backend;
  const MlpSettings& c = u.cal.cfg.fit.mlp;
  const int64_t K = static_cast<int64_t>(selected.size()) * u.cal.source.features_per_layer();
  const MlpShape shape{K, c.hidden, G};
  const LayerData d = load_layer_data(u.cal, u.share, selected, l, kind);
  std::vector<float> R[2], z[2];  // the ridge's residual; the standardised features
  for (int split = 0; split < 2; ++split) {
    const int64_t n = d.rows[split];
    R[split].assign(n * G, 0.0f);
    ContentBatch cb;
    cb.rows = n, cb.layers = {l, 1}, cb.gathered = true, cb.residual_mlp = false;
    (kind == Kind::k ? cb.keys : cb.values) = d.x[split].data();
    (kind == Kind::k ? cb.out_keys : cb.out_values) = R[split].data();
    ridge.map_content_host(cb);
    for (int64_t i = 0; i < n * G; ++i) R[split][i] = d.y[split][i] - R[split][i];
  }
  // Trained on standardised features (the keys' large-mean channels would otherwise swamp the first layer).
  std::vector<double> mean, inv_sd;
  standardisation(u.group, d.x[0], d.rows[0], K, mean, inv_sd);
  for (int split = 0; split < 2; ++split) {
    z[split] = d.x[split];
    for (int64_t t = 0; t < d.rows[split]; ++t)
      for (int64_t i = 0; i < K; ++i)
        z[split][t * K + i] = static_cast<float>((z[split][t * K + i] - mean[i]) * inv_sd[i]);
  }
  MlpTraining t;
  t.epochs = c.epochs, t.batch_tokens = c.batch_tokens, t.seed = c.seed * 1000003 + static_cast<uint64_t>(2 * l + mapped_index(kind));
  t.adam.lr = c.lr, t.adam.weight_decay = c.weight_decay;

  const std::string state_file = u.ck.path(l, kind, "state");
  std::optional<MlpTrained> resume;
  if (const auto s = read_on_root(u.group, u.ck, state_file)) resume = deserialise_state(*s, shape);
  if (resume) {
    ++u.resumed;
    spdlog::info("residual MLP of target layer {} ({}): resuming from epoch {} of {}", l, kind_dataset(kind),
                 resume->epoch_mse.size(), c.epochs);
    u.progress.add(static_cast<int64_t>(resume->epoch_mse.size()) * u.tokens_per_epoch);
  }
  bool stopped = false;
  const auto after_epoch = [&](const MlpTrained& now) {
    u.progress.add(u.tokens_per_epoch);
    fault_point("term_in_mlp", ++u.epochs_run, u.ctx.comm.rank());
    stopped = !u.group.all_ok(!u.ctx.stop.requested());
    const double since = seconds_since(u.last_state);
    if (u.group.rank() == 0 && (stopped || since >= static_cast<double>(u.cal.cfg.runtime.checkpoint.mlp_seconds))) {
      u.ck.write(state_file, serialise_state(now));
      u.last_state = std::chrono::steady_clock::now();
      fault_point("kill_in_mlp", ++u.states_written, u.ctx.comm.rank());
    }
    return !stopped;
  };
  MlpTrained trained = train_residual_mlp(be, u.group, shape, z[0].data(), R[0].data(), d.rows[0], t,
                                          resume ? &*resume : nullptr, after_epoch);
  if (stopped)
    throw Interrupted("stopped by a signal while training residual MLPs; the trained ones and the last epoch are "
                      "checkpointed in " + u.ck.dir());
  u.progress.add(u.tokens_per_epoch);
  Outcome o;
  o.layer = l, o.d.kind = kind;
  validation_scores(u.group, be, trained.params, z[1], R[1], d.y[1], d.rows[1], G, o);
  o.d.kept = u.cal.cfg.fit.mapper == MapperKind::mlp || (o.d.val_r2_mlp >= o.d.val_r2_ridge + kMinGain);
  if (o.d.kept) {
    fold_standardisation(trained.params, mean, inv_sd);
    o.params = std::move(trained.params);
    o.d.hidden = o.params.shape.hidden;
  }
  return o;
}


// Rank 0: the layer file of `entry` rewritten with its ridge tensors (as stored) and the kept MLPs; the manifest
// entry (SHA-256, decisions) and the export's record of the layer follow.
void write_layer(const std::string& dir, ManifestLayer& entry, const std::vector<const Outcome*>& kinds) {
  const std::string file = (fs::path(dir) / entry.file).string();
  StoredLayerFile stored;
  read_layer_file(file, entry.target_layer, entry.source_layers, stored);
  LayerFileContent& c = stored.content;
  entry.mlp.clear();
  for (const Outcome* o : kinds) {
    entry.mlp.push_back(o->d);
    if (o->d.kept) c.kinds[o->d.kind].mlp = &o->params;
  }
  write_layer_file(file, c);
  entry.sha256 = sha256_file(file);
  record_rewritten_layer(dir, entry);
}

// Rank 0: every layer file and the manifest of mapper `m` (named `k` in logs) with the outcomes of all ranks.
// `rewritten` counts layer files over the stage (the kill_in_mlp_rewrite fault hook).
void write_mapper(const MapperManifest& m, const std::string& k, const std::vector<Outcome>& outcomes,
                  const FitConfig& cfg, double seconds, int64_t& rewritten) {
  ByKind<int> kept;
  std::vector<ManifestLayer> layers = m.layers;
  for (ManifestLayer& entry : layers) {
    std::vector<const Outcome*> kinds;
    for (const Outcome& o : outcomes)
      if (o.layer == entry.target_layer) kinds.push_back(&o), kept[o.d.kind] += o.d.kept;
    std::sort(kinds.begin(), kinds.end(), [](const Outcome* a, const Outcome* b) { return a->d.kind < b->d.kind; });
    write_layer(m.dir, entry, kinds);
    fault_point("kill_in_mlp_rewrite", ++rewritten, 0);
  }
  add_mlps_to_manifest(m.dir, layers, mapper_kind_name(cfg.fit.mapper), cfg.fit.mlp, seconds);
  spdlog::info("residual MLPs {}: kept for {} of {} target layers' keys and {} of their values ({})", k, kept.k,
               m.target.n_layers, kept.v, mapper_kind_name(cfg.fit.mapper));
}

}  // namespace

void fit_residual_mlps(Context& ctx, const Calibration& cal, const std::vector<std::string>& partial_dirs,
                       const std::string& ckpt_dir, const nlohmann::json& export_identity) {
  const FitConfig& cfg = cal.cfg;
  if (cfg.fit.mapper == MapperKind::ridge) return;
  Comm& group = ctx.readers();
  const int G = ctx.grid ? ctx.grid->layer_groups : 1, me = ctx.grid ? ctx.grid->layer_group : 0;
  const std::vector<ShardRows> share = agreed(ctx.comm, [&] { return plan_rows(cal, group.size(), group.rank()); });
  double training_rows = 0;  // the group's, per epoch
  for (const auto& sr : share) training_rows += static_cast<double>(std::count(sr.validation.begin(), sr.validation.end(), 0));
  group.allreduce_sum(&training_rows, 1);
  const auto tokens_per_epoch = static_cast<int64_t>(training_rows);
  int64_t rewritten = 0;
  // The export's identity holds the data, the solve's settings, fit.mapper, fit.mlp and eval.shards.
  nlohmann::json identity = {{"export", export_identity}};
  for (const std::string& dir : partial_dirs) {
    const auto t0 = std::chrono::steady_clock::now();
    const MapperManifest m = read_mapper_manifest(dir);
    const std::string k = "k" + m.k_label;
    identity["k"] = k;
    const MlpCheckpoint ck(ckpt_dir, k.substr(1), identity);
    const int64_t G_feat = m.target.features_per_layer();
    std::vector<int> layers;
    for (int l = me; l < m.target.n_layers; l += G) layers.push_back(l);
    Progress progress(G > 1 ? "residual MLPs " + k + " (this layer group's layers)" : "residual MLPs " + k,
                      static_cast<int64_t>(layers.size()) * 2 * cfg.fit.mlp.epochs * tokens_per_epoch, 0);
    UnitContext u{ctx, group, cal, share, ck, progress, tokens_per_epoch};
    ByteWriter bytes;
    int taken_over = 0;
    for (const int l : layers) {
      std::vector<MapperLayer> one;
      one.push_back(load_mapper_layer(m, l, /*verify=*/false));  // the ridge (any MLP in it is ignored)
      const std::vector<int> selected = one[0].source_layers;
      ServingMapper ridge(m, std::move(one), ctx.backend, {}, {l, 1});
      for (Kind kind : kMappedKinds) {
        const std::string done_file = ck.path(l, kind, "outcome");
        std::optional<std::string> done = read_on_root(group, ck, done_file);
        Outcome o;
        if (done) {
          auto all = deserialise(*done);
          CROSSKV_ASSERT(all.size() == 1 && all[0].layer == l && all[0].d.kind == kind, done_file + ": another unit");
          o = std::move(all[0]);
          ++taken_over;
          progress.add(int64_t{cfg.fit.mlp.epochs} * u.tokens_per_epoch);
        } else {
          o = fit_unit(u, ridge, selected, G_feat, l, kind);
          if (group.rank() == 0) {
            ByteWriter one;
            serialise(o, one);
            ck.write(done_file, one.bytes());
            std::error_code ec;
            fs::remove(ck.path(l, kind, "state"), ec);
          }
        }
        if (group.rank() == 0) serialise(o, bytes);
      }
    }
    progress.finish();
    // One line for the job: units taken over and trainings resumed, summed over the layer groups' first ranks.
    std::vector<double> resumed{group.rank() == 0 ? static_cast<double>(taken_over) : 0.0,
                                group.rank() == 0 ? static_cast<double>(u.resumed) : 0.0};
    ctx.comm.allreduce_sum(resumed.data(), resumed.size());
    if (resumed[0] > 0 || resumed[1] > 0)
      spdlog::info("residual MLPs {}: {:.0f} trained (layer, kind) pair(s) taken over, {:.0f} resumed from an epoch "
                   "checkpoint, from {}", k, resumed[0], resumed[1], ck.dir());
    const std::vector<std::string> all = gather_strings(ctx.comm, bytes.bytes());
    if (ctx.comm.rank() == 0) {
      std::vector<Outcome> outcomes;
      for (const auto& s : all)
        for (auto& o : deserialise(s)) outcomes.push_back(std::move(o));
      write_mapper(m, k, outcomes, cfg, seconds_since(t0), rewritten);
    }
  }
  ctx.comm.barrier();
}

}  // namespace crosskv
