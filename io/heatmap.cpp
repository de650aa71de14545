#include "io/heatmap.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace crosskv {
namespace {

// Viridis at 5 stops, linearly interpolated.
std::string viridis(double v) {
  static const double stops[5][3] = {
      {68, 1, 84}, {59, 82, 139}, {33, 145, 140}, {94, 201, 98}, {253, 231, 37}};
  if (std::isnan(v)) return "#cccccc";
  v = std::clamp(v, 0.0, 1.0) * 4.0;
  const int i = std::min(3, static_cast<int>(v));
  const double t = v - i;
  char buf[8];
  std::snprintf(buf, sizeof buf, "#%02x%02x%02x", int(stops[i][0] + t * (stops[i + 1][0] - stops[i][0])),
                int(stops[i][1] + t * (stops[i + 1][1] - stops[i][1])),
                int(stops[i][2] + t * (stops[i + 1][2] - stops[i][2])));
  return buf;
}

}  // namespace

std::string render_heatmaps_svg(const std::vector<HeatmapPanel>& panels, const std::string& caption) {
  const double panel = 300, margin = 50, gap = 40, bar = 60;
  const double width = margin + panels.size() * (panel + gap) + bar, height = panel + 2 * margin + 30;
  std::ostringstream o;
  o << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << width << "\" height=\"" << height
    << "\" font-family=\"sans-serif\" font-size=\"12\" shape-rendering=\"crispEdges\">\n<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  o << "<text x=\"" << margin << "\" y=\"18\" font-size=\"13\">" << caption << "</text>\n";
  for (size_t p = 0; p < panels.size(); ++p) {
    const ProbeR2& r = *panels[p].r2;
    const double x0 = margin + p * (panel + gap), y0 = margin;
    const double cw = panel / r.Lt, ch = panel / r.Ls;
    o << "<text x=\"" << x0 + panel / 2 << "\" y=\"" << y0 - 8 << "\" text-anchor=\"middle\" font-weight=\"bold\">"
      << panels[p].title << "</text>\n";
    for (int a = 0; a < r.Ls; ++a)
      for (int l = 0; l < r.Lt; ++l) {
        const double v = r.mean[a * r.Lt + l];
        o << "<rect x=\"" << x0 + l * cw << "\" y=\"" << y0 + a * ch << "\" width=\"" << cw + 0.05 << "\" height=\""
          << ch + 0.05 << "\" fill=\"" << viridis(v) << "\"><title>source " << a << ", target " << l << ": R2 = " << v
          << "</title></rect>\n";
      }
    o << "<rect x=\"" << x0 << "\" y=\"" << y0 << "\" width=\"" << panel << "\" height=\"" << panel
      << "\" fill=\"none\" stroke=\"black\"/>\n";
    o << "<text x=\"" << x0 + panel / 2 << "\" y=\"" << y0 + panel + 20 << "\" text-anchor=\"middle\">target layer (0.."
      << r.Lt - 1 << ")</text>\n";
    o << "<text transform=\"translate(" << x0 - 10 << "," << y0 + panel / 2
      << ") rotate(-90)\" text-anchor=\"middle\">source layer (0.." << r.Ls - 1 << ")</text>\n";
  }
  const double bx = margin + panels.size() * (panel + gap);
  for (int i = 0; i < 50; ++i)
    o << "<rect x=\"" << bx << "\" y=\"" << margin + panel * (49 - i) / 50.0 << "\" width=\"14\" height=\""
      << panel / 50.0 + 0.5 << "\" fill=\"" << viridis(i / 49.0) << "\"/>\n";
  o << "<text x=\"" << bx + 18 << "\" y=\"" << margin + 10 << "\">1.0</text><text x=\"" << bx + 18 << "\" y=\""
    << margin + panel << "\">&#8804;0</text><text x=\"" << bx << "\" y=\"" << margin + panel + 20
    << "\">R&#178;</text>\n</svg>\n";
  return o.str();
}

}  // namespace crosskv
