#pragma once
// Storage of the fp32 moment blocks (docs/METHOD.md, The fit): arenas carved into blocks and panels, which blocks are being
// accumulated, and the products that fill them. What the blocks mean (means, covariances, token counts) is Moments'.
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <utility>
#include <vector>

#include "core/backend.hpp"

namespace crosskv {

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
  int arena = -1;  // the arena that holds it (MomentBlocks' index)
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

// The blocks of one kind of a pair: Gram (a, b), cross (a, l), and the same-head probe's per-head Gram and cross
// blocks. Blocks added by a plan are live (accumulated in the current pass) until mark_complete().
class MomentBlocks {
 public:
  enum class BlockKind { gram, cross, head_gram, head_cross };

  MomentBlocks() = default;
  explicit MomentBlocks(const PairDims& d) : d_(d) {}

  // Lays out the plan's new blocks (zeros, live) in one new arena; blocks already present are kept as they are.
  void add_plan(const MomentPlan& plan);
  // Adds the products of `rows` shifted inputs (backend operands of the current round) to every live block: whole
  // Gram and cross rows as one wide GEMM each (panels), the other blocks batched, the same-head blocks from
  // head-major copies.
  void accumulate(ComputeBackend& be, const float* X, const float* Y, int64_t rows);
  // Holds the live arenas where the backend accumulates (ComputeBackend::hold_sums; a device backend's copies on the
  // device); done by accumulate() if not before. Calls while held do nothing.
  void hold(ComputeBackend& be);
  // The held copies back to the host arenas (write_back) or dropped (the host arenas are then overwritten by the
  // caller), and released.
  void release(bool write_back);
  // Every live block with its offset in the flat live state (plan order: Gram, cross, same-head Gram, same-head
  // cross): the layout of round reductions and checkpoints.
  std::vector<std::pair<const BlockRef*, int64_t>> live_layout() const;
  // The live blocks as pieces of the flat live state from `at` on, current where they are held.
  void live_pieces(std::vector<ComputeBackend::SumPiece<float>>& f, int64_t at) const;
  // Zeroes the live blocks where they are current (their held copies, else the host).
  void zero_live();
  // The live blocks were written on the host (gathered or loaded): not zero any more.
  void touched() { live_zero_ = false; }
  void mark_complete();

  // Every block times w (fp32), and w times another's blocks added (the same blocks).
  void scale(float w);
  void add(const MomentBlocks& o, float w);
  // Same-head blocks of every head, from the Gram blocks (a, a) and the cross blocks present.
  void derive_head_probe();
  // A complete Gram block (a, b), created as zeros if absent: for blocks accumulated on other ranks.
  BlockRef complete_gram(int a, int b);

  bool has_gram(int a, int b) const { return gram_idx_.count({a, b}) > 0; }
  bool has_cross(int a, int l) const { return cross_idx_.count({a, l}) > 0; }
  bool has_head_probe(int h) const { return h < static_cast<int>(head_cross_.size()) && !head_cross_[h].empty(); }
  const BlockRef& gram(int a, int b) const;   // throws (assertion) when absent
  const BlockRef& cross(int a, int l) const;
  const BlockRef& head_gram(int a, int h) const;  // empty when that head was not probed
  const BlockRef& head_cross(int h) const;
  bool same_blocks(const MomentBlocks& o) const {
    return gram_idx_ == o.gram_idx_ && cross_idx_ == o.cross_idx_ && head_cross_.size() == o.head_cross_.size();
  }
  int64_t floats() const;

 private:
  const BlockRef& block(size_t i, BlockKind kind) const;
  // Carves contiguous blocks of {rows, cols} out of one new arena (zeros).
  std::vector<BlockRef> new_blocks(const std::vector<std::pair<int64_t, int64_t>>& shapes);
  // add_plan's steps: the plan's blocks not yet present (in plan order: the order of the flat live state), their
  // offsets in the new arena, and the blocks, panels and same-head blocks placed there.
  struct PlanBlocks {
    std::vector<std::pair<int, int>> grams, crosses;
    std::vector<bool> probe;  // [Hs] the same-head blocks of these heads
    bool heads = false;
  };
  struct ArenaLayout {
    std::vector<int64_t> gram_panel, cross_panel;   // [Ls] a source layer's whole row, or -1
    std::vector<int64_t> gram_single, cross_single;  // per new block outside a panel, or -1
    int64_t head_off = 0, floats = 0;
  };
  PlanBlocks new_in(const MomentPlan& plan) const;
  ArenaLayout lay_out(const PlanBlocks& nb) const;
  void place_blocks(const PlanBlocks& nb, const ArenaLayout& at, float* base, int arena);
  void place_panels(const ArenaLayout& at, float* base, int arena);
  void place_heads(const PlanBlocks& nb, float* p, int arena);
  template <class Fn>
  void for_each_live(Fn fn) const;

  PairDims d_;
  std::map<std::pair<int, int>, std::size_t> gram_idx_, cross_idx_;
  std::vector<std::unique_ptr<FloatArena>> arenas_;
  std::vector<BlockRef> gram_, cross_;
  std::vector<BlockRef> head_gram_;   // [Ls*Hs] of Ds x Ds (upper)
  std::vector<BlockRef> head_cross_;  // [Hs] of (Ls*Ds) x (Lt*Dt)
  std::vector<float> hx_, hy_;        // head-major scratch
  // Blocks being accumulated in the current pass (the rest are complete), the arenas that hold them, and whether
  // they are all zero (just made, or zeroed after a round: on the host, or on the device where they stay resident,
  // so hold_sums' promise holds whenever it can still create a range).
  std::vector<bool> gram_live_, cross_live_;
  bool head_live_ = false;
  std::vector<int> live_arenas_;
  std::vector<ComputeBackend::HeldSumsPtr<float>> held_;  // [arenas_.size()] while held: the live ones'
  bool live_zero_ = true;
  // Where a call adds into block memory p of arena `arena`: its held copy.
  float* sums(const float* p, int arena) const;
  // Where a plan adds every Gram block (a, b >= a) or every cross block (a, l) of a source layer a, those blocks form
  // a panel, [F x (Ls-a)F] or [F x Y] (consecutive cross panels: one [n*F x Y] matrix), accumulated by one wide GEMM
  // each instead of block by block: C = X[:, x_col .. x_col+m)^T (Y or X)[:, b_col .. b_col+n).
  struct Panel {
    int64_t x_col, m;
    bool from_y;
    int64_t b_col, n;
    float* C;
    int64_t ldc;
    int arena;
  };
  std::vector<Panel> panels_;  // of the live blocks
  std::vector<bool> gram_in_panel_, cross_in_panel_;
};

}  // namespace crosskv
