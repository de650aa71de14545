// The CUDA backend against the CPU backend (the oracle). Without CUDA or a GPU every test is SKIPPED with the
// reason (ctest reports it as skipped, never as passed).
#include <algorithm>
#include <cstring>
#include <deque>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <limits>
#include <map>
#include <random>
#include <set>
#include <tuple>

#include "backends/backends.hpp"
#include "backends/host/host_backend.hpp"
#include "core/half.hpp"
#include "core/host_kernels.hpp"
#include "core/mlp.hpp"
#include "fit/mlp_training.hpp"
#include "fit/moments.hpp"
#include "core/rope.hpp"
#include "core/thread_comm.hpp"
#include "fit/ridge.hpp"
#include "contract/shadow_backend.hpp"
#include "contract/twin_comm.hpp"
#include "helpers.hpp"
#include "reference_mapper.hpp"
#include "scalar_oracle.hpp"
#include "eval/layer_diagnostics.hpp"
#include "serve/serving_mapper.hpp"
#include "serve/transfer.hpp"
#include "artifact/mapper.hpp"
#include "fit/checkpoint.hpp"
#include "fit/validate.hpp"
#include "fit/plan.hpp"
#include "fit/round.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_compiled_in()) GTEST_SKIP() << "built without CUDA";
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
    before_ = cuda_device_info(0);
    gpu_ = make_cuda_backend(0);
    cpu_ = make_cpu_backend();
  }
  // On the emulated device every byte is accounted for: the backend gives back all it took (a GPU's driver and
  // libraries keep pools of their own, so the check is the emulation's).
  void TearDown() override {
    gpu_.reset();
    if (before_.name.find("emulated") == std::string::npos) return;
    EXPECT_EQ(cuda_device_info(0).free_bytes, before_.free_bytes) << "device memory not freed by the CUDA backend";
  }
  CudaDeviceInfo before_;
  std::unique_ptr<ComputeBackend> gpu_, cpu_;
};

std::vector<float> random_rows(int64_t n, uint64_t seed, float offset) {
  std::mt19937_64 rng(seed);
  std::normal_distribution<float> d(0.0f, 1.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = offset + d(rng);
  return v;
}

float max_abs(const std::vector<float>& v) {
  float m = 0;
  for (float x : v) m = std::max(m, std::fabs(x));
  return m;
}

}  // namespace

TEST_F(Cuda, MomentsMatchTheCpuOverManyBlocks) {
  const PairDims d{3, 2, 8, 4, 2, 8};
  MomentPlan plan = MomentPlan::full(d, true);
  Moments a(d, std::vector<float>(d.X(), 0.5f), std::vector<float>(d.Y(), -0.5f)), b(d, a.shift_x(), a.shift_y());
  a.add_plan(plan);
  b.add_plan(plan);
  int64_t total = 0;
  for (int blk = 0; blk < 5; ++blk) {  // more blocks than staging buffers
    const int64_t rows = 100 + 37 * blk;
    auto X = random_rows(rows * d.X(), 10 + blk, 0.7f), Y = random_rows(rows * d.Y(), 20 + blk, -0.3f);
    auto X2 = X, Y2 = Y;
    a.accumulate(*cpu_, X.data(), Y.data(), rows);
    b.accumulate(*gpu_, X2.data(), Y2.data(), rows);
    total += rows;
  }
  b.release_sums(true);
  std::vector<float> fa, fb;
  std::vector<double> da, db;
  pack_live(a, fa, da);
  pack_live(b, fb, db);
  ASSERT_EQ(fa.size(), fb.size());
  // fp32 sums of `total` products of O(1) values, in a different order: error ~ eps * sqrt(total) * magnitude.
  const float tol = 4 * 1.2e-7f * std::sqrt(static_cast<float>(total)) * max_abs(fa);
  for (size_t i = 0; i < fa.size(); ++i) ASSERT_NEAR(fa[i], fb[i], tol) << "element " << i;
  // Token statistics: fp64 sums of the same fp32 values in another order.
  ASSERT_EQ(da.size(), db.size());
  for (size_t i = 0; i < da.size(); ++i) ASSERT_NEAR(da[i], db[i], 1e-12 * total * (1 + std::fabs(da[i]))) << i;
}

TEST_F(Cuda, CholeskyAndSolvesMatchTheCpu) {
  const int64_t n = 300, lda = 310, nrhs = 7, ldb = 9;
  std::mt19937_64 rng(5);
  std::normal_distribution<double> nd(0, 1);
  std::vector<double> M(n * n);
  for (auto& x : M) x = nd(rng);
  std::vector<double> A(n * lda, 0.0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j < n; ++j) {
      double s = i == j ? 1.0 : 0.0;
      for (int64_t k = 0; k < n; ++k) s += M[i * n + k] * M[j * n + k] / n;
      A[i * lda + j] = s;
    }
  auto Lc = A, Lg = A;
  ASSERT_EQ(checks(*cpu_).cholesky(n, Lc.data(), lda), 0);
  ASSERT_EQ(checks(*gpu_).cholesky(n, Lg.data(), lda), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) ASSERT_NEAR(Lc[i * lda + j], Lg[i * lda + j], 1e-10) << i << "," << j;
  std::vector<double> B(n * ldb);
  for (auto& x : B) x = nd(rng);
  for (int64_t lead : {n, int64_t{120}}) {  // the whole factor and a leading block of it
    auto Bc = B, Bg = B;
    checks(*cpu_).cholesky_solve(lead, Lc.data(), lda, nrhs, Bc.data(), ldb);
    checks(*gpu_).cholesky_solve(lead, Lg.data(), lda, nrhs, Bg.data(), ldb);
    for (int64_t i = 0; i < lead; ++i)
      for (int64_t j = 0; j < nrhs; ++j) ASSERT_NEAR(Bc[i * ldb + j], Bg[i * ldb + j], 1e-9 * (1 + std::fabs(Bc[i * ldb + j])));
    for (bool t : {false, true}) {
      auto Tc = B, Tg = B;
      checks(*cpu_).triangular_solve(lead, Lc.data(), lda, t, nrhs, Tc.data(), ldb);
      checks(*gpu_).triangular_solve(lead, Lg.data(), lda, t, nrhs, Tg.data(), ldb);
      for (int64_t i = 0; i < lead; ++i)
        for (int64_t j = 0; j < nrhs; ++j) ASSERT_NEAR(Tc[i * ldb + j], Tg[i * ldb + j], 1e-9 * (1 + std::fabs(Tc[i * ldb + j])));
    }
  }
  // A host matrix that is not the factor any more (same address, new contents) is not served from the device.
  auto L2 = Lg;
  for (int64_t i = 0; i < n; ++i) L2[i * lda + i] *= 2;
  auto Bc = B, Bg = B;
  checks(*cpu_).cholesky_solve(n, L2.data(), lda, nrhs, Bc.data(), ldb);
  checks(*gpu_).cholesky_solve(n, L2.data(), lda, nrhs, Bg.data(), ldb);
  for (int64_t i = 0; i < n * ldb; i += ldb) ASSERT_NEAR(Bc[i], Bg[i], 1e-9 * (1 + std::fabs(Bc[i])));
}

// Factors are handles owning their device memory: many held at once (no fixed number kept), each solving like the
// CPU's factor of the same system, the host's matrix left as it was, and the pivots copied to the host.
TEST_F(Cuda, FactorHandlesOwnTheirDeviceMemory) {
  const int64_t n = 200, nrhs = 5;
  std::mt19937_64 rng(9);
  std::normal_distribution<double> nd(0, 1);
  auto spd = [&] {
    std::vector<double> M(n * n), A(n * n);
    for (auto& x : M) x = nd(rng);
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) {
        double s = i == j ? 1.0 : 0.0;
        for (int64_t k = 0; k < n; ++k) s += M[i * n + k] * M[j * n + k] / n;
        A[i * n + j] = s;
      }
    return A;
  };
  std::vector<std::vector<double>> systems;
  std::vector<ComputeBackend::FactorPtr> held;
  for (int i = 0; i < 6; ++i) {
    systems.push_back(spd());
    const auto before = systems.back();
    held.push_back(gpu_->factor_system(n, systems.back().data(), n));
    ASSERT_EQ(held.back()->info, 0);
    EXPECT_EQ(systems.back(), before) << "the host keeps what it had";
  }
  std::vector<double> B(n * nrhs);
  for (auto& x : B) x = nd(rng);
  for (size_t s = 0; s < systems.size(); ++s) {  // the oldest too: nothing was evicted
    auto L = systems[s];
    ASSERT_EQ(checks(*cpu_).cholesky(n, L.data(), n), 0);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(L[i * n + i], held[s]->pivots[i], 1e-10) << "pivot " << i;
    auto Bc = B, Bg = B;
    checks(*cpu_).cholesky_solve(n, L.data(), n, nrhs, Bc.data(), nrhs);
    gpu_->solve(*held[s], n, nrhs, Bg.data(), nrhs);
    for (size_t i = 0; i < B.size(); ++i) ASSERT_NEAR(Bc[i], Bg[i], 1e-9 * (1 + std::fabs(Bc[i])));
  }
  const auto recycled = gpu_->factor_system(n, systems[0].data(), n, std::move(held[1]));  // memory lent back
  EXPECT_EQ(recycled->pivots, held[0]->pivots);
}

