#pragma once
// r2.h5 (docs/FORMATS.md): k_rope, k, v [Ls, Lt] float64 head-averaged; per_head/<name> [Ls, Lt, H].
#include <map>
#include <string>

#include "core/kind.hpp"
#include "core/r2.hpp"

namespace crosskv {

void write_r2_file(const std::string& path, const std::map<Kind, ProbeR2>& probes,
                   const std::map<std::string, std::string>& attrs);
std::map<Kind, ProbeR2> read_r2_file(const std::string& path);

}  // namespace crosskv
