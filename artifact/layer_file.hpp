#pragma once
// A mapper's layer file (SPEC §6, docs/FORMATS.md), defined once: its name, its tensors' names and dtypes, and its
// metadata, for the writers (the export, the residual-MLP rewrite) and the reader (artifact/mapper).
#include <cstdint>
#include <string>
#include <vector>

#include "core/mlp.hpp"

namespace crosskv {

// "layer-007.safetensors" for target layer 7.
std::string layer_file_name(int target_layer);
// A tensor of the file: "<kind>.<part>" (kind 'k' or 'v'; part "weight", "bias", or "mlp.<name>" of mlp_tensors).
std::string layer_tensor_name(char kind, const std::string& part);

// What one kind (keys or values) of a target layer stores.
struct LayerFileKind {
  std::string weight_dtype = "F32";  // "F32", "BF16" or "F16": the weight's bits as given
  const void* weight = nullptr;      // [features x G], row-major
  const float* bias = nullptr;       // [G]
  const MlpParams* mlp = nullptr;    // the residual MLP kept for this kind, or null
};
struct LayerFileContent {
  int target_layer = 0;
  std::vector<int> source_layers;  // ascending
  int64_t features = 0, G = 0;     // cross_head: features = source_layers.size() * F, weights [features x G]
  LayerFileKind k, v;
  int heads = 0;                   // per_head: Ht, features = source_layers.size() * Ds, weights [Ht, features, Dt]
};
// Writes the layer file at `path`, whole or not at all.
void write_layer_file(const std::string& path, const LayerFileContent& c);

}  // namespace crosskv
