#pragma once
// Reading a mapper artifact (SPEC §6) back, validated: a mapper is a file from elsewhere. Every problem is an
// InputError naming the file and the field.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/kv_spec.hpp"
#include "core/mlp.hpp"

namespace crosskv {

struct MapperLayerEntry {
  int target_layer = 0;
  std::vector<int> source_layers;  // ascending, distinct, < source n_layers
  std::string file, sha256;
};

struct MapperManifest {
  std::string dir, path;  // the artifact folder and its manifest.json
  nlohmann::json json;
  std::string source_model, target_model;
  KvSpec source, target;
  int k_count = 0;
  std::string dtype;
  std::vector<MapperLayerEntry> layers;  // one per target layer, in target-layer order
};

struct MapperLayer {
  int target_layer = 0;
  std::vector<int> source_layers;
  std::vector<float> wk, bk, wv, bv;  // [k*F x G], [G]
  // The residual MLPs kept for keys and values (issue 15: target = ridge + f(x) on the same features); empty
  // (no parameters) where the layer keeps ridge alone.
  MlpParams mlp_k, mlp_v;
};

// Validates a manifest's text (`path` names it in messages; `dir` is where its layer files are).
MapperManifest parse_mapper_manifest(const std::string& text, const std::string& path, const std::string& dir);
MapperManifest read_mapper_manifest(const std::string& dir);
// Loads one target layer's tensors (checking the file's SHA-256 when `verify`) and their shapes.
MapperLayer load_mapper_layer(const MapperManifest& m, int target_layer, bool verify = true);
// InputError naming `where` unless `spec` is the mapper's source (or target) kv_spec, saying what differs.
void check_kv_spec(const MapperManifest& m, bool source_side, const KvSpec& spec, const std::string& where);

}  // namespace crosskv
