#include "fit/moments.hpp"

#include <algorithm>
#include <cmath>

#include "core/backend.hpp"
#include "core/host_kernels.hpp"
#include "core/comm.hpp"
#include "core/memory.hpp"
#include "core/error.hpp"

namespace crosskv {

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

}  // namespace crosskv
