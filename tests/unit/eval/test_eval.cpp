// Held-out diagnostics at scale: the GEMM-based, per-layer diagnostics (eval/layer_diagnostics) and the streamed,
// rank-shared evaluation (eval/held_out) against the scalar oracle (tests/scalar_oracle: diagnose and evaluate).
#include <cmath>
#include <map>
#include <random>

#include "scalar_oracle.hpp"
#include "eval/layer_diagnostics.hpp"
#include "serve/transfer.hpp"
#include "backends/backends.hpp"
#include "core/thread_comm.hpp"
#include "helpers.hpp"
#include "artifact/mapper.hpp"
#include "eval/held_out.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

// Random caches with grouped queries and RoPE, sequences of several lengths (one of a single token).
Cache random_cache(int L, int H, int Hq, int D, const std::vector<int64_t>& seq_offsets, uint64_t seed) {
  Cache c;
  c.spec.n_layers = L, c.spec.n_kv_heads = H, c.spec.n_q_heads = Hq, c.spec.head_dim = D;
  c.spec.rope.type = "default", c.spec.rope.theta = 10000, c.spec.rope.rotary_dim = D;
  c.seq_offsets = seq_offsets;
  c.tokens = seq_offsets.back();
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0, 1);
  c.keys.resize(c.tokens * L * H * D);
  c.values.resize(c.keys.size());
  c.queries.resize(c.tokens * L * Hq * D);
  for (auto* v : {&c.keys, &c.values, &c.queries})
    for (auto& x : *v) x = n(rng);
  for (size_t s = 0; s + 1 < seq_offsets.size(); ++s)
    for (int64_t t = seq_offsets[s]; t < seq_offsets[s + 1]; ++t) c.positions.push_back(int32_t(t - seq_offsets[s]));
  return c;
}

std::vector<float> noisy(const std::vector<float>& v, float sigma, uint64_t seed) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> n(0, sigma);
  auto out = v;
  for (auto& x : out) x += n(rng);
  return out;
}

// Columns of layer l of a [T x L*width] cache: [T x width].
std::vector<float> layer_of(const std::vector<float>& all, int64_t T, int L, int64_t width, int l) {
  std::vector<float> out(T * width);
  for (int64_t t = 0; t < T; ++t)
    std::copy_n(all.data() + (t * L + l) * width, width, out.data() + t * width);
  return out;
}

LayerTruth truth_of(const Cache& c, int l) {
  const int64_t G = c.spec.features_per_layer(), QW = int64_t{c.spec.n_q_heads} * c.spec.head_dim;
  LayerTruth t;
  t.layer = l, t.spec = c.spec, t.tokens = c.tokens;
  t.positions = c.positions.data(), t.seq_offsets = c.seq_offsets.data();
  t.sequences = int64_t(c.seq_offsets.size()) - 1;
  t.keys = layer_of(c.keys, c.tokens, c.spec.n_layers, G, l);
  t.values = layer_of(c.values, c.tokens, c.spec.n_layers, G, l);
  if (!c.queries.empty()) t.queries = layer_of(c.queries, c.tokens, c.spec.n_layers, QW, l);
  return t;
}

// Every figure of two diagnostics of a layer within tolerances that follow from fp32 GEMMs against fp64 loops:
// R² to 1e-6 (fp64 sums of fp32 predictions, which a mapper's GEMM makes to fp32 rounding, in an order that
// depends on BLAS's threads); attention cosine to 1e-5; concentrations (ratios of fp32 second moments) to 1e-4
// relative.
void expect_layer_near(const LayerDiagnostics& got, const LayerDiagnostics& want, const std::string& what) {
  SCOPED_TRACE(what + ", layer " + std::to_string(want.layer));
  auto near = [](const std::vector<double>& a, const std::vector<double>& b, double abs, double rel, const char* n) {
    ASSERT_EQ(a.size(), b.size()) << n;
    for (size_t i = 0; i < a.size(); ++i)
      if (std::isnan(b[i]))
        EXPECT_TRUE(std::isnan(a[i])) << n << "[" << i << "]";
      else
        EXPECT_NEAR(a[i], b[i], abs + rel * std::fabs(b[i])) << n << "[" << i << "]";
  };
  EXPECT_EQ(got.layer, want.layer);
  near(got.r2_k, want.r2_k, 1e-6, 0, "r2_k");
  near(got.r2_v, want.r2_v, 1e-6, 0, "r2_v");
  near(got.cosine, want.cosine, 1e-5, 0, "cosine");
  near(got.k_concentration, want.k_concentration, 1e-6, 1e-4, "k_concentration");
  near(got.v_concentration, want.v_concentration, 1e-6, 1e-4, "v_concentration");
}

