#pragma once
// A mapper's every layer in host memory, and applying it the plain way (one BLAS product per selected source layer,
// the residual MLP and per_head layers by loops): the tests' reference for Transfer, the serving mapper and the device backends.
#include <string>
#include <vector>

#include "artifact/mapper.hpp"
#include "core/kind.hpp"

namespace crosskv {

struct MapperWeights {
  std::string dir;
  MapperManifest manifest;
  KvSpec source, target;
  std::vector<MapperLayer> layers;
};
MapperWeights load_mapper(const std::string& dir);

// X: source content [rows x Ls*F] (RoPE-stripped keys, or values); out: target content [rows x Lt*G].
void map_content(const MapperWeights& m, Kind kind, const float* X, int64_t rows, float* out);

}  // namespace crosskv
