#include "stages/mlp.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <tuple>

#include "apply/transfer.hpp"
#include "core/comm.hpp"
#include "core/log.hpp"
#include "core/mlp.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "io/atomic_file.hpp"
#include "io/mapper.hpp"
#include "io/safetensors.hpp"
#include "io/shard.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

// Whether calibration sequence g (counted over the job's shards in order) is held back for validation.
bool validation_sequence(uint64_t g, const MlpConfig& c) {
  uint64_t z = g + 0x9E3779B97F4A7C15ull * (c.seed + 1);  // splitmix64
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  z ^= z >> 31;
  return static_cast<double>(z >> 11) / static_cast<double>(uint64_t{1} << 53) < c.val_fraction;
}

// One target layer's calibration data in content space: the selected source layers side by side (X) and the
// target layer (Y), keys and values, the rows of training and of validation apart.
struct LayerData {
  std::vector<float> x[2][2], y[2][2];  // [kind: keys, values][split: training, validation]
  int64_t rows[2] = {0, 0};
};

LayerData load_layer_data(const Calibration& cal, const std::vector<int>& sources, int l) {
  const Rope rs(cal.source), rt(cal.target);
  const int64_t F = cal.source.features_per_layer(), G = cal.target.features_per_layer();
  const int64_t K = static_cast<int64_t>(sources.size()) * F;
  LayerData d;
  uint64_t sequence = 0;
  std::vector<uint16_t> raw;
  for (const ShardPair& sh : cal.shards) {
    const ShardReader src(sh.source_path), tgt(sh.target_path);
    const int64_t T = src.header().tokens;
    const auto pos_s = src.positions(), pos_t = tgt.positions();
    const auto offs = src.seq_offsets();
    std::vector<float> xs[2], ys[2], layer(T * F);
    for (int kind = 0; kind < 2; ++kind) {
      xs[kind].resize(T * K);
      for (size_t j = 0; j < sources.size(); ++j) {
        src.read_layer(kind == 0 ? "keys" : "values", sources[j], layer.data(), raw);
        if (kind == 0) rs.strip_block(layer.data(), T, cal.source.n_kv_heads, pos_s.data());
        for (int64_t t = 0; t < T; ++t)
          std::copy_n(layer.data() + t * F, F, xs[kind].data() + t * K + static_cast<int64_t>(j) * F);
      }
      ys[kind].resize(T * G);
      tgt.read_layer(kind == 0 ? "keys" : "values", l, ys[kind].data(), raw);
      if (kind == 0) rt.strip_block(ys[kind].data(), T, cal.target.n_kv_heads, pos_t.data());
    }
    // The rows the fit used: 0, s, 2s, ... (token_stride), `used` of them.
    for (int64_t i = 0; i < sh.used; ++i) {
      const int64_t t = i * cal.cfg.token_stride;
      const auto s = std::upper_bound(offs.begin(), offs.end(), t) - offs.begin() - 1;
      const int split = validation_sequence(sequence + static_cast<uint64_t>(s), cal.cfg.mlp) ? 1 : 0;
      for (int kind = 0; kind < 2; ++kind) {
        d.x[kind][split].insert(d.x[kind][split].end(), xs[kind].begin() + t * K, xs[kind].begin() + (t + 1) * K);
        d.y[kind][split].insert(d.y[kind][split].end(), ys[kind].begin() + t * G, ys[kind].begin() + (t + 1) * G);
      }
      ++d.rows[split];
    }
    sequence += offs.size() - 1;
  }
  return d;
}

// The validation R² a residual MLP must add to be kept (fit.mapper: auto).
constexpr double kMinGain = 1e-3;

// One (target layer, kind)'s outcome.
struct Outcome {
  int layer = 0, kind = 0;
  bool kept = false;
  double mse_ridge = NAN, mse_mlp = NAN, r2_ridge = NAN, r2_mlp = NAN;
  MlpParams params;
};

