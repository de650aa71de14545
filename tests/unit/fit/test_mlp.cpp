// The residual MLP's core: gradients against finite differences of an fp64 reference, the zero-initialised
// last layer (training starts at the ridge fit), determinism, and a planted non-linearity that ridge leaves short
// and the MLP learns on held-out tokens.
#include <cmath>
#include <fstream>
#include <map>
#include <random>
#include <tuple>

#include "backends/backends.hpp"
#include "core/mlp.hpp"
#include "fit/mlp_checkpoint.hpp"
#include "fit/mlp_training.hpp"
#include "core/thread_comm.hpp"
#include "helpers.hpp"
#include "artifact/mapper.hpp"
#include "io/shard.hpp"
#include "scalar_oracle.hpp"
#include "serve/transfer.hpp"
#include "eval/held_out.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

std::vector<float> randn(int64_t n, uint64_t seed, float scale = 1.0f) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, scale);
  std::vector<float> v(static_cast<size_t>(n));
  for (auto& x : v) x = d(rng);
  return v;
}

// The loss of MlpParams p in fp64, by loops: the reference the backend's gradient is checked against.
double reference_loss(const MlpParams& p, const std::vector<double>& flat, const std::vector<float>& X,
                      const std::vector<float>& R, int64_t rows) {
  const MlpShape& s = p.shape;
  const double* w1 = flat.data();
  const double* b1 = w1 + s.in * s.hidden;
  const double* w2 = b1 + s.hidden;
  const double* b2 = w2 + s.hidden * s.hidden;
  const double* w3 = b2 + s.hidden;
  const double* b3 = w3 + s.hidden * s.out;
  double loss = 0;
  std::vector<double> h1(s.hidden), h2(s.hidden);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < s.hidden; ++j) {
      double a = b1[j];
      for (int64_t i = 0; i < s.in; ++i) a += X[r * s.in + i] * w1[i * s.hidden + j];
      h1[j] = std::max(a, 0.0);
    }
    for (int64_t j = 0; j < s.hidden; ++j) {
      double a = b2[j];
      for (int64_t i = 0; i < s.hidden; ++i) a += h1[i] * w2[i * s.hidden + j];
      h2[j] = std::max(a, 0.0);
    }
    for (int64_t j = 0; j < s.out; ++j) {
      double a = b3[j];
      for (int64_t i = 0; i < s.hidden; ++i) a += h2[i] * w3[i * s.out + j];
      loss += (a - R[r * s.out + j]) * (a - R[r * s.out + j]);
    }
  }
  return loss;
}

}  // namespace

TEST(Mlp, GradientsMatchFiniteDifferencesOfAnFp64Reference) {
  auto be = make_cpu_backend();
  const MlpShape s{6, 5, 4};
  const int64_t rows = 9;
  MlpParams p(s);
  p.flat = randn(s.parameters(), 1, 0.5f);  // every layer non-zero, so every gradient is
  const auto X = randn(rows * s.in, 2), R = randn(rows * s.out, 3);
  MlpParams grad(s);
  MlpWorkspace ws;
  const double loss = mlp_loss_and_gradient(*be, p, X.data(), R.data(), rows, grad, ws);
  std::vector<double> flat(p.flat.begin(), p.flat.end());
  EXPECT_NEAR(loss, reference_loss(p, flat, X, R, rows), 1e-5 * loss);
  const double h = 1e-5;
  for (size_t i = 0; i < flat.size(); ++i) {
    auto f = flat;
    f[i] += h;
    const double up = reference_loss(p, f, X, R, rows);
    f[i] -= 2 * h;
    const double down = reference_loss(p, f, X, R, rows);
    const double fd = (up - down) / (2 * h);
    EXPECT_NEAR(grad.flat[i], fd, 1e-3 * (1 + std::fabs(fd))) << "parameter " << i;
  }
  // Gradients add up over batches: two halves give the whole.
  MlpParams halves(s);
  mlp_loss_and_gradient(*be, p, X.data(), R.data(), 4, halves, ws);
  mlp_loss_and_gradient(*be, p, X.data() + 4 * s.in, R.data() + 4 * s.out, rows - 4, halves, ws);
  for (size_t i = 0; i < flat.size(); ++i) EXPECT_NEAR(halves.flat[i], grad.flat[i], 1e-4 * (1 + std::fabs(grad.flat[i])));
}

