// Applying and diagnosing mappers: the transfer library, the diagnostics on cases with known answers, the
// baselines, hardened manifests.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <fstream>
#include <iterator>
#include <random>
#include <set>
#include <tuple>

#include "scalar_oracle.hpp"
#include "eval/report.hpp"
#include "serve/serving_mapper.hpp"
#include "serve/transfer.hpp"
#include "backends/backends.hpp"
#include "core/half.hpp"
#include "core/rope.hpp"
#include "core/sha256.hpp"
#include "helpers.hpp"
#include "unit/mapper_fixture.hpp"
#include "reference_mapper.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "artifact/safetensors.hpp"
#include "io/shard.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

SynthOptions linear_pair(const std::string& out, uint64_t data_seed = 0) {
  SynthOptions o = small_synth(out, 31);
  o.relation = SynthRelation::linear;
  o.source.rope = RopeSpec{};
  o.source.rope.type = "default";
  o.source.rope.rotary_dim = 16;
  o.target.rope = default_synth_options().target.rope;
  o.target.rope.type = "llama3";
  o.target.rope.rotary_dim = 16;
  o.with_queries = true;
  o.data_seed = data_seed;
  return o;
}

double max_abs_diff(const std::vector<float>& a, const std::vector<float>& b) {
  double m = 0;
  for (size_t i = 0; i < a.size(); ++i) m = std::max(m, std::fabs(double(a[i]) - b[i]));
  return m;
}

double max_abs(const std::vector<float>& a) {
  double m = 0;
  for (float x : a) m = std::max(m, std::fabs(double(x)));
  return m;
}

}  // namespace

TEST(Transfer, PlantedMapIsRecoveredOnHeldOutTokensThroughTheLibrary) {
  TempDir tmp;
  synthesize(linear_pair(tmp.str("cal")));
  SynthOptions h = linear_pair(tmp.str("held"), 999);
  h.domains = {"eval"};
  h.shards_per_domain = 1;
  synthesize(h);
  fit_yaml(config_yaml(tmp.str("cal"), "{k: [1], lambda: 0}"));
  auto be = make_cpu_backend();
  Transfer tr(tmp.str("cal/out/k1"), *be);
  Cache s = read_cache(tmp.str("held/source/eval/shard-000.h5"), false);
  Cache t = read_cache(tmp.str("held/target/eval/shard-000.h5"));
  std::vector<float> k(t.keys.size()), v(t.values.size());
  tr.apply(s.keys.data(), s.values.data(), s.positions.data(), t.positions.data(), s.tokens, k.data(), v.data());
  // Keys come out post target-RoPE, exactly as the target caches them.
  EXPECT_LT(max_abs_diff(k, t.keys), 2e-5 * max_abs(t.keys) * 16);
  EXPECT_LT(max_abs_diff(v, t.values), 1e-3);
  // Peak memory is one layer: each layer file was read once for this call.
  EXPECT_EQ(tr.layer_loads(), h.target.n_layers);
  // And the diagnostics say so: R² ~ 1, cosine ~ 1.
  Evaluation ev = evaluate(tr, s, t);
  EXPECT_GT(ev.mapper.r2_k, 0.9999);
  EXPECT_GT(ev.mapper.r2_v, 0.9999);
  ASSERT_TRUE(ev.mapper.attention_cosine.has_value());
  EXPECT_GT(*ev.mapper.attention_cosine, 0.9999);
  EXPECT_TRUE(ev.ok()) << ev.verdict();
  // The "- inference RoPE" bug is caught by every figure.
  EXPECT_LT(ev.no_target_rope.r2_k, 0.5);
  EXPECT_LT(*ev.no_target_rope.attention_cosine, *ev.mapper.attention_cosine - 0.05);
  // The mean-only baseline explains nothing held out.
  EXPECT_LT(std::fabs(ev.mean_only.r2_k), 0.05);
  EXPECT_LT(*ev.mean_only.attention_cosine, *ev.mapper.attention_cosine);
}