void expect_diagnostics_near(const Diagnostics& got, const Diagnostics& want, const std::string& what) {
  ASSERT_EQ(got.layers.size(), want.layers.size()) << what;
  for (size_t l = 0; l < want.layers.size(); ++l) expect_layer_near(got.layers[l], want.layers[l], what);
  EXPECT_EQ(got.tokens, want.tokens);
  EXPECT_NEAR(got.r2_k, want.r2_k, 1e-6) << what;
  EXPECT_NEAR(got.r2_v, want.r2_v, 1e-6) << what;
  ASSERT_EQ(got.attention_cosine.has_value(), want.attention_cosine.has_value()) << what;
  if (want.attention_cosine) {
    EXPECT_NEAR(*got.attention_cosine, *want.attention_cosine, 1e-5) << what;
    EXPECT_NEAR(*got.k_concentration, *want.k_concentration, 1e-4 * std::fabs(*want.k_concentration)) << what;
    EXPECT_NEAR(*got.v_concentration, *want.v_concentration, 1e-4 * std::fabs(*want.v_concentration)) << what;
  }
}

}  // namespace

TEST(LayerDiagnostics, EveryFigureMatchesTheScalarOracle) {
  const Cache c = random_cache(3, 2, 6, 16, {0, 90, 91, 250}, 11);
  auto be = make_cpu_backend();
  // A good prediction, a poor one, and values off where the queries do not look.
  for (float sigma : {0.05f, 0.8f}) {
    const auto k = noisy(c.keys, sigma, 5), v = noisy(c.values, sigma, 6);
    const Diagnostics want = diagnose(c, k, v);
    // Whole rows at once, and rows in tiles of 7 (a tile smaller than every sequence but the one-token one).
    for (int64_t tile : {LayerDiagnoser::kDefaultTileFloats, int64_t{7 * 3 * 250}}) {
      std::vector<LayerDiagnostics> layers;
      for (int l = 0; l < c.spec.n_layers; ++l) {
        const LayerTruth truth = truth_of(c, l);
        LayerDiagnoser dg(*be, truth, tile);
        const int64_t G = c.spec.features_per_layer();
        const auto pk = layer_of(k, c.tokens, c.spec.n_layers, G, l), pv = layer_of(v, c.tokens, c.spec.n_layers, G, l);
        layers.push_back(dg.diagnose(pk.data(), pv.data()));
        expect_layer_near(layers.back(), want.layers[l], "sigma " + std::to_string(sigma) + ", tile " +
                                                             std::to_string(tile));
      }
      expect_diagnostics_near(summarize_layers(layers, c.tokens, true), want, "summary");
    }
  }
}

