// Held-out diagnostics, ratios in one run. Prints one JSON object.
//   crosskv-bench-eval demo [cpu|cuda] [WORK_DIR]
//     The demo's pair (source 8 x 4 x 32, target 12 x 4 x 32, 8 query heads; 1,024 held-out tokens in 2 sequences)
//     fitted for k = 1, 2, 4, all; per k the scalar oracle (evaluate(), whole caches) against the streamed GEMM
//     evaluation (evaluate_mappers), and the whole sweep from one read of the held-out shards.
//   crosskv-bench-eval paper [cpu|cuda] [TOKENS]
//     One Qwen3-32B-shaped target layer (64 query heads, 8 KV heads of 128) on TOKENS held-out tokens (default
//     4,096, sequences of 1,024) with queries: the truth's side and three predictions (a mapper and two baselines),
//     GFLOP/s against the backend's own GEMM rate on the attention shape in the same run, and the process's peak
//     memory against one layer's footprint.
//   crosskv-bench-eval mlp [cpu|cuda] [K]
//     Training the residual MLP of one Qwen3-14B -> 32B-shaped (target layer, kind): K = 4 selected source layers of
//     8 x 128 (4,096 features) -> 1,024 hidden -> 1,024 hidden -> 8 x 128, batches of 1,024 tokens; tokens/s and
//     GFLOP/s (forward and backward: six GEMMs a layer) against the backend's GEMM rate on the first layer's shape.
#include <sys/resource.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <vector>

#include "core/blas_kernels.hpp"
#include "scalar_oracle.hpp"
#include "eval/layer_diagnostics.hpp"
#include "serve/transfer.hpp"
#include "backends/backends.hpp"
#include "core/comm.hpp"
#include "fit/config.hpp"
#include "runtime/log.hpp"
#include "core/mlp.hpp"
#include "fit/mlp_training.hpp"
#include "fit/fit_pipeline.hpp"
#include "eval/held_out.hpp"
#include "fit/calibration.hpp"
#include "tools/synth.hpp"

using namespace crosskv;
using Clock = std::chrono::steady_clock;
namespace fs = std::filesystem;

namespace {

double since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }
double peak_rss_bytes() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_maxrss) * 1024.0;
}

std::unique_ptr<ComputeBackend> backend(const std::string& device) {
  return device == "cuda" ? make_cuda_backend(0) : make_cpu_backend();
}

int demo(const std::string& device, const std::string& work) {
  fs::remove_all(work);
  SynthOptions o = default_synth_options();
  o.out = work + "/data";
  o.shards_per_domain = 2, o.sequences_per_shard = 8, o.seq_len = 512, o.with_queries = true;
  synthesize(o);
  SynthOptions h = o;
  h.out = work + "/held", h.domains = {"heldout"}, h.shards_per_domain = 1, h.sequences_per_shard = 2;
  h.data_seed = 2026;
  synthesize(h);
  auto comm = make_single_comm();
  auto be = backend(device);
  {
    Context ctx{*comm, *be};
    run_fit(parse_fit_config("source: {store: " + o.out + "/source}\ntarget: {store: " + o.out +
                                 "/target}\nfit: {k: [1, 2, 4, all], lambda: 0.01}\noutput: {dir: " + work +
                                 "/out}\n",
                             "bench.yaml"),
            FitOptions{}, ctx);
  }
  const HeldOut held{{h.out + "/source/heldout/shard-000.h5"}, {h.out + "/target/heldout/shard-000.h5"}, "heldout"};
  std::printf("{\"bench\": \"eval-demo\", \"backend\": \"%s\", \"tokens\": %d, \"per_k\": [", be->name().c_str(),
              h.sequences_per_shard * h.seq_len);
  double old_sum = 0, new_sum = 0;
  std::vector<std::string> ks = {"k1", "k2", "k4", "kall"}, dirs;
  for (size_t i = 0; i < ks.size(); ++i) {
    const std::string dir = work + "/out/" + ks[i];
    dirs.push_back(dir);
    auto t0 = Clock::now();
    const Cache s = read_caches(held.source_shards, false), t = read_caches(held.target_shards, true);
    Transfer tr(dir, *be, TransferOptions{true, true, false});
    const Evaluation want = evaluate(tr, s, t);
    const double old_s = since(t0);
    t0 = Clock::now();
    const auto got = evaluate_mappers({dir}, held, *be, *comm, false);
    const double new_s = since(t0);
    old_sum += old_s, new_sum += new_s;
    std::printf("%s{\"k\": \"%s\", \"oracle_s\": %.3f, \"gemm_s\": %.3f, \"speedup\": %.1f, "
                "\"cosine_oracle\": %.6f, \"cosine_gemm\": %.6f}",
                i ? ", " : "", ks[i].c_str(), old_s, new_s, old_s / new_s, want.mapper.attention_cosine.value_or(0),
                got[0].evaluation.mapper.attention_cosine.value_or(0));
  }
  const auto t0 = Clock::now();
  evaluate_mappers(dirs, held, *be, *comm, false);
  const double sweep_s = since(t0);
  std::printf("], \"oracle_total_s\": %.3f, \"gemm_per_k_total_s\": %.3f, \"gemm_sweep_s\": %.3f, "
              "\"speedup_per_k\": %.1f, \"speedup_sweep\": %.1f}\n",
              old_sum, new_sum, sweep_s, old_sum / new_sum, old_sum / sweep_s);
  return 0;
}