TEST_F(Cuda, NotPositiveDefiniteReportsTheSameMinorAsTheCpu) {
  const int64_t n = 6;
  std::vector<double> A(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) A[i * n + i] = i == 3 ? -1.0 : 2.0;
  auto Ac = A, Ag = A;
  EXPECT_EQ(checks(*cpu_).cholesky(n, Ac.data(), n), 4);
  EXPECT_EQ(checks(*gpu_).cholesky(n, Ag.data(), n), 4);
}

TEST_F(Cuda, FitMatchesTheCpuFit) {
  TempDir dir;
  synthesize(small_synth(dir.str()));
  auto fit = [&](ComputeBackend& be, const std::string& out) {
    FitConfig cfg = parse_fit_config(
        config_yaml(dir.str(), "{k: [1, 3, all], lambda: 0.01, structure: [cross_head, per_head]}", out), "cfg.yaml");
    auto comm = make_single_comm();
    Context ctx{*comm, be};
    return run_fit(cfg, FitOptions{}, ctx);
  };
  fit(*cpu_, "cpu");
  fit(*gpu_, "gpu");
  fit(*gpu_, "gpu2");
  // Same device, same config: byte-identical artifacts (fixed kernels and reduction order, no atomics).
  const std::vector<std::string> folders = {"k1", "k3", "kall", "k1-per_head", "k3-per_head", "kall-per_head"};
  for (const std::string& k : folders)
    for (const auto& e : std::filesystem::directory_iterator(dir.str("gpu/" + k))) {
      if (e.path().extension() != ".safetensors") continue;
      std::ifstream a(e.path(), std::ios::binary), b(dir.str("gpu2/" + k + "/" + e.path().filename().string()), std::ios::binary);
      const std::string sa((std::istreambuf_iterator<char>(a)), {}), sb((std::istreambuf_iterator<char>(b)), {});
      EXPECT_TRUE(!sa.empty() && sa == sb) << e.path() << " differs between two GPU fits";
    }
  for (const std::string& k : folders) {
    MapperWeights c = load_mapper(dir.str("cpu/" + k)), g = load_mapper(dir.str("gpu/" + k));
    ASSERT_EQ(c.layers.size(), g.layers.size());
    for (size_t l = 0; l < c.layers.size(); ++l) {
      EXPECT_EQ(c.layers[l].source_layers, g.layers[l].source_layers) << k << " layer " << l;
      const float scale = std::max(1.0f, max_abs(c.layers[l].wk));
      for (size_t i = 0; i < c.layers[l].wk.size(); ++i)
        ASSERT_NEAR(c.layers[l].wk[i], g.layers[l].wk[i], 1e-4f * scale) << k << " layer " << l;
    }
  }
}

namespace {


}  // namespace

namespace {

// The device's element-wise work against the host code, on any backend that prepares on the device: the CUDA one
// (Cuda.* tests) and the shadow (DeviceContract.*, which keeps these checks honest without a GPU).
std::vector<RopeSpec> every_rope() {
  std::vector<RopeSpec> r(7);
  r[0].theta = 1e6;                                            // Qwen3: default, half
  r[1].convention = RopeConvention::interleaved;               // GPT-J style
  r[2].rotary_dim = 8;                                         // partial rotary
  r[3].type = "linear", r[3].factor = 4.0;                     //
  r[4].type = "llama3", r[4].theta = 5e5, r[4].factor = 8.0, r[4].low_freq_factor = 1.0, r[4].high_freq_factor = 4.0,
  r[4].original_max_position_embeddings = 8192;                //
  r[5].type = "yarn", r[5].factor = 16.0, r[5].original_max_position_embeddings = 16384;  // attention factor != 1
  r[6].type = "none";
  return r;
}

void check_prepare(ComputeBackend& dev) {
  const int L = 3, H = 2, D = 16;
  const int64_t rows = 37, cols = int64_t{L} * H * D;
  std::mt19937_64 rng(11);
  std::uniform_int_distribution<int32_t> posd(0, 200000);
  std::vector<int32_t> pos(rows);
  for (auto& p : pos) p = posd(rng);
  const auto x = random_rows(rows * cols, 12, 0.3f), shift = random_rows(cols, 13, 0.1f);
  std::vector<float> scale = random_rows(rows, 14, 0.f);  // sqrt of token weights (fit.weighting: dataset)
  for (float& s : scale) s = std::fabs(s) + 0.25f;
  std::vector<uint16_t> bf(x.size()), hf(x.size());
  for (size_t i = 0; i < x.size(); ++i) bf[i] = float_to_bf16(x[i]), hf[i] = float_to_fp16(x[i]);
  using S = Dtype;
  const ComputeBackend::StoredBlock blocks[] = {
      {x.data(), S::f32, rows, cols}, {hf.data(), S::f16, rows, cols}, {bf.data(), S::bf16, rows, cols}};
  std::vector<KvSpec> specs;
  for (const RopeSpec& rope : every_rope()) {
    specs.push_back(KvSpec{L, H, D, H, rope, {}, std::nullopt});
    if (rope.type == "none") continue;
    RopeSpec local = rope, none = rope;  // per layer: Gemma 3's local theta, and a layer without RoPE
    local.type = "default", local.theta = 1e4, none.type = "none";
    specs.push_back(KvSpec{L, H, D, H, rope,
                           {{Attention::sliding, 4, local}, {Attention::full, 0, rope}, {Attention::full, 0, none}},
                           std::nullopt});
  }
  for (const KvSpec& spec : specs) {
    const RopeSpec& rope = spec.rope;
    const Rope r(spec);
    for (const auto& in : blocks)
      for (bool strip : {false, true})
        for (int shifted = 0; shifted < 3; ++shifted) {  // none, shift, shift and row scale
          const std::string what = rope.type + (rope.convention == RopeConvention::interleaved ? " interleaved" : "") +
                                   (spec.layers.empty() ? "" : " per layer") + " rotary " +
                                   std::to_string(rope.rotary_dim) + ", dtype " +
                                   std::to_string(static_cast<int>(in.dtype)) + (strip ? ", strip" : "") +
                                   (shifted ? ", shift" : "") + (shifted == 2 ? ", row scale" : "");
          const ComputeBackend::Strip st{&r, pos.data()};
          const float* sh = shifted ? shift.data() : nullptr;
          const float* sc = shifted == 2 ? scale.data() : nullptr;
          std::vector<float> want, host, got(rows * cols);
          prepare_on_host(in, strip ? &st : nullptr, sh, sc, want);
          dev.begin_inputs();
          dev.stage_inputs({{in.data, rows * cols * (in.dtype == S::f32 ? 4 : 2)}, {pos.data(), rows * 4},
                            ComputeBackend::floats(scale.data(), rows)});
          const float* p = dev.prepare(in, strip ? &st : nullptr, sh, sc, host);
          checks(dev).download(p, rows * cols, got.data());
          // The angle is fp64 on both sides; cos/sin may differ in the last fp32 bit, products may fuse (FMA).
          for (int64_t i = 0; i < rows * cols; ++i)
            ASSERT_NEAR(want[i], got[i], 4e-6f * (1 + std::fabs(want[i]))) << what << ", element " << i;
        }
  }
}

void check_gather_and_stats(ComputeBackend& dev) {
  const int L = 3, H = 4, D = 8;
  const int64_t rows = 300, cols = int64_t{L} * H * D;
  const auto x = random_rows(rows * cols, 21, 0.5f);
  std::vector<float> want, host, got(rows * cols);
  make_cpu_backend()->gather_heads(rows, L, H, D, x.data(), want);
  std::vector<float> rw = random_rows(rows, 22, 0.f);  // row weights (sqrt of token weights)
  for (float& w : rw) w = std::fabs(w);
  dev.begin_inputs();
  dev.stage_inputs({ComputeBackend::floats(x.data(), rows * cols), ComputeBackend::floats(rw.data(), rows)});
  checks(dev).download(dev.gather_heads(rows, L, H, D, x.data(), host), rows * cols, got.data());
  ASSERT_EQ(want, got);  // a permutation
  std::vector<double> sum(cols, 1.0), sq(cols, 2.0), wsum = sum, wsq = sq;
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) wsum[c] += x[t * cols + c], wsq[c] += double{x[t * cols + c]} * x[t * cols + c];
  auto held_sum = dev.hold_sums(sum.data(), cols, false), held_sq = dev.hold_sums(sq.data(), cols, false);
  dev.column_stats(rows, cols, x.data(), cols, nullptr, held_sum->at(sum.data()), held_sq->at(sq.data()));
  dev.column_stats(rows / 2, cols / 2, x.data(), cols, nullptr, held_sum->at(sum.data()), nullptr);  // a sub-block
  dev.column_stats(rows, cols, x.data(), cols, rw.data(), held_sum->at(sum.data()), nullptr);  // weighted rows
  for (int64_t t = 0; t < rows / 2; ++t)
    for (int64_t c = 0; c < cols / 2; ++c) wsum[c] += x[t * cols + c];
  for (int64_t t = 0; t < rows; ++t)
    for (int64_t c = 0; c < cols; ++c) wsum[c] += double{rw[t]} * x[t * cols + c];
  held_sum->to_host();
  held_sq->to_host();
  for (int64_t c = 0; c < cols; ++c) {
    ASSERT_NEAR(sum[c], wsum[c], 1e-12 * rows * (1 + std::fabs(wsum[c]))) << "column " << c;
    ASSERT_NEAR(sq[c], wsq[c], 1e-12 * rows * (1 + wsq[c])) << "column " << c;
  }
}

