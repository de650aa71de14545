// GPU benchmark: moment accumulation through Moments on the CUDA backend against the cuBLAS SGEMM rate of
// the same backend on staged inputs, same run, same shapes: (1) fp32 inputs shifted on the host and copied; (2) the
// fit's path, stored bf16 keys converted, RoPE-stripped and shifted on the device. Rates are steady state (sums
// held); a round's end is timed apart (the fit pays it once per round, not per block): the fit's way since
// 2026-11-30, a 1/8 share (P = 8) copied to the host from the resident sums and the sums zeroed on the device
// (share_to_host_s, zero_resident_s); and the earlier way, every sum flushed to the host and zeroed there, then made
// resident again by the next block (flush_s, zero_live_s, first_block_of_round_s).
// Prints one JSON object. Without a GPU it prints the reason and exits 77.
//   crosskv-bench-gpu [Ls Hs Ds Lt Ht Dt rows blocks]   (default: Qwen3 14B -> 32B, 40x8x128 -> 64x8x128, 4096, 3)
//   crosskv-bench-gpu --fit CONFIG.yaml [cpu|cuda]      a whole fit in this process (no MPI), timed
//   crosskv-bench-gpu --factor [Ls Hs Ds rows]          the k = all system: host-assembled vs factor_cov (40 8 128)
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <random>
#include <vector>

#include "core/blas_kernels.hpp"
#include "backends/backends.hpp"
#include "backends/checks.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "fit/config.hpp"
#include "core/half.hpp"
#include "core/kv_spec.hpp"
#include "core/rope.hpp"
#include "core/memory.hpp"
#include "fit/moments.hpp"
#include "fit/fit_pipeline.hpp"
#include "fit/round.hpp"
#include "fit/calibration.hpp"

#include <spdlog/spdlog.h>
#include <string>

using namespace crosskv;
using Clock = std::chrono::steady_clock;

int fit_main(const std::string& config, const std::string& device) {
  spdlog::set_level(spdlog::level::info);
  FitConfig cfg = load_fit_config(config);
  auto be = device == "cpu" ? make_cpu_backend() : make_cuda_backend(0, 0, cfg.runtime.tf32);
  auto comm = make_single_comm();
  Context ctx{*comm, *be};
  const auto t0 = Clock::now();
  FitResult r = run_fit(cfg, FitOptions{}, ctx);
  const double s = std::chrono::duration<double>(Clock::now() - t0).count();
  std::printf("{\"backend\": \"%s\", \"fit_s\": %.2f, \"tokens\": %lld, \"passes\": %d, \"artifacts\": %zu}\n",
              be->name().c_str(), s, static_cast<long long>(r.tokens_read), r.passes, r.artifacts.size());
  return 0;
}

// The k = all system of one kind: Cxx + λI over every source layer, assembled on the host and uploaded (the fit's
// path until 2026-11-30: factor_system) against assembled by the backend from the fp32 blocks and factored there
// (factor_cov, as the fit does; "assemble_cov_s" is then only the host's terms, "factor_assembled_s" the rest).
// Same run, same moments; prints one JSON object.
int factor_main(int Ls, int H, int D, int64_t rows, ComputeBackend& be) {
  const PairDims d{Ls, H, D, 1, H, D};
  Moments m(d, std::vector<float>(d.X(), 0.0f), std::vector<float>(d.Y(), 0.0f));
  MomentPlan gram;
  for (int a = 0; a < Ls; ++a)
    for (int b = a; b < Ls; ++b) gram.gram.emplace_back(a, b);
  m.add_plan(gram);
  std::vector<float> X(rows * d.X()), Y(rows * d.Y(), 0.0f);
  uint64_t z = 7;
  for (auto& x : X) {
    z = z * 6364136223846793005ULL + 1442695040888963407ULL;
    x = static_cast<float>(static_cast<int32_t>(z >> 32)) * (1.0f / 2147483648.0f);
  }
  m.accumulate(be, X.data(), Y.data(), rows);
  m.release_sums(true);
  std::vector<int> all(Ls);
  for (int a = 0; a < Ls; ++a) all[a] = a;
  const int64_t n = d.X();
  BigVector<double> A(n * n);
  const double lambda = 0.01;
  auto t0 = Clock::now();
  m.covariances().cov_xx(all, A.data(), n);
  for (int64_t i = 0; i < n; ++i) A[i * n + i] += lambda;
  const double host_assemble_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  std::vector<double> diag(n);
  const auto host_made = be.factor_system(n, A.data(), n);  // uploaded and factored
  const double host_factor_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  const auto terms = m.covariances().cov_xx_terms(all);
  const double dev_assemble_s = std::chrono::duration<double>(Clock::now() - t0).count();  // the terms only
  t0 = Clock::now();
  const auto dev_made = be.factor_cov(terms, lambda, diag.data());  // assembled where it is factored
  const double dev_factor_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const std::vector<double>& pivots = host_made->pivots;
  const std::vector<double>& pivots2 = dev_made->pivots;
  const int64_t info_host = host_made->info, info_dev = dev_made->info;
  double max_rel = 0;
  for (int64_t i = 0; i < n; ++i) max_rel = std::max(max_rel, std::fabs(pivots2[i] - pivots[i]) / pivots[i]);
  std::printf("{\"backend\": \"%s\", \"features\": %lld, \"system_gb\": %.2f, \"host_assemble_s\": %.2f, "
              "\"upload_and_factor_s\": %.2f, \"assemble_cov_s\": %.2f, \"factor_assembled_s\": %.2f, "
              "\"speedup\": %.2f, \"info\": [%lld, %lld], \"pivots_max_rel_diff\": %.2e}\n",
              be.name().c_str(), static_cast<long long>(n), n * n * 8e-9, host_assemble_s, host_factor_s,
              dev_assemble_s, dev_factor_s, (host_assemble_s + host_factor_s) / (dev_assemble_s + dev_factor_s),
              static_cast<long long>(info_host), static_cast<long long>(info_dev), max_rel);
  return 0;
}

