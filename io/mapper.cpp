#include "io/mapper.hpp"

#include <cblas.h>

#include <filesystem>
#include <fstream>

#include "core/error.hpp"
#include "core/sha256.hpp"
#include "io/safetensors.hpp"

namespace fs = std::filesystem;

namespace crosskv {

Mapper load_mapper(const std::string& dir) {
  Mapper m;
  m.dir = dir;
  const std::string mpath = (fs::path(dir) / "manifest.json").string();
  std::ifstream in(mpath);
  if (!in) throw InputError(mpath + ": missing (not a complete mapper artifact)");
  try {
    in >> m.manifest;
  } catch (const nlohmann::json::exception& e) {
    throw InputError(mpath + ": not valid JSON: " + e.what());
  }
  if (m.manifest.value("format", "") != "crosskv-mapper" || m.manifest.value("format_version", 0) != 1)
    throw InputError(mpath + ": format must be crosskv-mapper version 1");
  m.source = parse_kv_spec(m.manifest["source"]["kv_spec"].dump(), mpath);
  m.target = parse_kv_spec(m.manifest["target"]["kv_spec"].dump(), mpath);
  for (const auto& l : m.manifest["layers"]) {
    const std::string file = (fs::path(dir) / l["file"].get<std::string>()).string();
    if (sha256_file(file) != l["sha256"].get<std::string>())
      throw InputError(file + ": SHA-256 does not match the manifest (corrupt or modified file)");
    auto t = read_safetensors(file);
    MapperLayer ml;
    ml.target_layer = l["target_layer"].get<int>();
    ml.source_layers = l["source_layers"].get<std::vector<int>>();
    for (const char* name : {"k.weight", "k.bias", "v.weight", "v.bias"})
      if (!t.count(name)) throw InputError(file + ": tensor '" + name + "' is missing");
    ml.wk = std::move(t["k.weight"].values);
    ml.bk = std::move(t["k.bias"].values);
    ml.wv = std::move(t["v.weight"].values);
    ml.bv = std::move(t["v.bias"].values);
    m.layers.push_back(std::move(ml));
  }
  return m;
}

void map_content(const Mapper& m, bool keys, const float* X, int64_t rows, float* out) {
  const int64_t F = m.source.features_per_layer(), G = m.target.features_per_layer();
  const int64_t XW = m.source.n_layers * F, YW = m.target.n_layers * G;
  for (const auto& l : m.layers) {
    const auto& W = keys ? l.wk : l.wv;
    const auto& b = keys ? l.bk : l.bv;
    float* Y = out + l.target_layer * G;
    for (int64_t t = 0; t < rows; ++t) std::copy(b.begin(), b.end(), Y + t * YW);
    for (size_t j = 0; j < l.source_layers.size(); ++j)
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, rows, G, F, 1.0f, X + l.source_layers[j] * F, XW,
                  W.data() + j * F * G, G, 1.0f, Y, YW);
  }
}

}  // namespace crosskv
