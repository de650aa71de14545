// Apply throughput for one Qwen3-8B -> 32B-shaped target layer (k = 8 source layers of 8 x 128 -> 8 x 128: keys
// and values, 2 x [8192 x 1024] fp32 weights = 64 MiB), against the memory-bandwidth bound of streaming that
// layer's weights once per batch, with the bandwidth measured in the same run. Prints one JSON object.
//   crosskv-bench-apply [cpu|cuda] [k] [resident]   (resident: weights kept on the backend, as for serving)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/kv_spec.hpp"
#include "core/rope.hpp"
#include "apply/transfer.hpp"

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

}  // namespace

int main(int argc, char** argv) {
  const std::string device = argc > 1 ? argv[1] : "cpu";
  const int k = argc > 2 ? std::atoi(argv[2]) : 8;
  // "resident": the weights are kept on the backend (keep_constant, as a resident Transfer does for serving).
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
  if (resident) {
    be->keep_constant(Wk.data(), static_cast<int64_t>(Wk.size()));
    be->keep_constant(Wv.data(), static_cast<int64_t>(Wv.size()));
  }
  const double bw = read_bandwidth(size_t{1} << 30);
  // Compute peak of the same backend: a large square product.
  double peak = 0;
  {
    const int64_t n = 2048;
    std::vector<float> A(n * n, 0.5f), B(n * n, 0.25f), C(n * n, 0.0f);
    be->matmul_acc(n, n, n, A.data(), n, B.data(), n, C.data(), n);
    for (int r = 0; r < 3; ++r) {
      const auto t0 = Clock::now();
      be->matmul_acc(n, n, n, A.data(), n, B.data(), n, C.data(), n);
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
    std::vector<int> layers;
    for (int j = 0; j < k; ++j) layers.push_back((j * Ls) / k);  // spread over the source layers
    std::vector<float> scratch;
    auto one = [&] {  // what Transfer does for one target layer
      map_one_layer(*be, Xk.data(), XW, layers, F, Wk.data(), bk.data(), G, T, Yk.data(), G, scratch);
      map_one_layer(*be, Xv.data(), XW, layers, F, Wv.data(), bv.data(), G, T, Yv.data(), G, scratch);
      rope.apply_block(Yk.data(), T, H, pos.data());
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