TEST(Transfer, ApplyEqualsTheFitsOwnPredictionOnTheCalibrationTokens) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [2], lambda: 0.01}"));
  auto be = make_cpu_backend();
  Transfer tr(tmp.str("out/k2"), *be, TransferOptions{true});
  // In-sample R² per head from the moments (the manifest) vs the R² of the applied mapper on every calibration token.
  std::vector<double> sse_k(tr.target().n_layers * tr.target().n_kv_heads, 0.0), sse_v = sse_k, sst_k = sse_k,
                      sst_v = sse_k, sum_k = sse_k;
  std::vector<Cache> sources, targets;
  for (const char* sh : {"web/shard-000.h5", "web/shard-001.h5"}) {
    sources.push_back(read_cache(tmp.str(std::string("source/") + sh), false));
    targets.push_back(read_cache(tmp.str(std::string("target/") + sh), false));
  }
  const KvSpec& Tg = tr.target();
  const int L = Tg.n_layers, H = Tg.n_kv_heads, D = Tg.head_dim;
  const int64_t W = int64_t{L} * H * D;
  // Column means over all calibration tokens, content space.
  std::vector<double> mk(W, 0.0), mv(W, 0.0);
  int64_t N = 0;
  std::vector<std::vector<float>> ck, pk, pv;
  for (size_t i = 0; i < sources.size(); ++i) {
    const Cache &s = sources[i], &t = targets[i];
    std::vector<float> k(t.keys.size()), v(t.values.size()), tk = t.keys;
    tr.apply(s.keys.data(), s.values.data(), s.positions.data(), t.positions.data(), s.tokens, k.data(), v.data());
    Rope(Tg).strip_block(k.data(), s.tokens, {0, L, H}, t.positions.data());
    Rope(Tg).strip_block(tk.data(), s.tokens, {0, L, H}, t.positions.data());
    for (int64_t r = 0; r < t.tokens; ++r)
      for (int64_t c = 0; c < W; ++c) {
        mk[c] += tk[r * W + c];
        mv[c] += t.values[r * W + c];
      }
    N += t.tokens;
    ck.push_back(std::move(tk));
    pk.push_back(std::move(k));
    pv.push_back(std::move(v));
  }
  for (int64_t c = 0; c < W; ++c) {
    mk[c] /= N;
    mv[c] /= N;
  }
  for (size_t i = 0; i < sources.size(); ++i)
    for (int64_t r = 0; r < targets[i].tokens; ++r)
      for (int64_t c = 0; c < W; ++c) {
        const int64_t head = c / D;
        const double yk = ck[i][r * W + c], yv = targets[i].values[r * W + c];
        sse_k[head] += (pk[i][r * W + c] - yk) * (pk[i][r * W + c] - yk);
        sse_v[head] += (pv[i][r * W + c] - yv) * (pv[i][r * W + c] - yv);
        sst_k[head] += (yk - mk[c]) * (yk - mk[c]);
        sst_v[head] += (yv - mv[c]) * (yv - mv[c]);
      }
  const auto& layers = tr.manifest().layers;
  for (int l = 0; l < L; ++l)
    for (int h = 0; h < H; ++h) {
      const int i = l * H + h;
      EXPECT_NEAR(1 - sse_k[i] / sst_k[i], layers[l].r2_k.at(h), 2e-4) << "layer " << l << " head " << h;
      EXPECT_NEAR(1 - sse_v[i] / sst_v[i], layers[l].r2_v.at(h), 2e-4) << "layer " << l << " head " << h;
    }
}

TEST(Transfer, ResidentOptionReadsEachLayerOnce) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1], lambda: 0.01}"));
  auto be = make_cpu_backend();
  Cache s = read_cache(tmp.str("source/web/shard-000.h5"), false);
  for (bool resident : {false, true}) {
    Transfer tr(tmp.str("out/k1"), *be, TransferOptions{resident});
    const int64_t W = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
    std::vector<float> k(s.tokens * W), v(s.tokens * W);
    for (int rep = 0; rep < 3; ++rep)
      tr.apply(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), s.tokens, k.data(), v.data());
    EXPECT_EQ(tr.layer_loads(), tr.target().n_layers * (resident ? 1 : 3));
  }
}