TEST(LayerDiagnostics, SlidingLayersAttendWithinTheirWindowAsTheOracle) {
  Cache c = random_cache(3, 2, 6, 16, {0, 90, 91, 250}, 14);
  RopeSpec local = c.spec.rope;
  local.theta = c.spec.rope.theta * 7;
  c.spec.layers = {{Attention::sliding, 20, local}, {Attention::full, 0, c.spec.rope}, {Attention::sliding, 1, local}};
  auto be = make_cpu_backend();
  const auto k = noisy(c.keys, 0.3f, 5), v = noisy(c.values, 0.3f, 6);
  const Diagnostics want = diagnose(c, k, v);
  for (int64_t tile : {LayerDiagnoser::kDefaultTileFloats, int64_t{7 * 3 * 250}})
    for (int l = 0; l < c.spec.n_layers; ++l) {
      const LayerTruth truth = truth_of(c, l);
      LayerDiagnoser dg(*be, truth, tile);
      const int64_t G = c.spec.features_per_layer();
      const auto pk = layer_of(k, c.tokens, c.spec.n_layers, G, l), pv = layer_of(v, c.tokens, c.spec.n_layers, G, l);
      expect_layer_near(dg.diagnose(pk.data(), pv.data()), want.layers[l], "tile " + std::to_string(tile));
    }
  // The window is what makes the figure: read as full attention, the sliding layers give other cosines.
  Cache full = c;
  for (LayerSpec& ls : full.spec.layers) ls.attention = Attention::full, ls.window = 0;
  const Diagnostics unwindowed = diagnose(full, k, v);
  EXPECT_GT(std::fabs(unwindowed.layers[0].cosine_mean - want.layers[0].cosine_mean), 1e-3);
  EXPECT_GT(std::fabs(unwindowed.layers[2].cosine_mean - want.layers[2].cosine_mean), 1e-3);
  EXPECT_EQ(unwindowed.layers[1].cosine_mean, want.layers[1].cosine_mean);
}

TEST(LayerDiagnostics, AQueryScaleOtherThanTheHeadDimsIsTheOnesTheAttentionUses) {
  Cache c = random_cache(2, 2, 4, 16, {0, 90, 200}, 15);
  c.spec.query_scale = 1.0 / 12;  // Gemma 2 27B: query_pre_attn_scalar 144 with head_dim 128
  auto be = make_cpu_backend();
  const auto k = noisy(c.keys, 0.3f, 5), v = noisy(c.values, 0.3f, 6);
  const Diagnostics want = diagnose(c, k, v);
  std::vector<LayerDiagnostics> layers;
  for (int l = 0; l < c.spec.n_layers; ++l) {
    const LayerTruth truth = truth_of(c, l);
    LayerDiagnoser dg(*be, truth);
    const int64_t G = c.spec.features_per_layer();
    const auto pk = layer_of(k, c.tokens, c.spec.n_layers, G, l), pv = layer_of(v, c.tokens, c.spec.n_layers, G, l);
    layers.push_back(dg.diagnose(pk.data(), pv.data()));
    expect_layer_near(layers.back(), want.layers[l], "query_scale");
  }
  // The scale makes the figure: at 1/sqrt(head_dim) the same caches give another cosine.
  Cache plain = c;
  plain.spec.query_scale.reset();
  EXPECT_GT(std::fabs(diagnose(plain, k, v).layers[0].cosine_mean - want.layers[0].cosine_mean), 1e-4);
}

TEST(LayerDiagnostics, OneTruthServesManyPredictionsAndNoQueriesGivesR2Only) {
  Cache c = random_cache(1, 2, 2, 8, {0, 64, 128}, 12);
  auto be = make_cpu_backend();
  const LayerTruth truth = truth_of(c, 0);
  LayerDiagnoser dg(*be, truth);
  // The truth's own cache: cosine 1, R² 1; then a prediction; then the truth again gives the same as the first.
  const LayerDiagnostics same = dg.diagnose(truth.keys.data(), truth.values.data());
  EXPECT_DOUBLE_EQ(same.r2_k_mean, 1.0);
  EXPECT_NEAR(same.cosine_mean, 1.0, 1e-6);
  const auto k = noisy(truth.keys, 0.3f, 1);
  const LayerDiagnostics other = dg.diagnose(k.data(), truth.values.data());
  EXPECT_LT(other.r2_k_mean, 0.99);
  const LayerDiagnostics again = dg.diagnose(truth.keys.data(), truth.values.data());
  EXPECT_EQ(again.cosine, same.cosine);
  EXPECT_EQ(again.k_concentration, same.k_concentration);
  // Without queries: R² alone, as the oracle.
  c.queries.clear();
  const LayerTruth r2_only = truth_of(c, 0);
  LayerDiagnoser d2(*be, r2_only);
  const LayerDiagnostics ld = d2.diagnose(k.data(), truth.values.data());
  EXPECT_TRUE(ld.cosine.empty());
  expect_layer_near(ld, diagnose(c, k, c.values).layers[0], "no queries");
}

