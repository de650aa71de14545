#pragma once
// The residual MLP (docs/RESULTS.md, Residual MLPs), per (target layer, kind): target = ridge(x) + f(x), with
// f(x) = relu(relu(x W1 + b1) W2 + b2) W3 + b3 on the same content-space features as the ridge. W3 and b3 start at
// zero, so training starts exactly at the ridge fit. fp32 parameters (the master weights), products through the
// compute backend, Adam. The fit's stage (fit/mlp) trains one per (target layer, kind) and keeps it where it helps.
#include <cstdint>
#include <functional>
#include <vector>

#include "core/backend.hpp"

namespace crosskv {

// How a residual MLP is trained (fit.mlp in a config, and in a manifest's fit).
struct MlpSettings {
  int hidden = 256;            // units of each of the two hidden layers
  int epochs = 20;
  double lr = 1e-3;            // Adam
  int64_t batch_tokens = 1024;
  double weight_decay = 1e-4;  // decoupled, on the matrices
  double val_fraction = 0.1;   // of the calibration sequences, held back to decide (auto) and report
  uint64_t seed = 0;
};

struct MlpShape {
  int64_t in = 0, hidden = 0, out = 0;
  int64_t parameters() const { return in * hidden + hidden + hidden * hidden + hidden + hidden * out + out; }
};

// Every parameter in one flat fp32 array, the tensors views into it (a reduction or a checkpoint takes the array
// whole): W1 [in x hidden], b1, W2 [hidden x hidden], b2, W3 [hidden x out], b3, all row-major.
struct MlpParams {
  MlpShape shape;
  std::vector<float> flat;

  MlpParams() = default;
  explicit MlpParams(const MlpShape& s) : shape(s), flat(static_cast<size_t>(s.parameters()), 0.0f) {}
  // He-normal W1 and W2 from `seed` (a fixed generator: the same seed gives the same bits), zero biases, and a zero
  // last layer.
  static MlpParams initial(const MlpShape& s, uint64_t seed);
  float* w1() { return flat.data(); }
  float* b1() { return w1() + shape.in * shape.hidden; }
  float* w2() { return b1() + shape.hidden; }
  float* b2() { return w2() + shape.hidden * shape.hidden; }
  float* w3() { return b2() + shape.hidden; }
  float* b3() { return w3() + shape.hidden * shape.out; }
  const float* w1() const { return const_cast<MlpParams*>(this)->w1(); }
  const float* b1() const { return const_cast<MlpParams*>(this)->b1(); }
  const float* w2() const { return const_cast<MlpParams*>(this)->w2(); }
  const float* b2() const { return const_cast<MlpParams*>(this)->b2(); }
  const float* w3() const { return const_cast<MlpParams*>(this)->w3(); }
  const float* b3() const { return const_cast<MlpParams*>(this)->b3(); }
};

// The six tensors in the artifacts' form: "w1" [in x hidden], "b1" [hidden], "w2" [hidden x hidden], "b2" [hidden],
// "w3" [hidden x out], "b3" [out], each at `offset` in MlpParams::flat.
struct MlpTensor {
  const char* name;
  std::vector<int64_t> shape;
  int64_t offset;
};
inline std::vector<MlpTensor> mlp_tensors(const MlpShape& s) {
  const int64_t in = s.in, h = s.hidden, g = s.out;
  return {{"w1", {in, h}, 0},
          {"b1", {h}, in * h},
          {"w2", {h, h}, in * h + h},
          {"b2", {h}, in * h + h + h * h},
          {"w3", {h, g}, in * h + 2 * h + h * h},
          {"b3", {g}, in * h + 2 * h + h * h + h * g}};
}

// Activations of a batch, kept for the backward pass.
struct MlpWorkspace {
  std::vector<float> h1, h2, out, d_out, d_h2, d_h1;
};

// The three kernels an MLP's forward pass needs, on the memory the caller's arrays live in (the host for training,
// the backend's for serving), so that one forward serves both.
class AffineKernels {
 public:
  virtual ~AffineKernels() = default;
  // Y[t*ldy + c] = b[c] for t < rows, c < n.
  virtual void broadcast_rows(const float* b, int64_t n, int64_t rows, float* Y, int64_t ldy) = 0;
  virtual void gemm(const DenseMaths::BatchedGemm& g) = 0;
  virtual void relu(float* X, int64_t n) = 0;
};

// out[rows x s.out] = f(X) for X [rows x s.in] (row-major, leading dim s.in), the parameters `p` laid out as
// MlpParams::flat; h1 and h2 [rows x s.hidden] receive the hidden activations.
void mlp_forward(AffineKernels& k, const MlpShape& s, const float* p, const float* X, int64_t rows, float* h1,
                 float* h2, float* out);
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
