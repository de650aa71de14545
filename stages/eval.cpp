#include "stages/eval.hpp"

#include <filesystem>
#include <fstream>
#include <iterator>

#include "apply/report.hpp"
#include "apply/transfer.hpp"
#include "core/log.hpp"
#include "io/atomic_file.hpp"

namespace fs = std::filesystem;

namespace crosskv {

nlohmann::json MapperEvaluation::json() const {
  nlohmann::json j = evaluation.json();
  j["mapper"] = dir;
  return j;
}

std::vector<MapperEvaluation> evaluate_mappers(const std::vector<std::string>& dirs, const Cache& source,
                                               const Cache& target, ComputeBackend& be, bool verify) {
  std::vector<MapperEvaluation> out;
  for (const auto& dir : dirs) {
    Transfer tr(dir, be, TransferOptions{true, true, verify});
    MapperEvaluation e{dir, tr.manifest().json, tr.manifest().source_model + " -> " + tr.manifest().target_model,
                       evaluate(tr, source, target)};
    out.push_back(std::move(e));
  }
  return out;
}

std::string render_evaluation_report(const std::vector<MapperEvaluation>& evals, const std::string& held_out,
                                     const std::string& heatmap_path) {
  ReportInput in;
  in.eval_source = held_out;
  for (const auto& e : evals) {
    if (in.title.empty()) in.title = e.title;
    in.manifests.push_back(e.manifest);
    in.evaluations.push_back(e.evaluation);
  }
  std::ifstream svg(heatmap_path);
  if (svg) in.heatmap_svg.assign(std::istreambuf_iterator<char>(svg), std::istreambuf_iterator<char>());
  return render_report(in);
}

std::string evaluate_held_out(const std::vector<std::string>& source_shards,
                              const std::vector<std::string>& target_shards, const std::string& held_out_names,
                              const std::vector<std::string>& artifacts, const std::string& output_dir,
                              const std::string& heatmap_path, ComputeBackend& be) {
  const Cache s = read_caches(source_shards, false), t = read_caches(target_shards, true);
  const auto evals = evaluate_mappers(artifacts, s, t, be, /*verify=*/false);
  for (const auto& e : evals) {
    const std::string k = fs::path(e.dir).filename().string();
    nlohmann::json j = e.json();
    j["held_out_shards"] = held_out_names;
    write_file_atomic((fs::path(output_dir) / ("eval-" + k + ".json")).string(), j.dump(2) + "\n");
    spdlog::info("held-out {} ({} tokens): {}", k, s.tokens, e.evaluation.verdict);
  }
  const std::string report = (fs::path(output_dir) / "report.html").string();
  write_file_atomic(report, render_evaluation_report(evals, held_out_names, heatmap_path));
  return report;
}

}  // namespace crosskv
