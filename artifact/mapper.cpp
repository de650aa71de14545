#include "artifact/mapper.hpp"


#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <regex>
#include <set>
#include <tuple>

#include "core/error.hpp"
#include "core/sha256.hpp"
#include "artifact/layer_file.hpp"
#include "artifact/manifest.hpp"
#include "artifact/manifest_json.hpp"
#include "artifact/safetensors.hpp"

namespace fs = std::filesystem;

namespace crosskv {
namespace {

using manifest_json::field;
using manifest_json::int_field;
using manifest_json::str_field;

KvSpec spec_field(const nlohmann::json& side, const std::string& name, const std::string& path) {
  KvSpec s = parse_kv_spec(field(side, "kv_spec", path, name + ".").dump(), path + " (" + name + ".kv_spec)");
  if (s.n_layers > 4096 || s.features_per_layer() > (1 << 20))
    throw InputError(path + ": " + name + ".kv_spec is implausibly large (" + std::to_string(s.n_layers) +
                     " layers, " + std::to_string(s.features_per_layer()) + " features per layer)");
  return s;
}

// The manifest's "fit": k (its count and label), the mapper kind, the dtype and the structure.
void parse_fit_section(const nlohmann::json& fit, const std::string& path, MapperManifest& m) {
  m.k_count = static_cast<int>(int_field(fit, "k_count", path, "fit."));
  if (m.k_count < 1 || m.k_count > m.source.n_layers)
    throw InputError(path + ": fit.k_count " + std::to_string(m.k_count) + " is outside 1.." +
                     std::to_string(m.source.n_layers));
  const auto k = fit.find("k");
  if (k != fit.end() && !(k->is_number_integer() || *k == "all"))
    throw InputError(path + ": fit.k is " + k->dump() + ", expected a number of source layers or \"all\"");
  m.k_label = k == fit.end() ? std::to_string(m.k_count) : k->is_string() ? "all" : std::to_string(k->get<int64_t>());
  if (fit.contains("mapper")) {
    m.mapper = str_field(fit, "mapper", path, "fit.");
    if (m.mapper != "ridge" && m.mapper != "mlp" && m.mapper != "auto")
      throw InputError(path + ": fit.mapper is '" + m.mapper + "', expected ridge, mlp or auto");
  }
  m.dtype = str_field(fit, "dtype", path, "fit.");
  if (m.dtype != "fp32" && m.dtype != "bf16" && m.dtype != "fp16")
    throw InputError(path + ": fit.dtype is '" + m.dtype + "', expected fp32, bf16 or fp16");
  if (fit.contains("structure")) {
    const std::string st = str_field(fit, "structure", path, "fit.");
    const auto parsed = parse_structure(st);
    if (!parsed) throw InputError(path + ": fit.structure is '" + st + "', expected cross_head or per_head");
    m.structure = *parsed;
    if (m.structure == Structure::per_head && m.source.n_kv_heads != m.target.n_kv_heads)
      throw InputError(path + ": fit.structure is per_head but the source has " +
                       std::to_string(m.source.n_kv_heads) + " KV heads and the target " +
                       std::to_string(m.target.n_kv_heads) + " (head matching needs equal counts)");
  }
  manifest_json::read_fit_details(fit, path, m);
}

// Layer entry i, checked against the manifest: its target layer, k ascending source layers, a layer file's name and
// a SHA-256.
ManifestLayer checked_layer(const nlohmann::json& l, size_t i, const MapperManifest& m) {
  static const std::regex sha_re("[0-9a-f]{64}");
  const std::string& path = m.path;
  const std::string pre = "layers[" + std::to_string(i) + "]";
  ManifestLayer e = manifest_json::layer_from_json(l, path, pre);
  if (e.target_layer < 0 || e.target_layer >= m.target.n_layers)
    throw InputError(path + ": " + pre + ".target_layer " + std::to_string(e.target_layer) + " is out of range");
  if (e.source_layers.size() != static_cast<size_t>(m.k_count))
    throw InputError(path + ": " + pre + ".source_layers must list fit.k_count = " + std::to_string(m.k_count) +
                     " layers");
  for (size_t j = 0; j < e.source_layers.size(); ++j)
    if (e.source_layers[j] >= m.source.n_layers || (j > 0 && e.source_layers[j] <= e.source_layers[j - 1]))
      throw InputError(path + ": " + pre + ".source_layers must be ascending source layers in 0.." +
                       std::to_string(m.source.n_layers - 1) + ", got " + l["source_layers"].dump());
  if (!is_layer_file_name(e.file))
    throw InputError(path + ": " + pre + ".file '" + e.file + "' is not a layer-NNN.safetensors name in the folder");
  if (!std::regex_match(e.sha256, sha_re)) throw InputError(path + ": " + pre + ".sha256 is not 64 hex digits");
  return e;
}

}  // namespace

MapperManifest parse_mapper_manifest(const std::string& text, const std::string& path, const std::string& dir) {
  MapperManifest m;
  m.dir = dir;
  m.path = path;
  nlohmann::json j;
  try {
    j = nlohmann::json::parse(text);
  } catch (const nlohmann::json::exception& e) {
    throw InputError(path + ": not valid JSON: " + e.what());
  }
  if (!j.is_object()) throw InputError(path + ": must be a JSON object");
  const std::string format = str_field(j, "format", path);
  if (format != kMapperFormat)
    throw InputError(path + ": format is '" + format + "', expected '" + kMapperFormat + "'");
  const int64_t version = int_field(j, "format_version", path);
  if (version != kManifestVersion)
    throw InputError(path + ": unknown format_version " + std::to_string(version) + " (this crosskv reads version " +
                     std::to_string(kManifestVersion) + ")");
  if (j.contains("tool") && j["tool"].is_object())
    m.tool = j["tool"].value("name", std::string("?")) + " " + j["tool"].value("version", std::string("?"));
  const auto& src = field(j, "source", path);
  const auto& tgt = field(j, "target", path);
  m.source_model = str_field(src, "model", path, "source.");
  m.target_model = str_field(tgt, "model", path, "target.");
  if (src.contains("weights")) m.source_weights = str_field(src, "weights", path, "source.");
  if (tgt.contains("weights")) m.target_weights = str_field(tgt, "weights", path, "target.");
  m.source = spec_field(src, "source", path);
  m.target = spec_field(tgt, "target", path);
  parse_fit_section(field(j, "fit", path), path, m);
  if (j.contains("calibration")) m.calibration = manifest_json::calibration_from_json(j["calibration"], path);
  const auto& layers = field(j, "layers", path);
  if (!layers.is_array() || layers.size() != static_cast<size_t>(m.target.n_layers))
    throw InputError(path + ": layers must list each of the target's " + std::to_string(m.target.n_layers) +
                     " layers once");
  m.layers.resize(m.target.n_layers);
  std::vector<bool> seen(m.target.n_layers, false);
  for (size_t i = 0; i < layers.size(); ++i) {
    ManifestLayer e = checked_layer(layers[i], i, m);
    if (seen[e.target_layer])
      throw InputError(path + ": layers[" + std::to_string(i) + "].target_layer " + std::to_string(e.target_layer) +
                       " is out of range or repeated");
    seen[e.target_layer] = true;
    m.layers[e.target_layer] = std::move(e);
  }
  return m;
}

int64_t MapperManifest::weight_rows() const {
  return int64_t{k_count} * (structure == Structure::per_head ? source.head_dim : source.features_per_layer());
}

MapperManifest read_mapper_manifest(const std::string& dir) {
  const std::string path = (fs::path(dir) / kManifestFile).string();
  std::ifstream in(path);
  if (!in) throw InputError(path + ": missing (not a complete mapper artifact)");
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  return parse_mapper_manifest(text, path, dir);
}

MapperLayer load_mapper_layer(const MapperManifest& m, int target_layer, bool verify) {
  CROSSKV_ASSERT(target_layer >= 0 && target_layer < static_cast<int>(m.layers.size()), "target layer out of range");
  const ManifestLayer& e = m.layers[target_layer];
  const std::string file = (fs::path(m.dir) / e.file).string();
  std::error_code ec;
  if (fs::is_symlink(fs::symlink_status(file, ec))) {
    // A link may stay inside the mapper folder; one that leaves it would make the folder apply another's weights.
    const fs::path to = fs::canonical(file, ec), dir = fs::canonical(m.dir, ec);
    if (ec || to.parent_path() != dir)
      throw InputError(file + ": a symlink leaving the mapper folder (to " + fs::read_symlink(file, ec).string() +
                       "); a mapper's layer files must be its own");
  }
  std::ifstream in(file, std::ios::binary);
  if (!in) throw InputError(file + ": missing (named by " + m.path + ")");
  std::string bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  Sha256 h;
  h.update(bytes.data(), bytes.size());
  if (verify && h.hex() != e.sha256)
    throw InputError(file + ": SHA-256 does not match the manifest (corrupt or modified file)");
  auto t = parse_safetensors(bytes, file);
  const int64_t G = m.target.features_per_layer();
  const int64_t rows = m.weight_rows();
  const bool per_head = m.structure == Structure::per_head;
  const std::vector<int64_t> wshape = per_head ? std::vector<int64_t>{m.target.n_kv_heads, rows, m.target.head_dim}
                                               : std::vector<int64_t>{rows, G};
  auto take = [&](const std::string& name, std::vector<int64_t> shape, bool weight) {
    auto it = t.find(name);
    if (it == t.end()) throw InputError(file + ": tensor '" + name + "' is missing");
    if (it->second.shape != shape) {
      std::string want, got;
      for (auto d : shape) want += (want.empty() ? "" : ", ") + std::to_string(d);
      for (auto d : it->second.shape) got += (got.empty() ? "" : ", ") + std::to_string(d);
      throw InputError(file + ": tensor '" + name + "' has shape [" + got + "], expected [" + want + "]");
    }
    if (!weight && it->second.dtype != "F32") throw InputError(file + ": tensor '" + name + "' must be F32");
    const auto& v = it->second.values;
    const auto bad = std::find_if(v.begin(), v.end(), [](float x) { return !std::isfinite(x); });
    if (bad != v.end())
      throw InputError(file + ": target layer " + std::to_string(target_layer) + ", tensor '" + name + "' holds " +
                       (std::isnan(*bad) ? "NaN" : "Inf") + " at element " + std::to_string(bad - v.begin()) +
                       " (a mapper's weights and biases must be finite)");
    return std::move(it->second.values);
  };
  MapperLayer l;
  l.target_layer = target_layer;
  l.source_layers = e.source_layers;
  l.structure = m.structure;
  l.wk = take(layer_tensor_name(Kind::k, "weight"), wshape, true);
  l.bk = take(layer_tensor_name(Kind::k, "bias"), {G}, false);
  l.wv = take(layer_tensor_name(Kind::v, "weight"), wshape, true);
  l.bv = take(layer_tensor_name(Kind::v, "bias"), {G}, false);
  // Optional residual MLPs: <kind>.mlp.{w1, b1, w2, b2, w3, b3}, F32, hidden width from w1.
  for (auto [kind, mlp] : {std::pair{Kind::k, &l.mlp_k}, std::pair{Kind::v, &l.mlp_v}}) {
    const std::string p = layer_tensor_name(kind, "mlp.");
    const auto w1 = t.find(p + "w1");
    if (w1 != t.end() && per_head)
      throw InputError(file + ": tensor '" + p + "w1' in a per_head mapper (residual MLPs are cross_head only)");
    if (w1 == t.end()) {
      for (const auto& [name, tensor] : t)
        if (name.rfind(p, 0) == 0)
          throw InputError(file + ": tensor '" + name + "' without '" + p + "w1' (a residual MLP needs all six)");
      continue;
    }
    if (w1->second.shape.size() != 2 || w1->second.shape[0] != rows || w1->second.shape[1] <= 0)
      throw InputError(file + ": tensor '" + p + "w1' must be [" + std::to_string(rows) + ", hidden]");
    const int64_t h = w1->second.shape[1];
    *mlp = MlpParams(MlpShape{rows, h, G});
    for (const MlpTensor& x : mlp_tensors(mlp->shape)) {
      const std::vector<float> v = take(p + x.name, x.shape, false);
      std::copy(v.begin(), v.end(), mlp->flat.begin() + x.offset);
    }
  }
  return l;
}

MapperLayer as_cross_head(const MapperManifest& m, MapperLayer l) {
  if (l.structure == Structure::cross_head) return l;
  const int64_t H = m.target.n_kv_heads, Ds = m.source.head_dim, Dt = m.target.head_dim;
  const int64_t F = m.source.features_per_layer(), G = m.target.features_per_layer();
  const int64_t k = static_cast<int64_t>(l.source_layers.size());
  for (std::vector<float>* w : {&l.wk, &l.wv}) {
    std::vector<float> dense(k * F * G, 0.0f);
    for (int64_t h = 0; h < H; ++h)
      for (int64_t j = 0; j < k; ++j)
        for (int64_t p = 0; p < Ds; ++p) {
          const float* src = w->data() + ((h * k + j) * Ds + p) * Dt;
          std::copy(src, src + Dt, dense.data() + (j * F + h * Ds + p) * G + h * Dt);
        }
    *w = std::move(dense);
  }
  l.structure = Structure::cross_head;
  return l;
}

void check_kv_spec(const MapperManifest& m, bool source_side, const KvSpec& spec, const std::string& where) {
  const KvSpec& want = source_side ? m.source : m.target;
  if (spec == want) return;
  const nlohmann::json a = kv_spec_to_json(spec), b = kv_spec_to_json(want);
  std::string diff;
  for (auto it = b.begin(); it != b.end(); ++it)
    if (!a.contains(it.key()) || a[it.key()] != it.value())
      diff += (diff.empty() ? "" : ", ") + it.key() + " " + (a.contains(it.key()) ? a[it.key()].dump() : "?") +
              " (mapper: " + it.value().dump() + ")";
  throw InputError(where + ": kv_spec does not match the mapper's " + (source_side ? "source" : "target") + " (" +
                   m.path + "): " + diff);
}

}  // namespace crosskv
