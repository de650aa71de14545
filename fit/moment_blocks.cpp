#include "fit/moment_blocks.hpp"

#include <set>
#include <string>

#include "core/error.hpp"
#include "core/memory.hpp"

namespace crosskv {

FloatArena::FloatArena(int64_t count) : n_(count) {
  CROSSKV_ASSERT(count >= 0, "negative arena size");
  p_ = static_cast<float*>(allocate_zeroed(static_cast<size_t>(std::max<int64_t>(count, 1)) * sizeof(float)));
}

FloatArena::~FloatArena() { release_zeroed(p_, static_cast<size_t>(std::max<int64_t>(n_, 1)) * sizeof(float)); }

MomentPlan MomentPlan::full(const PairDims& d, bool head_probe) {
  MomentPlan p;
  for (int a = 0; a < d.Ls; ++a)
    for (int b = a; b < d.Ls; ++b) p.gram.emplace_back(a, b);
  for (int a = 0; a < d.Ls; ++a)
    for (int l = 0; l < d.Lt; ++l) p.cross.emplace_back(a, l);
  if (head_probe) p.probe_heads = all_heads(d);
  return p;
}

std::vector<int> MomentPlan::all_heads(const PairDims& d) {
  std::vector<int> h(d.Hs);
  for (int i = 0; i < d.Hs; ++i) h[i] = i;
  return h;
}

int64_t MomentPlan::floats(const PairDims& d) const {
  int64_t n = static_cast<int64_t>(gram.size()) * d.F() * d.F() + static_cast<int64_t>(cross.size()) * d.F() * d.G();
  n += static_cast<int64_t>(probe_heads.size()) * (int64_t{d.Ls} * d.Ds * d.Ds + int64_t{d.Ls} * d.Ds * d.Lt * d.Dt);
  return n;
}

std::vector<BlockRef> MomentBlocks::new_blocks(const std::vector<std::pair<int64_t, int64_t>>& shapes) {
  int64_t total = 0;
  for (const auto& [r, c] : shapes) total += r * c;
  arenas_.push_back(std::make_unique<FloatArena>(total));
  float* p = arenas_.back()->data();
  const int arena = static_cast<int>(arenas_.size()) - 1;
  std::vector<BlockRef> out;
  for (const auto& [r, c] : shapes) {
    out.push_back({r * c != 0 ? p : nullptr, r, c, c, arena});
    p += r * c;
  }
  return out;
}

MomentBlocks::PlanBlocks MomentBlocks::new_in(const MomentPlan& plan) const {
  PlanBlocks nb;
  std::set<std::pair<int, int>> seen_gram, seen_cross;
  for (auto p : plan.gram) {
    CROSSKV_ASSERT(p.first <= p.second && p.second < d_.Ls, "bad gram pair");
    if (!gram_idx_.count(p) && seen_gram.insert(p).second) nb.grams.push_back(p);
  }
  for (auto p : plan.cross) {
    CROSSKV_ASSERT(p.first < d_.Ls && p.second < d_.Lt, "bad cross pair");
    if (!cross_idx_.count(p) && seen_cross.insert(p).second) nb.crosses.push_back(p);
  }
  nb.heads = !plan.probe_heads.empty() && head_cross_.empty();
  nb.probe.assign(d_.Hs, false);
  if (nb.heads) {
    CROSSKV_ASSERT(d_.Hs == d_.Ht, "same-head probe needs equal head counts");
    for (int h : plan.probe_heads) {
      CROSSKV_ASSERT(h >= 0 && h < d_.Hs, "bad probe head");
      nb.probe[h] = true;
    }
  }
  return nb;
}

// Gram panels, cross panels (consecutive ones adjacent), single blocks, same-head blocks. A panel is a source
// layer whose Gram row or cross row the plan adds whole.
MomentBlocks::ArenaLayout MomentBlocks::lay_out(const PlanBlocks& nb) const {
  const int64_t F = d_.F(), G = d_.G(), Y = d_.Y();
  const int Ls = d_.Ls, Lt = d_.Lt;
  std::vector<int64_t> gram_row(Ls, 0), cross_row(Ls, 0);
  for (const auto& pr : nb.grams) ++gram_row[pr.first];
  for (const auto& pr : nb.crosses) ++cross_row[pr.first];
  ArenaLayout at;
  int64_t& off = at.floats;
  at.gram_panel.assign(Ls, -1), at.cross_panel.assign(Ls, -1);
  for (int a = 0; a < Ls; ++a)
    if (gram_row[a] == Ls - a) at.gram_panel[a] = off, off += F * (Ls - a) * F;
  for (int a = 0; a < Ls; ++a)
    if (cross_row[a] == Lt) at.cross_panel[a] = off, off += F * Y;
  at.gram_single.assign(nb.grams.size(), -1), at.cross_single.assign(nb.crosses.size(), -1);
  for (size_t i = 0; i < nb.grams.size(); ++i)
    if (at.gram_panel[nb.grams[i].first] < 0) at.gram_single[i] = off, off += F * F;
  for (size_t i = 0; i < nb.crosses.size(); ++i)
    if (at.cross_panel[nb.crosses[i].first] < 0) at.cross_single[i] = off, off += F * G;
  at.head_off = off;
  if (nb.heads)
    for (int h = 0; h < d_.Hs; ++h)
      if (nb.probe[h]) off += int64_t{Ls} * d_.Ds * d_.Ds + int64_t{Ls} * d_.Ds * Lt * d_.Dt;
  return at;
}

void MomentBlocks::add_plan(const MomentPlan& plan) {
  const PlanBlocks nb = new_in(plan);
  if (nb.grams.empty() && nb.crosses.empty() && !nb.heads) return;
  const ArenaLayout at = lay_out(nb);
  CROSSKV_ASSERT(held_.empty(), "a plan added while the live blocks are held");
  arenas_.push_back(std::make_unique<FloatArena>(at.floats));
  const int arena = static_cast<int>(arenas_.size()) - 1;
  live_arenas_.push_back(arena);
  float* base = arenas_.back()->data();
  place_blocks(nb, at, base, arena);
  place_panels(at, base, arena);
  if (nb.heads) place_heads(nb, base + at.head_off, arena);
}

void MomentBlocks::place_blocks(const PlanBlocks& nb, const ArenaLayout& at, float* base, int arena) {
  const int64_t F = d_.F(), G = d_.G(), Y = d_.Y();
  const int Ls = d_.Ls;
  for (size_t i = 0; i < nb.grams.size(); ++i) {
    const auto [a, b] = nb.grams[i];
    const int64_t panel = at.gram_panel[a];
    gram_idx_.emplace(nb.grams[i], gram_.size());
    gram_.push_back(panel >= 0 ? BlockRef{base + panel + (b - a) * F, F, F, (Ls - a) * F, arena}
                               : BlockRef{base + at.gram_single[i], F, F, F, arena});
    gram_live_.push_back(true);
    gram_in_panel_.push_back(panel >= 0);
  }
  for (size_t i = 0; i < nb.crosses.size(); ++i) {
    const auto [a, l] = nb.crosses[i];
    const int64_t panel = at.cross_panel[a];
    cross_idx_.emplace(nb.crosses[i], cross_.size());
    cross_.push_back(panel >= 0 ? BlockRef{base + panel + l * G, F, G, Y, arena}
                                : BlockRef{base + at.cross_single[i], F, G, G, arena});
    cross_live_.push_back(true);
    cross_in_panel_.push_back(panel >= 0);
  }
}

// Each Gram panel one GEMM; adjacent cross panels one GEMM together.
void MomentBlocks::place_panels(const ArenaLayout& at, float* base, int arena) {
  const int64_t F = d_.F(), Y = d_.Y();
  const int Ls = d_.Ls;
  for (int a = 0; a < Ls; ++a)
    if (at.gram_panel[a] >= 0)
      panels_.push_back({a * F, F, false, a * F, (Ls - a) * F, base + at.gram_panel[a], (Ls - a) * F, arena});
  for (int a = 0; a < Ls;) {
    if (at.cross_panel[a] < 0) {
      ++a;
      continue;
    }
    int b = a;
    while (b + 1 < Ls && at.cross_panel[b + 1] >= 0) ++b;
    panels_.push_back({a * F, (b - a + 1) * F, true, 0, Y, base + at.cross_panel[a], Y, arena});
    a = b + 1;
  }
}

void MomentBlocks::place_heads(const PlanBlocks& nb, float* p, int arena) {
  const int Ls = d_.Ls, Lt = d_.Lt, H = d_.Hs, Ds = d_.Ds, Dt = d_.Dt;
  head_gram_.assign(int64_t{Ls} * H, BlockRef{});
  head_cross_.assign(H, BlockRef{});
  for (int h = 0; h < H; ++h) {
    if (!nb.probe[h]) continue;
    for (int a = 0; a < Ls; ++a, p += int64_t{Ds} * Ds) head_gram_[int64_t{a} * H + h] = {p, Ds, Ds, Ds, arena};
    head_cross_[h] = {p, int64_t{Ls} * Ds, int64_t{Lt} * Dt, int64_t{Lt} * Dt, arena};
    p += int64_t{Ls} * Ds * Lt * Dt;
  }
  head_live_ = true;
}

void MomentBlocks::hold(ComputeBackend& be) {
  if (!held_.empty() || live_arenas_.empty()) return;
  held_.resize(arenas_.size());
  for (int a : live_arenas_) held_[a] = be.hold_sums(arenas_[a]->data(), arenas_[a]->size(), live_zero_);
  live_zero_ = false;
}

void MomentBlocks::release(bool write_back) {
  for (auto& h : held_)
    if (h && write_back) h->to_host();
  // Dropped copies leave host arenas that are neither current nor known to be zero.
  held_.clear();
}

float* MomentBlocks::sums(const float* p, int arena) const {
  CROSSKV_ASSERT(arena >= 0 && arena < static_cast<int>(held_.size()) && held_[arena],
                 "moment blocks added into while not held");
  return held_[arena]->at(p);
}

void MomentBlocks::accumulate(ComputeBackend& be, const float* X, const float* Y, int64_t rows) {
  const int64_t XW = d_.X(), YW = d_.Y(), F = d_.F(), G = d_.G();
  const int Ls = d_.Ls, Lt = d_.Lt, H = d_.Hs, Ds = d_.Ds;
  // Head-major copies: source head h of every layer side by side, likewise for the targets.
  const float* hx = head_live_ ? be.gather_heads(rows, Ls, H, Ds, X, hx_) : nullptr;
  const float* hy = head_live_ ? be.gather_heads(rows, Lt, d_.Ht, d_.Dt, Y, hy_) : nullptr;
  hold(be);
  for (const Panel& pn : panels_)
    be.cross_acc(rows, pn.m, pn.n, X + pn.x_col, XW, (pn.from_y ? Y : X) + pn.b_col, pn.from_y ? YW : XW,
                 sums(pn.C, pn.arena), pn.ldc);
  std::vector<ComputeBackend::CrossTerm> grams, crosses;  // blocks outside panels (contiguous)
  for (const auto& [p, i] : gram_idx_) {
    if (!gram_live_[i] || gram_in_panel_[i]) continue;
    if (p.first == p.second)
      be.gram_acc(rows, F, X + p.first * F, XW, sums(gram_[i].p, gram_[i].arena), F);
    else
      grams.push_back({X + p.first * F, X + p.second * F, sums(gram_[i].p, gram_[i].arena)});
  }
  for (const auto& [p, i] : cross_idx_)
    if (cross_live_[i] && !cross_in_panel_[i])
      crosses.push_back({X + p.first * F, Y + p.second * G, sums(cross_[i].p, cross_[i].arena)});
  be.cross_acc_batch(rows, F, F, grams, XW, XW, F);
  be.cross_acc_batch(rows, F, G, crosses, XW, YW, G);
  if (head_live_) {
    for (int h = 0; h < H; ++h)
      if (!head_cross_[h].empty())
        be.cross_acc(rows, int64_t{Ls} * Ds, int64_t{Lt} * d_.Dt, hx + int64_t{h} * Ls * Ds, XW,
                     hy + int64_t{h} * Lt * d_.Dt, YW, sums(head_cross_[h].p, head_cross_[h].arena),
                     int64_t{Lt} * d_.Dt);
    for (int a = 0; a < Ls; ++a)
      for (int h = 0; h < H; ++h)
        if (!head_cross_[h].empty()) {
          const BlockRef& g = head_gram_[int64_t{a} * H + h];
          be.gram_acc(rows, Ds, X + a * F + int64_t{h} * Ds, XW, sums(g.p, g.arena), Ds);
        }
  }
}

template <class Fn>
void MomentBlocks::for_each_live(Fn fn) const {
  for (size_t i = 0; i < gram_.size(); ++i)
    if (gram_live_[i]) fn(i, BlockKind::gram);
  for (size_t i = 0; i < cross_.size(); ++i)
    if (cross_live_[i]) fn(i, BlockKind::cross);
  if (head_live_) {
    for (size_t i = 0; i < head_gram_.size(); ++i) fn(i, BlockKind::head_gram);
    for (size_t i = 0; i < head_cross_.size(); ++i) fn(i, BlockKind::head_cross);
  }
}

std::vector<std::pair<const BlockRef*, int64_t>> MomentBlocks::live_layout() const {
  std::vector<std::pair<const BlockRef*, int64_t>> out;
  int64_t off = 0;
  for_each_live([&](size_t i, BlockKind kind) {
    const BlockRef& b = block(i, kind);
    out.emplace_back(&b, off);
    off += b.size();
  });
  return out;
}

void MomentBlocks::live_pieces(std::vector<ComputeBackend::SumPiece<float>>& f, int64_t at) const {
  for (const auto& [b, off] : live_layout()) {
    ComputeBackend::SumPiece<float> q{b->p, b->rows, b->cols, b->ld, at + off};
    if (!held_.empty() && !b->empty()) q.held = sums(b->p, b->arena);  // (a head not probed is empty)
    f.push_back(q);
  }
}

void MomentBlocks::zero_live() {
  for (int a : live_arenas_) {  // a live arena holds live blocks only
    if (!held_.empty())
      held_[a]->zero();
    else
      std::fill_n(arenas_[a]->data(), arenas_[a]->size(), 0.0f);
  }
  live_zero_ = true;
}

void MomentBlocks::mark_complete() {
  for (const auto& h : held_) CROSSKV_ASSERT(!h || !h->on_device(), "moment blocks completed while held on a device");
  held_.clear();
  std::fill(gram_live_.begin(), gram_live_.end(), false);
  std::fill(cross_live_.begin(), cross_live_.end(), false);
  head_live_ = false;
  live_arenas_.clear();
  live_zero_ = true;
  panels_.clear();
}

void MomentBlocks::scale(float wf) {
  for (auto* set : {&gram_, &cross_, &head_gram_, &head_cross_})
    for (const BlockRef& b : *set)
      for (int64_t r = 0; r < b.rows; ++r)
        for (float* x = b.row(r); x != b.row(r) + b.cols; ++x) *x *= wf;
}

void MomentBlocks::add(const MomentBlocks& o, float wf) {
  CROSSKV_ASSERT(same_blocks(o), "moments with different blocks");
  live_zero_ = false;
  auto add_all = [wf](std::vector<BlockRef>& a, const std::vector<BlockRef>& b) {
    for (size_t i = 0; i < a.size(); ++i) {
      CROSSKV_ASSERT(a[i].rows == b[i].rows && a[i].cols == b[i].cols, "moments with different block shapes");
      for (int64_t r = 0; r < a[i].rows; ++r) {
        float* x = a[i].row(r);
        const float* y = b[i].row(r);
        for (int64_t c = 0; c < a[i].cols; ++c) x[c] += wf == 1.0f ? y[c] : wf * y[c];
      }
    }
  };
  add_all(gram_, o.gram_);
  add_all(cross_, o.cross_);
  add_all(head_gram_, o.head_gram_);
  add_all(head_cross_, o.head_cross_);
}

const BlockRef& MomentBlocks::block(size_t i, BlockKind kind) const {
  switch (kind) {
    case BlockKind::gram: return gram_[i];
    case BlockKind::cross: return cross_[i];
    case BlockKind::head_gram: return head_gram_[i];
    case BlockKind::head_cross: return head_cross_[i];
  }
  CROSSKV_ASSERT(false, "unknown block kind");
}

void MomentBlocks::derive_head_probe() {
  CROSSKV_ASSERT(d_.Hs == d_.Ht, "same-head probe needs equal head counts");
  const int Ls = d_.Ls, Lt = d_.Lt, H = d_.Hs, Ds = d_.Ds, Dt = d_.Dt;
  std::vector<std::pair<int64_t, int64_t>> shapes(int64_t{Ls} * H, {Ds, Ds});
  shapes.insert(shapes.end(), H, {int64_t{Ls} * Ds, int64_t{Lt} * Dt});
  const std::vector<BlockRef> blocks = new_blocks(shapes);
  head_gram_.assign(blocks.begin(), blocks.begin() + int64_t{Ls} * H);
  head_cross_.assign(blocks.begin() + int64_t{Ls} * H, blocks.end());
  for (int a = 0; a < Ls; ++a) {
    const auto& g = gram(a, a);
    for (int h = 0; h < H; ++h)
      for (int p = 0; p < Ds; ++p)
        for (int q = p; q < Ds; ++q)
          head_gram_[int64_t{a} * H + h].at(p, q) = g.at(int64_t{h} * Ds + p, int64_t{h} * Ds + q);
    for (int l = 0; l < Lt; ++l) {
      if (!has_cross(a, l)) continue;
      const auto& c = cross(a, l);
      for (int h = 0; h < H; ++h)
        for (int p = 0; p < Ds; ++p)
          std::copy_n(c.row(int64_t{h} * Ds + p) + int64_t{h} * Dt, Dt,
                      head_cross_[h].row(int64_t{a} * Ds + p) + int64_t{l} * Dt);
    }
  }
}

int64_t MomentBlocks::floats() const {
  int64_t n = 0;
  for (const auto* set : {&gram_, &cross_, &head_gram_, &head_cross_})
    for (const auto& v : *set) n += v.size();
  return n;
}

const BlockRef& MomentBlocks::gram(int a, int b) const {
  auto it = gram_idx_.find({a, b});
  CROSSKV_ASSERT(it != gram_idx_.end(), "gram block (" + std::to_string(a) + "," + std::to_string(b) + ") missing");
  return gram_[it->second];
}

const BlockRef& MomentBlocks::cross(int a, int l) const {
  auto it = cross_idx_.find({a, l});
  CROSSKV_ASSERT(it != cross_idx_.end(), "cross block (" + std::to_string(a) + "," + std::to_string(l) + ") missing");
  return cross_[it->second];
}

const BlockRef& MomentBlocks::head_gram(int a, int h) const { return head_gram_.at(int64_t{a} * d_.Hs + h); }
const BlockRef& MomentBlocks::head_cross(int h) const { return head_cross_.at(h); }

BlockRef MomentBlocks::complete_gram(int a, int b) {
  CROSSKV_ASSERT(a <= b && b < d_.Ls, "bad gram pair");
  auto [it, added] = gram_idx_.emplace(std::make_pair(a, b), gram_.size());
  if (added) {
    gram_.push_back(new_blocks({{d_.F(), d_.F()}}).front());
    gram_live_.push_back(false);
    gram_in_panel_.push_back(false);
  }
  CROSSKV_ASSERT(!gram_live_[it->second], "complete_gram on a block being accumulated");
  return gram_[it->second];
}

}  // namespace crosskv
