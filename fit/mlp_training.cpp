#include "fit/mlp_training.hpp"

#include <algorithm>
#include <cmath>

#include "core/comm.hpp"
#include "core/error.hpp"

namespace crosskv {
namespace {

// AffineKernels on host arrays: products through DenseMaths.
class HostAffine final : public AffineKernels {
 public:
  explicit HostAffine(DenseMaths& be) : be_(be) {}
  void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) override {
    for (int64_t r = 0; r < rows; ++r) std::copy_n(b, n, Y + r * ldy);
  }
  void gemm(const DenseMaths::BatchedGemm& g) override { be_.gemm_batched(g); }
  void relu(float* X, int64_t n) override {
    for (int64_t i = 0; i < n; ++i) X[i] = X[i] > 0.0f ? X[i] : 0.0f;
  }

 private:
  DenseMaths& be_;
};

// grad_w[k x n] += A[rows x k]^T D[rows x n]; grad_b[n] += column sums of D.
void weight_gradient(DenseMaths& be, const float* A, int64_t rows, int64_t k, const std::vector<float>& D,
                     int64_t n, float* grad_w, float* grad_b) {
  DenseMaths::BatchedGemm g;
  g.trans_a = true, g.m = k, g.n = n, g.k = rows, g.beta = 1.0f;
  g.A = A, g.lda = k, g.B = D.data(), g.ldb = n, g.C = grad_w, g.ldc = n;
  be.gemm_batched(g);
  for (int64_t r = 0; r < rows; ++r)
    for (int64_t c = 0; c < n; ++c) grad_b[c] += D[r * n + c];
}

// dA[rows x k] = (D[rows x n] W^T) masked where the layer's activation A was not positive (ReLU's derivative).
void input_gradient(DenseMaths& be, const std::vector<float>& D, int64_t rows, int64_t n, const float* W,
                    int64_t k, const std::vector<float>& A, std::vector<float>& dA) {
  dA.assign(static_cast<size_t>(rows * k), 0.0f);
  DenseMaths::BatchedGemm g;
  g.trans_b = true, g.m = rows, g.n = k, g.k = n;
  g.A = D.data(), g.lda = n, g.B = W, g.ldb = n, g.C = dA.data(), g.ldc = k;
  be.gemm_batched(g);
  for (size_t i = 0; i < dA.size(); ++i)
    if (A[i] <= 0.0f) dA[i] = 0.0f;
}

}  // namespace

void mlp_forward(DenseMaths& be, const MlpParams& p, const float* X, int64_t rows, MlpWorkspace& ws) {
  const MlpShape& s = p.shape;
  ws.h1.resize(static_cast<size_t>(rows * s.hidden)), ws.h2.resize(ws.h1.size());
  ws.out.resize(static_cast<size_t>(rows * s.out));
  HostAffine k(be);
  mlp_forward(k, s, p.flat.data(), X, rows, ws.h1.data(), ws.h2.data(), ws.out.data());
}

double mlp_loss_and_gradient(DenseMaths& be, const MlpParams& p, const float* X, const float* R, int64_t rows,
                             MlpParams& grad, MlpWorkspace& ws) {
  const MlpShape& s = p.shape;
  CROSSKV_ASSERT(grad.flat.size() == p.flat.size(), "gradient of another shape");
  mlp_forward(be, p, X, rows, ws);
  double loss = 0;
  ws.d_out.resize(ws.out.size());
  for (size_t i = 0; i < ws.out.size(); ++i) {
    const float e = ws.out[i] - R[i];
    loss += static_cast<double>(e) * e;
    ws.d_out[i] = 2.0f * e;
  }
  weight_gradient(be, ws.h2.data(), rows, s.hidden, ws.d_out, s.out, grad.w3(), grad.b3());
  input_gradient(be, ws.d_out, rows, s.out, p.w3(), s.hidden, ws.h2, ws.d_h2);
  weight_gradient(be, ws.h1.data(), rows, s.hidden, ws.d_h2, s.hidden, grad.w2(), grad.b2());
  input_gradient(be, ws.d_h2, rows, s.hidden, p.w2(), s.hidden, ws.h1, ws.d_h1);
  weight_gradient(be, X, rows, s.in, ws.d_h1, s.hidden, grad.w1(), grad.b1());
  return loss;
}

