#pragma once
// crosskv-fit end to end: validate -> plan -> probe pass -> select -> (second pass) -> solve -> export.
#include <string>
#include <vector>

#include "core/config.hpp"
#include "stages/stages.hpp"

namespace crosskv {

struct FitOptions {
  bool plan_only = false;
};

struct FitResult {
  std::string plan_text;
  std::vector<std::string> artifacts;  // one folder per k
  std::string r2_path, heatmap_path;
  int passes = 0;
};

FitResult run_fit(const FitConfig& cfg, const FitOptions& opts, Context& ctx);

}  // namespace crosskv