void check_to_half(ComputeBackend& dev) {
  std::vector<float> v = random_rows(5000, 31, 0.f);
  for (float& x : v) x *= 1000.0f;
  std::vector<uint32_t> bits = {0x00000001u, 0x00800000u, 0x33800000u, 0x33000001u, 0x387fe000u, 0x38800000u,
                                0x477fefffu, 0x477ff000u, 0x47800000u, 0x7f800000u, 0xff800000u, 0x7fc00000u,
                                0x7f800001u, 0xffc00123u, 0x3f808000u, 0x3f818000u, 0x80000000u, 0x3f800001u};
  for (uint32_t b : bits) {
    float f;
    std::memcpy(&f, &b, 4);
    v.push_back(f);
    v.push_back(-f);
  }
  for (bool bf16 : {true, false}) {
    std::vector<uint16_t> want(v.size()), got(v.size());
    for (size_t i = 0; i < v.size(); ++i) want[i] = bf16 ? float_to_bf16(v[i]) : float_to_fp16(v[i]);
    checks(dev).to_half(v.data(), static_cast<int64_t>(v.size()), bf16, got.data());
    for (size_t i = 0; i < v.size(); ++i) ASSERT_EQ(want[i], got[i]) << (bf16 ? "bf16" : "fp16") << " of " << v[i];
  }
}

// Moments in rounds (sums written back, packed and zeroed between them), then a second pass over new blocks, then a
// round that starts from unpacked non-zero sums: held copies made zero on the device, or copied up, against the CPU
// backend.
void check_rounds_and_passes(ComputeBackend& dev) {
  const PairDims d{3, 2, 8, 4, 2, 8};
  auto cpu = make_cpu_backend();
  const std::vector<float> sx(d.X(), 0.5f), sy(d.Y(), -0.5f);
  Moments a(d, sx, sy), b(d, sx, sy);
  MomentPlan probe;
  for (int s = 0; s < d.Ls; ++s) probe.gram.emplace_back(s, s);
  probe.probe_heads = MomentPlan::all_heads(d);
  a.add_plan(probe);
  b.add_plan(probe);
  std::vector<float> fa, fb;
  std::vector<double> da, db;
  auto round = [&](uint64_t seed, const std::string& what) {
    int64_t total = 0;
    for (int blk = 0; blk < 3; ++blk) {
      const int64_t rows = 50 + 29 * blk;
      auto X = random_rows(rows * d.X(), seed + blk, 0.7f), Y = random_rows(rows * d.Y(), seed + 10 + blk, -0.3f);
      auto X2 = X, Y2 = Y;
      a.accumulate(*cpu, X.data(), Y.data(), rows);
      b.accumulate(dev, X2.data(), Y2.data(), rows);
      total += rows;
    }
    a.release_sums(true);
    b.release_sums(true);
    pack_live(a, fa, da);
    pack_live(b, fb, db);
    ASSERT_EQ(fa.size(), fb.size()) << what;
    ASSERT_GT(fa.size(), 0u) << what;
    const float tol = 4 * 1.2e-7f * std::sqrt(static_cast<float>(total)) * std::max(1.0f, max_abs(fa));
    for (size_t i = 0; i < fa.size(); ++i) ASSERT_NEAR(fa[i], fb[i], tol) << what << ", element " << i;
    ASSERT_EQ(da.size(), db.size()) << what;
    for (size_t i = 0; i < da.size(); ++i) ASSERT_NEAR(da[i], db[i], 1e-12 * total * (1 + std::fabs(da[i]))) << what;
  };
  round(100, "round 1");
  LiveState::zero(a);
  LiveState::zero(b);
  round(200, "round 2 (after zero_live)");
  a.mark_pass_complete();
  b.mark_pass_complete();
  const MomentPlan full = MomentPlan::full(d, false);
  a.add_plan(full);
  b.add_plan(full);
  round(300, "pass 2");
  const size_t pass2_floats = fa.size();
  EXPECT_EQ(pass2_floats, static_cast<size_t>(full.floats(d) - d.Ls * d.F() * d.F())) << "only new blocks are live";
  unpack_live(b, fa.data(), da.data());  // resumed from a checkpoint: non-zero sums to copy up
  round(400, "pass 2, from unpacked sums");
}

}  // namespace

TEST_F(Cuda, MomentsInRoundsAndPassesMatchTheCpu) { check_rounds_and_passes(*gpu_); }
TEST(DeviceContract, ShadowMomentsInRoundsAndPassesMatchTheCpu) {
  ShadowBackend shadow;
  check_rounds_and_passes(shadow);
  EXPECT_EQ(shadow.held, 4) << "one held copy per round";
  EXPECT_EQ(shadow.written_back, 4);
  EXPECT_EQ(shadow.live_held(), 0);
}

namespace {


// Two passes of two rounds, each ended by reduce_round (with two readers, or one), keys and values together: the
// device's shares, read from its sums where they are held (never written back), equal the CPU's (exactly when
// `exact`, else within the fp32 accumulation error); the sums stay held across rounds, zeroed there. At a pass's end
// the held copies are dropped and the moments overwritten (as the gathered shares do): nothing the device held may
// reach them later.
void check_round_end(ComputeBackend& dev, Comm& host_comm, Comm& dev_comm, bool exact) {
  const PairDims d{3, 2, 8, 4, 2, 8};
  auto cpu = make_cpu_backend();
  const std::vector<float> sx(d.X(), 0.5f), sy(d.Y(), -0.5f);
  Moments ka(d, sx, sy), va(d, sx, sy), kb(d, sx, sy), vb(d, sx, sy);  // a: CPU, b: the device
  MomentPlan probe;
  for (int s = 0; s < d.Ls; ++s) probe.gram.emplace_back(s, s);
  probe.probe_heads = MomentPlan::all_heads(d);
  for (Moments* m : {&ka, &va, &kb, &vb}) m->add_plan(probe);
  for (int pass = 1; pass <= 2; ++pass) {
    std::vector<float> fa, fb, uk, uv;
    std::vector<double> da, db, ukd, uvd;
    int64_t total = 0;
    for (int round = 0; round < 2; ++round) {
      const std::string what = "pass " + std::to_string(pass) + ", round " + std::to_string(round + 1);
      for (int blk = 0; blk < 2; ++blk) {
        const int64_t rows = 40 + 23 * blk + 7 * round;
        const uint64_t seed = 1000 * pass + 100 * round + 10 * blk;
        for (int kind = 0; kind < 2; ++kind) {
          auto X = random_rows(rows * d.X(), seed + 2 * kind, 0.7f);
          auto Y = random_rows(rows * d.Y(), seed + 2 * kind + 1, -0.3f);
          auto X2 = X, Y2 = Y;
          (kind ? va : ka).accumulate(*cpu, X.data(), Y.data(), rows);
          (kind ? vb : kb).accumulate(dev, X2.data(), Y2.data(), rows);
        }
        total += rows;
      }
      if (round == 1) {  // what the pass's gathered shares will hold (the CPU's sums of both rounds)
        pack_live(ka, uk, ukd);
        pack_live(va, uv, uvd);
      }
      reduce_round({ka, nullptr, va}, *cpu, host_comm, fa, da);
      reduce_round({kb, nullptr, vb}, dev, dev_comm, fb, db);
      ASSERT_EQ(fa.size(), fb.size()) << what;
      ASSERT_EQ(da.size(), db.size()) << what;
      ASSERT_GT(fa.size(), 0u) << what;
      const float tol = exact ? 0.0f : 8 * 1.2e-7f * std::sqrt(static_cast<float>(total)) * std::max(1.0f, max_abs(fa));
      for (size_t i = 0; i < fa.size(); ++i) ASSERT_NEAR(fa[i], fb[i], tol) << what << ", float " << i;
      for (size_t i = 0; i < da.size(); ++i)
        ASSERT_NEAR(da[i], db[i], exact ? 0.0 : 1e-12 * total * (1 + std::fabs(da[i]))) << what << ", double " << i;
    }
    for (Moments* m : {&ka, &va, &kb, &vb}) m->release_sums(false);
    // The moments now take the gathered values (here the CPU's own sums, for both sides) and the pass is complete.
    for (auto [m, f, dd] : {std::tuple{&ka, &uk, &ukd}, std::tuple{&va, &uv, &uvd}, std::tuple{&kb, &uk, &ukd},
                            std::tuple{&vb, &uv, &uvd}}) {
      unpack_live(*m, f->data(), dd->data());
      m->mark_pass_complete();
    }
    if (pass == 1)
      for (Moments* m : {&ka, &va, &kb, &vb}) m->add_plan(MomentPlan::full(d, false));
  }
  const std::vector<int> layers{0, 1, 2};
  const int64_t n = 3 * d.F();
  for (auto [a, b] : {std::pair{&ka, &kb}, std::pair{&va, &vb}}) {
    std::vector<double> xa(n * n), xb(n * n), ya(n * d.G()), yb(n * d.G());
    a->covariances().cov_xx(layers, xa.data(), n);
    b->covariances().cov_xx(layers, xb.data(), n);
    a->covariances().cov_xy(layers, 2, ya.data(), d.G());
    b->covariances().cov_xy(layers, 2, yb.data(), d.G());
    ASSERT_EQ(xa, xb);
    ASSERT_EQ(ya, yb);
  }
}

}  // namespace

