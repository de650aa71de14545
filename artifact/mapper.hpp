#pragma once
// Reading a mapper artifact (docs/FORMATS.md, Mapper artifact) back, validated: a mapper is a file from elsewhere. Every problem is an
// InputError naming the file and the field.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include "artifact/manifest.hpp"
#include "core/kv_spec.hpp"
#include "core/mlp.hpp"
#include "core/structure.hpp"

namespace crosskv {

struct MapperManifest {
  std::string dir, path;  // the artifact folder and its manifest.json
  std::string tool;       // the program and version that wrote it ("crosskv 0.9.0"; empty: not recorded)
  std::string source_model, target_model;
  std::string source_weights, target_weights;  // the models' weights fingerprints (empty: not recorded)
  KvSpec source, target;
  int k_count = 0;
  std::string k_label;         // fit.k as a person writes it: "4", "all" (the folder is k<k_label>)
  std::string mapper = "ridge";  // fit.mapper: ridge, mlp or auto
  bool residual_mlps() const { return mapper != "ridge"; }  // mlp or auto: its layers may hold residual MLPs
  std::optional<MlpSettings> mlp;  // fit.mlp: the residual MLPs' settings
  std::string dtype, probe;
  int64_t features = 0, params = 0, bias_params = 0;  // per target layer's system; the mapper's (0: not recorded)
  std::optional<double> lambda;                       // fit.lambda, when fixed
  std::optional<ManifestLambdaChoice> lambda_choice;  // fit.lambda: auto, how λ was chosen
  ManifestCalibration calibration;
  Structure structure = Structure::cross_head;  // fit.structure (absent: cross_head, as before the field)
  // Rows of a layer's weight: k*F (cross_head) or k*Ds per head (per_head).
  int64_t weight_rows() const;
  std::vector<ManifestLayer> layers;  // one per target layer, in target-layer order (source layers < n_layers)
};

struct MapperLayer {
  int target_layer = 0;
  std::vector<int> source_layers;
  Structure structure = Structure::cross_head;
  // cross_head: [k*F x G]; per_head: [Ht][k*Ds x Dt] (head h's rows: source head h of the layers, ascending).
  // Biases [G].
  std::vector<float> wk, bk, wv, bv;
  // The residual MLPs kept for keys and values (target = ridge + f(x) on the same features); empty
  // (no parameters) where the layer keeps ridge alone.
  MlpParams mlp_k, mlp_v;
};

// Validates a manifest's text (`path` names it in messages; `dir` is where its layer files are).
MapperManifest parse_mapper_manifest(const std::string& text, const std::string& path, const std::string& dir);
MapperManifest read_mapper_manifest(const std::string& dir);
// Loads one target layer's tensors (checking the file's SHA-256 when `verify`) and their shapes.
MapperLayer load_mapper_layer(const MapperManifest& m, int target_layer, bool verify = true);
// A per_head layer as the cross_head layer it equals: weights [k*F x G], zero where a target head would read another
// source head. For diagnostics that want one form (crosskv-eval); serving applies per_head weights as they are.
MapperLayer as_cross_head(const MapperManifest& m, MapperLayer layer);
// InputError naming `where` unless `spec` is the mapper's source (or target) kv_spec, saying what differs.
void check_kv_spec(const MapperManifest& m, bool source_side, const KvSpec& spec, const std::string& where);

}  // namespace crosskv
