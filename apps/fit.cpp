// crosskv-fit CONFIG.yaml [--plan [--ranks N]] [--fresh]
#include <cstdio>
#include <iostream>

#include <CLI/CLI.hpp>

#include "apps/bootstrap.hpp"
#include "backends/backends.hpp"
#include "core/blas_kernels.hpp"
#include "core/backend.hpp"
#include "runtime/cli.hpp"
#include "core/comm.hpp"
#include "runtime/mpi.hpp"
#include "core/threads.hpp"
#include "core/error.hpp"
#include "eval/retention.hpp"
#include "runtime/log.hpp"
#include "fit/fit_pipeline.hpp"
#include "fit/checkpoint.hpp"

using namespace crosskv;

namespace {

int fail(const std::string& line, int code, int size) {
  std::fprintf(stderr, "crosskv-fit: error: %s\n", line.c_str());
  std::fflush(stderr);
  if (size > 1) mpi_abort(code);
  return code;
}

// The config, and the retention predictor its eval stage reads: a bad predictor file fails before the fit, not after.
FitConfig checked_config(const std::string& path) {
  FitConfig cfg = load_fit_config(path);
  if (!cfg.eval.shards.empty()) retention_model();
  return cfg;
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
  app.add_option("--log-level", log_level, "trace, debug, info, warn, error")
      ->check(CLI::IsMember(log_levels()))
      ->capture_default_str();
  app.add_flag("--version", version, "print the version and build features");
  if (auto rc = parse_command_line(app, argc, argv, "crosskv-fit")) return *rc;
  const BlasKernels& blas = select_blas_kernels();  // before any BLAS call
  if (version) {
    std::printf("crosskv-fit %s (cuda: %s, nccl: %s, mpi: yes)\n%s\n", CROSSKV_VERSION, cuda_compiled_in() ? "yes" : "no",
                nccl_compiled_in() ? "yes" : "no", blas.summary().c_str());
    if (!blas.warning.empty()) std::printf("warning: %s\n", blas.warning.c_str());
    return 0;
  }
  if (config_path.empty()) {
    std::fprintf(stderr, "crosskv-fit: error: missing CONFIG.yaml (see --help)\n");
    return 2;
  }
  StopFlag::install_signal_handlers();  // before MPI_Init, which can take seconds: a signal then is still a clean stop
  MpiSession mpi(&argc, &argv);
  std::unique_ptr<Comm> comm = make_mpi_comm();
  setup_logging(comm->rank(), comm->size(), log_level);
  const int world = comm->size();
  try {
    // A mistake in the config (or a missing device) is every rank's: agreed on, reported by rank 0 alone.
    const FitConfig cfg = agreed(*comm, [&] { return checked_config(config_path); });
    const int device = device_for_rank(cfg.runtime.device, mpi_local_rank());
    std::unique_ptr<ComputeBackend> backend = agreed(*comm, [&] { return make_backend(device, comm->rank(), cfg.runtime.tf32); });
    // GPU ranks reduce over NCCL (the same fixed-order sums as MPI) when each has a GPU of its own on every node:
    // NCCL refuses two ranks of one communicator on one device.
    if (device >= 0 && comm->size() > 1 && nccl_compiled_in()) {
      const int devices = cuda_device_count();
      if (comm->all_ok(mpi_local_size() <= devices))
        comm = make_nccl_comm(std::move(comm), device);
      else if (comm->rank() == 0)
        spdlog::warn("more ranks than GPUs on a node (here {} rank(s), {} GPU(s)): ranks share GPUs, and NCCL needs "
                     "one GPU per rank, so the collectives go through MPI",
                     mpi_local_size(), devices);
    }
    Context ctx{*comm, *backend};
    const int local_ranks = mpi_local_size();
    const ThreadChoice threads = configure_threads(local_ranks);
    spdlog::info("crosskv-fit {}: {} rank(s) on {}, backend {}, collectives {}", CROSSKV_VERSION, comm->size(),
                 host_name(), backend->name(), comm->name());
    spdlog::info("threads: {} per rank for BLAS and OpenMP ({}; {} core(s) usable, {} rank(s) on this node)",
                 threads.threads, threads.from_env ? "OPENBLAS_NUM_THREADS/OMP_NUM_THREADS as set" : "chosen",
                 threads.cores, local_ranks);
    if (comm->rank() == 0) log_blas_kernels(blas);
    FitResult r = run_fit(cfg, FitOptions{plan_only, fresh, plan_ranks}, ctx);
    if (plan_only && comm->rank() == 0) std::cout << r.plan_text;
    return 0;
  } catch (const AgreedError& e) {
    // Every rank knows (agreed()): one line from one rank, the same exit code everywhere, no MPI_Abort.
    if (e.report) {
      std::fprintf(stderr, "crosskv-fit: error: %s\n", e.what());
      std::fflush(stderr);
    }
    return e.exit_code;
  } catch (const Interrupted& e) {
    // Every rank reaches this together (the stop decision is collective): exit for the batch system to requeue;
    // rank 0 says so.
    if (comm->rank() == 0)
      std::fprintf(stderr, "crosskv-fit: interrupted: %s; run the same command again to resume\n", e.what());
    return kExitRequeue;
  } catch (const SolveError& e) {
    return fail(e.what(), 3, world);
  } catch (const UserError& e) {
    return fail(e.what(), 2, world);
  } catch (const std::exception& e) {
    return fail(e.what(), 1, world);
  }
}
