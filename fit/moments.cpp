#include "fit/moments.hpp"

#include <algorithm>
#include <cmath>

#include "core/backend.hpp"
#include "core/host_kernels.hpp"
#include "core/comm.hpp"
#include "core/memory.hpp"
#include "core/error.hpp"

namespace crosskv {

// Below this many elements the host loops run on one thread (a parallel region costs more than it saves).
constexpr int64_t kParallelMin = int64_t{1} << 22;

Moments::Moments(const PairDims& dims, std::vector<float> shift_x, std::vector<float> shift_y)
    : d_(dims), shift_x_(std::move(shift_x)), shift_y_(std::move(shift_y)) {
  CROSSKV_ASSERT(static_cast<int64_t>(shift_x_.size()) == d_.X() && static_cast<int64_t>(shift_y_.size()) == d_.Y(),
                 "shift sizes do not match the pair's dims");
  sum_x_.assign(d_.X(), 0.0);
  sum_y_.assign(d_.Y(), 0.0);
  sq_y_.assign(d_.Y(), 0.0);
  blocks_ = MomentBlocks(d_);
}

void Moments::add_plan(const MomentPlan& plan) { blocks_.add_plan(plan); }

void Moments::accumulate(ComputeBackend& be, float* X, float* Y, int64_t rows, const float* weights) {
  const int64_t XW = d_.X(), YW = d_.Y();
  std::vector<float> sqrt_w;
  RowWeights w;
  if (weights) {
    sqrt_w.resize(static_cast<size_t>(rows));
    for (int64_t t = 0; t < rows; ++t) {
      sqrt_w[t] = std::sqrt(weights[t]);
      w.sum += weights[t];
    }
    w.sqrt_w = sqrt_w.data();
  }
  for (int64_t t = 0; t < rows; ++t) {
    for (int64_t c = 0; c < XW; ++c) X[t * XW + c] -= shift_x_[c];
    for (int64_t c = 0; c < YW; ++c) Y[t * YW + c] -= shift_y_[c];
    if (!weights) continue;
    for (int64_t c = 0; c < XW; ++c) X[t * XW + c] *= sqrt_w[t];
    for (int64_t c = 0; c < YW; ++c) Y[t * YW + c] *= sqrt_w[t];
  }
  be.begin_inputs();
  be.stage_inputs({ComputeBackend::floats(X, rows * XW), ComputeBackend::floats(Y, rows * YW)});
  if (weights) be.stage_inputs({ComputeBackend::floats(sqrt_w.data(), rows)});
  accumulate_staged(be, X, Y, rows, w);
}

void Moments::accumulate_staged(ComputeBackend& be, const float* X, const float* Y, int64_t rows,
                                const RowWeights& w) {
  const int64_t XW = d_.X(), YW = d_.Y();
  hold_sums(be);
  if (!stats_done_) {
    // Rows are scaled by sqrt(w): weighing the column sums by sqrt(w) again gives Σ w x; the squares are Σ w y².
    be.column_stats(rows, XW, X, XW, w.sqrt_w, held_stats_[0]->at(sum_x_.data()), nullptr);
    be.column_stats(rows, YW, Y, YW, w.sqrt_w, held_stats_[1]->at(sum_y_.data()), held_stats_[2]->at(sq_y_.data()));
    n_ += w.sqrt_w ? w.sum : static_cast<double>(rows);
  }
  blocks_.accumulate(be, X, Y, rows);
}

void Moments::hold_sums(ComputeBackend& be) {
  blocks_.hold(be);
  if (stats_done_ || !held_stats_.empty()) return;
  for (std::vector<double>* v : {&sum_x_, &sum_y_, &sq_y_})  // small: copied up as they are
    held_stats_.push_back(be.hold_sums(v->data(), static_cast<int64_t>(v->size()), false));
}

void Moments::release_sums(bool write_back) {
  blocks_.release(write_back);
  for (auto& h : held_stats_)
    if (write_back) h->to_host();
  held_stats_.clear();
}

size_t Moments::live_floats() const {
  size_t n = 0;
  for (const auto& [b, at] : blocks_.live_layout()) n += b->size();
  return n;
}

size_t Moments::live_doubles() const { return stats_done_ ? 0 : 1 + sum_x_.size() + 2 * sum_y_.size(); }

void Moments::unpack_live_doubles(const double* d) {
  blocks_.touched();
  if (!stats_done_) {
    n_ = *d++;
    std::copy_n(d, sum_x_.size(), sum_x_.begin());
    d += sum_x_.size();
    std::copy_n(d, sum_y_.size(), sum_y_.begin());
    d += sum_y_.size();
    std::copy_n(d, sq_y_.size(), sq_y_.begin());
  }
}

void Moments::live_pieces(std::vector<ComputeBackend::SumPiece<float>>& f,
                          std::vector<ComputeBackend::SumPiece<double>>& d) {
  blocks_.live_pieces(f, flat_size(f));
  if (stats_done_) return;
  int64_t d_at = flat_size(d);
  d.push_back({&n_, 1, 1, 1, d_at++});
  std::vector<double>* stats[3] = {&sum_x_, &sum_y_, &sq_y_};
  for (int i = 0; i < 3; ++i) {
    const auto n = static_cast<int64_t>(stats[i]->size());
    d.push_back({stats[i]->data(), 1, n, n, d_at});
    if (!held_stats_.empty()) d.back().held = held_stats_[i]->held();
    d_at += n;
  }
}

void Moments::zero_live() {
  blocks_.zero_live();
  if (stats_done_) return;
  n_ = 0;
  if (held_stats_.empty()) {
    for (std::vector<double>* v : {&sum_x_, &sum_y_, &sq_y_}) std::fill(v->begin(), v->end(), 0.0);
    return;
  }
  for (auto& h : held_stats_) h->zero();
}

void Moments::mark_pass_complete() {
  for (const auto& h : held_stats_) CROSSKV_ASSERT(!h->on_device(), "moments completed while held on a device");
  held_stats_.clear();
  stats_done_ = true;
  blocks_.mark_complete();
}

void Moments::scale(double w) {
  if (w == 1.0) return;
  blocks_.scale(static_cast<float>(w));
  n_ *= w;
  for (auto& x : sum_x_) x *= w;
  for (auto& x : sum_y_) x *= w;
  for (auto& x : sq_y_) x *= w;
}

void Moments::add(const Moments& o, double weight) {
  CROSSKV_ASSERT(shift_x_ == o.shift_x_ && shift_y_ == o.shift_y_, "moments about different shifts");
  blocks_.add(o.blocks_, static_cast<float>(weight));
  n_ += weight * o.n_;
  for (size_t i = 0; i < sum_x_.size(); ++i) sum_x_[i] += weight * o.sum_x_[i];
  for (size_t i = 0; i < sum_y_.size(); ++i) {
    sum_y_[i] += weight * o.sum_y_[i];
    sq_y_[i] += weight * o.sq_y_[i];
  }
}

void Moments::derive_head_probe() { blocks_.derive_head_probe(); }

int64_t Moments::bytes() const {
  return static_cast<int64_t>(sizeof(double)) * (sum_x_.size() + 2 * sum_y_.size()) +
         static_cast<int64_t>(sizeof(float)) * (shift_x_.size() + shift_y_.size() + blocks_.floats());
}

std::vector<double> Moments::mean_x(int a) const {
  std::vector<double> m(d_.F());
  for (int64_t p = 0; p < d_.F(); ++p) m[p] = shift_x_[a * d_.F() + p] + mx(a * d_.F() + p);
  return m;
}

std::vector<double> Moments::mean_y(int l) const {
  std::vector<double> m(d_.G());
  for (int64_t c = 0; c < d_.G(); ++c) m[c] = shift_y_[l * d_.G() + c] + my(l * d_.G() + c);
  return m;
}

std::vector<double> Moments::var_y(int l) const {
  std::vector<double> v(d_.G());
  for (int64_t c = 0; c < d_.G(); ++c) {
    const int64_t col = l * d_.G() + c;
    v[c] = std::max(0.0, sq_y_[col] / n_ - my(col) * my(col));
  }
  return v;
}

ComputeBackend::CovTerms Moments::cov_xx_terms(const std::vector<int>& layers) const {
  using Read = ComputeBackend::CovBlock::Read;
  ComputeBackend::CovTerms t;
  t.F = d_.F();
  t.nl = static_cast<int64_t>(layers.size());
  t.inv_n = 1.0 / n_;
  for (int64_t i = 0; i < t.nl; ++i)
    for (int64_t j = 0; j < t.nl; ++j) {
      const int a = layers[i], b = layers[j];
      const BlockRef& g = blocks_.gram(std::min(a, b), std::max(a, b));  // a missing block throws here
      t.blocks.push_back({g.p, g.ld, a < b ? Read::as_is : a > b ? Read::transposed : Read::upper});
    }
  for (int a : layers)
    for (int64_t p = 0; p < t.F; ++p) t.mean.push_back(mx(a * t.F + p));
  return t;
}

void Moments::cov_xx(const std::vector<int>& layers, double* A, int64_t lda) const {
  assemble_cov_on_host(cov_xx_terms(layers), 0.0, A, lda, nullptr);
}

void Moments::cov_xy(const std::vector<int>& layers, int l, double* B, int64_t ldb) const {
  const int64_t F = d_.F(), G = d_.G();
  const double inv_n = 1.0 / n_;
  const int64_t nl = static_cast<int64_t>(layers.size());
  std::vector<BlockRef> blocks(nl);
  for (int64_t i = 0; i < nl; ++i) blocks[i] = blocks_.cross(layers[i], l);
#pragma omp parallel for schedule(static) if (nl * F * G > kParallelMin)
  for (int64_t ip = 0; ip < nl * F; ++ip) {
    const int64_t i = ip / F, p = ip % F;
    const float* c = blocks[i].row(p);
    double* row = B + (i * F + p) * ldb;
    const double mp = mx(layers[i] * F + p);
    for (int64_t q = 0; q < G; ++q) row[q] = c[q] * inv_n - mp * my(l * G + q);
  }
}

ComputeBackend::CovTerms Moments::head_cov_xx_terms(const std::vector<int>& layers, int h) const {
  ComputeBackend::CovTerms t = cov_xx_terms(layers);
  const int64_t F = t.F, Ds = d_.Ds, at = int64_t{h} * Ds;
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

void Moments::head_cov_xy(const std::vector<int>& layers, int l, int h, double* B, int64_t ldb) const {
  const int64_t F = d_.F(), G = d_.G(), Ds = d_.Ds, Dt = d_.Dt;
  const int64_t xat = int64_t{h} * Ds, yat = int64_t{h} * Dt;
  const double inv_n = 1.0 / n_;
  for (size_t i = 0; i < layers.size(); ++i) {
    const BlockRef& c = blocks_.cross(layers[i], l);
    for (int64_t p = 0; p < Ds; ++p) {
      const float* row = c.row(xat + p) + yat;
      double* out = B + (static_cast<int64_t>(i) * Ds + p) * ldb;
      const double mp = mx(layers[i] * F + xat + p);
      for (int64_t q = 0; q < Dt; ++q) out[q] = row[q] * inv_n - mp * my(l * G + yat + q);
    }
  }
}

void Moments::head_cov_xx(int a, int h, double* A) const {
  const int Ds = d_.Ds;
  const auto& g = blocks_.head_gram(a, h);
  CROSSKV_ASSERT(!g.empty(), "same-head probe block of head " + std::to_string(h) + " not accumulated here");
  const int64_t base = a * d_.F() + int64_t{h} * Ds;
  for (int p = 0; p < Ds; ++p)
    for (int q = 0; q < Ds; ++q) {
      const float v = p <= q ? g.at(p, q) : g.at(q, p);
      A[int64_t{p} * Ds + q] = v / n_ - mx(base + p) * mx(base + q);
    }
}

void Moments::head_cov_xy(int a, int h, double* B) const {
  const int Ds = d_.Ds, Dt = d_.Dt, Lt = d_.Lt;
  const auto& c = blocks_.head_cross(h);
  CROSSKV_ASSERT(!c.empty(), "same-head probe block of head " + std::to_string(h) + " not accumulated here");
  const int64_t xbase = a * d_.F() + int64_t{h} * Ds;
  for (int p = 0; p < Ds; ++p)
    for (int l = 0; l < Lt; ++l)
      for (int e = 0; e < Dt; ++e) {
        B[int64_t{p} * Lt * Dt + int64_t{l} * Dt + e] =
            c.at(int64_t{a} * Ds + p, int64_t{l} * Dt + e) / n_ - mx(xbase + p) * my(l * d_.G() + int64_t{h} * Dt + e);
      }
}

}  // namespace crosskv