TEST(Mlp, TrainingStartsExactlyAtTheRidgeFit) {
  auto be = make_cpu_backend();
  const MlpShape s{8, 16, 4};
  const MlpParams p = MlpParams::initial(s, 7);
  const auto X = randn(32 * s.in, 4);
  MlpWorkspace ws;
  mlp_forward(*be, p, X.data(), 32, ws);
  for (float y : ws.out) ASSERT_EQ(y, 0.0f);  // the residual is zero: ridge alone
  // The same seed, the same bits; another seed, other weights.
  EXPECT_EQ(MlpParams::initial(s, 7).flat, p.flat);
  EXPECT_NE(MlpParams::initial(s, 8).flat, p.flat);
}

namespace {

// The planted pair of crosskv-synth --relation nonlinear: values of target layer 0 are a linear map of source layer
// 0 plus a ReLU layer of it. Ridge (k = 1) is fitted; X are the source values of layer 0, R the target's less the
// ridge's prediction, for the calibration tokens (c) and held-out ones (h); Yh the held-out target values.
struct Planted {
  TempDir tmp;
  int64_t F = 0, G = 0, rows = 0, held = 0;
  std::vector<float> Xc, Rc, Xh, Rh, Yh;
  Planted() {
    for (auto [dir, seed, domain] : {std::tuple{"cal", uint64_t{0}, "web"}, {"held", uint64_t{99}, "held"}}) {
      SynthOptions o = small_synth(tmp.str(dir), 31);
      o.relation = SynthRelation::nonlinear, o.data_seed = seed, o.domains = {domain};
      o.sequences_per_shard = 8, o.seq_len = 256;
      synthesize(o);
    }
    fit_yaml(config_yaml(tmp.str("cal"), "{k: [1], lambda: 0.001}"));
    const MapperManifest m = read_mapper_manifest(tmp.str("cal/out/k1"));
    const MapperLayer w = load_mapper_layer(m, 0);
    EXPECT_EQ(w.source_layers, std::vector<int>{0});
    F = m.source.features_per_layer(), G = m.target.features_per_layer();
    rows = load(w, {"cal/source/web/shard-000.h5", "cal/source/web/shard-001.h5"}, Xc, Rc, nullptr);
    held = load(w, {"held/source/held/shard-000.h5"}, Xh, Rh, &Yh);
  }
  int64_t load(const MapperLayer& w, const std::vector<std::string>& shards, std::vector<float>& X,
               std::vector<float>& R, std::vector<float>* Y) {
    std::vector<uint16_t> raw;
    int64_t n = 0;
    for (const auto& path : shards) {
      std::string target = tmp.str(path);
      target.replace(target.rfind("/source/"), 8, "/target/");
      ShardReader src(tmp.str(path)), tgt(target);
      const int64_t T = src.header().tokens;
      std::vector<float> x(T * F), y(T * G);
      src.read_layer("values", 0, x.data(), raw);
      tgt.read_layer("values", 0, y.data(), raw);
      if (Y) Y->insert(Y->end(), y.begin(), y.end());
      for (int64_t t = 0; t < T; ++t)
        for (int64_t c = 0; c < G; ++c) {
          double pred = w.bv[c];
          for (int64_t i = 0; i < F; ++i) pred += double(x[t * F + i]) * w.wv[i * G + c];
          y[t * G + c] -= static_cast<float>(pred);
        }
      X.insert(X.end(), x.begin(), x.end());
      R.insert(R.end(), y.begin(), y.end());
      n += T;
    }
    return n;
  }
  // Held-out R² of the values: ridge alone, and ridge + the MLP p.
  std::pair<double, double> r2(ComputeBackend& be, const MlpParams& p) const {
    MlpWorkspace ws;
    mlp_forward(be, p, Xh.data(), held, ws);
    double sst = 0, sse_ridge = 0, sse_mlp = 0;
    for (int64_t c = 0; c < G; ++c) {
      double mean = 0;
      for (int64_t t = 0; t < held; ++t) mean += Yh[t * G + c] / double(held);
      for (int64_t t = 0; t < held; ++t) {
        sst += (Yh[t * G + c] - mean) * (Yh[t * G + c] - mean);
        sse_ridge += double(Rh[t * G + c]) * Rh[t * G + c];
        const double e = double(Rh[t * G + c]) - ws.out[t * G + c];
        sse_mlp += e * e;
      }
    }
    return {1 - sse_ridge / sst, 1 - sse_mlp / sst};
  }
};

MlpTraining training(int epochs) {
  MlpTraining t;
  t.epochs = epochs, t.batch_tokens = 256, t.seed = 5;
  t.adam.lr = 3e-3, t.adam.weight_decay = 1e-4;
  return t;
}

}  // namespace

