#pragma once
// Moment accumulation (docs/METHOD.md, The fit): fp32 Gram/cross blocks of shifted features and targets (stored in MomentBlocks),
// fp64 token sums, and the centred covariances they give. Every later quantity (probe R², fits for any k and λ,
// in-sample R²) is a function of these.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/backend.hpp"
#include "core/kind.hpp"
#include "fit/moment_blocks.hpp"

namespace crosskv {

class Comm;

// Below this many elements the host loops of the systems' assembly run on one thread (a parallel region costs more
// than it saves).
constexpr int64_t kParallelMin = int64_t{1} << 22;

// Per-token weights of one block of rows (fit.weighting: dataset, docs/METHOD.md, The fit): the moments are Σ w x xᵀ, Σ w x yᵀ,
// Σ w x, Σ w y², N = Σ w. sqrt_w scales the shifted rows (prepare's row_scale) and weighs the column sums; it is a
// staged operand. A null sqrt_w is the unweighted fit (every w = 1).
struct RowWeights {
  const float* sqrt_w = nullptr;
  double sum = 0;  // Σ w over the block's rows
};

class Covariances;

// The sums being accumulated over one pass or more: fp32 blocks and fp64 token statistics about provisional shifts.
// What they give (means, covariances) is read through covariances(); the reduction's access to the live sums is
// fit/round.hpp's.
class Moments {
 public:
  Moments() = default;
  Moments(const PairDims& dims, std::vector<float> shift_x, std::vector<float> shift_y);

  const PairDims& dims() const { return d_; }
  // Adds blocks to accumulate in the coming pass (new blocks start at zero); complete blocks are kept as they are.
  void add_plan(const MomentPlan& plan);

  // Folds in `rows` tokens: X [rows x Ls*F] and Y [rows x Lt*G], row-major, unshifted (shifted, and scaled by the
  // square roots of `weights` [rows] when given, here, in place). Token sums and target variances are accumulated in
  // the first pass only. The sums are held where the backend accumulates (hold_sums) until release_sums(): a device
  // backend's stay on the device in between.
  void accumulate(ComputeBackend& be, float* X, float* Y, int64_t rows, const float* weights = nullptr);
  // The same for inputs already shifted (by shift_x()/shift_y()), scaled by w.sqrt_w when weighted, and staged or
  // prepared in the backend's current round (ComputeBackend::begin_inputs): X and Y are the backend's operands,
  // possibly device memory.
  void accumulate_staged(ComputeBackend& be, const float* X, const float* Y, int64_t rows, const RowWeights& w = {});
  // Holds the live sums where `be` accumulates them (ComputeBackend::hold_sums): done by accumulate() if not before;
  // holding them first makes live_pieces() name the held copies. Calls while held do nothing.
  void hold_sums(ComputeBackend& be);
  // The held copies back to the host (write_back: the host moments are current from here on) or dropped (the caller
  // overwrites the host copies), and released. Read, pack or change the sums on the host only after this.
  void release_sums(bool write_back);
  // Marks the live state complete without any reduction (the caller reduced it).
  void mark_pass_complete();
  // Adds complete moments of other tokens (another calibration domain) with the same shifts and blocks, each
  // token counting `weight` times.
  void add(const Moments& other, double weight = 1.0);
  // Every token counts `weight` times (a domain weight).
  void scale(double weight);
  // Fills the same-head blocks of every head from the Gram blocks (a, a) and the cross blocks present (those of
  // absent cross blocks stay zero).
  void derive_head_probe();
  // A complete Gram block (a, b), created as zeros if absent: for blocks accumulated on other ranks.
  BlockRef complete_gram(int a, int b) { return blocks_.complete_gram(a, b); }

  int64_t tokens() const { return static_cast<int64_t>(n_); }
  double weight_sum() const { return n_; }  // Σ w (the token count when unweighted)
  bool has_gram(int a, int b) const { return blocks_.has_gram(a, b); }
  int64_t bytes() const;
  const std::vector<float>& shift_x() const { return shift_x_; }
  const std::vector<float>& shift_y() const { return shift_y_; }