TEST_F(Cuda, PrepareMatchesTheHostForEveryDtypeAndRope) { check_prepare(*gpu_); }
TEST_F(Cuda, GatherHeadsAndColumnStatsMatchTheHost) { check_gather_and_stats(*gpu_); }
TEST_F(Cuda, ToHalfMatchesTheHostBitForBit) { check_to_half(*gpu_); }
namespace {

// A Moments' live state as pack_live lays it out.
std::pair<std::vector<float>, std::vector<double>> packed(const Moments& m) {
  std::pair<std::vector<float>, std::vector<double>> p;
  pack_live(m, p.first, p.second);
  return p;
}

// copy_sums over windows that cut blocks anywhere (mid-row, inside a panel's strided rows, across blocks and across
// the float/double boundary of two kinds) gives the values of pack_live's order; the device reads resident sums.
void check_copy_windows(ComputeBackend& dev, bool exact) {
  const PairDims d{3, 2, 8, 4, 2, 8};
  auto cpu = make_cpu_backend();
  const std::vector<float> sx(d.X(), 0.5f), sy(d.Y(), -0.5f);
  Moments a(d, sx, sy), b(d, sx, sy);
  MomentPlan plan = MomentPlan::full(d, true);
  plan.cross.erase(plan.cross.begin() + 5);  // one source layer's cross row is not whole: single blocks too
  a.add_plan(plan);
  b.add_plan(plan);
  const int64_t rows = 57;
  auto X = random_rows(rows * d.X(), 51, 0.7f), Y = random_rows(rows * d.Y(), 52, -0.3f);
  auto X2 = X, Y2 = Y;
  a.accumulate(*cpu, X.data(), Y.data(), rows);
  b.accumulate(dev, X2.data(), Y2.data(), rows);
  std::vector<float> want;
  std::vector<double> wantd;
  pack_live(a, want, wantd);
  std::vector<ComputeBackend::SumPiece<float>> fp;
  std::vector<ComputeBackend::SumPiece<double>> dp;
  LiveState::pieces(b, fp, dp);
  const auto n = static_cast<int64_t>(want.size()), nd = static_cast<int64_t>(wantd.size());
  ASSERT_EQ(fp.back().at + fp.back().rows * fp.back().cols, n);
  ASSERT_EQ(dp.back().at + dp.back().rows * dp.back().cols, nd);
  const float tol = exact ? 0.0f : 4 * 1.2e-7f * std::sqrt(float{rows}) * std::max(1.0f, max_abs(want));
  std::mt19937_64 rng(53);
  for (int w = 0; w < 200; ++w) {
    int64_t off = static_cast<int64_t>(rng() % n), len = 1 + static_cast<int64_t>(rng() % (n - off));
    if (w == 0) off = 0, len = n;
    if (w == 1) off = 3, len = 5;  // inside the first row of the first block
    std::vector<float> got(len, std::numeric_limits<float>::quiet_NaN());
    dev.copy_sums(fp, off, len, got.data(), false);
    for (int64_t i = 0; i < len; ++i) ASSERT_NEAR(want[off + i], got[i], tol) << "window " << off << "+" << len;
  }
  for (int64_t off = 0; off < nd; off += 7) {
    const int64_t len = std::min<int64_t>(11, nd - off);
    std::vector<double> got(len);
    dev.copy_sums(dp, off, len, got.data(), false);
    for (int64_t i = 0; i < len; ++i)
      ASSERT_NEAR(wantd[off + i], got[i], exact ? 0.0 : 1e-12 * rows * (1 + std::fabs(wantd[off + i])));
  }
  b.release_sums(true);
  // And back: windows placed into fresh moments (place_sums, as the pass's gather does) give the same packed state.
  Moments c(d, sx, sy);
  c.add_plan(plan);
  std::vector<ComputeBackend::SumPiece<float>> cp;
  std::vector<ComputeBackend::SumPiece<double>> cd;
  LiveState::pieces(c, cp, cd);
  for (int64_t off = 0, len = 1; off < n; off += len, len = 1 + static_cast<int64_t>(rng() % 97))
    place_sums(cp, off, std::min(len, n - off), want.data() + off);
  LiveState::unpack_doubles(c, wantd.data());
  EXPECT_EQ(packed(c), std::make_pair(want, wantd));
}

}  // namespace

namespace {

// Cxx + λI of source layers in a mixed order (blocks read as stored, transposed and from their upper triangle),
// assembled by the backend and factored there, against the host's cov_xx: the same diagonal bit for bit, and the
// same solution of a system (exactly on the shadow; within fp64 factor round-off on a GPU).
void check_assembled_factor(ComputeBackend& dev, bool exact) {
  const PairDims d{3, 2, 8, 4, 2, 8};
  auto cpu = make_cpu_backend();
  Moments m(d, std::vector<float>(d.X(), 0.5f), std::vector<float>(d.Y(), -0.5f));
  m.add_plan(MomentPlan::full(d, false));
  const int64_t rows = 300;
  auto X = random_rows(rows * d.X(), 61, 0.7f), Y = random_rows(rows * d.Y(), 62, -0.3f);
  m.accumulate(*cpu, X.data(), Y.data(), rows);
  const double lambda = 0.01;
  for (const std::vector<int>& order : {std::vector<int>{2, 0, 1}, std::vector<int>{1}, std::vector<int>{0, 2}}) {
    const int64_t n = static_cast<int64_t>(order.size()) * d.F(), nrhs = 5;
    std::vector<double> want(n * n);
    m.covariances().cov_xx(order, want.data(), n);
    for (int64_t i = 0; i < n; ++i) want[i * n + i] += lambda;
    std::vector<double> diag(n);
    const auto f = dev.factor_cov(m.covariances().cov_xx_terms(order), lambda, diag.data());
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(want[i * n + i], diag[i]) << "diagonal " << i;
    ASSERT_EQ(checks(*cpu).cholesky(n, want.data(), n), 0);
    ASSERT_EQ(f->info, 0);
    ASSERT_EQ(f->n, n);
    for (int64_t i = 0; i < n; ++i) ASSERT_NEAR(want[i * n + i], f->pivots[i], exact ? 0.0 : 1e-12 * want[i * n + i]);
    const auto b = random_rows(n * nrhs, 63, 0.0f);
    std::vector<double> xw(b.begin(), b.end()), xg = xw;
    checks(*cpu).cholesky_solve(n, want.data(), n, nrhs, xw.data(), nrhs);
    dev.solve(*f, n, nrhs, xg.data(), nrhs);
    for (int64_t i = 0; i < n * nrhs; ++i)
      ASSERT_NEAR(xw[i], xg[i], exact ? 0.0 : 1e-9 * (1 + std::fabs(xw[i]))) << "layers " << order.size() << ", " << i;
  }
}

}  // namespace

TEST_F(Cuda, SystemsAssembledOnTheDeviceMatchTheHost) { check_assembled_factor(*gpu_, false); }
TEST(DeviceContract, SystemsAssembledByTheBackendMatchTheHost) {
  check_assembled_factor(*make_cpu_backend(), true);
  ShadowBackend shadow;
  check_assembled_factor(shadow, true);
  EXPECT_EQ(shadow.assembled, 3);
}

