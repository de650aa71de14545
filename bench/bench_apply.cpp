// Apply throughput for one Qwen3-8B -> 32B-shaped target layer (k = 8 source layers of 8 x 128 -> 8 x 128: keys
// and values, 2 x [8192 x 1024] fp32 weights = 64 MiB), against the memory-bandwidth bound of streaming that
// layer's weights once per batch, with the bandwidth measured in the same run. Prints one JSON object.
//   crosskv-bench-apply [cpu|cuda] [k] [resident]   (resident: the layer's mapper held; else built per call)
// The serving apply: a Qwen3-14B -> 32B-shaped mapper (40 x 8 x 128 -> Lt x 8 x 128, k source layers per
// target layer), every target layer in one ServingMapper call on caches in the backend's memory, against the
// same mapper applied a layer at a time (the streamed Transfer's loop of one-layer windows on host arrays, the
// windows built once) and through host arrays,
// in the same run; the roofline from the backend's own copy bandwidth and GEMM peak, measured in the same run; and the
// serving caches' finiteness check (check_finite_caches) against the host-array call.
//   crosskv-bench-apply [cpu|cuda] serving [Lt=8] [k=4] [tf32] [per_head | structures]
// per_head: the head-matched mapper of the same shapes (Ht times fewer weights); structures: both, cross_head then
// per_head, in one run (one JSON object per line).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <memory>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "core/blas_kernels.hpp"
#include "backends/backends.hpp"
#include "backends/checks.hpp"
#include "core/backend.hpp"
#include "core/kv_spec.hpp"
#include "core/rope.hpp"
#include "serve/serving_mapper.hpp"
#include "serve/transfer.hpp"

using namespace crosskv;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Read bandwidth: sum a buffer much larger than the caches, best of a few.
double read_bandwidth(size_t bytes) {
  std::vector<double> buf(bytes / sizeof(double), 1.0);
  double best = 0, sink = 0;
  for (int r = 0; r < 5; ++r) {
    const auto t0 = Clock::now();
    double s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i + 3 < buf.size(); i += 4) {
      s0 += buf[i];
      s1 += buf[i + 1];
      s2 += buf[i + 2];
      s3 += buf[i + 3];
    }
    sink += s0 + s1 + s2 + s3;
    best = std::max(best, static_cast<double>(bytes) / seconds_since(t0));
  }
  if (sink == 42) std::printf(" ");
  return best;
}

// Seconds per call of fn: best of repeats for at least `budget` seconds (at least 3 calls) after one warm-up.
template <class Fn>
double time_call(Fn fn, double budget = 1.0) {
  fn();
  double best = 1e30;
  int reps = 0;
  const auto t0 = Clock::now();
  while (seconds_since(t0) < budget || reps < 3) {
    const auto t = Clock::now();
    fn();
    best = std::min(best, seconds_since(t));
    ++reps;
  }
  return best;
}

