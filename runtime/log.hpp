#pragma once
// Logging: spdlog with the rank in every line; progress meters for long passes.
#include <chrono>
#include <cstdint>
#include <string>

#include <spdlog/spdlog.h>

#include "core/blas_kernels.hpp"

namespace crosskv {

// Whether log lines carry ANSI colours: never with NO_COLOR, always with CLICOLOR_FORCE, else only when stdout is
// a terminal and no launcher (mpirun, srun, a Slurm job) started this process.
bool log_colours();
// Sets the default logger: rank 0 logs at `level`, other ranks warnings and above; colours as log_colours().
void setup_logging(int rank, int size, const std::string& level = "info");
// The BLAS kernels chosen (select_blas_kernels) in the log: their summary (info) and, when they do not match the
// CPU, the warning with its fix.
void log_blas_kernels(const BlasKernels& k);
std::string human_bytes(double bytes);
std::string human_count(double n);
std::string human_seconds(double s);
// Seconds of the steady clock since t0.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

class Progress {
 public:
  Progress(std::string label, int64_t total, double bytes_per_unit, std::string unit = "tokens");
  // Adds units done; logs at most every few seconds.
  void add(int64_t units);
  void finish();
  double seconds() const;

 private:
  void report(bool final);
  std::string label_, unit_;
  int64_t total_, done_ = 0;
  double bytes_per_token_;
  std::chrono::steady_clock::time_point start_, last_;
};

}  // namespace crosskv
