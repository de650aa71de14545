// crosskv-eval --mapper DIR --source SHARD.h5 --target SHARD.h5 --json OUT.json [--html OUT.html]: held-out
// diagnostics of a mapper (docs/METHOD.md, Diagnostics) against the target's own capture of the same tokens, with baselines. Under
// mpirun the target layers are shared out over the ranks; rank 0 writes the outputs.
#include <cstdio>
#include <filesystem>

#include <CLI/CLI.hpp>

#include "apps/bootstrap.hpp"
#include "backends/backends.hpp"
#include "core/blas_kernels.hpp"
#include "runtime/cli.hpp"
#include "core/comm.hpp"
#include "runtime/mpi.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "core/atomic_file.hpp"
#include "eval/held_out.hpp"
#include "eval/retention.hpp"

using namespace crosskv;

int main(int argc, char** argv) {
  // The retention predictor the verdict reads, and its file, for tools/family/calibrate.py check.
  if (argc == 2 && std::string(argv[1]) == "--print-retention-model")
    return run_tool("crosskv-eval", [] {
      nlohmann::json j = retention_model().json();
      j["file"] = retention_model_path().string();
      std::printf("%s\n", j.dump(1).c_str());
      return 0;
    });
  CLI::App app{"crosskv-eval: held-out diagnostics of a mapper"};
  app.footer("crosskv-eval --print-retention-model: the retention predictor the verdict uses and its file (JSON); "
             "CROSSKV_RETENTION_MODEL=FILE reads another (tools/family/calibrate.py fit writes one)");
  std::string mapper, source, target, json_path, html_path, device = "cpu";
  bool require_ok = false;
  double min_retention = 0.8;
  app.add_option("--mapper", mapper, "mapper artifact folder (k<K>/)")->required();
  app.add_option("--source", source, "source model's shard of held-out tokens")->required();
  app.add_option("--target", target, "target model's shard of the same tokens (with queries for attention figures)")
      ->required();
  app.add_option("--json", json_path, "where to write the figures (JSON)")->required();
  app.add_option("--html", html_path, "also write a report to open in a browser");
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_flag("--require-ok", require_ok, "exit 4 when the verdict is not LIKELY TO TRANSFER");
  app.add_option("--min-retention", min_retention,
                 "the predicted share of the prefix's benefit kept that LIKELY TO TRANSFER needs (eval.min_retention)")
      ->check(CLI::Range(1e-9, 1.0).description("a share in (0, 1]"))
      ->capture_default_str();
  if (auto rc = parse_command_line(app, argc, argv, "crosskv-eval")) return *rc;
  const BlasKernels& blas = select_blas_kernels();  // before any BLAS call
  MpiSession mpi(&argc, &argv);
  std::unique_ptr<Comm> comm = make_mpi_comm();
  setup_logging(comm->rank(), comm->size(), "info");
  const bool root = comm->rank() == 0;
  if (root) log_blas_kernels(blas);
  try {
    return run_tool("crosskv-eval", [&]() -> int {
      // One rank per GPU: the rank's index on its node picks the device.
      agreed(*comm, [] { return retention_model().mappers; });  // a bad predictor file fails before the work
      auto be = agreed(*comm, [&] {
        return backend_for_this_rank(device_kind(device), comm->rank(), false);
      });
      const auto evals = evaluate_mappers({mapper}, HeldOut{{source}, {target}, source}, *be, *comm, /*verify=*/true,
                                          VerdictThresholds{min_retention});
      const Evaluation& ev = evals.front().evaluation;
      if (!root) return require_ok && !ev.ok() ? 4 : 0;
      nlohmann::json j = evals.front().json();
      j["source"] = source;
      j["target"] = target;
      write_file_atomic(json_path, j.dump(2) + "\n");
      // The fit's R² heatmaps are embedded when the mapper still sits in its output folder.
      if (!html_path.empty())
        write_file_atomic(html_path, render_evaluation_report(
                                         evals, source, (std::filesystem::path(mapper) / ".." / "r2_heatmap.svg").string()));
      auto f = [](const std::optional<double>& x) { return x ? std::to_string(*x) : std::string("n/a"); };
      spdlog::info("held-out R² k {:.4f}, v {:.4f}; attention cosine {}; K-concentration {}; V-concentration {}",
                   ev.mapper.r2_k, ev.mapper.r2_v, f(ev.mapper.attention_cosine), f(ev.mapper.k_concentration),
                   f(ev.mapper.v_concentration));
      spdlog::info("baselines: mean-only cosine {}, without target RoPE cosine {}", f(ev.mean_only.attention_cosine),
                   f(ev.no_target_rope.attention_cosine));
      spdlog::info("verdict: {}", ev.verdict());
      return require_ok && !ev.ok() ? 4 : 0;
    });
  } catch (const AgreedError& e) {  // every rank knows; the lowest failing rank reports
    if (e.report) std::fprintf(stderr, "crosskv-eval: error: %s\n", e.what());
    return e.exit_code;
  }
}
