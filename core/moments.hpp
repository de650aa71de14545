#pragma once
// Moment accumulation (SPEC §3): fp32 Gram/cross blocks of shifted features and targets, fp64 sums.
// Every later quantity (probe R², fits for any k and λ, in-sample R²) is a function of these.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/backend.hpp"

namespace crosskv {

class Comm;

// fp32 moment blocks live in a few large zero-initialised allocations (one per add_plan, core/memory): untouched
// pages cost nothing until written, and a device backend keeps a pass's blocks resident as one allocation.
class FloatArena {
 public:
  explicit FloatArena(int64_t count);
  ~FloatArena();
  FloatArena(const FloatArena&) = delete;
  FloatArena& operator=(const FloatArena&) = delete;
  float* data() const { return p_; }
  int64_t size() const { return n_; }

 private:
  float* p_ = nullptr;
  int64_t n_ = 0;
};

// A moment block: rows x cols floats of arena memory, row-major with leading dimension ld (the blocks of a panel
// share its rows); empty for an absent block.
struct BlockRef {
  float* p = nullptr;
  int64_t rows = 0, cols = 0, ld = 0;
  float* row(int64_t r) const { return p + r * ld; }
  float& at(int64_t r, int64_t c) const { return p[r * ld + c]; }
  int64_t size() const { return rows * cols; }
  bool empty() const { return size() == 0; }
  bool contiguous() const { return ld == cols; }
};

// Shapes of one kind (keys stripped, keys raw, or values) of a model pair.
struct PairDims {
  int Ls = 0, Hs = 0, Ds = 0;  // source layers, KV heads, head dim
  int Lt = 0, Ht = 0, Dt = 0;  // target
  int64_t F() const { return int64_t{Hs} * Ds; }  // features per source layer
  int64_t G() const { return int64_t{Ht} * Dt; }  // targets per target layer
  int64_t X() const { return Ls * F(); }
  int64_t Y() const { return Lt * G(); }
};

// Which moment blocks to accumulate.
struct MomentPlan {
  std::vector<std::pair<int, int>> gram;   // source layer pairs (a, b), a <= b: [F x F]
  std::vector<std::pair<int, int>> cross;  // (source a, target l): [F x G]
  std::vector<int> probe_heads;            // same-head blocks of these heads: per (a, h) [Ds x Ds]; per h [Ls*Ds x Lt*Dt]

  static MomentPlan full(const PairDims& d, bool head_probe);
  static std::vector<int> all_heads(const PairDims& d);
  bool empty() const { return gram.empty() && cross.empty() && probe_heads.empty(); }
  int64_t floats(const PairDims& d) const;
};

class Moments {
 public:
  // The kinds of fp32 blocks: Gram (a, b), cross (a, l), and the same-head probe's per-head Gram and cross blocks.
  enum class BlockKind { gram, cross, head_gram, head_cross };

  Moments() = default;
  Moments(const PairDims& dims, std::vector<float> shift_x, std::vector<float> shift_y);

  const PairDims& dims() const { return d_; }
  // Adds blocks to accumulate in the coming pass (new blocks start at zero); complete blocks are kept as they are.
  void add_plan(const MomentPlan& plan);

  // Folds in `rows` tokens: X [rows x Ls*F] and Y [rows x Lt*G], row-major, unshifted (shifted here, in place).
  // Token sums and target variances are accumulated in the first pass only. With a device backend the sums stay on
  // the device until be.flush().
  void accumulate(ComputeBackend& be, float* X, float* Y, int64_t rows);
  // The same for inputs already shifted (by shift_x()/shift_y()) and staged or prepared in the backend's current
  // round (ComputeBackend::begin_inputs): X and Y are the backend's operands, possibly device memory.
  void accumulate_staged(ComputeBackend& be, const float* X, const float* Y, int64_t rows);
  // The live state (this pass's blocks, and the token statistics in the first pass), flat in a fixed order: the
  // layout of round reductions and checkpoints. Its sizes:
  size_t live_floats() const;
  size_t live_doubles() const;
  // The live state as pieces in that order, appended to f and d after the pieces already there (so the pieces of
  // several Moments, in turn, are their flat states back to back): for a reduction that reads the sums where they are
  // (ComputeBackend::copy_sums), and for gathering them back in place (place_sums, then unpack_live_doubles).
  void live_pieces(std::vector<ComputeBackend::SumPiece<float>>& f, std::vector<ComputeBackend::SumPiece<double>>& d);
  // The live doubles (token statistics), after the floats were written through live_pieces.
  void unpack_live_doubles(const double* d);
  // Zeroes the live state where it is current: a device backend zeroes resident sums on the device (they stay
  // resident), the rest is zeroed on the host.
  void zero_live(ComputeBackend& be);
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
  BlockRef complete_gram(int a, int b);