// Ridge (k = 1) leaves R² clearly short of 1 on held-out tokens; the residual MLP, trained on the calibration
// tokens' ridge residual, raises it. Training twice gives the same bits.
TEST(Mlp, ResidualMlpLearnsWhatRidgeLeavesOfAPlantedNonlinearity) {
  Planted d;
  auto be = make_cpu_backend();
  auto comm = make_single_comm();
  const MlpShape s{d.F, 64, d.G};
  const MlpTrained m = train_residual_mlp(*be, *comm, s, d.Xc.data(), d.Rc.data(), d.rows, training(30));
  const auto [r2_ridge, r2_mlp] = d.r2(*be, m.params);
  std::printf("held-out R2 of target layer 0's values: ridge %.4f, ridge + MLP %.4f (training MSE %.4f -> %.4f)\n",
              r2_ridge, r2_mlp, m.epoch_mse.front(), m.epoch_mse.back());
  EXPECT_LT(r2_ridge, 0.95);
  EXPECT_GT(r2_mlp, r2_ridge + 0.05);
  EXPECT_LT(m.epoch_mse.back(), 0.5 * m.epoch_mse.front());
  EXPECT_EQ(m.steps, 30 * ((d.rows + 255) / 256));
  const auto again = train_residual_mlp(*be, *comm, s, d.Xc.data(), d.Rc.data(), d.rows, training(2));
  EXPECT_EQ(again.params.flat,
            train_residual_mlp(*be, *comm, s, d.Xc.data(), d.Rc.data(), d.rows, training(2)).params.flat);
}

// Data-parallel: the tokens split over 2 or 3 ranks (unequal shares), gradients summed in a fixed order. Every rank
// ends with the same bits, the same job gives them again, and the model is as good as one rank's.
TEST(Mlp, TrainingOverRanksGivesEveryRankTheSameWeights) {
  Planted d;
  const MlpShape s{d.F, 64, d.G};
  for (int ranks : {2, 3}) {
    std::vector<std::vector<float>> first(ranks), second(ranks);
    for (auto* out : {&first, &second})
      run_ranks(ranks, [&](Comm& comm) {
        auto be = make_cpu_backend();
        // Rank r takes a contiguous share, the last one smaller.
        const int64_t share = (d.rows + ranks) / ranks, r0 = std::min(d.rows, comm.rank() * share),
                      n = std::min(d.rows, r0 + share) - r0;
        const auto m = train_residual_mlp(*be, comm, s, d.Xc.data() + r0 * s.in, d.Rc.data() + r0 * s.out, n,
                                          training(10));
        (*out)[comm.rank()] = m.params.flat;
        if (comm.rank() == 0) {
          MlpParams p(s);
          p.flat = m.params.flat;
          const auto [r2_ridge, r2_mlp] = d.r2(*be, p);
          EXPECT_GT(r2_mlp, r2_ridge + 0.05) << ranks << " ranks";
        }
      });
    for (int r = 1; r < ranks; ++r) EXPECT_EQ(first[r], first[0]) << "rank " << r << " of " << ranks;
    EXPECT_EQ(second[0], first[0]) << "the same job on " << ranks << " ranks, twice";
  }
}

