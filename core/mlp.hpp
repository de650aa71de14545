#pragma once
// The residual MLP (docs/RESULTS.md, Residual MLPs), per (target layer, kind): target = ridge(x) + f(x), with
// f(x) = relu(relu(x W1 + b1) W2 + b2) W3 + b3 on the same content-space features as the ridge. W3 and b3 start at
// zero, so training starts exactly at the ridge fit. Here: its parameters and the forward pass that serving and
// training share; the training (gradients, Adam, data-parallel epochs) is the fit's (fit/mlp_training.hpp).
#include <cstdint>
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
}  // namespace crosskv
