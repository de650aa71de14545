#include "fit/grid.hpp"

#include <algorithm>
#include <vector>

#include "core/error.hpp"

namespace crosskv {

int Grid::gram_group(int a, int b, int Ls) const {
  // Triangular index of (a, b): spreads diagonal and off-diagonal blocks over the groups.
  const int64_t tri = int64_t{a} * Ls - int64_t{a} * (a - 1) / 2 + (b - a);
  return static_cast<int>(tri % layer_groups);
}

MomentPlan Grid::share(const MomentPlan& plan, const PairDims& d) const {
  MomentPlan p;
  for (const auto& g : plan.gram)
    if (gram_group(g.first, g.second, d.Ls) == layer_group) p.gram.push_back(g);
  for (const auto& c : plan.cross)
    if (owns_target(c.second)) p.cross.push_back(c);
  for (int h : plan.probe_heads)
    if (owns_head(h)) p.probe_heads.push_back(h);
  return p;
}

std::string Grid::describe() const {
  return std::to_string(layer_groups) + " layer group(s) x " + std::to_string(token_groups) + " token group(s)";
}

Grid make_grid(Comm& world, int layer_groups) {
  const int P = world.size();
  CROSSKV_ASSERT(layer_groups >= 1 && P % layer_groups == 0, "layer groups must divide the rank count");
  Grid g;
  g.layer_groups = layer_groups;
  g.token_groups = P / layer_groups;
  g.layer_group = world.rank() / g.token_groups;
  g.token_group = world.rank() % g.token_groups;
  g.readers = world.split(g.layer_group, g.token_group);
  g.peers = world.split(g.token_group, g.layer_group);
  CROSSKV_ASSERT(g.readers->size() == g.token_groups && g.readers->rank() == g.token_group, "readers split");
  CROSSKV_ASSERT(g.peers->size() == g.layer_groups && g.peers->rank() == g.layer_group, "peers split");
  return g;
}

void share_gram(Grid& grid, const MomentPlan& plan, Moments& m) {
  if (grid.layer_groups == 1) return;
  const int Ls = m.dims().Ls;
  for (const auto& [a, b] : plan.gram) {
    const int owner = grid.gram_group(a, b, Ls);
    CROSSKV_ASSERT(owner != grid.layer_group || m.has_gram(a, b), "own Gram block missing");
    const BlockRef block = m.complete_gram(a, b);
    // One broadcast of the block's F x F values on every rank; a block inside a panel goes through a copy.
    std::vector<float> staged;
    float* buf = block.p;
    if (!block.contiguous()) {
      staged.resize(block.size());
      buf = staged.data();
      for (int64_t r = 0; r < block.rows; ++r) std::copy_n(block.row(r), block.cols, buf + r * block.cols);
    }
    grid.peers->broadcast(buf, block.size() * sizeof(float), owner);
    if (!block.contiguous())
      for (int64_t r = 0; r < block.rows; ++r) std::copy_n(buf + r * block.cols, block.cols, block.row(r));
  }
}

}  // namespace crosskv