// ---- The stage (fit.mapper: auto | mlp): a planted non-linearity gets residual MLPs that raise held-out R² and
// the attention cosine; an exactly linear pair keeps ridge; the same job writes the same bytes.
namespace {

struct StageRun {
  std::map<std::string, double> figures;
  nlohmann::json manifest;
  std::vector<std::string> hashes;
};

StageRun fit_and_eval(const TempDir& tmp, const std::string& data, const std::string& mapper, const std::string& out) {
  const FitResult fit = fit_yaml(config_yaml(tmp.str(data), "{k: [1], lambda: 0.001, mapper: " + mapper +
                                                                ", mlp: {hidden: 64, epochs: 30, val_fraction: 0.2}}",
                                             out));
  // The plan names the MLPs' size, flops and memory when there are any.
  EXPECT_EQ(fit.plan_text.find("residual MLPs (fit.mapper: " + mapper + "): 64 hidden") != std::string::npos,
            mapper != "ridge")
      << fit.plan_text;
  StageRun r;
  const std::string dir = tmp.str(data + "/" + out + "/k1");
  std::ifstream(dir + "/manifest.json") >> r.manifest;
  for (const auto& l : r.manifest["layers"]) r.hashes.push_back(l["sha256"]);
  auto be = make_cpu_backend();
  auto comm = make_single_comm();
  const HeldOut h{{tmp.str(data + "-held/source/held/shard-000.h5")}, {tmp.str(data + "-held/target/held/shard-000.h5")},
                  "held"};
  const Evaluation ev = evaluate_mappers({dir}, h, *be, *comm, true)[0].evaluation;
  r.figures = {{"r2_k", ev.mapper.r2_k}, {"r2_v", ev.mapper.r2_v}, {"cosine", *ev.mapper.attention_cosine}};
  EXPECT_EQ(ev.ridge_only.has_value(), mapper != "ridge");  // side by side: the same mapper without its MLPs
  if (ev.ridge_only)
    r.figures.insert({{"ridge_r2_k", ev.ridge_only->r2_k}, {"ridge_cosine", *ev.ridge_only->attention_cosine}});
  // The streamed eval applies the MLPs as the Transfer library does (the oracle's path).
  Transfer tr(dir, *be);
  const Evaluation want = evaluate(tr, read_caches(h.source_shards, false), read_caches(h.target_shards, true));
  EXPECT_NEAR(ev.mapper.r2_k, want.mapper.r2_k, 1e-5);
  EXPECT_NEAR(ev.mapper.r2_v, want.mapper.r2_v, 1e-5);
  EXPECT_NEAR(*ev.mapper.attention_cosine, *want.mapper.attention_cosine, 1e-5);
  EXPECT_NEAR(ev.mean_only.r2_k, want.mean_only.r2_k, 1e-5);
  return r;
}

void synth_pair(const TempDir& tmp, const std::string& name, SynthRelation rel) {
  for (auto [dir, seed, domain] : {std::tuple{name, uint64_t{0}, "web"}, {name + "-held", uint64_t{99}, "held"}}) {
    SynthOptions o = small_synth(tmp.str(dir), 31);
    o.relation = rel, o.data_seed = seed, o.domains = {domain}, o.with_queries = true;
    o.sequences_per_shard = 8, o.seq_len = 256, o.shards_per_domain = domain == std::string("held") ? 1 : 2;
    synthesize(o);
  }
}

}  // namespace