  // What the complete sums give, for the probe and the solve.
  Covariances covariances() const;

 private:
  friend class Covariances;
  friend struct LiveState;  // fit/round.hpp: the live sums, flat, for reductions and checkpoints

  PairDims d_;
  double n_ = 0;
  std::vector<float> shift_x_, shift_y_;
  std::vector<double> sum_x_, sum_y_, sq_y_;
  std::vector<ComputeBackend::HeldSumsPtr<double>> held_stats_;  // of sum_x_, sum_y_, sq_y_ while held
  bool stats_done_ = false;  // the token statistics are complete (after the first pass)
  MomentBlocks blocks_;
};

// Centred covariances in fp64 (divided by N) of complete moments, read in place: a view that lives no longer than
// its Moments. Means are of the unshifted data.
class Covariances {
 public:
  explicit Covariances(const Moments& m) : m_(m) {}

  const PairDims& dims() const { return m_.d_; }
  int64_t tokens() const { return m_.tokens(); }
  double weight_sum() const { return m_.n_; }
  bool has_gram(int a, int b) const { return m_.blocks_.has_gram(a, b); }
  bool has_cross(int a, int l) const { return m_.blocks_.has_cross(a, l); }
  bool has_head_probe(int h) const { return m_.blocks_.has_head_probe(h); }

  std::vector<double> mean_x(int a) const;          // [F]
  std::vector<double> mean_y(int l) const;          // [G]
  std::vector<double> var_y(int l) const;           // diag of Cyy [G]
  std::vector<double> var_x(int a) const;           // diag of Cxx of source layer a [F]
  // Cxx for the listed source layers (in that order), written into A (lda) as [n*F x n*F], full symmetric.
  void cov_xx(const std::vector<int>& layers, double* A, int64_t lda) const;
  // What cov_xx assembles, for a backend to assemble and factor (ComputeBackend::factor_cov): blocks, means, 1/N.
  ComputeBackend::CovTerms cov_xx_terms(const std::vector<int>& layers) const;
  // Cxy for the listed source layers and target layer l: [n*F x G] (ldb).
  void cov_xy(const std::vector<int>& layers, int l, double* B, int64_t ldb) const;
  // Head-matched (per_head) systems: source head h of the listed layers, in that order. The terms of Cxx
  // [n*Ds x n*Ds] (sub-blocks of the Gram blocks, read in place), and Cxy against head h of target layer l:
  // [n*Ds x Dt] (ldb).
  ComputeBackend::CovTerms head_cov_xx_terms(const std::vector<int>& layers, int h) const;
  void head_cov_xy(const std::vector<int>& layers, int l, int h, double* B, int64_t ldb) const;
  // Same-head probe: Cxx of (a, h) [Ds x Ds] into A, and Cxy of (a, h) against head h of every target layer:
  // [Ds x Lt*Dt] into B.
  void head_cov_xx(int a, int h, double* A) const;
  void head_cov_xy(int a, int h, double* B) const;

 private:
  double mx(int64_t col) const { return m_.sum_x_[col] / m_.n_; }
  double my(int64_t col) const { return m_.sum_y_[col] / m_.n_; }
  const Moments& m_;
};

inline Covariances Moments::covariances() const { return Covariances(*this); }

// The moments one pass accumulates, by name: keys (RoPE-stripped), the raw keys when the pass keeps them (pass 1,
// for the probe's k_rope matrix), values. Reductions and checkpoints lay their live sums back to back in this order.
struct PassMoments {
  Moments& k;
  Moments* k_rope;
  Moments& v;
  // Null for raw keys the pass does not keep.
  Moments* of(Kind kind) const { return kind == Kind::k ? &k : kind == Kind::v ? &v : k_rope; }
  template <class F>
  void each(F&& f) const {
    for (Kind kind : kAllKinds)
      if (Moments* m = of(kind)) f(*m);
  }
};

}  // namespace crosskv
