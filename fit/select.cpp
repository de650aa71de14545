#include "fit/select.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>

namespace crosskv {

std::vector<std::vector<int>> rank_sources(const std::vector<double>& r2_k, const std::vector<double>& r2_v, int Ls,
                                           int Lt) {
  std::vector<std::vector<int>> out(Lt);
  for (int l = 0; l < Lt; ++l) {
    std::vector<double> score(Ls);
    for (int a = 0; a < Ls; ++a) {
      const double s = 0.5 * (r2_k[a * Lt + l] + r2_v[a * Lt + l]);
      score[a] = std::isnan(s) ? -std::numeric_limits<double>::infinity() : s;
    }
    out[l].resize(Ls);
    std::iota(out[l].begin(), out[l].end(), 0);
    std::stable_sort(out[l].begin(), out[l].end(), [&](int x, int y) { return score[x] > score[y]; });
  }
  return out;
}

std::vector<int> top_k(const std::vector<int>& ranking, int k) {
  std::vector<int> s(ranking.begin(), ranking.begin() + std::min<size_t>(k, ranking.size()));
  std::sort(s.begin(), s.end());
  return s;
}

}  // namespace crosskv