TEST(MlpStage, AutoKeepsResidualMlpsWhereTheyHelpAndTheyRaiseHeldOutFigures) {
  TempDir tmp;
  synth_pair(tmp, "nl", SynthRelation::nonlinear);
  const StageRun ridge = fit_and_eval(tmp, "nl", "ridge", "out-ridge");
  const StageRun mlp = fit_and_eval(tmp, "nl", "auto", "out-auto");
  EXPECT_FALSE(ridge.manifest["layers"][0].contains("mlp"));  // ridge: the artifact as before
  EXPECT_FALSE(ridge.manifest["fit"].contains("mapper"));
  EXPECT_EQ(mlp.manifest["fit"]["mapper"], "auto");
  int kept = 0;
  for (const auto& l : mlp.manifest["layers"])
    for (const char* kind : {"k", "v"}) {
      const auto& d = l["mlp"][kind];
      ASSERT_TRUE(d["val_mse_ridge"].is_number() && d["val_r2_mlp"].is_number()) << l.dump();
      EXPECT_EQ(d["kept"].get<bool>(), d["val_r2_mlp"].get<double>() >= d["val_r2_ridge"].get<double>() + 1e-3);
      kept += d["kept"].get<bool>();
    }
  EXPECT_GE(kept, 12) << "of 16 (8 layers x 2 kinds)";
  std::printf("held-out, ridge -> ridge + MLP (auto): R2 k %.4f -> %.4f, v %.4f -> %.4f, cosine %.4f -> %.4f\n",
              ridge.figures.at("r2_k"), mlp.figures.at("r2_k"), ridge.figures.at("r2_v"), mlp.figures.at("r2_v"),
              ridge.figures.at("cosine"), mlp.figures.at("cosine"));
  EXPECT_GT(mlp.figures.at("r2_k"), ridge.figures.at("r2_k") + 0.02);
  EXPECT_GT(mlp.figures.at("r2_v"), ridge.figures.at("r2_v") + 0.02);
  EXPECT_GT(mlp.figures.at("cosine"), ridge.figures.at("cosine"));
  // "Ridge alone" in the MLP fit's eval is the ridge fit's mapper: the same ridge weights.
  EXPECT_NEAR(mlp.figures.at("ridge_r2_k"), ridge.figures.at("r2_k"), 1e-6);
  EXPECT_NEAR(mlp.figures.at("ridge_cosine"), ridge.figures.at("cosine"), 1e-6);
  // The same job again: the same bytes.
  EXPECT_EQ(fit_and_eval(tmp, "nl", "auto", "out-auto2").hashes, mlp.hashes);
}

TEST(MlpStage, AutoKeepsRidgeOnAnExactlyLinearPair) {
  TempDir tmp;
  synth_pair(tmp, "lin", SynthRelation::linear);
  const StageRun r = fit_and_eval(tmp, "lin", "auto", "out");
  for (const auto& l : r.manifest["layers"])
    for (const char* kind : {"k", "v"}) EXPECT_FALSE(l["mlp"][kind]["kept"].get<bool>()) << l["mlp"].dump();
  EXPECT_GT(r.figures.at("r2_v"), 0.999);
}

