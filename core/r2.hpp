#pragma once
// R² figures every product reads: the probe's matrices (the fit makes them, io stores and draws them) and the mean
// over heads that skips the undefined ones.
#include <vector>

namespace crosskv {

struct ProbeR2 {
  int Ls = 0, Lt = 0, H = 0;
  std::vector<double> mean;      // [Ls x Lt] head-averaged
  std::vector<double> per_head;  // [Ls x Lt x H]
  // fit.lambda: auto (fit/lambda.hpp): each head's GCV and R² over the λ grid, [Ls x Lt x H x grid]; empty otherwise.
  std::vector<double> gcv, r2_grid;
};
// The head averages of r.per_head, into r.mean.
void probe_means(ProbeR2& r);
// The mean of the values that are not NaN (NaN when there are none).
double mean_ignoring_nan(const std::vector<double>& v);

}  // namespace crosskv