// ---- The serving apply: weights resident, every layer in one call, the caches in the backend's memory.
namespace {

// Transfer::apply and ServingMapper (one call, and host arrays) on the same caches: the same bits on the CPU.
void expect_resident_equals_transfer(const std::string& dir, const Cache& s, int64_t rows) {
  auto be = make_cpu_backend();
  Transfer tr(dir, *be);
  ServingMapper rt(dir, *be);
  const int64_t W = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
  std::vector<int32_t> tgt(s.positions.begin(), s.positions.begin() + rows);
  for (auto& p : tgt) p += 3;  // the target's positions need not be the source's
  std::vector<float> k(rows * W), v(rows * W), rk(rows * W, -1), rv(rows * W, -1), hk(rows * W), hv(rows * W);
  tr.apply(s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, k.data(), v.data());
  rt.apply({s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, rk.data(), rv.data(), {}});
  rt.apply_host(s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, hk.data(), hv.data());
  EXPECT_EQ(std::memcmp(k.data(), rk.data(), k.size() * 4), 0) << dir << ": keys";
  EXPECT_EQ(std::memcmp(v.data(), rv.data(), v.size() * 4), 0) << dir << ": values";
  EXPECT_EQ(std::memcmp(k.data(), hk.data(), k.size() * 4), 0) << dir << ": keys (host arrays)";
  EXPECT_EQ(std::memcmp(v.data(), hv.data(), v.size() * 4), 0) << dir << ": values (host arrays)";
  EXPECT_GT(max_abs(rk), 0.1);
  // Layer by layer, and in runs: each call's outputs are those layers of the whole call, bit for bit.
  const int Lt = tr.target().n_layers;
  const int64_t G = tr.target().features_per_layer();
  for (TargetLayers r : {TargetLayers{0, 1}, TargetLayers{Lt - 1, 1}, TargetLayers{1, Lt - 1}, TargetLayers{1, -1}}) {
    const int n = r.size(Lt);
    std::vector<float> want_k(rows * n * G), want_v(rows * n * G);
    for (int64_t t = 0; t < rows; ++t) {
      std::copy_n(k.data() + t * W + r.first * G, n * G, want_k.data() + t * n * G);
      std::copy_n(v.data() + t * W + r.first * G, n * G, want_v.data() + t * n * G);
    }
    std::vector<float> tk(want_k.size()), tv(want_k.size()), sk(want_k.size()), sv(want_k.size());
    std::vector<float> hk1(want_k.size()), hv1(want_k.size());
    tr.apply(s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, tk.data(), tv.data(), r);
    ServingBatch b{s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, sk.data(), sv.data(), r};
    rt.apply(b);
    rt.apply_host(s.keys.data(), s.values.data(), s.positions.data(), tgt.data(), rows, hk1.data(), hv1.data(), r);
    const std::string what = dir + ": layers [" + std::to_string(r.first) + ", " + std::to_string(r.first + n) + ")";
    EXPECT_EQ(tk, want_k) << what << ", Transfer keys";
    EXPECT_EQ(tv, want_v) << what << ", Transfer values";
    EXPECT_EQ(sk, want_k) << what << ", ServingMapper keys";
    EXPECT_EQ(sv, want_v) << what << ", ServingMapper values";
    EXPECT_EQ(hk1, want_k) << what << ", ServingMapper keys (host arrays)";
    EXPECT_EQ(hv1, want_v) << what << ", ServingMapper values (host arrays)";
  }
}

}  // namespace

TEST(ServingMapper, EqualsTransferBitForBitOnTheCpuForEveryK) {
  TempDir tmp;
  synthesize(small_synth(tmp.str()));
  fit_yaml(config_yaml(tmp.str(), "{k: [1, 2, all], lambda: 0.01}"));
  const Cache s = read_cache(tmp.str("source/web/shard-000.h5"), false);
  ASSERT_GT(s.seq_offsets.size(), 2u);  // a batch of several sequences, back to back
  for (const char* k : {"k1", "k2", "kall"}) expect_resident_equals_transfer(tmp.str("out/") + k, s, s.tokens);
  // A batch of one token, and of none; target layers in chunks of one and of three (a cap on the gather).
  expect_resident_equals_transfer(tmp.str("out/k2"), s, 1);
  for (int64_t per_chunk : {1, 3}) {
    auto cpu = make_cpu_backend();
    Transfer tr(tmp.str("out/k2"), *cpu);
    ServingMapper rt(tmp.str("out/k2"), *cpu);
    rt.set_gather_bytes(per_chunk * s.tokens * 2 * rt.source().features_per_layer() * 4);
    const int64_t W = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
    std::vector<float> k(s.tokens * W), v(s.tokens * W), rk(s.tokens * W), rv(s.tokens * W);
    tr.apply(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), s.tokens, k.data(), v.data());
    rt.apply_host(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), s.tokens, rk.data(),
                  rv.data());
    EXPECT_EQ(k, rk) << per_chunk << " layer(s) per product";
    EXPECT_EQ(v, rv) << per_chunk << " layer(s) per product";
  }
  auto be = make_cpu_backend();
  ServingMapper rt(tmp.str("out/k1"), *be);
  rt.apply(ServingBatch{});
  const int64_t F = rt.source().features_per_layer(), G = rt.target().features_per_layer();
  EXPECT_EQ(rt.weight_bytes(), int64_t{rt.target().n_layers} * 2 * (F * G + G) * 4);
}

