// crosskv-bench-stream CONFIG.yaml: the streaming read rate alone (read, convert to fp32, strip RoPE, check
// finiteness), with no moment blocks to accumulate. Prints one JSON line.
#include <cstdio>

#include "core/blas_kernels.hpp"
#include "backends/backends.hpp"
#include "core/backend.hpp"
#include "core/comm.hpp"
#include "fit/config.hpp"
#include "runtime/log.hpp"
#include "fit/validate.hpp"
#include "fit/stream.hpp"

using namespace crosskv;

int main(int argc, char** argv) {
  // The kernels every figure is taken with, chosen before any BLAS call and printed with the results.
  std::fprintf(stderr, "%s\n", crosskv::select_blas_kernels().summary().c_str());
  if (argc != 2) {
    std::fprintf(stderr, "usage: crosskv-bench-stream CONFIG.yaml\n");
    return 2;
  }
  spdlog::set_level(spdlog::level::warn);
  FitConfig cfg = load_fit_config(argv[1]);
  Calibration cal = validate(cfg);
  auto comm = make_single_comm();
  auto be = make_cpu_backend();
  Context ctx{*comm, *be};
  const PairDims d = cal.dims();
  Shifts s = compute_shifts(cal);
  Moments k(d, s[Kind::k].x, s[Kind::k].y), raw(d, s[Kind::k_rope].x, s[Kind::k_rope].y), v(d, s[Kind::v].x, s[Kind::v].y);
  PassStats st = stream_pass(cal, ctx, {k, &raw, v}, "read-only pass");
  std::printf("{\"tokens\": %lld, \"seconds\": %.3f, \"tokens_per_s\": %.1f, \"fp32_mb_per_s\": %.1f}\n",
              static_cast<long long>(st.tokens), st.seconds, st.tokens / st.seconds, st.bytes / st.seconds / 1e6);
  return 0;
}