TEST(LayerDiagnostics, QueryHeadsNotAMultipleOfKvHeadsAreNamed) {
  Cache c = random_cache(1, 2, 3, 8, {0, 16}, 13);
  auto be = make_cpu_backend();
  const LayerTruth truth = truth_of(c, 0);
  expect_error<InputError>([&] { LayerDiagnoser dg(*be, truth); },
                           {"n_q_heads 3 is not a multiple of n_kv_heads 2"});
}

// ---- The streamed evaluation against the oracle's, on a fitted mapper.
namespace {

SynthOptions pair_with_queries(const std::string& out, uint64_t data_seed) {
  SynthOptions o = small_synth(out, 31);
  o.with_queries = true;
  o.data_seed = data_seed;
  return o;
}

struct Fitted {
  TempDir tmp;
  HeldOut held;
  Fitted() {
    synthesize(pair_with_queries(tmp.str("cal"), 0));
    SynthOptions h = pair_with_queries(tmp.str("held"), 999);
    h.domains = {"eval"};
    h.shards_per_domain = 2;
    h.sequences_per_shard = 2;
    synthesize(h);
    fit_yaml(config_yaml(tmp.str("cal"), "{k: [1, 3], lambda: 0.01}"));
    for (const char* s : {"shard-000.h5", "shard-001.h5"}) {
      held.source_shards.push_back(tmp.str(std::string("held/source/eval/") + s));
      held.target_shards.push_back(tmp.str(std::string("held/target/eval/") + s));
    }
    held.names = "eval";
  }
  std::vector<std::string> mappers() const { return {tmp.str("cal/out/k1"), tmp.str("cal/out/k3")}; }
};

}  // namespace

TEST(HeldOutEval, StreamedEvaluationOfEveryKMatchesTheOracle) {
  Fitted f;
  auto be = make_cpu_backend();
  auto comm = make_single_comm();
  const auto got = evaluate_mappers(f.mappers(), f.held, *be, *comm, true);
  ASSERT_EQ(got.size(), 2u);
  const Cache s = read_caches(f.held.source_shards, false), t = read_caches(f.held.target_shards, true);
  for (size_t i = 0; i < got.size(); ++i) {
    Transfer tr(f.mappers()[i], *be);
    const Evaluation want = evaluate(tr, s, t);
    expect_diagnostics_near(got[i].evaluation.mapper, want.mapper, "mapper " + f.mappers()[i]);
    expect_diagnostics_near(got[i].evaluation.mean_only, want.mean_only, "mean-only");
    expect_diagnostics_near(got[i].evaluation.no_target_rope, want.no_target_rope, "no target RoPE");
    EXPECT_EQ(got[i].evaluation.ok(), want.ok());
    EXPECT_EQ(got[i].dir, f.mappers()[i]);
  }
  EXPECT_GT(got[1].evaluation.mapper.r2_k, got[1].evaluation.mean_only.r2_k + 0.1);  // the mapper explains something
}

TEST(HeldOutEval, LayersSharedOverRanksGiveTheSameFiguresOnEveryRank) {
  Fitted f;
  auto be = make_cpu_backend();
  auto single = make_single_comm();
  const auto one = evaluate_mappers(f.mappers(), f.held, *be, *single, false);
  for (int ranks : {2, 3}) {
    run_ranks(ranks, [&](Comm& comm) {
      auto mine = make_cpu_backend();
      const auto got = evaluate_mappers(f.mappers(), f.held, *mine, comm, false);
      ASSERT_EQ(got.size(), one.size());
      for (size_t i = 0; i < got.size(); ++i) {
        const Diagnostics &a = got[i].evaluation.mapper, &b = one[i].evaluation.mapper;
        ASSERT_EQ(a.layers.size(), b.layers.size());
        for (size_t l = 0; l < a.layers.size(); ++l) {
          EXPECT_EQ(a.layers[l].layer, int(l));
          expect_layer_near(a.layers[l], b.layers[l], "rank " + std::to_string(comm.rank()));
        }
        EXPECT_EQ(got[i].evaluation.verdict(), one[i].evaluation.verdict());
      }
    });
  }
}

