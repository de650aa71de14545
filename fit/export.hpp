#pragma once
// Stage 7: mapper artifacts (docs/FORMATS.md, Mapper artifact). Each k (and structure: "k<K>-per_head") is written into "<out>/k<K>.partial" layer by layer as the solves
// finish; the manifest is written last and the folder renamed to "<out>/k<K>", so a folder named k<K> with a
// manifest is always complete.
#include <condition_variable>
#include <deque>
#include <exception>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "artifact/manifest.hpp"
#include "fit/ridge.hpp"
#include "fit/plan.hpp"

namespace crosskv {

class ComputeBackend;

class ArtifactWriter {
 public:
  ArtifactWriter(const Calibration& cal, const FitPlan& plan, int rank = 0);
  ~ArtifactWriter();
  ArtifactWriter(const ArtifactWriter&) = delete;
  ArtifactWriter& operator=(const ArtifactWriter&) = delete;
  // Prepares "<out>/k<K>.partial" for every k. Folders of an interrupted export of the same job (the same
  // `identity`: data, config and grid) are kept, so that layers already written need not be solved again; any
  // other partial folder is emptied.
  void begin(const nlohmann::json& identity);
  // True when target layer l was written completely (every k) by an interrupted export of this job and its files
  // still match their recorded SHA-256: its manifest entries are taken over and it need not be solved. Any rank, for
  // its own layers, after begin() on rank 0.
  bool resume_layer(int l);
  // fits_k[i] / fits_v[i] belong to the plan's slot i (FitPlan::slot_k, slot_structure). A writer thread converts the weights to bf16/fp16 (on the host, in
  // parallel: they are there already), writes, syncs and hashes the files while the caller solves the next layer.
  // One layer waits at most (the call blocks until the one before it is being written); a write's error is thrown by
  // the next call.
  // `lambda` (fit.lambda: auto): how layer l's λ was chosen (Lambdas::layer_choice), recorded in its manifest entry
  // with the λ each k was solved with.
  void write_layer(int l, std::vector<LayerFit> fits_k, std::vector<LayerFit> fits_v,
                   std::optional<ManifestLambda> lambda = {});
  // fit.lambda: auto: the fit's choice (Lambdas::choice), recorded in every manifest.
  void set_lambda_choice(std::optional<ManifestLambdaChoice> choice) { lambda_choice_ = std::move(choice); }
  // Waits until every layer is written; throws the first write error.
  void drain();
  // Seconds the writer thread spent on layers (converting weights included), converting weights, and the solving
  // thread waiting for the writer.
  double write_seconds() const;
  double convert_seconds() const;
  double wait_seconds() const { return wait_s_; }
  // The manifest entries of the layers written here (per k, as bytes for another rank; after drain()), and entries
  // written by other ranks.
  std::string layer_entries() const;
  void add_layer_entries(const std::string& per_k);
  // Writes every manifest (layers sorted by target layer) and moves the folders into place. Returns the folders.
  // Without `publish`, the manifests stay in the k<K>.partial folders with the layers' records (a later stage adds
  // to the layer files, then publish_artifact moves each into place); returns those folders.
  // `run` is the manifests' record of the run.
  std::vector<std::string> finish(const ManifestRun& run, bool publish = true);

 private:
  struct Job {
    int l = 0;
    std::vector<LayerFit> fk, fv;
    std::optional<ManifestLambda> lambda;
  };
  void write_job(const Job& job);
  BigVector<uint16_t> half_k_, half_v_;  // the writer thread's conversions, reused from layer to layer
  void run_writer();
  std::string final_dir(size_t slot) const;  // the artifact of plan slot `slot` (FitPlan::slot_folder)
  std::string partial_dir(size_t slot) const;
  std::string record_dir(size_t slot) const;  // inside partial_dir: per-layer records, removed by finish()
  nlohmann::json identity_;                   // of the export (begin)
  const Calibration& cal_;
  const FitPlan& plan_;
  std::vector<std::vector<ManifestLayer>> layers_;  // per k: the manifest's layer entries
  int rank_ = 0;
  int64_t files_ = 0;  // files written, for the kill_in_export fault hook
  void written();
  mutable std::mutex m_;
  std::condition_variable cv_;
  std::deque<Job> queue_;
  bool busy_ = false, closing_ = false;
  double write_s_ = 0, wait_s_ = 0, convert_s_ = 0;
  std::exception_ptr error_;
  std::thread thread_;
  std::optional<ManifestLambdaChoice> lambda_choice_;
};


// Moves "<output_dir>/<folder>.partial" (its manifest written) into place as <folder> ("k4", "k4-per_head"), holding
// exactly the manifest's files. Returns the folder.
std::string publish_artifact(const std::string& output_dir, const std::string& folder);
// After a stage between finish(publish = false) and publish_artifact rewrote a layer file of `partial_dir`: its
// record takes the new manifest entry (file and SHA-256), so that a resumed export takes the layer over as written.
void record_rewritten_layer(const std::string& partial_dir, const ManifestLayer& entry);

}  // namespace crosskv