// Over ranks (threads): layer l to layer group l mod G, its token groups training data-parallel. Every rank's layer
// files are those rank 0 wrote (one set), the same job twice gives the same bytes, and any grid's validation scores
// agree with one rank's (other batches, not other bits only: within a few 0.01).
TEST(MlpStage, LayerAndTokenGroupsRepeatByteForByteAndAgreeWithOneRank) {
  TempDir tmp;
  synth_pair(tmp, "nl", SynthRelation::nonlinear);
  const std::string fit = "{k: [1], lambda: 0.001, mapper: auto, mlp: {hidden: 32, epochs: 8, val_fraction: 0.2}}";
  fit_yaml(config_yaml(tmp.str("nl"), fit, "one"));
  const auto one = nlohmann::json::parse(file_bytes(tmp.str("nl/one/k1/manifest.json")));
  for (const std::string runtime : {"{block_tokens: 200}", "{block_tokens: 200, layer_groups: 2}"}) {
    SCOPED_TRACE(runtime);
    for (const char* out : {"a", "b"}) {
      const std::string yaml = "source: {store: " + tmp.str("nl/source") + "}\ntarget: {store: " +
                               tmp.str("nl/target") + "}\nfit: " + fit + "\noutput: {dir: " + tmp.str(out) +
                               "}\nruntime: " + runtime + "\n";
      fs::remove_all(tmp.str(out));
      run_ranks(2, [&](Comm& comm) {
        auto be = make_cpu_backend();
        Context ctx{comm, *be};
        run_fit(parse_fit_config(yaml, "cfg.yaml"), FitOptions{}, ctx);
      });
    }
    const auto a = nlohmann::json::parse(file_bytes(tmp.str("a/k1/manifest.json")));
    const auto b = nlohmann::json::parse(file_bytes(tmp.str("b/k1/manifest.json")));
    EXPECT_EQ(a["layers"], b["layers"]);  // names, SHA-256s, decisions and scores
    EXPECT_EQ(a["grid"]["layer_groups"], runtime.find("layer_groups") == std::string::npos ? 1 : 2);
    for (const auto& e : a["layers"]) {
      const std::string f = e["file"];
      EXPECT_TRUE(file_bytes(tmp.str("a/k1/" + f)) == file_bytes(tmp.str("b/k1/" + f))) << f;
      const auto& o = one["layers"][e["target_layer"].get<int>()]["mlp"];
      for (const char* kind : {"k", "v"}) {
        EXPECT_NEAR(e["mlp"][kind]["val_r2_ridge"].get<double>(), o[kind]["val_r2_ridge"].get<double>(), 1e-3) << f;
        EXPECT_NEAR(e["mlp"][kind]["val_r2_mlp"].get<double>(), o[kind]["val_r2_mlp"].get<double>(), 0.03) << f;
      }
    }
  }
}

// A training state's bytes (fit/mlp_checkpoint): read back bit for bit; a short one, a cut one, or one of another
// shape is no state (the training starts over) rather than a crash.
TEST(MlpCheckpoint, AStateComesBackBitForBitAndABrokenOneIsNone) {
  const MlpShape s{3, 4, 2};
  const size_t n = static_cast<size_t>(s.parameters());
  const MlpTrained t{MlpParams::initial(s, 7), {0.5, 0.25, NAN}, 11, std::vector<float>(n, 1.5f),
                     std::vector<float>(n, 2.5f), false};
  const std::string bytes = serialise_state(t);
  EXPECT_EQ(bytes.size(), 24 + 3 * 8 + 3 * n * 4) << "the layout of every checkpoint written before";
  const auto back = deserialise_state(bytes, s);
  ASSERT_TRUE(back);
  EXPECT_EQ(back->params.flat, t.params.flat);
  EXPECT_EQ(back->steps, 11);
  ASSERT_EQ(back->epoch_mse.size(), 3u);
  EXPECT_EQ(back->epoch_mse[1], 0.25);
  EXPECT_TRUE(std::isnan(back->epoch_mse[2]));
  EXPECT_EQ(back->adam_m, t.adam_m);
  EXPECT_EQ(back->adam_v, t.adam_v);
  EXPECT_FALSE(deserialise_state(bytes.substr(0, 10), s));
  EXPECT_FALSE(deserialise_state(bytes.substr(0, bytes.size() - 4), s));
  EXPECT_FALSE(deserialise_state(bytes, MlpShape{3, 5, 2}));
}
