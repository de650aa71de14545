#pragma once
// The fit configuration (docs/FORMATS.md). Unknown keys, wrong types and out-of-range values are ConfigErrors
// that name the file, key and line.
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "core/dtype.hpp"
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
// fit.weighting: every token counts once, or by the target shards' `weights` dataset (docs/METHOD.md, The fit).
enum class Weighting { uniform, dataset };
const char* to_string(Weighting w);
std::string mapper_kind_name(MapperKind k);

// The residual MLPs' training (fit.mlp).
struct MlpConfig {
  int hidden = 256;            // units of each of the two hidden layers
  int epochs = 20;
  double lr = 1e-3;            // Adam
  int64_t batch_tokens = 1024;
  double weight_decay = 1e-4;  // decoupled, on the matrices
  double val_fraction = 0.1;   // of the calibration sequences, held back to decide (auto) and report
  uint64_t seed = 0;
};

struct FitConfig {
  std::string config_path;
  std::string source_store, target_store;
  std::vector<std::string> domains;  // empty: every domain found
  std::map<std::string, double> weights;  // per-domain weight of the moments (default 1)
  int64_t token_stride = 1;
  std::optional<int64_t> max_tokens;
  std::vector<KChoice> ks = {{1}, {2}, {4}, {8}, {0}};
  double lambda = 0.01;
  ProbeMode probe = ProbeMode::same_head;
  std::vector<Structure> structures = {Structure::cross_head};  // distinct; one artifact folder per k and structure
  Dtype dtype = Dtype::f32;
  MapperKind mapper = MapperKind::ridge;
  Weighting weighting = Weighting::uniform;
  MlpConfig mlp;
  std::string output_dir;
  // Held-out shard pairs (paths relative to the stores): left out of the fit, diagnosed after it (report.html).
  std::vector<std::string> eval_shards;
  double min_retention = 0.8;  // eval.min_retention: the predicted recovered share a LIKELY TO TRANSFER verdict needs
  DeviceKind device = DeviceKind::auto_;
  bool tf32 = false;  // CUDA: let cuBLAS use TF32 tensor cores for the fp32 moments (10-bit mantissa products)
  int64_t block_tokens = 4096;
  double max_moment_gib = 8.0;  // per rank; above this the fit moments are gathered in a second, selective pass
  int layer_groups = 0;         // ranks per token group share target layers in this many groups; 0: auto
  std::string checkpoint_dir;  // empty: <output_dir>/checkpoint (checkpoint_path())
  int64_t checkpoint_every_shards = 8;
  // Residual-MLP training: an epoch's state is checkpointed when this long has passed since the last (0: every epoch).
  int64_t checkpoint_mlp_seconds = 300;
};

// runtime.checkpoint.dir, or its default under output.dir.
std::string checkpoint_path(const FitConfig& cfg);

FitConfig load_fit_config(const std::string& path);
FitConfig parse_fit_config(const std::string& yaml_text, const std::string& path);

}  // namespace crosskv