int paper(const std::string& device, int64_t tokens) {
  auto be = backend(device);
  KvSpec s;
  s.n_layers = 64, s.n_kv_heads = 8, s.n_q_heads = 64, s.head_dim = 128;
  s.rope.type = "default", s.rope.theta = 1e6, s.rope.rotary_dim = 128;
  const int64_t seq = std::min<int64_t>(1024, tokens), G = s.features_per_layer(), QW = int64_t{64} * 128;
  std::vector<int64_t> offs = {0};
  while (offs.back() < tokens) offs.push_back(std::min(tokens, offs.back() + seq));
  std::vector<int32_t> pos(tokens);
  for (size_t i = 0; i + 1 < offs.size(); ++i)
    for (int64_t t = offs[i]; t < offs[i + 1]; ++t) pos[t] = static_cast<int32_t>(t - offs[i]);
  std::mt19937_64 rng(1);
  std::normal_distribution<float> n(0, 1);
  LayerTruth truth;
  truth.spec = s, truth.tokens = tokens, truth.positions = pos.data(), truth.seq_offsets = offs.data();
  truth.sequences = static_cast<int64_t>(offs.size()) - 1;
  truth.keys.resize(tokens * G), truth.values.resize(tokens * G), truth.queries.resize(tokens * QW);
  for (auto* v : {&truth.keys, &truth.values, &truth.queries})
    for (auto& x : *v) x = n(rng);
  std::vector<std::vector<float>> preds;  // three predictions of keys and values
  for (float sigma : {0.1f, 0.5f, 1.0f})
    for (const auto* v : {&truth.keys, &truth.values}) {
      preds.push_back(*v);
      for (auto& x : preds.back()) x += sigma * n(rng);
    }
  const double rss_before = peak_rss_bytes();
  // The backend's GEMM on the attention's shape: scores of 8 query heads over one 1,024-token sequence.
  std::vector<float> A(seq * QW), C(8 * seq * seq);
  for (auto& x : A) x = n(rng);
  ComputeBackend::BatchedGemm g;
  g.trans_b = true, g.m = seq, g.n = seq, g.k = 128, g.A = A.data(), g.lda = QW, g.stride_a = 128;
  g.B = truth.keys.data(), g.ldb = G, g.C = C.data(), g.ldc = seq, g.stride_c = seq * seq, g.batch = 8;
  be->gemm_batched(g);
  int reps = 0;
  auto t0 = Clock::now();
  while (since(t0) < 2.0 || reps < 3) be->gemm_batched(g), ++reps;
  const double gemm_rate = 2.0 * 8 * seq * seq * 128 * reps / since(t0);
  A = {}, C = {};
  const LayerDiagnosticsCost cost = layer_diagnostics_cost(s, tokens, offs, true);
  t0 = Clock::now();
  LayerDiagnoser dg(*be, truth);
  const double truth_s = since(t0);
  t0 = Clock::now();
  for (size_t p = 0; p < preds.size(); p += 2) dg.diagnose(preds[p].data(), preds[p + 1].data());
  const double pred_s = since(t0);
  const double flops = cost.truth_flops + 3 * cost.prediction_flops, secs = truth_s + pred_s;
  const double layer_bytes = 4.0 * tokens * (2 * G + QW) + 6.0 * 4 * tokens * G + cost.scratch_bytes;
  std::printf("{\"bench\": \"eval-paper-layer\", \"backend\": \"%s\", \"shape\": \"Qwen3-32B target layer: 64 q heads, 8 kv "
              "heads x 128\", \"tokens\": %lld, \"sequence\": %lld, \"truth_s\": %.3f, \"three_predictions_s\": %.3f, "
              "\"gflop\": %.1f, \"gflops\": %.1f, \"gemm_gflops_same_run\": %.1f, \"fraction_of_gemm\": %.3f, "
              "\"layer_footprint_bytes\": %.0f, \"peak_rss_bytes\": %.0f, \"rss_before_diagnostics\": %.0f, "
              "\"k_sweep_of_4_projected_64_layers_s\": %.0f}\n",
              be->name().c_str(), static_cast<long long>(tokens), static_cast<long long>(seq), truth_s, pred_s,
              flops / 1e9, flops / secs / 1e9, gemm_rate / 1e9, flops / secs / gemm_rate, layer_bytes,
              peak_rss_bytes(), rss_before, 64 * (truth_s + 4 * pred_s));
  return 0;
}

