#pragma once
// Stage 7: mapper artifacts (SPEC §6). Each k is written into "<out>/k<K>.partial" layer by layer as the solves
// finish; the manifest is written last and the folder renamed to "<out>/k<K>", so a folder named k<K> with a
// manifest is always complete.
#include <map>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "core/ridge.hpp"
#include "stages/stages.hpp"

namespace crosskv {

class ComputeBackend;

class ArtifactWriter {
 public:
  // `be` converts weights to bf16/fp16 (on the device where there is one).
  ArtifactWriter(const Calibration& cal, const FitPlan& plan, ComputeBackend& be, int rank = 0);
  void begin();
  // fits_k[i] / fits_v[i] belong to plan.ks[i].
  void write_layer(int l, const std::vector<LayerFit>& fits_k, const std::vector<LayerFit>& fits_v);
  // The manifest entries of the layers written here (per k), and entries written by other ranks.
  nlohmann::json layer_entries() const { return layers_; }
  void add_layer_entries(const nlohmann::json& per_k);
  // Writes every manifest (layers sorted by target layer) and moves the folders into place. Returns the folders.
  std::vector<std::string> finish(const nlohmann::json& extra);

 private:
  std::string final_dir(const KPlan& k) const;
  std::string partial_dir(const KPlan& k) const;
  const Calibration& cal_;
  const FitPlan& plan_;
  ComputeBackend& be_;
  std::vector<nlohmann::json> layers_;  // per k: the manifest's "layers" list
  int rank_ = 0;
  int64_t files_ = 0;  // files written, for the kill_in_export fault hook
  void written();
};

nlohmann::json nan_to_null(const std::vector<double>& v);

}  // namespace crosskv
