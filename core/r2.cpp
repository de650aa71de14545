#include "core/r2.hpp"

#include <cmath>
#include <cstdint>
#include <limits>

namespace crosskv {

double mean_ignoring_nan(const std::vector<double>& v) {
  double s = 0;
  int n = 0;
  for (double x : v)
    if (!std::isnan(x)) {
      s += x;
      ++n;
    }
  return n ? s / n : std::numeric_limits<double>::quiet_NaN();
}

void probe_means(ProbeR2& r) {
  const int64_t H = r.H;
  for (int64_t i = 0; i < int64_t{r.Ls} * r.Lt; ++i)
    r.mean[i] = mean_ignoring_nan(std::vector<double>(r.per_head.begin() + i * H, r.per_head.begin() + (i + 1) * H));
}

}  // namespace crosskv