TEST_F(Cuda, CopySumsOfAnyWindowFollowsThePackOrder) { check_copy_windows(*gpu_, false); }
TEST(DeviceContract, CopySumsOfAnyWindowFollowsThePackOrder) {
  check_copy_windows(*make_cpu_backend(), true);  // the host default
  ShadowBackend shadow;
  check_copy_windows(shadow, true);
}
TEST_F(Cuda, RoundEndsReadTheResidentSumsInPlace) {
  TwinComm twin(false);
  check_round_end(*gpu_, twin, twin, false);
}
TEST(DeviceContract, ShadowRoundEndsReadTheResidentSumsInPlace) {
  for (bool device_buffers : {false, true}) {
    ShadowBackend shadow;
    TwinComm host_twin(false), dev_twin(device_buffers);
    check_round_end(shadow, host_twin, dev_twin, true);
    const std::string what = device_buffers ? "device buffers" : "host buffers";
    EXPECT_EQ(shadow.written_back, 0) << what << ": round ends read the held copies where they are";
    EXPECT_EQ(shadow.held, 4) << what << ": one held copy per kind and pass, kept across rounds";
    EXPECT_EQ(shadow.dropped, 4) << what << ": each dropped at its pass's end";
    EXPECT_EQ(shadow.live_held(), 0) << what;
    EXPECT_EQ(shadow.copies_to_device > 0, device_buffers) << what;
  }
}

namespace {

// One reader: its share of a pass is its moments. Each round's checkpoint reads the sums where they are (a device's
// held copies; the shadow device poisons the host copies until the pass's write-back), the sums run on across rounds,
// and a state read back, whole or deferred straight into fresh moments, holds the CPU's sums.
void check_one_reader_checkpoints(ComputeBackend& dev, bool exact) {
  const PairDims d{3, 2, 8, 4, 2, 8};
  auto cpu = make_cpu_backend();
  auto comm = make_single_comm();
  TempDir dir;
  const nlohmann::json identity = {{"job", "one reader"}};
  const std::vector<float> sx(d.X(), 0.5f), sy(d.Y(), -0.5f);
  const MomentPlan plan = MomentPlan::full(d, true);
  Moments a(d, sx, sy), b(d, sx, sy);  // a: CPU, b: the device
  a.add_plan(plan);
  b.add_plan(plan);
  LiveSums live{&dev, {}, {}};
  b.hold_sums(dev);  // held first: the pieces name the held copies
  LiveState::pieces(b, live.f, live.d);
  CheckpointStore store(dir.str("ck"), identity, *comm);
  PassState state;
  int64_t total = 0;
  for (int round = 0; round < 3; ++round) {
    for (int blk = 0; blk < 2; ++blk) {
      const int64_t rows = 30 + 11 * blk + 5 * round;
      auto X = random_rows(rows * d.X(), 700 + 10 * round + blk, 0.7f), Y = random_rows(rows * d.Y(), 800 + round, -0.3f);
      auto X2 = X, Y2 = Y;
      a.accumulate(*cpu, X.data(), Y.data(), rows);
      b.accumulate(dev, X2.data(), Y2.data(), rows);
      total += rows;
    }
    state.rounds_done = round + 1;
    store.save(state, &live);
    std::vector<float> want;
    std::vector<double> wantd;
    pack_live(a, want, wantd);
    auto got = CheckpointStore(dir.str("ck"), identity, *comm).load();
    ASSERT_TRUE(got.has_value());
    EXPECT_EQ(got->rounds_done, round + 1);
    ASSERT_EQ(got->pass1_f.size(), want.size());
    ASSERT_EQ(got->pass1_d.size(), wantd.size());
    const float tol = exact ? 0.0f : 8 * 1.2e-7f * std::sqrt(static_cast<float>(total)) * std::max(1.0f, max_abs(want));
    for (size_t i = 0; i < want.size(); ++i) ASSERT_NEAR(want[i], got->pass1_f[i], tol) << "round " << round << ", float " << i;
    for (size_t i = 0; i < wantd.size(); ++i)
      ASSERT_NEAR(wantd[i], got->pass1_d[i], exact ? 0.0 : 1e-12 * total * (1 + std::fabs(wantd[i]))) << "double " << i;
  }
  b.release_sums(true);  // the pass's end: the host moments are current
  std::vector<float> fb;
  std::vector<double> db;
  pack_live(b, fb, db);
  auto got = CheckpointStore(dir.str("ck"), identity, *comm).load({.defer_latest_sums = true});
  ASSERT_TRUE(got.has_value() && got->deferred.has_value());
  EXPECT_TRUE(got->pass1_f.empty()) << "deferred sums are not read by load";
  Moments c(d, sx, sy);
  c.add_plan(plan);
  LiveSums into;
  LiveState::pieces(c, into.f, into.d);
  const std::vector<double> doubles = read_deferred(*got->deferred, into.f);
  LiveState::unpack_doubles(c, doubles.data());
  EXPECT_EQ(packed(c), std::make_pair(fb, db));
  // Moments of another plan do not take the state: the error names the file and both counts.
  Moments e(d, sx, sy);
  e.add_plan(MomentPlan::full(d, false));
  LiveSums other;
  LiveState::pieces(e, other.f, other.d);
  try {
    read_deferred(*got->deferred, other.f);
    ADD_FAILURE() << "a state of another size was read";
  } catch (const InputError& err) {
    EXPECT_NE(std::string(err.what()).find(got->deferred->path + ": the checkpoint holds " + std::to_string(fb.size())),
              std::string::npos) << err.what();
    EXPECT_NE(std::string(err.what()).find("use --fresh"), std::string::npos) << err.what();
  }
}

}  // namespace

TEST_F(Cuda, OneReaderCheckpointsReadTheResidentSums) { check_one_reader_checkpoints(*gpu_, false); }
TEST(DeviceContract, OneReaderCheckpointsReadTheResidentSums) {
  ShadowBackend shadow;
  check_one_reader_checkpoints(shadow, true);
  EXPECT_EQ(shadow.written_back, 1) << "only the pass's end";
  EXPECT_EQ(shadow.live_held(), 0);
}
TEST(DeviceContract, ShadowPrepareGatherAndStatsMatchTheHost) {
  ShadowBackend shadow;
  check_prepare(shadow);
  check_gather_and_stats(shadow);
  check_to_half(shadow);
}

TEST(DeviceContract, AFitThroughAShadowDeviceEqualsTheCpuFit) {
  TempDir dir;
  synthesize(small_synth(dir.str()));
  auto cpu = make_cpu_backend();
  ShadowBackend shadow;
  for (const std::string probe : {"same_head", "all_heads"})
    for (const std::string extra : {"", "runtime: {block_tokens: 200, max_moment_gib: 0.00001}\n"}) {
      auto fit = [&](ComputeBackend& be, const std::string& out) {
        std::string y = config_yaml(dir.str(), "{k: [1, 3, all], lambda: 0.01, probe: " + probe + "}", out);
        if (!extra.empty()) y.replace(y.find("runtime: {block_tokens: 200}\n"), 29, extra);
        auto comm = make_single_comm();
        Context ctx{*comm, be};
        spdlog::set_level(spdlog::level::warn);
        return run_fit(parse_fit_config(y, "cfg.yaml"), FitOptions{}, ctx);
      };
      const std::string tag = probe + (extra.empty() ? "-1pass" : "-2pass");
      fit(*cpu, "cpu-" + tag);
      const int held = shadow.held, written_back = shadow.written_back, dropped = shadow.dropped;
      const int assembled_before = shadow.assembled;
      fit(shadow, "shadow-" + tag);
      // Kinds held once per pass (keys, values, and raw keys for the all-heads probe), each written back once.
      EXPECT_GE(shadow.held - held, extra.empty() ? 2 : 4) << tag;
      EXPECT_EQ(shadow.written_back - written_back, shadow.held - held) << "one reader: its sums to the host once";
      EXPECT_EQ(shadow.dropped, dropped) << "one reader reduces nothing: its checkpoints read the sums in place";
      EXPECT_EQ(shadow.live_held(), 0) << tag;
      EXPECT_GT(shadow.assembled, assembled_before) << "the ridge systems are assembled by the backend";
      for (const std::string k : {"k1", "k3", "kall"}) {
        MapperWeights c = load_mapper(dir.str("cpu-" + tag + "/" + k)), s = load_mapper(dir.str("shadow-" + tag + "/" + k));
        for (size_t l = 0; l < c.layers.size(); ++l) {
          ASSERT_EQ(c.layers[l].source_layers, s.layers[l].source_layers) << tag << " " << k << " layer " << l;
          const float scale = std::max(1.0f, max_abs(c.layers[l].wk));
          for (size_t i = 0; i < c.layers[l].wk.size(); ++i)
            ASSERT_NEAR(c.layers[l].wk[i], s.layers[l].wk[i], 1e-5f * scale) << tag << " " << k << " layer " << l;
        }
      }
    }
}

// A mapper fitted on the CPU (small_synth, one k), and held-out caches with target positions of their own.
namespace {

std::string fitted_mapper(TempDir& dir, const std::string& k, const std::string& structure = "cross_head") {
  synthesize(small_synth(dir.str()));
  auto comm = make_single_comm();
  auto cpu = make_cpu_backend();
  Context ctx{*comm, *cpu};
  spdlog::set_level(spdlog::level::warn);
  run_fit(parse_fit_config(config_yaml(dir.str(), "{k: [" + k + "], structure: " + structure + "}", "out"), "cfg.yaml"),
          FitOptions{}, ctx);
  return dir.str(std::string("out/") + mapper_folder_name(k, *parse_structure(structure)));
}

struct ServingCase {
  Cache cache;
  std::vector<int32_t> target_positions;
};
ServingCase serving_case(const std::string& dir) {
  ServingCase c{read_cache(dir + "/source/web/shard-000.h5", false), {}};
  c.target_positions = c.cache.positions;
  for (auto& p : c.target_positions) p += 7;
  return c;
}

}  // namespace

