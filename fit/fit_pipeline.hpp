#pragma once
// crosskv-fit end to end: validate -> plan -> probe pass -> select -> (second pass) -> solve -> export.
#include <string>
#include <vector>

#include "fit/config.hpp"
#include "fit/calibration.hpp"
#include "fit/context.hpp"

namespace crosskv {

struct FitOptions {
  bool plan_only = false;
  bool fresh = false;  // ignore (and remove) committed checkpoints
  int plan_ranks = 0;  // with plan_only: plan a job of this many ranks (0: this job's)
};

struct FitResult {
  std::string plan_text;
  std::vector<std::string> artifacts;  // one folder per k
  std::string r2_path, heatmap_path;
  std::string report_path;  // report.html, when the config names held-out shards (eval.shards)
  int passes = 0;
  int64_t tokens_read = 0;  // calibration tokens streamed by this run (0 when everything came from a checkpoint)
};

FitResult run_fit(const FitConfig& cfg, const FitOptions& opts, Context& ctx);

}  // namespace crosskv
