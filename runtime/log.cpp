#include "runtime/log.hpp"

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>

#include <unistd.h>

#include <spdlog/sinks/stdout_color_sinks.h>
// Logs go to stdout; stderr is kept for the one-line error of a failing command.

namespace crosskv {

bool log_colours() {
  auto set = [](const char* name) {
    const char* v = std::getenv(name);
    return v && *v && std::strcmp(v, "0") != 0;
  };
  if (set("NO_COLOR")) return false;
  if (set("CLICOLOR_FORCE")) return true;
  // Under a launcher stdout may be a pseudo-terminal of the launcher's (OpenMPI's orted) whose output goes to a file
  // (a Slurm job's): a terminal here does not mean a person reads it.
  for (const char* launcher : {"OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMIX_RANK", "SLURM_JOB_ID"})
    if (std::getenv(launcher)) return false;
  return isatty(STDOUT_FILENO) == 1;
}

void setup_logging(int rank, int size, const std::string& level) {
  auto logger = spdlog::stdout_color_mt("crosskv-" + std::to_string(rank),
                                        log_colours() ? spdlog::color_mode::always : spdlog::color_mode::never);
  if (size > 1)
    logger->set_pattern("[%H:%M:%S.%e] [rank " + std::to_string(rank) + "] [%^%l%$] %v");
  else
    logger->set_pattern("[%H:%M:%S.%e] [%^%l%$] %v");
  logger->set_level(rank == 0 ? spdlog::level::from_str(level) : spdlog::level::warn);
  spdlog::set_default_logger(logger);
}

std::string human_bytes(double b) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  int u = 0;
  while (std::fabs(b) >= 1024 && u < 4) {
    b /= 1024;
    ++u;
  }
  char buf[64];
  std::snprintf(buf, sizeof buf, u ? "%.2f %s" : "%.0f %s", b, units[u]);
  return buf;
}

std::string human_count(double n) {
  char buf[64];
  if (n >= 1e9) std::snprintf(buf, sizeof buf, "%.2f B", n / 1e9);
  else if (n >= 1e6) std::snprintf(buf, sizeof buf, "%.2f M", n / 1e6);
  else if (n >= 1e3) std::snprintf(buf, sizeof buf, "%.2f K", n / 1e3);
  else if (n >= 10 || n == 0) std::snprintf(buf, sizeof buf, "%.0f", n);
  else std::snprintf(buf, sizeof buf, "%.2f", n);
  return buf;
}

std::string human_seconds(double s) {
  char buf[64];
  if (s < 60) std::snprintf(buf, sizeof buf, "%.1f s", s);
  else if (s < 3600) std::snprintf(buf, sizeof buf, "%dm%02ds", int(s) / 60, int(s) % 60);
  else std::snprintf(buf, sizeof buf, "%dh%02dm", int(s) / 3600, (int(s) % 3600) / 60);
  return buf;
}

Progress::Progress(std::string label, int64_t total, double bpt, std::string unit)
    : label_(std::move(label)), unit_(std::move(unit)), total_(total), bytes_per_token_(bpt), start_(std::chrono::steady_clock::now()),
      last_(start_) {}

double Progress::seconds() const {
  return seconds_since(start_);
}

void Progress::add(int64_t units) {
  done_ += units;
  auto now = std::chrono::steady_clock::now();
  if (std::chrono::duration<double>(now - last_).count() >= 5.0) {
    last_ = now;
    report(false);
  }
}

void Progress::finish() { report(true); }

void Progress::report(bool final) {
  const double s = std::max(seconds(), 1e-9);
  const double rate = done_ / s;
  const std::string bytes = bytes_per_token_ > 0 ? ", " + human_bytes(rate * bytes_per_token_) + "/s" : "";
  if (final) {
    spdlog::info("{}: {} {} in {} ({} {}/s{})", label_, done_, unit_, human_seconds(s), human_count(rate), unit_, bytes);
  } else {
    const double eta = rate > 0 ? (total_ - done_) / rate : 0;
    spdlog::info("{}: {}/{} {} ({:.0f}%), {} {}/s{}, ETA {}", label_, done_, total_, unit_,
                 total_ ? 100.0 * done_ / total_ : 100.0, human_count(rate), unit_, bytes, human_seconds(eta));
  }
}

void log_blas_kernels(const BlasKernels& k) {
  spdlog::info("{}", k.summary());
  if (!k.warning.empty()) spdlog::warn("{}", k.warning);
}

}  // namespace crosskv