// A resident Transfer reads every layer file once and keeps the weights on the backend (a ServingMapper over every
// layer); mapped through the shadow device it equals the CPU.
TEST(DeviceContract, ResidentTransferReadsItsWeightsOnceAndMatchesTheCpu) {
  TempDir dir;
  const std::string mapper = fitted_mapper(dir, "2");
  auto cpu = make_cpu_backend();
  ShadowBackend shadow;
  const MapperWeights m = load_mapper(mapper);
  const int64_t rows = 5, XW = int64_t{m.source.n_layers} * m.source.features_per_layer(),
                YW = int64_t{m.target.n_layers} * m.target.features_per_layer();
  const auto X = random_rows(rows * XW, 41, 0.1f);
  std::vector<float> want(rows * YW), got(rows * YW);
  Transfer tc(mapper, *cpu, TransferOptions{true, true, true});
  Transfer ts(mapper, shadow, TransferOptions{true, true, true});
  for (int pass = 0; pass < 2; ++pass) {  // the second pass maps every layer with the weights already held
    tc.map_content(Kind::k, X.data(), rows, want.data());
    ts.map_content(Kind::v, X.data(), rows, got.data());
    ts.map_content(Kind::k, X.data(), rows, got.data());
    ASSERT_EQ(want, got) << "pass " << pass;
  }
  EXPECT_EQ(ts.layer_loads(), m.target.n_layers);
}

// The serving apply through the shadow device: every kernel's operand is the backend's memory (a host array would be
// a fault on a GPU), host arrays cross by copy alone, a caller's stream is waited for and signalled, and the
// results equal the CPU's bit for bit; the backend's memory is released with the transfer.
TEST(DeviceContract, ServingApplyKeepsEveryOperandOnTheDeviceAndMatchesTheCpu) {
  for (const std::string k : {"1", "2", "all"}) {
    TempDir dir;
    const std::string mapper = fitted_mapper(dir, k);
    const ServingCase c = serving_case(dir.str());
    const int64_t rows = c.cache.tokens;
    auto cpu = make_cpu_backend();
    ShadowBackend shadow;
    shadow.device_memory = true;
    {
      Transfer want_tr(mapper, *cpu);
      ServingMapper rt(mapper, shadow);
      const int64_t XW = int64_t{rt.source().n_layers} * rt.source().features_per_layer(),
                    YW = int64_t{rt.target().n_layers} * rt.target().features_per_layer();
      std::vector<float> wk(rows * YW), wv(rows * YW), hk(rows * YW), hv(rows * YW), dk(rows * YW), dv(rows * YW);
      want_tr.apply(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(),
                    c.target_positions.data(), rows, wk.data(), wv.data());
      rt.apply_host(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(), c.target_positions.data(),
                    rows, hk.data(), hv.data());
      EXPECT_EQ(wk, hk) << "k=" << k;
      EXPECT_EQ(wv, hv) << "k=" << k;
      // Caches already in device memory, ordered with a caller's stream.
      auto keys = shadow.allocate(rows * XW * 4), values = shadow.allocate(rows * XW * 4),
           pos = shadow.allocate(rows * 8), ok = shadow.allocate(rows * YW * 4), ov = shadow.allocate(rows * YW * 4);
      shadow.copy_from_host(c.cache.keys.data(), rows * XW * 4, keys->data);
      shadow.copy_from_host(c.cache.values.data(), rows * XW * 4, values->data);
      shadow.copy_from_host(c.cache.positions.data(), rows * 4, pos->data);
      shadow.copy_from_host(c.target_positions.data(), rows * 4, pos->as<int32_t>() + rows);
      int user_stream = 0;
      const int gemms = shadow.gemm_calls, gathers = shadow.gathers, Lt = rt.target().n_layers;
      rt.apply({keys->as<float>(), values->as<float>(), pos->as<int32_t>(), pos->as<int32_t>() + rows, rows,
                ok->as<float>(), ov->as<float>(), {}},
               &user_stream);
      // Per kind: k = all is one batched product over every layer, k = 2 one gather and one batched product for
      // the chunk of all layers, k = 1 a product per layer reading the cache in place.
      EXPECT_EQ(shadow.gemm_calls - gemms, k == "1" ? 2 * Lt : 2) << "k=" << k;
      EXPECT_EQ(shadow.gathers - gathers, k == "2" ? 2 : 0) << "k=" << k;
      shadow.copy_to_host(ok->data, rows * YW * 4, dk.data());
      shadow.copy_to_host(ov->data, rows * YW * 4, dv.data());
      EXPECT_EQ(wk, dk) << "k=" << k;
      EXPECT_EQ(wv, dv) << "k=" << k;
      EXPECT_EQ(shadow.stream_waits, 1);
      EXPECT_EQ(shadow.stream_signals, 1);
      EXPECT_EQ(shadow.last_stream, &user_stream);
    }
    EXPECT_EQ(shadow.live_allocations(), 0) << "the transfer's weights and scratch are released with it";
  }
}

// The device's free memory caps the moments per rank: a device with room for the probe blocks but not for every
// block gets a two-pass fit (the same artifacts as the CPU's two-pass fit); one too small even for the inputs is
// refused at once, naming the setting.
TEST(DeviceContract, TheDevicesFreeMemoryShapesThePlan) {
  TempDir dir;
  synthesize(small_synth(dir.str()));
  const FitConfig cfg = parse_fit_config(config_yaml(dir.str(), "{k: [1, all]}", "dev"), "cfg.yaml");
  const Calibration cal = validate(cfg);
  const PairDims d = cal.dims();
  const double read_bpt = 2.0 * (d.X() + d.Y()) * 4.0;
  const FitPlan one = make_plan(d, cal.tokens_used, cfg.fit.ks, cfg.fit.probe, 1e9, read_bpt);
  const FitPlan two = make_plan(d, cal.tokens_used, cfg.fit.ks, cfg.fit.probe, 1e-9, read_bpt);
  ASSERT_TRUE(one.single_pass);
  ASSERT_FALSE(two.single_pass);
  ASSERT_LT(two.rank_moment_bytes, one.rank_moment_bytes);
  const double inputs = 2.0 * cfg.runtime.block_tokens * static_cast<double>(d.X() + d.Y()) * 16.0;
  ShadowBackend shadow;
  shadow.free_bytes = static_cast<int64_t>((inputs + (one.rank_moment_bytes + two.rank_moment_bytes) / 2.0) / 0.9);
  auto comm = make_single_comm();
  Context ctx{*comm, shadow};
  spdlog::set_level(spdlog::level::warn);
  const FitResult r = run_fit(cfg, FitOptions{}, ctx);
  EXPECT_EQ(r.passes, 2);
  FitConfig cpu_cfg = parse_fit_config(config_yaml(dir.str(), "{k: [1, all]}", "cpu"), "cfg.yaml");
  cpu_cfg.runtime.max_moment_gib = 1e-9;  // two passes on the CPU too
  auto cpu = make_cpu_backend();
  Context cctx{*comm, *cpu};
  run_fit(cpu_cfg, FitOptions{}, cctx);
  for (const std::string k : {"k1", "kall"}) {
    MapperWeights c = load_mapper(dir.str("cpu/" + k)), g = load_mapper(dir.str("dev/" + k));
    for (size_t l = 0; l < c.layers.size(); ++l) {
      const float scale = std::max(1.0f, max_abs(c.layers[l].wk));
      for (size_t i = 0; i < c.layers[l].wk.size(); ++i)
        ASSERT_NEAR(c.layers[l].wk[i], g.layers[l].wk[i], 1e-5f * scale) << k << " layer " << l;
    }
  }
  FitConfig small = cfg;
  small.output.dir = dir.str("small");
  shadow.free_bytes = 1000;
  expect_error<ConfigError>([&] { run_fit(small, FitOptions{}, ctx); },
                            {"cfg.yaml: runtime.block_tokens: 200 tokens per block need",
                             "of device memory for inputs alone"});
  shadow.free_bytes = static_cast<int64_t>((inputs + two.rank_moment_bytes / 2.0) / 0.9);  // not even two passes
  expect_error<ConfigError>([&] { run_fit(small, FitOptions{}, ctx); },
                            {"cfg.yaml: runtime.layer_groups: a rank's moments need", "beside its inputs"});
}