TEST(HeldOutEval, MismatchedHeldOutShardsAreNamed) {
  Fitted f;
  auto be = make_cpu_backend();
  auto comm = make_single_comm();
  HeldOut swapped = f.held;
  swapped.source_shards = f.held.target_shards;  // the target's cache as the source
  expect_error<InputError>([&] { evaluate_mappers(f.mappers(), swapped, *be, *comm, false); },
                           {f.held.target_shards[0], "kv_spec does not match the mapper's source", "n_layers"});
  HeldOut fewer = f.held;
  fewer.target_shards.pop_back();  // one shard's tokens missing on the target side
  expect_error<InputError>([&] { evaluate_mappers(f.mappers(), fewer, *be, *comm, false); },
                           {f.held.target_shards[0], "holds other tokens than", f.held.source_shards[1]});
  // Under ranks, the error is agreed on: every rank throws, the lowest reports.
  run_ranks(2, [&](Comm& c) {
    auto mine = make_cpu_backend();
    try {
      evaluate_mappers(f.mappers(), swapped, *mine, c, false);
      ADD_FAILURE() << "no error";
    } catch (const AgreedError& e) {
      EXPECT_EQ(e.exit_code, 2);
      EXPECT_EQ(e.report, c.rank() == 0);
      EXPECT_NE(std::string(e.what()).find("kv_spec does not match"), std::string::npos) << e.what();
    }
  });
}

// The nonlinear relation (the planted nonlinear pair): ridge finds the planted source layer and the linear part, and falls
// clearly short of R² 1 on held-out tokens, where the linear relation is recovered exactly.
TEST(HeldOutEval, APlantedNonlinearityLeavesRidgeShort) {
  TempDir tmp;
  auto pair = [&](const std::string& dir, SynthRelation r, uint64_t data_seed, const char* domain) {
    SynthOptions o = small_synth(tmp.str(dir), 31);
    o.relation = r, o.data_seed = data_seed, o.domains = {domain}, o.with_queries = true;
    synthesize(o);
  };
  auto be = make_cpu_backend();
  auto comm = make_single_comm();
  std::map<std::string, double> r2;
  for (auto [name, rel] : {std::pair{"linear", SynthRelation::linear}, {"nonlinear", SynthRelation::nonlinear}}) {
    pair(name, rel, 0, "web");
    pair(std::string(name) + "-held", rel, 99, "held");
    fit_yaml(config_yaml(tmp.str(name), "{k: [1], lambda: 0.001}"));
    const HeldOut h{{tmp.str(std::string(name) + "-held/source/held/shard-000.h5")},
                    {tmp.str(std::string(name) + "-held/target/held/shard-000.h5")}, "held"};
    const auto ev = evaluate_mappers({tmp.str(std::string(name) + "/out/k1")}, h, *be, *comm, false);
    r2[name] = 0.5 * (ev[0].evaluation.mapper.r2_k + ev[0].evaluation.mapper.r2_v);
    // The planted layer (l mod Ls) is the one selected.
    const auto m = read_mapper_manifest(tmp.str(std::string(name) + "/out/k1"));
    for (const auto& l : m.layers) EXPECT_EQ(l.source_layers, std::vector<int>{l.target_layer % 6}) << name;
  }
  EXPECT_GT(r2["linear"], 0.999);
  EXPECT_LT(r2["nonlinear"], 0.95);
  EXPECT_GT(r2["nonlinear"], 0.6);
  std::printf("held-out ridge R2 (k = 1): linear %.4f, nonlinear %.4f\n", r2["linear"], r2["nonlinear"]);
}
