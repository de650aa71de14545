#pragma once
// A report a person opens in a browser: one self-contained HTML file with inline SVG (no network).
#include <string>
#include <vector>

#include "artifact/mapper.hpp"
#include "eval/evaluation.hpp"

namespace crosskv {

struct ReportInput {
  std::string title;                      // the pair
  std::vector<MapperManifest> manifests;  // one per mapper (k) evaluated
  std::vector<Evaluation> evaluations;    // the same order
  std::string eval_source;                // what the held-out tokens were
  std::string heatmap_svg;                // the fit's R² heatmaps, if at hand
};

std::string render_report(const ReportInput& in);

}  // namespace crosskv