// ---- Held-out diagnostics on the device: strided-batched GEMMs, syevd, and one layer's figures against the CPU's.
TEST_F(Cuda, BatchedGemmOfEveryTransposeAndStrideMatchesTheCpu) {
  const int64_t m = 37, n = 29, k = 45, batch = 3;
  const auto A = random_rows(batch * 64 * 64, 1, 0.0f), B = random_rows(batch * 64 * 64, 2, 0.0f);
  uint64_t seed = 0;
  for (bool ta : {false, true})
    for (bool tb : {false, true})
      for (int64_t stride_b : {int64_t{0}, int64_t{64 * 64}})
        for (float beta : {1.0f, 0.0f}) {  // beta 0: C's values between the outputs stay as they were
          ComputeBackend::BatchedGemm g;
          g.trans_a = ta, g.trans_b = tb, g.m = m, g.n = n, g.k = k, g.alpha = 0.5f, g.beta = beta;
          g.A = A.data(), g.lda = 64, g.stride_a = 64 * 64, g.B = B.data(), g.ldb = 64, g.stride_b = stride_b;
          g.ldc = 40, g.stride_c = 40 * 40, g.batch = batch;
          // A new C each time: values left from an earlier product must not pass for the ones kept between outputs.
          std::vector<float> c_cpu = random_rows(batch * 40 * 40, 3 + seed++, 0.0f), c_gpu = c_cpu;
          g.C = c_cpu.data();
          cpu_->gemm_batched(g);
          g.C = c_gpu.data();
          gpu_->gemm_batched(g);
          for (size_t i = 0; i < c_cpu.size(); ++i)
            ASSERT_NEAR(c_gpu[i], c_cpu[i], 1e-4f * (1 + std::fabs(c_cpu[i])))
                << "trans " << ta << tb << ", stride_b " << stride_b << ", beta " << beta << ", element " << i;
        }
}

TEST_F(Cuda, SymmetricEigenMatchesTheCpu) {
  const int64_t n = 24;
  const auto X = random_rows(100 * n, 4, 0.0f);
  std::vector<double> A(n * n, 0.0);
  for (int64_t t = 0; t < 100; ++t)
    for (int64_t i = 0; i < n; ++i)
      for (int64_t j = 0; j < n; ++j) A[i * n + j] += double(X[t * n + i]) * X[t * n + j];
  auto a_cpu = A, a_gpu = A;
  std::vector<double> w_cpu(n), w_gpu(n);
  cpu_->symmetric_eigen(n, a_cpu.data(), n, w_cpu.data());
  gpu_->symmetric_eigen(n, a_gpu.data(), n, w_gpu.data());
  for (int64_t i = 0; i < n; ++i) {
    EXPECT_NEAR(w_gpu[i], w_cpu[i], 1e-9 * w_cpu.back());
    double dot = 0;  // eigenvectors (columns) equal up to sign
    for (int64_t r = 0; r < n; ++r) dot += a_gpu[r * n + i] * a_cpu[r * n + i];
    EXPECT_NEAR(std::fabs(dot), 1.0, 1e-8) << "eigenvector " << i;
  }
}

namespace {

// One random target layer (GQA, RoPE, sequences of several lengths) and a noisy prediction of it.
struct RandomLayer {
  std::vector<int32_t> positions;
  std::vector<int64_t> offsets = {0, 70, 71, 300};
  LayerTruth truth;
  std::vector<float> keys, values;
  RandomLayer() {
    KvSpec s;
    s.n_layers = 1, s.n_kv_heads = 2, s.n_q_heads = 6, s.head_dim = 16;
    s.rope.type = "default", s.rope.theta = 10000, s.rope.rotary_dim = 16;
    for (size_t i = 0; i + 1 < offsets.size(); ++i)
      for (int64_t t = offsets[i]; t < offsets[i + 1]; ++t) positions.push_back(int32_t(t - offsets[i]));
    const int64_t T = offsets.back();
    truth.spec = s, truth.tokens = T, truth.positions = positions.data(), truth.seq_offsets = offsets.data();
    truth.sequences = int64_t(offsets.size()) - 1;
    truth.keys = random_rows(T * 32, 5, 0.0f), truth.values = random_rows(T * 32, 6, 0.0f);
    truth.queries = random_rows(T * 96, 7, 0.0f);
    keys = truth.keys, values = truth.values;
    const auto noise = random_rows(T * 32, 8, 0.0f);
    for (int64_t i = 0; i < T * 32; ++i) keys[i] += 0.3f * noise[i], values[i] -= 0.2f * noise[i];
  }
};

// Figures of a layer from two backends: fp32 GEMMs in another order.
void expect_same_figures(const LayerDiagnostics& a, const LayerDiagnostics& b) {
  auto near = [](const std::vector<double>& x, const std::vector<double>& y, double tol, const char* what) {
    ASSERT_EQ(x.size(), y.size()) << what;
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(x[i], y[i], tol * (1 + std::fabs(y[i]))) << what << "[" << i << "]";
  };
  near(a.r2_k, b.r2_k, 1e-6, "r2_k");
  near(a.r2_v, b.r2_v, 1e-6, "r2_v");
  near(a.cosine, b.cosine, 1e-5, "cosine");
  near(a.k_concentration, b.k_concentration, 1e-4, "k_concentration");
  near(a.v_concentration, b.v_concentration, 1e-4, "v_concentration");
}

}  // namespace

// A backend that takes its calls one at a time (the shadow device) gets the host's figures: the units of the
// attention run serially there, in row tiles.
TEST(DeviceContract, LayerDiagnosticsThroughTheShadowDeviceEqualTheCpu) {
  RandomLayer r;
  ShadowBackend shadow;
  ASSERT_FALSE(shadow.concurrent_calls());
  auto cpu = make_cpu_backend();
  LayerDiagnoser on_cpu(*cpu, r.truth), on_shadow(shadow, r.truth, /*tile_floats=*/3 * 40 * 300);
  expect_same_figures(on_shadow.diagnose(r.keys.data(), r.values.data()),
                      on_cpu.diagnose(r.keys.data(), r.values.data()));
}

TEST_F(Cuda, LayerDiagnosticsMatchTheCpu) {
  RandomLayer r;
  LayerDiagnoser on_cpu(*cpu_, r.truth), on_gpu(*gpu_, r.truth);
  expect_same_figures(on_gpu.diagnose(r.keys.data(), r.values.data()), on_cpu.diagnose(r.keys.data(), r.values.data()));
}

