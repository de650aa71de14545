#pragma once
// A fitted mapper on disk for the artifact, serving and eval tests: the small synthetic pair fitted at one k, its
// manifest at hand to damage, and residual-MLP tensors added to a layer.
#include <algorithm>
#include <fstream>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "artifact/safetensors.hpp"
#include "core/sha256.hpp"
#include "helpers.hpp"

namespace crosskv::test {

struct Artifact {
  TempDir tmp;
  std::string dir;
  nlohmann::json manifest;
  explicit Artifact(const std::string& k = "2", const std::string& structure = "cross_head") {
    synthesize(small_synth(tmp.str()));
    fit_yaml(config_yaml(tmp.str(), "{k: [" + k + "], lambda: 0.01, structure: " + structure + "}"));
    dir = tmp.str("out/k" + k + (structure == "per_head" ? "-per_head" : ""));
    std::ifstream in(dir + "/manifest.json");
    in >> manifest;
  }
  void write(const nlohmann::json& m) const { std::ofstream(dir + "/manifest.json") << m.dump(); }
};

// Adds residual MLPs (hidden width h, random, non-zero last layer) for keys and values to layer `l` of an artifact,
// or the tensors `only` alone when given; re-hashes the file in the manifest.
inline void add_mlp_tensors(Artifact& a, int l, int64_t h, const std::vector<std::string>& only = {}, float poison = 0) {
  const std::string file = a.dir + "/" + a.manifest["layers"][l]["file"].get<std::string>();
  auto t = read_safetensors(file);
  const int64_t in = t.at("k.weight").shape[0], G = t.at("k.weight").shape[1];
  std::mt19937_64 rng(11);
  std::normal_distribution<float> n(0, 0.3f);
  for (const char* kind : {"k", "v"})
    for (auto [name, shape] : {std::pair<const char*, std::vector<int64_t>>{"w1", {in, h}}, {"b1", {h}},
                               {"w2", {h, h}}, {"b2", {h}}, {"w3", {h, G}}, {"b3", {G}}}) {
      const std::string full = std::string(kind) + ".mlp." + name;
      if (!only.empty() && std::find(only.begin(), only.end(), full) == only.end()) continue;
      TensorIn& x = t[full];
      x.dtype = "F32", x.shape = shape;
      int64_t count = 1;
      for (auto d : shape) count *= d;
      x.values.resize(count);
      for (auto& v : x.values) v = n(rng);
      if (poison != 0) x.values[1] = poison;
    }
  std::vector<TensorOut> out;
  for (const auto& [name, x] : t)
    out.push_back({name, "F32", x.shape, x.values.data(), x.values.size() * sizeof(float)});
  write_safetensors(file, out, {});
  a.manifest["layers"][l]["sha256"] = sha256_file(file);
  a.write(a.manifest);
}

}  // namespace crosskv::test
