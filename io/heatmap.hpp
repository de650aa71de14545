#pragma once
// The R² heatmaps as one SVG (like the paper's Figure 2): rows source layer, columns target layer.
#include <string>
#include <vector>

#include "core/r2.hpp"

namespace crosskv {

struct HeatmapPanel {
  std::string title;
  const ProbeR2* r2;
};

std::string render_heatmaps_svg(const std::vector<HeatmapPanel>& panels, const std::string& caption);

}  // namespace crosskv