void put(std::string& s, const void* p, size_t n) { s.append(static_cast<const char*>(p), n); }
std::string serialise(const std::vector<Outcome>& all) {
  std::string s;
  for (const Outcome& o : all) {
    const int32_t head[3] = {o.layer, o.kind, o.kept ? 1 : 0};
    const int64_t shape[3] = {o.params.shape.in, o.params.shape.hidden, o.params.shape.out};
    put(s, head, sizeof head);
    put(s, &o.mse_ridge, 8), put(s, &o.mse_mlp, 8), put(s, &o.r2_ridge, 8), put(s, &o.r2_mlp, 8);
    put(s, shape, sizeof shape);
    if (o.kept) put(s, o.params.flat.data(), o.params.flat.size() * 4);
  }
  return s;
}
std::vector<Outcome> deserialise(const std::string& s) {
  std::vector<Outcome> all;
  size_t at = 0;
  auto get = [&](void* p, size_t n) {
    CROSSKV_ASSERT(at + n <= s.size(), "short MLP message");
    std::memcpy(p, s.data() + at, n);
    at += n;
  };
  while (at < s.size()) {
    Outcome o;
    int32_t head[3];
    int64_t shape[3];
    get(head, sizeof head);
    get(&o.mse_ridge, 8), get(&o.mse_mlp, 8), get(&o.r2_ridge, 8), get(&o.r2_mlp, 8), get(shape, sizeof shape);
    o.layer = head[0], o.kind = head[1], o.kept = head[2] != 0;
    if (o.kept) {
      o.params = MlpParams(MlpShape{shape[0], shape[1], shape[2]});
      get(o.params.flat.data(), o.params.flat.size() * 4);
    }
    all.push_back(std::move(o));
  }
  return all;
}

// Trains and judges both kinds of target layer l of mapper `m`.
std::vector<Outcome> fit_layer(ComputeBackend& be, const Calibration& cal, const MapperManifest& m, int l) {
  const MapperLayer w = load_mapper_layer(m, l, /*verify=*/false);  // the ridge (any MLP in the file is ignored)
  const LayerData d = load_layer_data(cal, w.source_layers, l);
  const int64_t G = m.target.features_per_layer(), K = static_cast<int64_t>(w.source_layers.size()) *
                                                         m.source.features_per_layer();
  const MlpConfig& c = cal.cfg.mlp;
  auto single = make_single_comm();
  std::vector<Outcome> out;
  std::vector<float> scratch;
  for (int kind = 0; kind < 2; ++kind) {
    const std::vector<float>& W = kind == 0 ? w.wk : w.wv;
    const std::vector<float>& b = kind == 0 ? w.bk : w.bv;
    std::vector<float> R[2];  // the ridge's residual, training and validation
    for (int split = 0; split < 2; ++split) {
      const int64_t n = d.rows[split];
      R[split].assign(n * G, 0.0f);
      map_one_layer(be, d.x[kind][split].data(), K, {0}, K, W.data(), b.data(), G, n, R[split].data(), G, scratch);
      for (int64_t i = 0; i < n * G; ++i) R[split][i] = d.y[kind][split][i] - R[split][i];
    }
    // Trained on standardised features (the keys' large-mean channels would otherwise swamp the first layer), then
    // the standardisation is folded into W1 and b1: the artifact applies f to the features as they are.
    std::vector<double> mean(K, 0.0), inv_sd(K, 0.0);
    const int64_t n0 = std::max<int64_t>(d.rows[0], 1);
    for (int64_t t = 0; t < d.rows[0]; ++t)
      for (int64_t i = 0; i < K; ++i) mean[i] += d.x[kind][0][t * K + i] / static_cast<double>(n0);
    for (int64_t t = 0; t < d.rows[0]; ++t)
      for (int64_t i = 0; i < K; ++i) {
        const double e = d.x[kind][0][t * K + i] - mean[i];
        inv_sd[i] += e * e / static_cast<double>(n0);
      }
    for (auto& v : inv_sd) v = v > 1e-12 ? 1.0 / std::sqrt(v) : 1.0;
    std::vector<float> z[2];
    for (int split = 0; split < 2; ++split) {
      z[split] = d.x[kind][split];
      for (int64_t t = 0; t < d.rows[split]; ++t)
        for (int64_t i = 0; i < K; ++i)
          z[split][t * K + i] = static_cast<float>((z[split][t * K + i] - mean[i]) * inv_sd[i]);
    }
    MlpTraining t;
    t.epochs = c.epochs, t.batch_tokens = c.batch_tokens, t.seed = c.seed * 1000003 + static_cast<uint64_t>(2 * l + kind);
    t.adam.lr = c.lr, t.adam.weight_decay = c.weight_decay;
    MlpTrained trained = train_residual_mlp(be, *single, MlpShape{K, c.hidden, G}, z[0].data(), R[0].data(),
                                            d.rows[0], t);
    Outcome o;
    o.layer = l, o.kind = kind;
    if (d.rows[1] > 0) {
      MlpWorkspace ws;
      mlp_forward(be, trained.params, z[1].data(), d.rows[1], ws);
      double er = 0, em = 0;
      for (int64_t i = 0; i < d.rows[1] * G; ++i) {
        er += double(R[1][i]) * R[1][i];
        em += (double(R[1][i]) - ws.out[i]) * (double(R[1][i]) - ws.out[i]);
      }
      o.mse_ridge = er / static_cast<double>(d.rows[1] * G), o.mse_mlp = em / static_cast<double>(d.rows[1] * G);
      // The validation targets' variance (about each column's mean) turns both into R².
      double sst = 0;
      const std::vector<float>& y = d.y[kind][1];
      for (int64_t col = 0; col < G; ++col) {
        double mean = 0;
        for (int64_t r = 0; r < d.rows[1]; ++r) mean += y[r * G + col] / static_cast<double>(d.rows[1]);
        for (int64_t r = 0; r < d.rows[1]; ++r) sst += (y[r * G + col] - mean) * (y[r * G + col] - mean);
      }
      if (sst > 0) o.r2_ridge = 1 - er / sst, o.r2_mlp = 1 - em / sst;
    }
    // auto: kept where it raises the validation R² by at least kMinGain (not for a rounding-sized gain).
    o.kept = cal.cfg.mapper == MapperKind::mlp || (o.r2_mlp >= o.r2_ridge + kMinGain);
    if (o.kept) {  // relu(((x - mean) * inv_sd) W1 + b1) = relu(x W1' + b1')
      MlpParams& p = trained.params;
      const int64_t H = p.shape.hidden;
      for (int64_t j = 0; j < H; ++j) {
        double shift = 0;
        for (int64_t i = 0; i < K; ++i) shift += mean[i] * inv_sd[i] * p.w1()[i * H + j];
        p.b1()[j] = static_cast<float>(p.b1()[j] - shift);
      }
      for (int64_t i = 0; i < K; ++i)
        for (int64_t j = 0; j < H; ++j) p.w1()[i * H + j] = static_cast<float>(p.w1()[i * H + j] * inv_sd[i]);
      o.params = std::move(p);
    }
    out.push_back(std::move(o));
  }
  return out;
}