void Adam::step(MlpParams& p, const MlpParams& grad_sum, double count) {
  CROSSKV_ASSERT(p.flat.size() == m_.size() && grad_sum.flat.size() == m_.size() && count > 0, "Adam: shapes");
  ++t_;
  const double c1 = 1.0 - std::pow(o_.beta1, static_cast<double>(t_)), c2 = 1.0 - std::pow(o_.beta2, static_cast<double>(t_));
  const MlpShape& s = p.shape;
  // Weight decay on the matrices only: [W1 | b1 | W2 | b2 | W3 | b3].
  const int64_t b1 = s.in * s.hidden, w2 = b1 + s.hidden, b2 = w2 + s.hidden * s.hidden, w3 = b2 + s.hidden,
                b3 = w3 + s.hidden * s.out;
  auto decays = [&](int64_t i) { return i < b1 || (i >= w2 && i < b2) || (i >= w3 && i < b3); };
  for (int64_t i = 0; i < static_cast<int64_t>(m_.size()); ++i) {
    const double g = grad_sum.flat[i] / count;
    m_[i] = static_cast<float>(o_.beta1 * m_[i] + (1 - o_.beta1) * g);
    v_[i] = static_cast<float>(o_.beta2 * v_[i] + (1 - o_.beta2) * g * g);
    double x = p.flat[i];
    if (o_.weight_decay > 0 && decays(i)) x -= o_.lr * o_.weight_decay * x;
    x -= o_.lr * (m_[i] / c1) / (std::sqrt(v_[i] / c2) + o_.eps);
    p.flat[i] = static_cast<float>(x);
  }
}

void Adam::restore(std::vector<float> m, std::vector<float> v, int64_t steps) {
  CROSSKV_ASSERT(m.size() == m_.size() && v.size() == v_.size() && steps >= 0, "Adam state of another shape");
  m_ = std::move(m), v_ = std::move(v), t_ = steps;
}

MlpTrained train_residual_mlp(DenseMaths& be, Comm& comm, const MlpShape& s, const float* X, const float* R,
                              int64_t rows, const MlpTraining& t, const MlpTrained* resume,
                              const MlpEpochHook& after_epoch) {
  CROSSKV_ASSERT(t.batch_tokens > 0 && t.epochs >= 0, "MLP training: batch and epochs");
  const int P = comm.size();
  const int64_t local_batch = (t.batch_tokens + P - 1) / P;
  double most = static_cast<double>(rows);  // the job's largest share fixes the number of steps per epoch
  std::vector<double> shares(static_cast<size_t>(P), 0.0);
  shares[comm.rank()] = most;
  comm.allreduce_sum(shares.data(), shares.size());
  most = *std::max_element(shares.begin(), shares.end());
  const int64_t steps = static_cast<int64_t>(std::ceil(most / static_cast<double>(local_batch)));
  MlpTrained out{MlpParams::initial(s, t.seed), {}, 0, {}, {}, false};
  Adam adam(s, t.adam);
  if (resume) {
    CROSSKV_ASSERT(resume->params.flat.size() == out.params.flat.size() &&
                       resume->epoch_mse.size() <= static_cast<size_t>(t.epochs),
                   "MLP training resumed from another shape or a longer training");
    out.params = resume->params;
    out.epoch_mse = resume->epoch_mse;
    adam.restore(resume->adam_m, resume->adam_v, resume->steps);
  }
  MlpParams grad(s);
  MlpWorkspace ws;
  for (int e = static_cast<int>(out.epoch_mse.size()); e < t.epochs; ++e) {
    double sums[2] = {0, 0};  // squared error and values over the job's tokens in this epoch
    for (int64_t step = 0; step < steps; ++step) {
      const int64_t r0 = std::min(rows, step * local_batch), n = std::min(rows, r0 + local_batch) - r0;
      std::fill(grad.flat.begin(), grad.flat.end(), 0.0f);
      double counts[2] = {n > 0 ? mlp_loss_and_gradient(be, out.params, X + r0 * s.in, R + r0 * s.out, n, grad, ws)
                                : 0.0,
                          static_cast<double>(n * s.out)};
      comm.allreduce_sum(grad.flat.data(), grad.flat.size());
      comm.allreduce_sum(counts, 2);
      sums[0] += counts[0], sums[1] += counts[1];
      if (counts[1] > 0) adam.step(out.params, grad, counts[1]);
    }
    out.epoch_mse.push_back(sums[1] > 0 ? sums[0] / sums[1] : 0.0);
    out.steps = adam.steps();
    if (after_epoch && e + 1 < t.epochs) {
      out.adam_m = adam.first_moment(), out.adam_v = adam.second_moment();
      if (!after_epoch(out)) return out;
    }
  }
  out.steps = adam.steps();
  out.adam_m = adam.first_moment(), out.adam_v = adam.second_moment();
  out.complete = true;
  return out;
}

}  // namespace crosskv
