#pragma once
// Reading a mapper artifact (SPEC §6) back, and mapping content-space KV with it.
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/kv_spec.hpp"

namespace crosskv {

struct MapperLayer {
  int target_layer = 0;
  std::vector<int> source_layers;
  std::vector<float> wk, bk, wv, bv;  // [k*F x G], [G]
};

struct Mapper {
  std::string dir;
  nlohmann::json manifest;
  KvSpec source, target;
  std::vector<MapperLayer> layers;
};

// Loads every layer and checks each file's SHA-256 against the manifest. InputError names the file.
Mapper load_mapper(const std::string& dir);

// X: source content [rows x Ls*F] (RoPE-stripped keys, or values); out: target content [rows x Lt*G].
void map_content(const Mapper& m, bool keys, const float* X, int64_t rows, float* out);

}  // namespace crosskv
