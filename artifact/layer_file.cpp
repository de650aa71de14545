#include "artifact/layer_file.hpp"

#include <cstdio>
#include <map>
#include <regex>
#include <utility>

#include "artifact/manifest.hpp"
#include "artifact/safetensors.hpp"
#include "core/error.hpp"
#include "core/half.hpp"

namespace crosskv {

std::string layer_file_name(int target_layer) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "layer-%03d.safetensors", target_layer);
  return buf;
}

bool is_layer_file_name(const std::string& name) {
  static const std::regex pattern(R"(layer-\d{3,}\.safetensors)");
  return std::regex_match(name, pattern);
}

std::string layer_tensor_name(Kind kind, const std::string& part) {
  CROSSKV_ASSERT(kind != Kind::k_rope, "a layer file holds keys (k) and values (v)");
  return std::string(kind_name(kind)) + "." + part;
}

void write_layer_file(const std::string& path, const LayerFileContent& c) {
  CROSSKV_ASSERT(c.features > 0 && c.G > 0, "a layer file of no features");
  std::vector<TensorOut> out;
  CROSSKV_ASSERT(c.heads >= 0 && (c.heads == 0 || c.G % c.heads == 0), "per-head weights of a width the heads split");
  const std::vector<int64_t> wshape = c.heads ? std::vector<int64_t>{c.heads, c.features, c.G / c.heads}
                                              : std::vector<int64_t>{c.features, c.G};
  const std::vector<int64_t> bshape = {c.G};
  for (Kind name : kMappedKinds) {
    const LayerFileKind* kind = &c.kinds[name];
    const size_t elem = kind->weight_dtype == "F32" ? 4 : 2;
    CROSSKV_ASSERT(kind->weight_dtype == "F32" || kind->weight_dtype == "BF16" || kind->weight_dtype == "F16",
                   "a weight dtype the format does not know");
    out.push_back({layer_tensor_name(name, "weight"), kind->weight_dtype, wshape, kind->weight,
                   static_cast<size_t>(c.features * c.G) * elem});
    out.push_back({layer_tensor_name(name, "bias"), "F32", bshape, kind->bias, static_cast<size_t>(c.G) * 4});
  }
  // The MLPs after the ridge tensors, keys first (their order in the file is the format's).
  for (Kind name : kMappedKinds) {
    const LayerFileKind* kind = &c.kinds[name];
    if (!kind->mlp) continue;
    const MlpParams& p = *kind->mlp;
    CROSSKV_ASSERT(p.shape.in == c.features && p.shape.out == c.G, "a residual MLP of another layer's shape");
    for (const MlpTensor& x : mlp_tensors(p.shape)) {
      int64_t count = 1;
      for (auto n : x.shape) count *= n;
      out.push_back({layer_tensor_name(name, std::string("mlp.") + x.name), "F32", x.shape, p.flat.data() + x.offset,
                     static_cast<size_t>(count) * 4});
    }
  }
  std::string csv;
  for (int a : c.source_layers) csv += (csv.empty() ? "" : ",") + std::to_string(a);
  std::map<std::string, std::string> meta = {
      {"format", kMapperFormat}, {"target_layer", std::to_string(c.target_layer)}, {"source_layers", csv}};
  if (c.heads) meta["structure"] = "per_head";  // cross_head files stay as they were
  write_safetensors(path, out, meta);
}

void read_layer_file(const std::string& path, int target_layer, const std::vector<int>& source_layers,
                     StoredLayerFile& out) {
  auto t = read_safetensors(path);
  LayerFileContent& c = out.content;
  c.target_layer = target_layer, c.source_layers = source_layers;
  const std::vector<int64_t>& shape = t.at(layer_tensor_name(Kind::k, "weight")).shape;
  CROSSKV_ASSERT(shape.size() == 2, path + ": a cross_head layer file");
  c.features = shape[0], c.G = shape[1];
  for (Kind i : kMappedKinds) {
    const Kind name = i;
    LayerFileKind& kind = c.kinds[i];
    TensorIn& w = t.at(layer_tensor_name(name, "weight"));
    out.weight[i] = std::move(w.values);
    out.bias[i] = std::move(t.at(layer_tensor_name(name, "bias")).values);
    kind.weight_dtype = w.dtype;
    kind.weight = out.weight[i].data();
    if (w.dtype != "F32") {  // bf16 / fp16 bits again: the fp32 values read are exact conversions of them
      out.half[i].resize(out.weight[i].size());
      const bool bf16 = w.dtype == "BF16";
      for (size_t j = 0; j < out.weight[i].size(); ++j)
        out.half[i][j] = bf16 ? float_to_bf16(out.weight[i][j]) : float_to_fp16(out.weight[i][j]);
      kind.weight = out.half[i].data();
    }
    kind.bias = out.bias[i].data();
  }
}

}  // namespace crosskv
