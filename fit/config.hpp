#pragma once
// A fit's configuration, section by section as the YAML file has them (docs/FORMATS.md, The fit's config). Unknown
// keys, wrong types and out-of-range values are ConfigErrors that name the file, key and line.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "core/backend.hpp"
#include "core/dtype.hpp"
#include "core/mlp.hpp"
#include "core/structure.hpp"

namespace crosskv {

enum class ProbeMode { same_head, all_heads };
const char* to_string(ProbeMode p);

// k = 0 means "all" source layers.
struct KChoice {
  int value = 0;
  bool is_all() const { return value == 0; }
  std::string label() const;  // "4" or "all"
};

// What a mapper layer keeps: ridge alone; ridge plus a residual MLP everywhere; or the MLP only where it
// beats ridge on the validation split (auto).
enum class MapperKind { ridge, mlp, auto_ };
std::string mapper_kind_name(MapperKind k);
// fit.weighting: every token counts once, or by the target shards' `weights` dataset (docs/METHOD.md, The fit).
enum class Weighting { uniform, dataset };
const char* to_string(Weighting w);

struct StoreConfig {
  std::string store;  // source.store / target.store, relative to the config file
};

struct CalibrationConfig {
  std::vector<std::string> domains;       // empty: every domain found
  std::map<std::string, double> weights;  // per-domain weight of the moments (default 1)
  int64_t token_stride = 1;
  std::optional<int64_t> max_tokens;
};

// fit.lambda: auto (each target layer's and kind's λ chosen from the moments by generalized cross-validation:
// fit/lambda.hpp), or one fixed λ in the KV's own units (the covariance's).
struct LambdaSetting {
  bool automatic = true;
  double value = 0.01;  // the fixed λ (automatic = false)
  nlohmann::json json() const;  // "auto" or the number
};

// fit: what is solved.
struct SolveConfig {
  std::vector<KChoice> ks = {{1}, {2}, {4}, {8}, {0}};
  LambdaSetting lambda;
  ProbeMode probe = ProbeMode::same_head;
  std::vector<Structure> structures = {Structure::cross_head};  // distinct; one artifact folder per k and structure
  Dtype dtype = Dtype::f32;
  MapperKind mapper = MapperKind::ridge;
  Weighting weighting = Weighting::uniform;
  MlpSettings mlp;
};

struct OutputConfig {
  std::string dir;
};

struct EvalConfig {
  // Held-out shard pairs (paths relative to the stores): left out of the fit, diagnosed after it (report.html).
  std::vector<std::string> shards;
  double min_retention = 0.8;  // the predicted share a LIKELY TO TRANSFER verdict needs
};

struct CheckpointConfig {
  std::string dir;  // empty: <output.dir>/checkpoint (checkpoint_path())
  int64_t every_shards = 8;
  // Residual-MLP training: an epoch's state is checkpointed when this long has passed since the last (0: every epoch).
  int64_t mlp_seconds = 300;
};

struct RuntimeConfig {
  DeviceKind device = DeviceKind::auto_;
  bool tf32 = false;  // CUDA: let cuBLAS use TF32 tensor cores for the fp32 moments (10-bit mantissa products)
  int64_t block_tokens = 4096;
  double max_moment_gib = 8.0;  // per rank; above this the fit moments are gathered in a second, selective pass
  int layer_groups = 0;         // ranks per token group share target layers in this many groups; 0: auto
  CheckpointConfig checkpoint;
};

struct FitConfig {
  std::string config_path;
  StoreConfig source, target;
  CalibrationConfig calibration;
  SolveConfig fit;
  OutputConfig output;
  EvalConfig eval;
  RuntimeConfig runtime;
};

// runtime.checkpoint.dir, or its default under output.dir.
std::string checkpoint_path(const FitConfig& cfg);

FitConfig load_fit_config(const std::string& path);
FitConfig parse_fit_config(const std::string& yaml_text, const std::string& path);

}  // namespace crosskv
