#pragma once
// A mapper's layer file (docs/FORMATS.md, Mapper artifact), defined once: its name, its tensors' names and dtypes, and its
// metadata, for the writers (the export, the residual-MLP rewrite) and the reader (artifact/mapper).
#include <cstdint>
#include <string>
#include <vector>

#include "core/kind.hpp"
#include "core/mlp.hpp"

namespace crosskv {

// "layer-007.safetensors" for target layer 7; and whether a manifest's file name is one of these.
std::string layer_file_name(int target_layer);
bool is_layer_file_name(const std::string& name);
// A tensor of the file: "<kind>.<part>" (kind k or v; part "weight", "bias", or "mlp.<name>" of mlp_tensors).
std::string layer_tensor_name(Kind kind, const std::string& part);

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
  ByKind<LayerFileKind> kinds;
  int heads = 0;                   // per_head: Ht, features = source_layers.size() * Ds, weights [Ht, features, Dt]
};
// Writes the layer file at `path`, whole or not at all.
void write_layer_file(const std::string& path, const LayerFileContent& c);

// A cross_head layer file's ridge tensors as stored (the weights' bits in their stored dtype), for a stage that
// rewrites the file around them (the residual MLPs): `content` points into the object, which owns the values.
struct StoredLayerFile {
  LayerFileContent content;
  ByKind<std::vector<float>> weight, bias;
  ByKind<std::vector<uint16_t>> half;  // bf16 / fp16 weights' bits
  StoredLayerFile() = default;
  StoredLayerFile(const StoredLayerFile&) = delete;
  StoredLayerFile& operator=(const StoredLayerFile&) = delete;
};
// Reads it (the caller names the layer and its source layers, from the manifest); any MLP tensors are not read.
void read_layer_file(const std::string& path, int target_layer, const std::vector<int>& source_layers,
                     StoredLayerFile& out);

}  // namespace crosskv
