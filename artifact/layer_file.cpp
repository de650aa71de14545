#include "artifact/layer_file.hpp"

#include <cstdio>
#include <map>

#include "artifact/manifest.hpp"
#include "artifact/safetensors.hpp"
#include "core/error.hpp"

namespace crosskv {

std::string layer_file_name(int target_layer) {
  char buf[32];
  std::snprintf(buf, sizeof buf, "layer-%03d.safetensors", target_layer);
  return buf;
}

std::string layer_tensor_name(char kind, const std::string& part) {
  CROSSKV_ASSERT(kind == 'k' || kind == 'v', "a layer file holds keys (k) and values (v)");
  return std::string(1, kind) + "." + part;
}

void write_layer_file(const std::string& path, const LayerFileContent& c) {
  CROSSKV_ASSERT(c.features > 0 && c.G > 0, "a layer file of no features");
  std::vector<TensorOut> out;
  CROSSKV_ASSERT(c.heads >= 0 && (c.heads == 0 || c.G % c.heads == 0), "per-head weights of a width the heads split");
  const std::vector<int64_t> wshape = c.heads ? std::vector<int64_t>{c.heads, c.features, c.G / c.heads}
                                              : std::vector<int64_t>{c.features, c.G};
  const std::vector<int64_t> bshape = {c.G};
  for (auto [name, kind] : {std::pair{'k', &c.k}, std::pair{'v', &c.v}}) {
    const size_t elem = kind->weight_dtype == "F32" ? 4 : 2;
    CROSSKV_ASSERT(kind->weight_dtype == "F32" || kind->weight_dtype == "BF16" || kind->weight_dtype == "F16",
                   "a weight dtype the format does not know");
    out.push_back({layer_tensor_name(name, "weight"), kind->weight_dtype, wshape, kind->weight,
                   static_cast<size_t>(c.features * c.G) * elem});
    out.push_back({layer_tensor_name(name, "bias"), "F32", bshape, kind->bias, static_cast<size_t>(c.G) * 4});
  }
  // The MLPs after the ridge tensors, keys first (their order in the file is the format's).
  for (auto [name, kind] : {std::pair{'k', &c.k}, std::pair{'v', &c.v}}) {
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

}  // namespace crosskv