// The serving apply on the GPU against the CPU's Transfer (fp32 products in another order: a tolerance relative to
// the output's scale), for every k and with residual MLPs, from host arrays and from device memory on a caller's
// stream; RoPE on the device equals the host's bit for bit.
TEST_F(Cuda, ServingApplyMatchesTheCpu) {
  for (const std::string structure : {"cross_head", "per_head"})
  for (const std::string k : {"1", "2", "all"}) {
    TempDir dir;
    const std::string mapper = fitted_mapper(dir, k, structure);
    const ServingCase c = serving_case(dir.str());
    const int64_t rows = c.cache.tokens;
    Transfer want_tr(mapper, *cpu_);
    ServingMapper rt(mapper, *gpu_);
    const int64_t XW = int64_t{rt.source().n_layers} * rt.source().features_per_layer(),
                  YW = int64_t{rt.target().n_layers} * rt.target().features_per_layer();
    std::vector<float> wk(rows * YW), wv(rows * YW), hk(rows * YW), hv(rows * YW), dk(rows * YW), dv(rows * YW);
    want_tr.apply(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(), c.target_positions.data(),
                  rows, wk.data(), wv.data());
    rt.apply_host(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(), c.target_positions.data(),
                  rows, hk.data(), hv.data());
    auto keys = gpu_->allocate(rows * XW * 4), values = gpu_->allocate(rows * XW * 4), pos = gpu_->allocate(rows * 8),
         ok = gpu_->allocate(rows * YW * 4), ov = gpu_->allocate(rows * YW * 4);
    gpu_->copy_from_host(c.cache.keys.data(), rows * XW * 4, keys->data);
    gpu_->copy_from_host(c.cache.values.data(), rows * XW * 4, values->data);
    gpu_->copy_from_host(c.cache.positions.data(), rows * 4, pos->data);
    gpu_->copy_from_host(c.target_positions.data(), rows * 4, pos->as<int32_t>() + rows);
    rt.apply({keys->as<float>(), values->as<float>(), pos->as<int32_t>(), pos->as<int32_t>() + rows, rows,
              ok->as<float>(), ov->as<float>(), {}},
             static_cast<void*>(nullptr));  // the legacy default stream
    gpu_->copy_to_host(ok->data, rows * YW * 4, dk.data());
    gpu_->copy_to_host(ov->data, rows * YW * 4, dv.data());
    const float scale = std::max(1.0f, max_abs(wk));
    for (size_t i = 0; i < wk.size(); ++i) {
      ASSERT_NEAR(hk[i], wk[i], 1e-4f * scale) << "k=" << k << " keys " << i;
      ASSERT_NEAR(hv[i], wv[i], 1e-4f * scale) << "k=" << k << " values " << i;
    }
    EXPECT_EQ(hk, dk) << "k=" << k << ": host arrays and device memory give the same bits";
    EXPECT_EQ(hv, dv) << "k=" << k;
    // Layer by layer on the device: each layer's outputs are that layer of the whole call, bit for bit.
    const int Lt = rt.target().n_layers;
    const int64_t G = rt.target().features_per_layer();
    for (int l = 0; l < Lt; ++l) {
      std::vector<float> lk(rows * G), lv(rows * G);
      rt.apply_host(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(), c.target_positions.data(),
                    rows, lk.data(), lv.data(), TargetLayers{l, 1});
      for (int64_t t = 0; t < rows; ++t) {
        ASSERT_EQ(std::memcmp(lk.data() + t * G, hk.data() + t * YW + l * G, G * 4), 0) << "k=" << k << " layer " << l;
        ASSERT_EQ(std::memcmp(lv.data() + t * G, hv.data() + t * YW + l * G, G * 4), 0) << "k=" << k << " layer " << l;
      }
    }
  }
  // RoPE (strip and apply, both conventions, an attention factor, per-layer tables with a layer without RoPE, a
  // block of some layers) on the device: the host's bits.
  for (const char* type : {"default", "yarn", "per layer"})
    for (const auto conv : {RopeConvention::half, RopeConvention::interleaved}) {
      const bool per_layer = std::string(type) == "per layer";
      KvSpec s;
      s.n_layers = per_layer ? 4 : 2, s.n_kv_heads = 3, s.head_dim = 16;
      s.rope.type = per_layer ? "yarn" : type, s.rope.theta = 1e4, s.rope.rotary_dim = 12, s.rope.convention = conv;
      if (s.rope.type == "yarn") s.rope.factor = 4, s.rope.original_max_position_embeddings = 64;
      if (per_layer) {
        RopeSpec local = s.rope, none = s.rope;
        local.type = "default", local.theta = 1e6, none.type = "none";
        s.layers = {{Attention::sliding, 8, local}, {Attention::full, 0, s.rope}, {Attention::full, 0, none},
                    {Attention::sliding, 8, local}};
      }
      const Rope rope(s);
      const LayerHeads layers = per_layer ? LayerHeads{1, 3, 2} : rope.all();
      const int64_t rows = 33, heads = layers.count * layers.heads, n = rows * heads * 16;
      std::vector<int32_t> pos(rows);
      for (int64_t t = 0; t < rows; ++t) pos[t] = static_cast<int32_t>(t * 37 % 4096);
      for (bool strip : {false, true}) {
        std::vector<float> host = random_rows(n, 5, 0.0f), dev(n);
        auto x = gpu_->allocate(n * 4), p = gpu_->allocate(rows * 4);
        gpu_->copy_from_host(host.data(), n * 4, x->data);
        gpu_->copy_from_host(pos.data(), rows * 4, p->data);
        gpu_->rope_rows(rope, layers, strip, x->as<float>(), rows, p->as<int32_t>());
        gpu_->copy_to_host(x->data, n * 4, dev.data());
        cpu_->rope_rows(rope, layers, strip, host.data(), rows, pos.data());
        EXPECT_EQ(host, dev) << type << (strip ? " strip" : " apply");
      }
    }
}

TEST_F(Cuda, ServingApplyWithResidualMlpsMatchesTheCpu) {
  TempDir dir;
  const std::string mapper = fitted_mapper(dir, "2");
  // Every layer gets a residual MLP (hidden 8) for both kinds.
  MapperManifest m = read_mapper_manifest(mapper);
  std::vector<MapperLayer> layers;
  for (int l = 0; l < m.target.n_layers; ++l) {
    MapperLayer w = load_mapper_layer(m, l);
    const MlpShape sh{static_cast<int64_t>(w.source_layers.size()) * m.source.features_per_layer(), 8,
                      m.target.features_per_layer()};
    w.mlp_k = MlpParams::initial(sh, 10 + l), w.mlp_v = MlpParams::initial(sh, 20 + l);
    for (auto* p : {&w.mlp_k, &w.mlp_v})
      for (int64_t i = 0; i < sh.hidden * sh.out; ++i) p->w3()[i] = 0.05f * static_cast<float>((i % 7) - 3);
    layers.push_back(std::move(w));
  }
  std::vector<MapperLayer> copy = layers;
  ServingMapper on_cpu(m, std::move(copy), *cpu_), on_gpu(m, std::move(layers), *gpu_);
  const ServingCase c = serving_case(dir.str());
  const int64_t rows = c.cache.tokens, YW = int64_t{m.target.n_layers} * m.target.features_per_layer();
  std::vector<float> wk(rows * YW), wv(rows * YW), gk(rows * YW), gv(rows * YW);
  on_cpu.apply_host(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(), c.target_positions.data(),
                    rows, wk.data(), wv.data());
  on_gpu.apply_host(c.cache.keys.data(), c.cache.values.data(), c.cache.positions.data(), c.target_positions.data(),
                    rows, gk.data(), gv.data());
  const float scale = std::max(1.0f, max_abs(wk));
  for (size_t i = 0; i < wk.size(); ++i) {
    ASSERT_NEAR(gk[i], wk[i], 1e-4f * scale) << "keys " << i;
    ASSERT_NEAR(gv[i], wv[i], 1e-4f * scale) << "values " << i;
  }
}

// The residual MLP's forward and gradient through cuBLAS against the CPU's.
TEST_F(Cuda, MlpForwardAndGradientMatchTheCpu) {
  const MlpShape s{24, 16, 8};
  MlpParams p(s);
  p.flat = random_rows(s.parameters(), 9, 0.0f);
  for (auto& x : p.flat) x *= 0.3f;
  const auto X = random_rows(50 * s.in, 10, 0.0f), R = random_rows(50 * s.out, 11, 0.0f);
  MlpParams g_cpu(s), g_gpu(s);
  MlpWorkspace w_cpu, w_gpu;
  const double l_cpu = mlp_loss_and_gradient(*cpu_, p, X.data(), R.data(), 50, g_cpu, w_cpu);
  const double l_gpu = mlp_loss_and_gradient(*gpu_, p, X.data(), R.data(), 50, g_gpu, w_gpu);
  EXPECT_NEAR(l_gpu, l_cpu, 1e-5 * l_cpu);
  for (size_t i = 0; i < g_cpu.flat.size(); ++i)
    ASSERT_NEAR(g_gpu.flat[i], g_cpu.flat[i], 1e-3f * (1 + std::fabs(g_cpu.flat[i]))) << "parameter " << i;
}

// NCCL between GPUs, ranks as threads with a GPU each: the same bits as the host's fixed-order collectives (rank order
// shows in fp32 sums from three ranks on: (a + b) + c is not (c + b) + a).
TEST(CudaNccl, CollectivesEqualTheHostCollectivesBitForBit) {
  if (!nccl_compiled_in()) GTEST_SKIP() << "built without NCCL";
  const int P = std::min(cuda_device_count(), 4);
  if (P < 3) GTEST_SKIP() << "needs 3 CUDA devices, found " << cuda_device_count();
  const size_t n = 3001;  // not a multiple of P
  run_ranks(P, [&](Comm& host) {
    const int r = host.rank();
    std::unique_ptr<Comm> nccl = make_nccl_comm(host.split(0, r), r);
    ASSERT_EQ(nccl->name(), "nccl");
    const std::vector<float> in = random_rows(static_cast<int64_t>(n), 100 + r, 0.5f);
    std::vector<double> din(n);
    for (size_t i = 0; i < n; ++i) din[i] = in[i] * 1e3 + 1.0 / (1 + i);
    auto same = [](const auto& a, const auto& b, const char* what) {
      ASSERT_EQ(a.size(), b.size()) << what;
      for (size_t i = 0; i < a.size(); ++i)
        ASSERT_EQ(std::memcmp(&a[i], &b[i], sizeof a[i]), 0) << what << ": element " << i << ": " << a[i] << " vs " << b[i];
    };
    std::vector<float> ha, na;
    host.reduce_scatter_sum(in.data(), n, ha);
    nccl->reduce_scatter_sum(in.data(), n, na);
    same(ha, na, "reduce_scatter_sum (fp32)");
    std::vector<double> hd, nd;
    host.reduce_scatter_sum(din.data(), n, hd);
    nccl->reduce_scatter_sum(din.data(), n, nd);
    same(hd, nd, "reduce_scatter_sum (fp64)");
    std::vector<float> hg(n), ng(n);
    host.allgather(ha, hg.data(), n);
    nccl->allgather(na, ng.data(), n);
    same(hg, ng, "allgather");
    std::vector<float> ar = in, nr = in;
    host.allreduce_sum(ar.data(), n);
    nccl->allreduce_sum(nr.data(), n);
    same(ar, nr, "allreduce_sum");
    std::vector<int> msg(17, r == 1 ? 42 : -1);
    nccl->broadcast(msg.data(), msg.size() * sizeof(int), 1);
    EXPECT_EQ(msg, std::vector<int>(17, 42));
  });
}
