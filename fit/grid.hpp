#pragma once
// The job's rank grid: G layer groups x T token groups (P = G * T). Rank r is in layer group r / T and token group
// r % T. A layer group owns target layers l with l % G == its index (their cross blocks, probe entries, solves and
// exports) and a 1/G share of the Gram blocks; its T ranks read disjoint shard subsets and reduce the group's
// moments among themselves. Every moment block is thus accumulated by exactly one layer group. After a pass the
// Gram blocks are exchanged between layer groups, since every solve may need any of them.
#include <memory>
#include <string>

#include "core/comm.hpp"
#include "fit/moments.hpp"

namespace crosskv {

struct Grid {
  int layer_groups = 1, token_groups = 1;
  int layer_group = 0, token_group = 0;
  std::unique_ptr<Comm> readers;  // this layer group's ranks, ordered by token group: they sum its moments
  std::unique_ptr<Comm> peers;    // this token group's ranks, one per layer group: they exchange Gram blocks

  bool owns_target(int l) const { return l % layer_groups == layer_group; }
  bool owns_head(int h) const { return h % layer_groups == layer_group; }
  // Layer group accumulating Gram block (a, b), a <= b, of a pair with Ls source layers.
  int gram_group(int a, int b, int Ls) const;
  // The part of a job-wide plan this rank's layer group accumulates (same-head probe blocks: its heads).
  MomentPlan share(const MomentPlan& plan, const PairDims& d) const;
  std::string describe() const;  // "2 layer groups x 2 token groups"
};

// Collective over `world`. layer_groups must divide world.size().
Grid make_grid(Comm& world, int layer_groups);

// Makes every Gram block of `plan` complete on every rank: each is broadcast from its layer group (over peers).
void share_gram(Grid& grid, const MomentPlan& plan, Moments& m);

}  // namespace crosskv
