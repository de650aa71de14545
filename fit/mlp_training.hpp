#pragma once
// Training a residual MLP (core/mlp.hpp): the host forward pass with its activations kept, the loss and its
// gradient, Adam, and data-parallel epochs over ranks. The fit's stage (fit/mlp) trains one per (target layer, kind)
// and keeps it where it helps.
#include <cstdint>
#include <functional>
#include <vector>

#include "core/backend.hpp"
#include "core/mlp.hpp"

namespace crosskv {

// Activations of a batch, kept for the backward pass.
struct MlpWorkspace {
  std::vector<float> h1, h2, out, d_out, d_h2, d_h1;
};

// The same on host arrays, the activations kept in `ws` for the backward pass.
void mlp_forward(DenseMaths& be, const MlpParams& p, const float* X, int64_t rows, MlpWorkspace& ws);

// The sum over the batch of squared errors of f(X) against the residual R [rows x out] (the target less the
// ridge's prediction), returned, and its gradient (summed over the batch, not averaged: batches and ranks add up)
// added to grad.
double mlp_loss_and_gradient(DenseMaths& be, const MlpParams& p, const float* X, const float* R, int64_t rows,
                             MlpParams& grad, MlpWorkspace& ws);

// Adam (decoupled weight decay on W1, W2, W3) with fp32 moments.
class Adam {
 public:
  struct Options {
    double lr = 1e-3, beta1 = 0.9, beta2 = 0.999, eps = 1e-8, weight_decay = 0.0;
  };
  Adam(const MlpShape& s, Options o) : o_(o), m_(static_cast<size_t>(s.parameters()), 0.0f), v_(m_) {}
  // Adam as it stood after `steps` steps (a checkpoint's moments): the next step is the one it would have taken.
  void restore(std::vector<float> m, std::vector<float> v, int64_t steps);
  // One step with the mean gradient `grad_sum / count`.
  void step(MlpParams& p, const MlpParams& grad_sum, double count);
  int64_t steps() const { return t_; }
  const std::vector<float>& first_moment() const { return m_; }
  const std::vector<float>& second_moment() const { return v_; }

 private:
  Options o_;
  std::vector<float> m_, v_;
  int64_t t_ = 0;
};

class Comm;

// Data-parallel training of one residual MLP: each rank holds its share of the tokens, X [rows x in] and the ridge's
// residual R [rows x out]. Every step takes the next batch_tokens / P (rounded up) rows of each rank, sums the
// gradients over ranks in a fixed order (Comm::allreduce_sum) and applies the same Adam step everywhere, so every
// rank ends with the same bits, and the same job gives the same bits again. Ranks with fewer rows take part in
// every step (with the rows they have left, or none).
struct MlpTraining {
  int epochs = 10;
  int64_t batch_tokens = 1024;
  Adam::Options adam;
  uint64_t seed = 0;
};
struct MlpTrained {
  MlpParams params;
  std::vector<double> epoch_mse;  // per epoch, over the job's tokens: each batch's squared error before its step
  int64_t steps = 0;
  std::vector<float> adam_m, adam_v;  // Adam's moments after the last epoch run (what a checkpoint keeps)
  bool complete = false;              // every epoch ran (false: the epoch hook stopped it)
};
// Called on every rank after each epoch with the training as it stands (epoch_mse.size() epochs done); returning
// false ends the training there (a stop request: the caller checkpoints and stops). Ranks must agree on the answer.
using MlpEpochHook = std::function<bool(const MlpTrained&)>;
// `resume`: a training of the same job stopped after some epochs (its params, Adam moments, steps, epoch_mse); it
// goes on from there to the same bits as an uninterrupted training.
MlpTrained train_residual_mlp(DenseMaths& be, Comm& comm, const MlpShape& s, const float* X, const float* R,
                              int64_t rows, const MlpTraining& t, const MlpTrained* resume = nullptr,
                              const MlpEpochHook& after_epoch = {});

}  // namespace crosskv