nlohmann::json finite_or_null(double x) { return std::isfinite(x) ? nlohmann::json(x) : nlohmann::json(nullptr); }

// Rank 0: the layer file of l rewritten with its ridge tensors (as stored) and the kept MLPs; the manifest entry.
void write_layer(const std::string& dir, nlohmann::json& entry, const std::vector<const Outcome*>& kinds) {
  const std::string file = (fs::path(dir) / entry["file"].get<std::string>()).string();
  const auto t = read_safetensors(file);
  std::vector<std::vector<uint16_t>> halves;
  std::vector<TensorOut> out;
  for (const char* name : {"k.weight", "k.bias", "v.weight", "v.bias"}) {
    const TensorIn& x = t.at(name);
    if (x.dtype == "F32") {
      out.push_back({name, "F32", x.shape, x.values.data(), x.values.size() * 4});
    } else {  // bf16 / fp16 bits again: the fp32 values read are exact conversions of them
      halves.emplace_back(x.values.size());
      to_half_on_host(x.values.data(), static_cast<int64_t>(x.values.size()), x.dtype == "BF16", halves.back().data());
      out.push_back({name, x.dtype, x.shape, halves.back().data(), halves.back().size() * 2});
    }
  }
  nlohmann::json mlp = nlohmann::json::object();
  for (const Outcome* o : kinds) {
    const std::string kind = o->kind == 0 ? "k" : "v";
    mlp[kind] = {{"kept", o->kept},
                 {"val_mse_ridge", finite_or_null(o->mse_ridge)},
                 {"val_mse_mlp", finite_or_null(o->mse_mlp)},
                 {"val_r2_ridge", finite_or_null(o->r2_ridge)},
                 {"val_r2_mlp", finite_or_null(o->r2_mlp)}};
    if (!o->kept) continue;
    const MlpParams& p = o->params;
    const int64_t in = p.shape.in, h = p.shape.hidden, g = p.shape.out;
    mlp[kind]["hidden"] = h;
    for (auto [name, shape, data] : {std::tuple{".mlp.w1", std::vector<int64_t>{in, h}, p.w1()},
                                     {".mlp.b1", std::vector<int64_t>{h}, p.b1()},
                                     {".mlp.w2", std::vector<int64_t>{h, h}, p.w2()},
                                     {".mlp.b2", std::vector<int64_t>{h}, p.b2()},
                                     {".mlp.w3", std::vector<int64_t>{h, g}, p.w3()},
                                     {".mlp.b3", std::vector<int64_t>{g}, p.b3()}}) {
      int64_t count = 1;
      for (auto s : shape) count *= s;
      out.push_back({kind + name, "F32", shape, data, static_cast<size_t>(count) * 4});
    }
  }
  std::string csv;
  for (const auto& a : entry["source_layers"]) csv += (csv.empty() ? "" : ",") + std::to_string(a.get<int>());
  write_safetensors(file, out, {{"format", "crosskv-mapper"},
                                {"target_layer", std::to_string(entry["target_layer"].get<int>())},
                                {"source_layers", csv}});
  entry["sha256"] = sha256_file(file);
  entry["mlp"] = mlp;
}

}  // namespace