int mlp(const std::string& device, int64_t k) {
  auto be = backend(device);
  auto comm = make_single_comm();
  const MlpShape s{k * 1024, 1024, 1024};
  const int64_t batch = 1024, steps = 6, rows = batch * steps;
  std::mt19937_64 rng(3);
  std::normal_distribution<float> n(0, 1);
  std::vector<float> X(rows * s.in), R(rows * s.out);
  for (auto* v : {&X, &R})
    for (auto& x : *v) x = n(rng);
  // The backend's GEMM on the first layer's forward shape, [batch x in] [in x hidden].
  std::vector<float> C(batch * s.hidden);
  ComputeBackend::BatchedGemm g;
  g.m = batch, g.n = s.hidden, g.k = s.in, g.A = X.data(), g.lda = s.in, g.B = R.data(), g.ldb = s.hidden;
  g.C = C.data(), g.ldc = s.hidden;
  be->gemm_batched(g);
  int reps = 0;
  auto t0 = Clock::now();
  while (since(t0) < 2.0 || reps < 3) be->gemm_batched(g), ++reps;
  const double gemm_rate = 2.0 * batch * s.hidden * s.in * reps / since(t0);
  MlpTraining t;
  t.epochs = 1, t.batch_tokens = batch, t.seed = 1;
  train_residual_mlp(*be, *comm, s, X.data(), R.data(), batch, t);  // warm-up
  t0 = Clock::now();
  const MlpTrained m = train_residual_mlp(*be, *comm, s, X.data(), R.data(), rows, t);
  const double secs = since(t0);
  const double per_token = 2.0 * 3.0 * static_cast<double>(s.in * s.hidden + s.hidden * s.hidden + s.hidden * s.out);
  std::printf("{\"bench\": \"mlp-train\", \"backend\": \"%s\", \"shape\": [%lld, %lld, %lld], \"parameters\": %lld, "
              "\"tokens\": %lld, \"steps\": %lld, \"seconds\": %.3f, \"tokens_per_s\": %.0f, \"gflops\": %.1f, "
              "\"gemm_gflops_same_run\": %.1f, \"fraction_of_gemm\": %.3f}\n",
              be->name().c_str(), static_cast<long long>(s.in), static_cast<long long>(s.hidden),
              static_cast<long long>(s.out), static_cast<long long>(s.parameters()), static_cast<long long>(rows),
              static_cast<long long>(m.steps), secs, rows / secs, per_token * rows / secs / 1e9, gemm_rate / 1e9,
              per_token * rows / secs / gemm_rate);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The kernels every figure is taken with, chosen before any BLAS call and printed with the results.
  std::fprintf(stderr, "%s\n", crosskv::select_blas_kernels().summary().c_str());
  spdlog::set_level(spdlog::level::warn);
  const std::string mode = argc > 1 ? argv[1] : "demo", device = argc > 2 ? argv[2] : "cpu";
  try {
    if (mode == "demo") return demo(device, argc > 3 ? argv[3] : (fs::temp_directory_path() / "crosskv-bench-eval").string());
    if (mode == "paper") return paper(device, argc > 3 ? std::atoll(argv[3]) : 4096);
    if (mode == "mlp") return mlp(device, argc > 3 ? std::atoll(argv[3]) : 4);
    std::fprintf(stderr, "usage: crosskv-bench-eval demo|paper|mlp [cpu|cuda] [WORK_DIR|TOKENS|K]\n");
    return 2;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "crosskv-bench-eval: error: %s\n", e.what());
    return 1;
  }
}
