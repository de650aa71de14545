// The CUDA backend against the CPU backend (the oracle). Without CUDA or a GPU every test is SKIPPED with the
// reason (ctest reports it as skipped, never as passed).
#include <limits>
#include <map>
#include <random>

#include "core/moments.hpp"
#include "core/ridge.hpp"
#include "helpers.hpp"
#include "io/mapper.hpp"
#include "stages/stages.hpp"

using namespace crosskv;
using namespace crosskv::test;

namespace {

class Cuda : public ::testing::Test {
 protected:
  void SetUp() override {
    if (!cuda_compiled_in()) GTEST_SKIP() << "built without CUDA";
    if (cuda_device_count() == 0) GTEST_SKIP() << "no CUDA device on this machine";
    gpu_ = make_cuda_backend(0);
    cpu_ = make_cpu_backend();
  }
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
  Moments a(d, std::vector<float>(d.X(), 0.5f), std::vector<float>(d.Y(), -0.5f));
  Moments b = a;
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
  gpu_->flush();
  std::vector<float> fa, fb;
  std::vector<double> da, db;
  a.pack_live(fa, da);
  b.pack_live(fb, db);
  ASSERT_EQ(fa.size(), fb.size());
  // fp32 sums of `total` products of O(1) values, in a different order: error ~ eps * sqrt(total) * magnitude.
  const float tol = 4 * 1.2e-7f * std::sqrt(static_cast<float>(total)) * max_abs(fa);
  for (size_t i = 0; i < fa.size(); ++i) ASSERT_NEAR(fa[i], fb[i], tol) << "element " << i;
  EXPECT_EQ(da, db);  // token statistics are summed on the host either way
}

TEST_F(Cuda, MatmulMatchesTheCpu) {
  const int64_t rows = 77, k = 130, n = 45, lda = 140, ldb = 50, ldc = 60;
  auto A = random_rows(rows * lda, 1, 0.2f), B = random_rows(k * ldb, 2, -0.1f), C = random_rows(rows * ldc, 3, 0.f);
  auto Cc = C, Cg = C;
  cpu_->matmul_acc(rows, k, n, A.data(), lda, B.data(), ldb, Cc.data(), ldc);
  gpu_->matmul_acc(rows, k, n, A.data(), lda, B.data(), ldb, Cg.data(), ldc);
  for (size_t i = 0; i < Cc.size(); ++i) ASSERT_NEAR(Cc[i], Cg[i], 1e-4f * (1 + std::fabs(Cc[i])));
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
  ASSERT_EQ(cpu_->cholesky(n, Lc.data(), lda), 0);
  ASSERT_EQ(gpu_->cholesky(n, Lg.data(), lda), 0);
  for (int64_t i = 0; i < n; ++i)
    for (int64_t j = 0; j <= i; ++j) ASSERT_NEAR(Lc[i * lda + j], Lg[i * lda + j], 1e-10) << i << "," << j;
  std::vector<double> B(n * ldb);
  for (auto& x : B) x = nd(rng);
  for (int64_t lead : {n, int64_t{120}}) {  // the whole factor and a leading block of it
    auto Bc = B, Bg = B;
    cpu_->cholesky_solve(lead, Lc.data(), lda, nrhs, Bc.data(), ldb);
    gpu_->cholesky_solve(lead, Lg.data(), lda, nrhs, Bg.data(), ldb);
    for (int64_t i = 0; i < lead; ++i)
      for (int64_t j = 0; j < nrhs; ++j) ASSERT_NEAR(Bc[i * ldb + j], Bg[i * ldb + j], 1e-9 * (1 + std::fabs(Bc[i * ldb + j])));
    for (bool t : {false, true}) {
      auto Tc = B, Tg = B;
      cpu_->triangular_solve(lead, Lc.data(), lda, t, nrhs, Tc.data(), ldb);
      gpu_->triangular_solve(lead, Lg.data(), lda, t, nrhs, Tg.data(), ldb);
      for (int64_t i = 0; i < lead; ++i)
        for (int64_t j = 0; j < nrhs; ++j) ASSERT_NEAR(Tc[i * ldb + j], Tg[i * ldb + j], 1e-9 * (1 + std::fabs(Tc[i * ldb + j])));
    }
  }
  // A host matrix that is not the factor any more (same address, new contents) is not served from the device.
  auto L2 = Lg;
  for (int64_t i = 0; i < n; ++i) L2[i * lda + i] *= 2;
  auto Bc = B, Bg = B;
  cpu_->cholesky_solve(n, L2.data(), lda, nrhs, Bc.data(), ldb);
  gpu_->cholesky_solve(n, L2.data(), lda, nrhs, Bg.data(), ldb);
  for (int64_t i = 0; i < n * ldb; i += ldb) ASSERT_NEAR(Bc[i], Bg[i], 1e-9 * (1 + std::fabs(Bc[i])));
}

TEST_F(Cuda, NotPositiveDefiniteReportsTheSameMinorAsTheCpu) {
  const int64_t n = 6;
  std::vector<double> A(n * n, 0.0);
  for (int64_t i = 0; i < n; ++i) A[i * n + i] = i == 3 ? -1.0 : 2.0;
  auto Ac = A, Ag = A;
  EXPECT_EQ(cpu_->cholesky(n, Ac.data(), n), 4);
  EXPECT_EQ(gpu_->cholesky(n, Ag.data(), n), 4);
}

TEST_F(Cuda, FitMatchesTheCpuFit) {
  TempDir dir;
  synthesize(small_synth(dir.str()));
  auto fit = [&](ComputeBackend& be, const std::string& out) {
    FitConfig cfg = parse_fit_config(config_yaml(dir.str(), "{k: [1, 3, all], lambda: 0.01}", out), "cfg.yaml");
    auto comm = make_single_comm();
    Context ctx{*comm, be};
    return run_fit(cfg, FitOptions{}, ctx);
  };
  fit(*cpu_, "cpu");
  fit(*gpu_, "gpu");
  for (const std::string k : {"k1", "k3", "kall"}) {
    Mapper c = load_mapper(dir.str("cpu/" + k)), g = load_mapper(dir.str("gpu/" + k));
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

// A host backend that behaves like a device one: operands must have been staged (they are read from private
// copies), sums live in shadow copies until flush(). A fit through it equals a CPU fit only if the pipeline stages
// every operand and flushes before it reads sums: the CUDA backend's contract, checked without a GPU.
class ShadowBackend final : public ComputeBackend {
 public:
  std::string name() const override { return "shadow"; }
  void stage_inputs(std::initializer_list<HostSpan> spans) override {
    staged_.clear();
    for (const auto& s : spans) staged_.push_back({s.data, std::vector<float>(s.data, s.data + s.count)});
  }
  void flush() override {
    for (auto& [host, copy] : sums_) std::copy(copy.begin(), copy.end(), host);
    sums_.clear();
    ++flushes;
  }
  void cross_acc(int64_t rows, int64_t m, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                 float* C, int64_t ldc) override {
    cpu_->cross_acc(rows, m, n, staged(A, (rows - 1) * lda + m), lda, staged(B, (rows - 1) * ldb + n), ldb,
                    resident(C, (m - 1) * ldc + n), ldc);
  }
  void matmul_acc(int64_t rows, int64_t k, int64_t n, const float* A, int64_t lda, const float* B, int64_t ldb,
                  float* C, int64_t ldc) override {
    cpu_->matmul_acc(rows, k, n, A, lda, B, ldb, C, ldc);
  }
  void gram_acc(int64_t rows, int64_t m, const float* A, int64_t lda, float* C, int64_t ldc) override {
    cpu_->gram_acc(rows, m, staged(A, (rows - 1) * lda + m), lda, resident(C, (m - 1) * ldc + m), ldc);
  }
  int64_t cholesky(int64_t n, double* A, int64_t lda) override { return cpu_->cholesky(n, A, lda); }
  void cholesky_solve(int64_t n, const double* L, int64_t lda, int64_t nrhs, double* B, int64_t ldb) override {
    cpu_->cholesky_solve(n, L, lda, nrhs, B, ldb);
  }
  void triangular_solve(int64_t n, const double* L, int64_t lda, bool t, int64_t nrhs, double* B,
                        int64_t ldb) override {
    cpu_->triangular_solve(n, L, lda, t, nrhs, B, ldb);
  }
  int flushes = 0;

 private:
  const float* staged(const float* p, int64_t extent) {
    for (const auto& [host, copy] : staged_)
      if (p >= host && p + extent <= host + copy.size()) return copy.data() + (p - host);
    ADD_FAILURE() << "an operand was not staged";
    return p;
  }
  float* resident(float* host, int64_t count) {
    auto it = sums_.find(host);
    if (it == sums_.end()) it = sums_.emplace(host, std::vector<float>(host, host + count)).first;
    // Poison the host copy: reading it before flush() must show.
    std::fill(host, host + count, std::numeric_limits<float>::quiet_NaN());
    return it->second.data();
  }
  std::unique_ptr<ComputeBackend> cpu_ = make_cpu_backend();
  std::vector<std::pair<const float*, std::vector<float>>> staged_;
  std::map<float*, std::vector<float>> sums_;
};

}  // namespace

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
      const int before = shadow.flushes;
      fit(shadow, "shadow-" + tag);
      EXPECT_GT(shadow.flushes, before);
      for (const std::string k : {"k1", "k3", "kall"}) {
        Mapper c = load_mapper(dir.str("cpu-" + tag + "/" + k)), s = load_mapper(dir.str("shadow-" + tag + "/" + k));
        for (size_t l = 0; l < c.layers.size(); ++l) {
          ASSERT_EQ(c.layers[l].source_layers, s.layers[l].source_layers) << tag << " " << k << " layer " << l;
          const float scale = std::max(1.0f, max_abs(c.layers[l].wk));
          for (size_t i = 0; i < c.layers[l].wk.size(); ++i)
            ASSERT_NEAR(c.layers[l].wk[i], s.layers[l].wk[i], 1e-5f * scale) << tag << " " << k << " layer " << l;
        }
      }
    }
}