  int64_t tokens() const { return static_cast<int64_t>(n_); }
  bool has_gram(int a, int b) const { return gram_idx_.count({a, b}) > 0; }
  bool has_cross(int a, int l) const { return cross_idx_.count({a, l}) > 0; }
  bool has_head_probe(int h) const { return h < static_cast<int>(head_cross_.size()) && !head_cross_[h].empty(); }
  int64_t bytes() const;

  // Centred covariances in fp64 (divided by N). Means are of the unshifted data.
  std::vector<double> mean_x(int a) const;          // [F]
  std::vector<double> mean_y(int l) const;          // [G]
  std::vector<double> var_y(int l) const;           // diag of Cyy [G]
  // Cxx for the listed source layers (in that order), written into A (lda) as [n*F x n*F], full symmetric.
  void cov_xx(const std::vector<int>& layers, double* A, int64_t lda) const;
  // What cov_xx assembles, for a backend to assemble and factor (ComputeBackend::factor_cov): blocks, means, 1/N.
  ComputeBackend::CovTerms cov_xx_terms(const std::vector<int>& layers) const;
  // Cxy for the listed source layers and target layer l: [n*F x G] (ldb).
  void cov_xy(const std::vector<int>& layers, int l, double* B, int64_t ldb) const;
  // Same-head probe: Cxx of (a, h) [Ds x Ds] into A, and Cxy of (a, h) against head h of every target layer:
  // [Ds x Lt*Dt] into B.
  void head_cov_xx(int a, int h, double* A) const;
  void head_cov_xy(int a, int h, double* B) const;

  // Raw accessors, for checkpoints and tests.
  const std::vector<float>& shift_x() const { return shift_x_; }
  const std::vector<float>& shift_y() const { return shift_y_; }

 private:
  const BlockRef& gram_block(int a, int b) const;
  const BlockRef& live_block(size_t i, BlockKind kind) const;
  // Every live block with its offset in the flat live state.
  std::vector<std::pair<const BlockRef*, int64_t>> live_layout() const;
  const BlockRef& cross_block(int a, int l) const;
  // Carves contiguous blocks of {rows, cols} out of one new arena (zeros).
  std::vector<BlockRef> new_blocks(const std::vector<std::pair<int64_t, int64_t>>& shapes);
  double mx(int64_t col) const { return sum_x_[col] / n_; }
  double my(int64_t col) const { return sum_y_[col] / n_; }

  PairDims d_;
  double n_ = 0;
  std::vector<float> shift_x_, shift_y_;
  std::vector<double> sum_x_, sum_y_, sq_y_;
  std::map<std::pair<int, int>, std::size_t> gram_idx_, cross_idx_;
  std::vector<std::unique_ptr<FloatArena>> arenas_;
  std::vector<BlockRef> gram_, cross_;
  std::vector<BlockRef> head_gram_;   // [Ls*Hs] of Ds x Ds (upper)
  std::vector<BlockRef> head_cross_;  // [Hs] of (Ls*Ds) x (Lt*Dt)
  std::vector<float> hx_, hy_;        // head-major scratch
  // Blocks being accumulated in the current pass (the rest are complete), the arenas that hold them, and whether
  // they are all zero (just made, or zeroed after a round: on the host, or on the device where they stay resident,
  // so keep_resident's promise holds whenever it can still create a range).
  std::vector<bool> gram_live_, cross_live_;
  bool head_live_ = false, stats_done_ = false;
  std::vector<const FloatArena*> live_arenas_;
  bool live_zero_ = true;
  // Where a plan adds every Gram block (a, b >= a) or every cross block (a, l) of a source layer a, those blocks form
  // a panel, [F x (Ls-a)F] or [F x Y] (consecutive cross panels: one [n*F x Y] matrix), accumulated by one wide GEMM
  // each instead of block by block: C = X[:, x_col .. x_col+m)^T (Y or X)[:, b_col .. b_col+n).
  struct Panel {
    int64_t x_col, m;
    bool from_y;
    int64_t b_col, n;
    float* C;
    int64_t ldc;
  };
  std::vector<Panel> panels_;                       // of the live blocks
  std::vector<bool> gram_in_panel_, cross_in_panel_;
};

}  // namespace crosskv