void fit_residual_mlps(Context& ctx, const Calibration& cal, const std::vector<std::string>& artifacts) {
  const FitConfig& cfg = cal.cfg;
  if (cfg.mapper == MapperKind::ridge) return;
  const int P = ctx.comm.size(), rank = ctx.comm.rank();
  for (const std::string& dir : artifacts) {
    const MapperManifest m = read_mapper_manifest(dir);
    const std::string k = fs::path(dir).filename().string();
    std::vector<Outcome> mine;
    const std::string bytes = agreed(ctx.comm, [&] {
      Progress progress(P > 1 ? "residual MLPs " + k + " (this rank's layers)" : "residual MLPs " + k,
                        (m.target.n_layers + P - 1 - rank) / P, 0, "layers");
      for (int l = rank; l < m.target.n_layers; l += P) {
        for (auto& o : fit_layer(ctx.backend, cal, m, l)) mine.push_back(std::move(o));
        progress.add(1);
      }
      progress.finish();
      return serialise(mine);
    });
    const std::vector<std::string> all = gather_strings(ctx.comm, bytes);
    if (rank != 0) continue;
    std::vector<Outcome> outcomes;
    for (const auto& s : all)
      for (auto& o : deserialise(s)) outcomes.push_back(std::move(o));
    std::ifstream in((fs::path(dir) / "manifest.json").string());
    nlohmann::json manifest = nlohmann::json::parse(in);
    int kept[2] = {0, 0};
    for (auto& entry : manifest["layers"]) {
      std::vector<const Outcome*> kinds;
      for (const Outcome& o : outcomes)
        if (o.layer == entry["target_layer"].get<int>()) kinds.push_back(&o), kept[o.kind] += o.kept;
      std::sort(kinds.begin(), kinds.end(), [](const Outcome* a, const Outcome* b) { return a->kind < b->kind; });
      write_layer(dir, entry, kinds);
    }
    manifest["fit"]["mapper"] = mapper_kind_name(cfg.mapper);
    manifest["fit"]["mlp"] = {{"hidden", cfg.mlp.hidden},           {"epochs", cfg.mlp.epochs},
                              {"lr", cfg.mlp.lr},                   {"batch_tokens", cfg.mlp.batch_tokens},
                              {"weight_decay", cfg.mlp.weight_decay}, {"val_fraction", cfg.mlp.val_fraction},
                              {"seed", cfg.mlp.seed}};
    write_file_atomic((fs::path(dir) / "manifest.json").string(), manifest.dump(2) + "\n");
    spdlog::info("residual MLPs {}: kept for {} of {} target layers' keys and {} of their values ({})", k, kept[0],
                 m.target.n_layers, kept[1], mapper_kind_name(cfg.mapper));
  }
  ctx.comm.barrier();
}

}  // namespace crosskv
