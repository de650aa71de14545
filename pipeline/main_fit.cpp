// crosskv-fit CONFIG.yaml [--plan [--ranks N]] [--fresh]
#include <mpi.h>

#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>

#include "core/backend.hpp"
#include "core/comm.hpp"
#include "core/error.hpp"
#include "core/log.hpp"
#include "pipeline/fit_pipeline.hpp"
#include "stages/checkpoint.hpp"

using namespace crosskv;

namespace {

std::unique_ptr<ComputeBackend> choose_backend(DeviceKind kind, int local_rank) {
  if (kind == DeviceKind::cpu) return make_cpu_backend();
  if (kind == DeviceKind::cuda) return make_cuda_backend(local_rank);
  return cuda_device_count() > 0 ? make_cuda_backend(local_rank % cuda_device_count()) : make_cpu_backend();
}

int fail(const std::string& line, int code, int size) {
  std::fprintf(stderr, "crosskv-fit: error: %s\n", line.c_str());
  std::fflush(stderr);
  if (size > 1) MPI_Abort(MPI_COMM_WORLD, code);
  return code;
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"crosskv-fit: fit cross-model KV mappers from calibration shards"};
  std::string config_path, log_level = "info";
  bool plan_only = false, fresh = false, version = false;
  int plan_ranks = 0;
  app.add_option("config", config_path, "fit config (YAML)");
  app.add_flag("--plan", plan_only, "validate and print the plan, then stop");
  app.add_option("--ranks", plan_ranks, "with --plan: plan a job of this many ranks (default: this job's)")
      ->check(CLI::PositiveNumber);
  app.add_flag("--fresh", fresh, "start over: remove committed checkpoints instead of resuming from them");
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")->capture_default_str();
  app.add_flag("--version", version, "print the version and build features");
  CLI11_PARSE(app, argc, argv);
  if (version) {
    std::printf("crosskv-fit %s (cuda: %s, mpi: yes)\n", CROSSKV_VERSION, cuda_compiled_in() ? "yes" : "no");
    return 0;
  }
  if (config_path.empty()) {
    std::fprintf(stderr, "crosskv-fit: error: missing CONFIG.yaml (see --help)\n");
    return 2;
  }
  MpiSession mpi(&argc, &argv);
  install_stop_signal_handlers();
  auto comm = make_mpi_comm();
  setup_logging(comm->rank(), comm->size(), log_level);
  try {
    FitConfig cfg = load_fit_config(config_path);
    auto backend = choose_backend(cfg.device, comm->rank());
    Context ctx{*comm, *backend};
    spdlog::info("crosskv-fit {}: {} rank(s) on {}, backend {}", CROSSKV_VERSION, comm->size(), host_name(),
                 backend->name());
    FitResult r = run_fit(cfg, FitOptions{plan_only, fresh, plan_ranks}, ctx);
    if (plan_only && comm->rank() == 0) std::cout << r.plan_text;
    return 0;
  } catch (const Interrupted& e) {
    // Every rank reaches this together (the stop decision is collective): exit for the batch system to requeue.
    std::fprintf(stderr, "crosskv-fit: interrupted: %s; run the same command again to resume\n", e.what());
    return kExitRequeue;
  } catch (const SolveError& e) {
    return fail(e.what(), 3, comm->size());
  } catch (const UserError& e) {
    return fail(e.what(), 2, comm->size());
  } catch (const std::exception& e) {
    return fail(e.what(), 1, comm->size());
  }
}
