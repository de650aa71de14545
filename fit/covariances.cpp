#include "fit/moments.hpp"

#include <algorithm>

#include "core/host_kernels.hpp"
#include "core/error.hpp"

namespace crosskv {


std::vector<double> Covariances::mean_x(int a) const {
  std::vector<double> m(m_.d_.F());
  for (int64_t p = 0; p < m_.d_.F(); ++p) m[p] = m_.shift_x_[a * m_.d_.F() + p] + mx(a * m_.d_.F() + p);
  return m;
}

std::vector<double> Covariances::mean_y(int l) const {
  std::vector<double> m(m_.d_.G());
  for (int64_t c = 0; c < m_.d_.G(); ++c) m[c] = m_.shift_y_[l * m_.d_.G() + c] + my(l * m_.d_.G() + c);
  return m;
}

std::vector<double> Covariances::var_y(int l) const {
  std::vector<double> v(m_.d_.G());
  for (int64_t c = 0; c < m_.d_.G(); ++c) {
    const int64_t col = l * m_.d_.G() + c;
    v[c] = std::max(0.0, m_.sq_y_[col] / m_.n_ - my(col) * my(col));
  }
  return v;
}

std::vector<double> Covariances::var_x(int a) const {
  const int64_t F = m_.d_.F();
  const BlockRef& g = m_.blocks_.gram(a, a);
  std::vector<double> v(F);
  for (int64_t p = 0; p < F; ++p) v[p] = std::max(0.0, g.at(p, p) / m_.n_ - mx(a * F + p) * mx(a * F + p));
  return v;
}

ComputeBackend::CovTerms Covariances::cov_xx_terms(const std::vector<int>& layers) const {
  using Read = ComputeBackend::CovBlock::Read;
  ComputeBackend::CovTerms t;
  t.F = m_.d_.F();
  t.nl = static_cast<int64_t>(layers.size());
  t.inv_n = 1.0 / m_.n_;
  for (int64_t i = 0; i < t.nl; ++i)
    for (int64_t j = 0; j < t.nl; ++j) {
      const int a = layers[i], b = layers[j];
      const BlockRef& g = m_.blocks_.gram(std::min(a, b), std::max(a, b));  // a missing block throws here
      t.blocks.push_back({g.p, g.ld, a < b ? Read::as_is : a > b ? Read::transposed : Read::upper});
    }
  for (int a : layers)
    for (int64_t p = 0; p < t.F; ++p) t.mean.push_back(mx(a * t.F + p));
  return t;
}

void Covariances::cov_xx(const std::vector<int>& layers, double* A, int64_t lda) const {
  assemble_cov_on_host(cov_xx_terms(layers), 0.0, A, lda, nullptr);
}

void Covariances::cov_xy(const std::vector<int>& layers, int l, double* B, int64_t ldb) const {
  const int64_t F = m_.d_.F(), G = m_.d_.G();
  const double inv_n = 1.0 / m_.n_;
  const int64_t nl = static_cast<int64_t>(layers.size());
  std::vector<BlockRef> blocks(nl);
  for (int64_t i = 0; i < nl; ++i) blocks[i] = m_.blocks_.cross(layers[i], l);
#pragma omp parallel for schedule(static) if (nl * F * G > kParallelMin)
  for (int64_t ip = 0; ip < nl * F; ++ip) {
    const int64_t i = ip / F, p = ip % F;
    const float* c = blocks[i].row(p);
    double* row = B + (i * F + p) * ldb;
    const double mp = mx(layers[i] * F + p);
    for (int64_t q = 0; q < G; ++q) row[q] = c[q] * inv_n - mp * my(l * G + q);
  }
}

ComputeBackend::CovTerms Covariances::head_cov_xx_terms(const std::vector<int>& layers, int h) const {
  ComputeBackend::CovTerms t = cov_xx_terms(layers);
  const int64_t F = t.F, Ds = m_.d_.Ds, at = int64_t{h} * Ds;
  CROSSKV_ASSERT(h >= 0 && at + Ds <= F, "head out of range");
  // Head h's rows and columns of block (a, b) are its [Ds x Ds] sub-block at (h*Ds, h*Ds), in place with the
  // block's leading dimension; a diagonal block's sub-block is stored upper like the block.
  for (auto& b : t.blocks) b.p += at * b.ld + at;
  std::vector<double> mean;
  for (int64_t i = 0; i < t.nl; ++i)
    for (int64_t p = 0; p < Ds; ++p) mean.push_back(t.mean[i * F + at + p]);
  t.mean = std::move(mean);
  t.F = Ds;
  return t;
}

void Covariances::head_cov_xy(const std::vector<int>& layers, int l, int h, double* B, int64_t ldb) const {
  const int64_t F = m_.d_.F(), G = m_.d_.G(), Ds = m_.d_.Ds, Dt = m_.d_.Dt;
  const int64_t xat = int64_t{h} * Ds, yat = int64_t{h} * Dt;
  const double inv_n = 1.0 / m_.n_;
  for (size_t i = 0; i < layers.size(); ++i) {
    const BlockRef& c = m_.blocks_.cross(layers[i], l);
    for (int64_t p = 0; p < Ds; ++p) {
      const float* row = c.row(xat + p) + yat;
      double* out = B + (static_cast<int64_t>(i) * Ds + p) * ldb;
      const double mp = mx(layers[i] * F + xat + p);
      for (int64_t q = 0; q < Dt; ++q) out[q] = row[q] * inv_n - mp * my(l * G + yat + q);
    }
  }
}

void Covariances::head_cov_xx(int a, int h, double* A) const {
  const int Ds = m_.d_.Ds;
  const auto& g = m_.blocks_.head_gram(a, h);
  CROSSKV_ASSERT(!g.empty(), "same-head probe block of head " + std::to_string(h) + " not accumulated here");
  const int64_t base = a * m_.d_.F() + int64_t{h} * Ds;
  for (int p = 0; p < Ds; ++p)
    for (int q = 0; q < Ds; ++q) {
      const float v = p <= q ? g.at(p, q) : g.at(q, p);
      A[int64_t{p} * Ds + q] = v / m_.n_ - mx(base + p) * mx(base + q);
    }
}

void Covariances::head_cov_xy(int a, int h, double* B) const {
  const int Ds = m_.d_.Ds, Dt = m_.d_.Dt, Lt = m_.d_.Lt;
  const auto& c = m_.blocks_.head_cross(h);
  CROSSKV_ASSERT(!c.empty(), "same-head probe block of head " + std::to_string(h) + " not accumulated here");
  const int64_t xbase = a * m_.d_.F() + int64_t{h} * Ds;
  for (int p = 0; p < Ds; ++p)
    for (int l = 0; l < Lt; ++l)
      for (int e = 0; e < Dt; ++e) {
        B[int64_t{p} * Lt * Dt + int64_t{l} * Dt + e] =
            c.at(int64_t{a} * Ds + p, int64_t{l} * Dt + e) / m_.n_ - mx(xbase + p) * my(l * m_.d_.G() + int64_t{h} * Dt + e);
      }
}

}  // namespace crosskv
