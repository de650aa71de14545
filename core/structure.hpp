#pragma once
// A mapper's structure (docs/METHOD.md, The fit): what a target head reads. cross_head (the paper's): every KV head of the
// selected source layers. per_head (head-matched): source head h of the selected layers alone for target head h,
// which needs equal KV head counts on both sides.
#include <algorithm>
#include <optional>
#include <string>
#include <vector>

namespace crosskv {

enum class Structure { cross_head, per_head };

inline const char* to_string(Structure s) { return s == Structure::cross_head ? "cross_head" : "per_head"; }
inline std::optional<Structure> parse_structure(const std::string& s) {
  if (s == "cross_head") return Structure::cross_head;
  if (s == "per_head") return Structure::per_head;
  return std::nullopt;
}
inline bool has_structure(const std::vector<Structure>& v, Structure s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}
// The artifact folder of one k and structure under output.dir: "k4", "kall" (cross_head), "k4-per_head".
inline std::string mapper_folder_name(const std::string& k_label, Structure s) {
  return "k" + k_label + (s == Structure::per_head ? "-per_head" : "");
}

}  // namespace crosskv
