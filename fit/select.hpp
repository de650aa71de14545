#pragma once
// Source-layer selection (docs/METHOD.md, Probe and selection): score = (R²_k + R²_v)/2; top-k per target layer, ties to the lower index.
#include <vector>

namespace crosskv {

// rankings[l] lists every source layer, best first. Scores are [Ls x Lt]; NaN ranks last.
std::vector<std::vector<int>> rank_sources(const std::vector<double>& r2_k, const std::vector<double>& r2_v, int Ls,
                                           int Lt);
// The first k of a ranking, ascending (the column order of X).
std::vector<int> top_k(const std::vector<int>& ranking, int k);

}  // namespace crosskv