TEST(ServingMapper, EqualsTransferBitForBitWithResidualMlps) {
  for (const char* k : {"1", "2", "all"}) {  // the MLP's input read in place, gathered for it, or the chunk's gather
    Artifact a(k);
    add_mlp_tensors(a, 2, 8);
    add_mlp_tensors(a, 3, 4);
    const Cache s = read_cache(a.tmp.str("source/web/shard-000.h5"), false);
    expect_resident_equals_transfer(a.dir, s, s.tokens);
  }
}

TEST(ServingMapper, PerHeadMappersEqualTransferAndTheReferenceForEveryK) {
  for (const char* k : {"1", "2", "all"}) {
    Artifact a(k, "per_head");
    const Cache s = read_cache(a.tmp.str("source/web/shard-000.h5"), false);
    expect_resident_equals_transfer(a.dir, s, s.tokens);  // bit for bit, whole and layer by layer
    expect_resident_equals_transfer(a.dir, s, 1);
    // Against the reference's loops, in content space.
    auto be = make_cpu_backend();
    Transfer tr(a.dir, *be);
    const MapperWeights ref = load_mapper(a.dir);
    const int64_t XW = int64_t{tr.source().n_layers} * tr.source().features_per_layer();
    const int64_t YW = int64_t{tr.target().n_layers} * tr.target().features_per_layer();
    std::vector<float> xk(s.keys.begin(), s.keys.begin() + s.tokens * XW), yk(s.tokens * YW), yv(s.tokens * YW),
        rk(s.tokens * YW), rv(s.tokens * YW);
    const Rope rs(tr.source());
    rs.strip_block(xk.data(), s.tokens, rs.all(), s.positions.data());
    tr.map_content(xk.data(), s.values.data(), s.tokens, yk.data(), yv.data());
    map_content(ref, Kind::k, xk.data(), s.tokens, rk.data());
    map_content(ref, Kind::v, s.values.data(), s.tokens, rv.data());
    EXPECT_LT(max_abs_diff(yk, rk), 1e-5 * std::max(1.0, max_abs(rk))) << k;
    EXPECT_LT(max_abs_diff(yv, rv), 1e-5 * std::max(1.0, max_abs(rv))) << k;
    // The per_head weights as the cross_head mapper they equal (zeros across heads): the same outputs.
    const MapperManifest m = read_mapper_manifest(a.dir);
    const double tol = 1e-5 * std::max(1.0, max_abs(rk));
    for (int l = 0; l < m.target.n_layers; ++l) {
      const MapperLayer dense = as_cross_head(m, load_mapper_layer(m, l));
      EXPECT_EQ(dense.wk.size(), dense.source_layers.size() * m.source.features_per_layer() *
                                     m.target.features_per_layer());
      const int64_t G = m.target.features_per_layer();
      const int64_t F = m.source.features_per_layer();
      for (int64_t t = 0; t < s.tokens; ++t)
        for (int64_t c = 0; c < G; ++c) {
          double y = dense.bk[c];  // X[t, selected layers] W + b, the dense weights by loops
          for (size_t j = 0; j < dense.source_layers.size(); ++j)
            for (int64_t i = 0; i < F; ++i)
              y += double{xk[t * XW + dense.source_layers[j] * F + i]} * dense.wk[(j * F + i) * G + c];
          ASSERT_NEAR(y, yk[t * YW + l * G + c], tol) << k << " layer " << l;
        }
    }
    ServingMapper rt(a.dir, *be);
    const int64_t F = rt.source().features_per_layer(), G = rt.target().features_per_layer();
    const int64_t kk = static_cast<int64_t>(m.layers[0].source_layers.size());
    EXPECT_EQ(rt.weight_bytes(), int64_t{rt.target().n_layers} * 2 * (kk * F * G / rt.target().n_kv_heads + G) * 4)
        << "per_head weights are Ht times smaller in memory too";
  }
}