int serving(const std::string& device, int Lt, int k, bool tf32, bool per_head) {
  auto be = device == "cuda" ? make_cuda_backend(0, 0, tf32) : make_cpu_backend();
  const int Ls = 40, H = 8, D = 128;
  const int64_t F = int64_t{H} * D, G = F, XW = Ls * F, YW = Lt * G, K = k * F;
  const int64_t KW = per_head ? K / H : K;  // rows of a layer's weight (per head for per_head)
  MapperManifest m;
  m.dir = m.path = "(in memory)";
  m.source_model = "Qwen3-14B-shaped", m.target_model = "Qwen3-32B-shaped";
  for (KvSpec* s : {&m.source, &m.target}) {
    s->n_kv_heads = H, s->head_dim = D, s->rope.theta = 1e6, s->rope.rotary_dim = D;
    s->n_q_heads = 40;
  }
  m.source.n_layers = Ls, m.target.n_layers = Lt, m.target.n_q_heads = 64;
  m.k_count = k, m.dtype = "fp32";
  m.structure = per_head ? Structure::per_head : Structure::cross_head;
  std::mt19937 rng(7);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<MapperLayer> layers(Lt);
  for (int l = 0; l < Lt; ++l) {
    MapperLayer& w = layers[l];
    w.target_layer = l;
    w.structure = m.structure;
    for (int j = 0; j < k; ++j) w.source_layers.push_back((j * Ls) / k + (l % std::max(1, Ls / k)));
    for (auto* v : {&w.wk, &w.wv}) {
      v->resize(KW * G);
      for (auto& x : *v) x = nd(rng);
    }
    w.bk.assign(G, 0.1f), w.bv.assign(G, -0.1f);
    m.layers.push_back({l, w.source_layers, "", "", {}, {}, {}, {}});
  }
  // The streamed Transfer's loop: a window (a one-layer ServingMapper) per target layer on host arrays, host RoPE;
  // here every window is built once, so that the loop alone is timed.
  std::vector<std::unique_ptr<ServingMapper>> windows;
  for (int l = 0; l < Lt; ++l) {
    std::vector<MapperLayer> one{layers[l]};
    windows.push_back(std::make_unique<ServingMapper>(m, std::move(one), *be, TargetHeads{}, TargetLayers{l, 1}));
  }
  ServingMapper rt(m, std::move(layers), *be);
  const Rope src_rope(m.source), tgt_rope(m.target);
  // The backend's copy bandwidth (bytes read + written) and GEMM peak, on its own memory.
  double bw = 0, peak = 0;
  {
    const int64_t n = int64_t{1} << 28;  // 1 GiB
    auto a = be->allocate(n), b = be->allocate(n);
    const double s = time_call([&] { be->copy_within(a->data, n, b->data), checks(*be).synchronize(); }, 0.5);
    bw = 2.0 * n / s;
    const int64_t q = 4096;
    auto A = be->allocate(q * q * 4), B = be->allocate(q * q * 4), C = be->allocate(q * q * 4);
    std::vector<float> fill(q * q, 0.01f);
    for (auto* x : {&A, &B, &C}) be->copy_from_host(fill.data(), q * q * 4, (*x)->data);
    DenseMaths::BatchedGemm g;
    g.m = g.n = g.k = q, g.A = A->as<float>(), g.lda = q, g.B = B->as<float>(), g.ldb = q, g.C = C->as<float>(),
    g.ldc = q;
    const double t = time_call([&] { be->serving_gemm(g), checks(*be).synchronize(); }, 0.5);
    peak = 2.0 * q * q * q / t;
  }
  const double weight_bytes = static_cast<double>(rt.weight_bytes());
  std::printf("{\"backend\": \"%s\", \"mapper\": \"40x8x128 -> %dx8x128, k=%d, %s, fp32 weights %.0f MiB\", "
              "\"copy_bandwidth_GBps\": %.1f, \"gemm_peak_gflops\": %.1f, \"batches\": [",
              be->name().c_str(), Lt, k, to_string(m.structure), weight_bytes / (1 << 20), bw / 1e9, peak / 1e9);
  bool first = true;
  for (int64_t T : {1, 64, 512, 4096}) {
    std::vector<float> Xk(T * XW), Xv(T * XW), Yk(T * YW), Yv(T * YW);
    for (auto& x : Xk) x = nd(rng);
    for (auto& x : Xv) x = nd(rng);
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
    auto dk = be->allocate(T * XW * 4), dv = be->allocate(T * XW * 4), dp = be->allocate(T * 4),
         ok = be->allocate(T * YW * 4), ov = be->allocate(T * YW * 4);
    be->copy_from_host(Xk.data(), T * XW * 4, dk->data);
    be->copy_from_host(Xv.data(), T * XW * 4, dv->data);
    be->copy_from_host(pos.data(), T * 4, dp->data);
    const ServingBatch b{dk->as<float>(), dv->as<float>(), dp->as<int32_t>(), dp->as<int32_t>(), T, ok->as<float>(),
                          ov->as<float>(), {}};
    const double resident = time_call([&] { rt.apply(b), checks(*be).synchronize(); });
    const double host = time_call([&] {
      rt.apply_host(Xk.data(), Xv.data(), pos.data(), pos.data(), T, Yk.data(), Yv.data());
    });
    // What the Python package checks before a host-array call (finite caches): its cost against the call it guards.
    const double input_checks = time_call([&] { check_finite_caches(Xk.data(), Xv.data(), XW, T); });
    std::vector<float> content, yk(T * G), yv(T * G);
    const double before = time_call([&] {
      content.assign(Xk.begin(), Xk.end());
      src_rope.strip_block(content.data(), T, {0, Ls, H}, pos.data());
      for (int l = 0; l < Lt; ++l) {
        ContentBatch c;
        c.keys = content.data(), c.values = Xv.data(), c.rows = T, c.out_keys = yk.data(), c.out_values = yv.data();
        c.layers = {l, 1};
        windows[l]->map_content_host(c);
        for (auto [from, to] : {std::pair{yk.data(), Yk.data()}, std::pair{yv.data(), Yv.data()}})
          for (int64_t t = 0; t < T; ++t) std::copy_n(from + t * G, G, to + t * YW + l * G);
      }
      tgt_rope.apply_block(Yk.data(), T, {0, Lt, H}, pos.data());
    });
    // Bytes the resident call must move at least: the weights once, the caches in (keys twice: the RoPE-stripped
    // copy), the gathered columns written and read per kind and layer (k > 1), the outputs written and RoPE'd.
    const bool gathers = k > 1 && !per_head;  // per_head reads the cache in place
    const double cache_bytes = 4.0 * T * (3.0 * XW + 2.0 * YW + YW + (gathers ? 2.0 * 2 * K * Lt : 0.0));
    const double flops = 2.0 * 2.0 * KW * G * Lt * T;
    const double roof = std::max((weight_bytes + cache_bytes) / bw, flops / peak);
    std::printf("%s{\"tokens\": %lld, \"resident_ms\": %.3f, \"host_arrays_ms\": %.3f, \"layer_windows_ms\": %.3f, "
                "\"resident_tokens_per_s\": %.0f, \"speedup_vs_layer_windows\": %.2f, \"speedup_vs_host_arrays\": %.2f, "
                "\"roofline_ms\": %.3f, \"of_roofline\": %.3f, \"bound\": \"%s\", \"gflops\": %.1f, "
                "\"input_checks_ms\": %.4f, \"input_checks_of_host_arrays\": %.4f}",
                first ? "" : ", ", static_cast<long long>(T), resident * 1e3, host * 1e3, before * 1e3, T / resident,
                before / resident, host / resident, roof * 1e3, roof / resident,
                (weight_bytes + cache_bytes) / bw > flops / peak ? "bandwidth" : "compute", flops / resident / 1e9,
                input_checks * 1e3, input_checks / host);
    first = false;
  }
  std::printf("]}\n");
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  // The kernels every figure is taken with, chosen before any BLAS call and printed with the results.
  std::fprintf(stderr, "%s\n", crosskv::select_blas_kernels().summary().c_str());
  const std::string device = argc > 1 ? argv[1] : "cpu";
  if (argc > 2 && std::string(argv[2]) == "serving") {
    if (device == "cuda" && (!cuda_compiled_in() || cuda_device_count() == 0)) {
      std::printf("SKIPPED: no CUDA device\n");
      return 77;
    }
    bool tf32 = false, per_head = false, structures = false;
    for (int i = 5; i < argc; ++i) {
      const std::string a = argv[i];
      tf32 = tf32 || a == "tf32", per_head = per_head || a == "per_head", structures = structures || a == "structures";
    }
    const int Lt = argc > 3 ? std::atoi(argv[3]) : 8, k = argc > 4 ? std::atoi(argv[4]) : 4;
    if (structures) {
      const int rc = serving(device, Lt, k, tf32, false);
      return rc ? rc : serving(device, Lt, k, tf32, true);
    }
    return serving(device, Lt, k, tf32, per_head);
  }
  const int k = argc > 2 ? std::atoi(argv[2]) : 8;
  // "resident": the layer's weights stay on the backend (a ServingMapper held, as a resident Transfer holds them);
  // else the layer's window is built per call (a streamed Transfer's: on a GPU the weights cross PCIe each call).
  const bool resident = argc > 3 && std::string(argv[3]) == "resident";
  if (device == "cuda" && (!cuda_compiled_in() || cuda_device_count() == 0)) {
    std::printf("SKIPPED: no CUDA device\n");
    return 77;
  }
  auto be = device == "cuda" ? make_cuda_backend(0) : make_cpu_backend();
  const int Ls = 36, H = 8, D = 128;  // Qwen3-8B source; one Qwen3-32B target layer of 8 x 128
  const int64_t F = int64_t{H} * D, G = int64_t{H} * D, XW = Ls * F;
  KvSpec tgt;
  tgt.n_layers = 1;
  tgt.n_kv_heads = H;
  tgt.head_dim = D;
  tgt.rope.theta = 1e6;
  tgt.rope.rotary_dim = D;
  Rope rope(tgt);
  std::mt19937 rng(1);
  std::normal_distribution<float> nd(0.0f, 0.02f);
  std::vector<float> Wk(k * F * G), Wv(k * F * G), bk(G, 0.1f), bv(G, -0.1f);
  for (auto& w : Wk) w = nd(rng);
  for (auto& w : Wv) w = nd(rng);
  const double weight_bytes = 2.0 * k * F * G * sizeof(float);
  std::vector<int> selected;
  for (int j = 0; j < k; ++j) selected.push_back((j * Ls) / k);  // spread over the source layers
  // The layer as a one-layer mapper.
  MapperManifest m;
  m.path = "bench", m.k_count = k, m.structure = Structure::cross_head;
  m.source = tgt, m.source.n_layers = Ls, m.target = tgt;
  m.layers.push_back({0, selected, "", "", {}, {}, {}, {}});
  MapperLayer layer;
  layer.target_layer = 0, layer.source_layers = selected, layer.structure = Structure::cross_head;
  layer.wk = Wk, layer.wv = Wv, layer.bk = bk, layer.bv = bv;
  auto window = [&] { return std::make_unique<ServingMapper>(m, std::vector<MapperLayer>{layer}, *be); };
  std::unique_ptr<ServingMapper> held;
  if (resident) held = window();
  const double bw = read_bandwidth(size_t{1} << 30);
  // Compute peak of the same backend: a large square product.
  double peak = 0;
  {
    const int64_t n = 2048;
    std::vector<float> A(n * n, 0.5f), B(n * n, 0.25f), C(n * n, 0.0f);
    DenseMaths::BatchedGemm g;
    g.m = g.n = g.k = n, g.beta = 1.0f, g.A = A.data(), g.lda = n, g.B = B.data(), g.ldb = n, g.C = C.data(),
    g.ldc = n;
    be->gemm_batched(g);
    for (int r = 0; r < 3; ++r) {
      const auto t0 = Clock::now();
      be->gemm_batched(g);
      peak = std::max(peak, 2.0 * n * n * n / seconds_since(t0));
    }
  }
  const double flops_per_token = 2.0 * 2.0 * k * F * G;
  std::printf("{\"backend\": \"%s\", \"layer\": \"k=%d, %dx%dx%d -> %dx%d, fp32 weights %.0f MiB\", "
              "\"weights\": \"%s\", \"read_bandwidth_GBps\": %.1f, \"matmul_peak_gflops\": %.1f, \"batches\": [",
              be->name().c_str(), k, Ls, H, D, H, D, weight_bytes / (1 << 20),
              resident ? (device == "cuda" ? "kept on the GPU (the bandwidth bound below is the host's: not binding)"
                                           : "kept on the backend")
                       : "host, per call",
              bw / 1e9, peak / 1e9);
  bool first = true;
  for (int64_t T : {1, 8, 64, 512, 4096}) {
    std::vector<float> Xk(T * XW), Xv(T * XW), Yk(T * G), Yv(T * G);
    for (auto& x : Xk) x = nd(rng);
    for (auto& x : Xv) x = nd(rng);
    std::vector<int32_t> pos(T);
    for (int64_t t = 0; t < T; ++t) pos[t] = static_cast<int32_t>(t);
    auto one = [&] {  // what Transfer does for one target layer
      std::unique_ptr<ServingMapper> built = held ? nullptr : window();
      ContentBatch c;
      c.keys = Xk.data(), c.values = Xv.data(), c.rows = T, c.out_keys = Yk.data(), c.out_values = Yv.data();
      c.layers = {0, 1};
      (held ? *held : *built).map_content_host(c);
      rope.apply_block(Yk.data(), T, rope.one(0), pos.data());
    };
    one();
    int reps = 0;
    const auto t0 = Clock::now();
    while (seconds_since(t0) < 1.0 || reps < 3) {
      one();
      ++reps;
    }
    const double s = seconds_since(t0) / reps;
    const double tok_s = T / s, bound = T * bw / weight_bytes;
    const double roof = std::min(bound, peak / flops_per_token);  // bandwidth or compute, whichever binds
    std::printf("%s{\"tokens\": %lld, \"tokens_per_s\": %.0f, \"bandwidth_bound_tokens_per_s\": %.0f, "
                "\"of_bandwidth_bound\": %.3f, \"roofline_tokens_per_s\": %.0f, \"of_roofline\": %.3f, "
                "\"gflops\": %.1f}",
                first ? "" : ", ", static_cast<long long>(T), tok_s, bound, tok_s / bound, roof, tok_s / roof,
                flops_per_token * tok_s / 1e9);
    first = false;
  }
  std::printf("]}\n");
  return 0;
}