int main(int argc, char** argv) {
  // The kernels every figure is taken with, chosen before any BLAS call and printed with the results.
  std::fprintf(stderr, "%s\n", crosskv::select_blas_kernels().summary().c_str());
  if (argc >= 2 && std::string(argv[1]) == "--factor") {
    const bool cpu = std::getenv("CROSSKV_BENCH_CPU") != nullptr;
    if (!cpu && (!cuda_compiled_in() || cuda_device_count() == 0)) {
      std::printf("SKIPPED: no CUDA device\n");
      return 77;
    }
    int v[4] = {40, 8, 128, 2048};
    for (int i = 2; i < argc && i <= 5; ++i) v[i - 2] = std::atoi(argv[i]);
    try {
      auto be = cpu ? make_cpu_backend() : make_cuda_backend(0, 0, false);
      return factor_main(v[0], v[1], v[2], v[3], *be);
    } catch (const std::exception& e) {
      std::fprintf(stderr, "crosskv-bench-gpu: error: %s\n", e.what());
      return 1;
    }
  }
  if (argc >= 3 && std::string(argv[1]) == "--fit") {
    if ((argc < 4 || std::string(argv[3]) != "cpu") && (!cuda_compiled_in() || cuda_device_count() == 0)) {
      std::printf("SKIPPED: no CUDA device\n");
      return 77;
    }
    try {
      return fit_main(argv[2], argc >= 4 ? argv[3] : "cuda");
    } catch (const std::exception& e) {
      std::fprintf(stderr, "crosskv-bench-gpu: error: %s\n", e.what());
      return 1;
    }
  }
  // CROSSKV_BENCH_CPU=1 runs the same code on the CPU backend (a check of the benchmark itself, small shapes).
  const bool on_cpu = std::getenv("CROSSKV_BENCH_CPU") != nullptr;
  if (!on_cpu && (!cuda_compiled_in() || cuda_device_count() == 0)) {
    std::printf("SKIPPED: %s\n", cuda_compiled_in() ? "no CUDA device" : "built without CUDA");
    return 77;
  }
  int v[8] = {40, 8, 128, 64, 8, 128, 4096, 3};
  for (int i = 1; i < argc && i <= 8; ++i) v[i - 1] = std::atoi(argv[i]);
  const PairDims d{v[0], v[1], v[2], v[3], v[4], v[5]};
  const int64_t rows = v[6];
  const int blocks = v[7];
  // CROSSKV_TF32=1: cuBLAS may use TF32 tensor cores (runtime.tf32: true).
  auto be = on_cpu ? make_cpu_backend() : make_cuda_backend(0, 0, std::getenv("CROSSKV_TF32") != nullptr);
  // Uniform values in [-1, 1) from a cheap hash (a Gaussian generator takes longer than the benchmark on these sizes).
  std::vector<float> X(rows * d.X()), Y(rows * d.Y());
  auto fill = [](std::vector<float>& v, uint64_t seed) {
    uint64_t z = seed;
    for (auto& x : v) {
      z = z * 6364136223846793005ULL + 1442695040888963407ULL;
      x = static_cast<float>(static_cast<int32_t>(z >> 32)) * (1.0f / 2147483648.0f);
    }
  };
  fill(X, 1);
  fill(Y, 2);

  // Every rate below is steady state: sums already resident, the device synchronised before and after the timed
  // calls. The round trip of the sums (flush to the host at a round's end, copied up again by the next block) is
  // timed on its own: the fit pays it once per round, not per block.
  // Baseline: the backend's cuBLAS SGEMM on staged inputs into one resident [F x G] sum, repeated.
  const int64_t F = d.F(), G = d.G();
  std::vector<float> C(F * G, 0.0f);
  const auto held_c = be->hold_sums(C.data(), F * G, true);
  // The device's SGEMM peak on this many rows: one wide product [rows x W]^T [rows x W], W = 8192 (or less).
  const int64_t W = std::min<int64_t>({8192, d.X(), d.Y()});
  std::vector<float> CL(W * W, 0.0f);
  const auto held_cl = be->hold_sums(CL.data(), W * W, true);
  float* dC = held_c->at(C.data());
  float* dCL = held_cl->at(CL.data());
  be->begin_inputs();
  be->stage_inputs({ComputeBackend::floats(X.data(), rows * d.X()), ComputeBackend::floats(Y.data(), rows * d.Y())});
  be->cross_acc(rows, F, G, X.data(), d.X(), Y.data(), d.Y(), dC, G);    // warm-up, held
  be->cross_acc(rows, W, W, X.data(), d.X(), Y.data(), d.Y(), dCL, W);  // warm-up, held
  checks(*be).synchronize();
  const int reps = 50;
  auto t0 = Clock::now();
  for (int r = 0; r < reps; ++r)
    be->cross_acc(rows, F, G, X.data() + (r % d.Ls) * F, d.X(), Y.data() + (r % d.Lt) * G, d.Y(), dC, G);
  checks(*be).synchronize();
  const double block_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double block_gflops = reps * 2.0 * rows * F * G / block_s / 1e9;
  const int wide_reps = 10;
  t0 = Clock::now();
  for (int r = 0; r < wide_reps; ++r) be->cross_acc(rows, W, W, X.data(), d.X(), Y.data(), d.Y(), dCL, W);
  checks(*be).synchronize();
  const double wide_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double sgemm_gflops = wide_reps * 2.0 * rows * W * W / wide_s / 1e9;

  // Accumulation: every Gram and cross block (the one-pass fit's work), block after block.
  Moments m(d, std::vector<float>(d.X(), 0.1f), std::vector<float>(d.Y(), -0.1f));
  m.add_plan(MomentPlan::full(d, false));
  std::vector<float> Xb = X, Yb = Y;
  m.accumulate(*be, Xb.data(), Yb.data(), rows);  // warm-up: the sums become resident (zeroed on the device)
  checks(*be).synchronize();
  t0 = Clock::now();
  for (int b = 0; b < blocks; ++b) {
    Xb = X;
    Yb = Y;
    m.accumulate(*be, Xb.data(), Yb.data(), rows);
  }
  checks(*be).synchronize();
  const double acc_s = std::chrono::duration<double>(Clock::now() - t0).count();
  // A round's end the earlier way: every sum back to the host (released), then zeroed there once packed.
  t0 = Clock::now();
  m.release_sums(true);
  const double flush_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  LiveState::zero(m);
  const double zero_s = std::chrono::duration<double>(Clock::now() - t0).count();
  const double Xw = static_cast<double>(d.X()), Yw = static_cast<double>(d.Y());
  const double acc_flops = blocks * 2.0 * rows * (Xw * (Xw + F) / 2.0 + Xw * Yw);  // syrk-equivalent + cross
  const double acc_gflops = acc_flops / acc_s / 1e9;

  // The fit's own path: stored bf16 keys staged as they come from the shards (half the bytes), converted, RoPE
  // stripped and shifted on the device (the fused kernel), then the same blocks.
  std::vector<uint16_t> Xs(X.size()), Ys(Y.size());
  for (size_t i = 0; i < X.size(); ++i) Xs[i] = float_to_bf16(X[i]);
  for (size_t i = 0; i < Y.size(); ++i) Ys[i] = float_to_bf16(Y[i]);
  std::vector<int32_t> pos(rows);
  for (int64_t t = 0; t < rows; ++t) pos[t] = static_cast<int32_t>(t);
  KvSpec ss{d.Ls, d.Hs, d.Ds, d.Hs, {}}, ts{d.Lt, d.Ht, d.Dt, d.Ht, {}};
  ss.rope.theta = ts.rope.theta = 1e6;
  const Rope rs(ss), rt(ts);
  const std::vector<float> shx(d.X(), 0.1f), shy(d.Y(), -0.1f);
  std::vector<float> hx, hy;
  auto prepared_block = [&] {
    be->begin_inputs();
    be->stage_inputs({{Xs.data(), rows * d.X() * 2}, {Ys.data(), rows * d.Y() * 2}, {pos.data(), rows * 4}});
    const ComputeBackend::Strip sx{&rs, pos.data()}, sy{&rt, pos.data()};
    const float* x = be->prepare({Xs.data(), Dtype::bf16, rows, d.X()}, &sx, shx.data(), nullptr, hx);
    const float* y = be->prepare({Ys.data(), Dtype::bf16, rows, d.Y()}, &sy, shy.data(), nullptr, hy);
    m.accumulate_staged(*be, x, y, rows);
  };
  // The next round's first block holds the sums again (zeroed on the device: nothing crosses PCIe).
  t0 = Clock::now();
  prepared_block();
  checks(*be).synchronize();
  const double first_block_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  for (int b = 0; b < blocks; ++b) prepared_block();
  checks(*be).synchronize();
  const double prep_s = std::chrono::duration<double>(Clock::now() - t0).count();
  // A round's end with several readers (P = 8 here): the reduce-scatter reads the resident sums in place and only
  // this rank's 1/P share comes to the host (timed: the first 1/8 of the sums, device to host), then the sums are
  // zeroed where they are (on the device, staying resident).
  std::vector<ComputeBackend::SumPiece<float>> fp;
  std::vector<ComputeBackend::SumPiece<double>> dp;
  LiveState::pieces(m, fp, dp);
  const int64_t share_n = static_cast<int64_t>(LiveState::floats(m) / 8);
  std::vector<float> share(share_n);
  t0 = Clock::now();
  be->copy_sums(fp, 0, share_n, share.data(), false);
  const double share_s = std::chrono::duration<double>(Clock::now() - t0).count();
  t0 = Clock::now();
  LiveState::zero(m);
  checks(*be).synchronize();
  const double zero_resident_s = std::chrono::duration<double>(Clock::now() - t0).count();
  m.release_sums(true);
  const double prep_gflops = acc_flops / prep_s / 1e9;
  std::printf(
      "{\"device\": \"%s\", \"shape\": [%d, %d, %d, %d, %d, %d], \"rows\": %lld, \"blocks\": %d, "
      "\"sgemm_gflops\": %.1f, \"sgemm_one_block_gflops\": %.1f, \"accumulate_gflops\": %.1f, \"ratio\": %.3f, \"accumulate_s_per_block\": %.3f, "
      "\"tokens_per_s\": %.0f, \"prepared_bf16_gflops\": %.1f, \"prepared_ratio\": %.3f, "
      "\"prepared_s_per_block\": %.3f, \"prepared_tokens_per_s\": %.0f, \"sums_gib\": %.2f, \"flush_s\": %.2f, "
      "\"zero_live_s\": %.2f, \"first_block_of_round_s\": %.2f, \"share_gib\": %.4f, \"share_to_host_s\": %.3f, "
      "\"zero_resident_s\": %.3f}\n",
      be->name().c_str(), d.Ls, d.Hs, d.Ds, d.Lt, d.Ht, d.Dt, static_cast<long long>(rows), blocks, sgemm_gflops,
      block_gflops, acc_gflops, acc_gflops / sgemm_gflops, acc_s / blocks, blocks * rows / acc_s, prep_gflops,
      prep_gflops / sgemm_gflops, prep_s / blocks, blocks * rows / prep_s, m.bytes() / double(1 << 30), flush_s,
      zero_s, first_block_s, share_n * 4.0 / double(1 << 30), share_s, zero_resident_s);
  return 0;
}