namespace {

// Every range of target heads maps those heads of the whole mapping: a tensor-parallel worker's columns alone.
void expect_heads_equal_the_whole(const std::string& dir, const Cache& s) {
  auto be = make_cpu_backend();
  ServingMapper whole(dir, *be);
  const KvSpec t = whole.target();
  const int64_t rows = s.tokens, Dt = t.head_dim, G = t.features_per_layer(), W = t.n_layers * G;
  std::vector<float> k(rows * W), v(rows * W);
  whole.apply_host(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), rows, k.data(), v.data());
  const double tol = 1e-5 * std::max(1.0, std::max(max_abs(k), max_abs(v)));
  for (int first = 0; first < t.n_kv_heads; ++first)
    for (int count = 1; first + count <= t.n_kv_heads; ++count) {
      ServingMapper part(dir, *be, true, TargetHeads{first, count});
      EXPECT_EQ(part.heads().first, first);
      EXPECT_EQ(part.heads().count, count);
      const int64_t g = count * Dt;
      std::vector<float> pk(rows * t.n_layers * g), pv(pk.size());
      part.apply_host(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(), rows, pk.data(),
                      pv.data());
      double dk = 0, dv = 0;
      for (int64_t r = 0; r < rows; ++r)
        for (int l = 0; l < t.n_layers; ++l)
          for (int64_t c = 0; c < g; ++c) {
            const int64_t at = r * W + l * G + first * Dt + c, got = (r * t.n_layers + l) * g + c;
            dk = std::max(dk, std::fabs(double(pk[got]) - k[at]));
            dv = std::max(dv, std::fabs(double(pv[got]) - v[at]));
          }
      const std::string what = dir + ": heads [" + std::to_string(first) + ", " + std::to_string(first + count) + ")";
      EXPECT_LT(dk, tol) << what << ", keys";
      EXPECT_LT(dv, tol) << what << ", values";
      if (count < t.n_kv_heads) {
        EXPECT_LT(part.weight_bytes(), whole.weight_bytes()) << what << " keeps fewer weights";
      }
    }
}

}  // namespace

TEST(ServingMapper, ARangeOfTargetHeadsMapsThoseHeadsOfTheWholeMapping) {
  for (const char* k : {"1", "2", "all"})
    for (const char* structure : {"cross_head", "per_head"}) {
      Artifact a(k, structure);
      expect_heads_equal_the_whole(a.dir, read_cache(a.tmp.str("source/web/shard-000.h5"), false));
    }
  Artifact mlp("2");  // residual MLPs: their last layer's columns are the heads' outputs
  add_mlp_tensors(mlp, 1, 8);
  expect_heads_equal_the_whole(mlp.dir, read_cache(mlp.tmp.str("source/web/shard-000.h5"), false));
  auto be = make_cpu_backend();
  for (TargetHeads h : {TargetHeads{-1, 1}, TargetHeads{2, -1}, TargetHeads{0, 0}, TargetHeads{1, 2}})
    expect_error<InputError>([&] { ServingMapper rt(mlp.dir, *be, true, h); },
                             {"target_heads", "[0, 2)", "first " + std::to_string(h.first)});
}

TEST(ServingMapper, RefusesWhatTransferRefusesByName) {
  Artifact a;
  auto be = make_cpu_backend();
  nlohmann::json m = a.manifest;
  m["target"]["kv_spec"]["rope"]["type"] = "dynamic";
  a.write(m);
  expect_error<InputError>([&] { ServingMapper rt(a.dir, *be); }, {"target.kv_spec", "dynamic"});
  a.write(a.manifest);
  std::ofstream(a.dir + "/" + a.manifest["layers"][1]["file"].get<std::string>(), std::ios::app) << "x";
  expect_error<InputError>([&] { ServingMapper rt(a.dir, *be); }, {"SHA-256"});
}

TEST(ServingMapper, ARangeOfTargetLayersOutsideTheMapperIsRefusedByName) {
  Artifact a;
  auto be = make_cpu_backend();
  ServingMapper rt(a.dir, *be);
  Transfer tr(a.dir, *be);
  const int Lt = rt.target().n_layers;
  const Cache s = read_cache(a.tmp.str("source/web/shard-000.h5"), false);
  std::vector<float> out(s.tokens * Lt * rt.target().features_per_layer());
  for (TargetLayers r : {TargetLayers{-1, 1}, TargetLayers{Lt, -1}, TargetLayers{0, 0}, TargetLayers{1, Lt}}) {
    const std::vector<std::string> parts = {"layers", "[0, " + std::to_string(Lt) + ")",
                                            "first " + std::to_string(r.first), "count " + std::to_string(r.count)};
    expect_error<InputError>([&] { rt.apply_host(s.keys.data(), s.values.data(), s.positions.data(),
                                                 s.positions.data(), s.tokens, out.data(), out.data(), r); }, parts);
    expect_error<InputError>([&] { tr.apply(s.keys.data(), s.values.data(), s.positions.data(), s.positions.data(),
                                            s.tokens, out.data(), out.data(), r); }, parts);
  }
}
