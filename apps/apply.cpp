// crosskv-apply --mapper DIR --source SHARD.h5 --out SHARD.h5: a source model's captured KV cache mapped into a
// shard in the target model's format (keys post target-RoPE), ready to compare with the target's own capture.
#include <algorithm>
#include <cmath>
#include <cstdio>
#include <filesystem>

#include <CLI/CLI.hpp>

#include "serve/transfer.hpp"
#include "apps/bootstrap.hpp"
#include "backends/backends.hpp"
#include "core/comm.hpp"
#include "runtime/mpi.hpp"
#include "core/blas_kernels.hpp"
#include "core/backend.hpp"
#include "runtime/cli.hpp"
#include "core/error.hpp"
#include "runtime/log.hpp"
#include "core/atomic_file.hpp"
#include "core/dtype.hpp"
#include "io/shard.hpp"

using namespace crosskv;

namespace {

bool same_file(const std::string& a, const std::string& b) {
  std::error_code ec;
  if (std::filesystem::equivalent(a, b, ec)) return true;
  return std::filesystem::weakly_canonical(a, ec) == std::filesystem::weakly_canonical(b, ec);
}

// Mapped rows [t0, t0 + rows) of one kind: every value finite, or an InputError naming the layer and token.
void check_finite(const std::vector<float>& mapped, const char* kind, int64_t t0, const KvSpec& target,
                  const std::string& source) {
  const auto bad = std::find_if(mapped.begin(), mapped.end(), [](float x) { return !std::isfinite(x); });
  if (bad == mapped.end()) return;
  const int64_t i = bad - mapped.begin(), width = target.n_layers * target.features_per_layer();
  throw InputError(source + ": mapped " + kind + " of target layer " +
                   std::to_string((i % width) / target.features_per_layer()) + " are not finite at token " +
                   std::to_string(t0 + i / width) + " (" + (std::isnan(*bad) ? "NaN" : "Inf") +
                   "; check the source shard's values there)");
}

// The output's stored dtype: --dtype, or the source's.
Dtype output_dtype(const std::string& name, Dtype source) {
  if (name.empty()) return source;
  if (const auto d = dtype_from_string(name)) return *d;
  throw UserError("--dtype: expected float32, float16 or bfloat16, got \"" + name + "\"");
}

// The target's RoPE positions: another shard's for the same tokens, or the source's.
std::vector<int32_t> target_positions(const std::string& positions_from, ShardReader& src, const std::string& source) {
  if (positions_from.empty()) return src.positions();
  ShardReader p(positions_from);
  if (p.token_ids() != src.token_ids())
    throw InputError(positions_from + ": token_ids differ from " + source + " (not the same tokens)");
  return p.positions();
}

// Every row of the source shard mapped into w, `block` tokens at a time.
void map_rows(Transfer& tr, ShardReader& src, const std::string& source, const std::vector<int32_t>& spos,
              const std::vector<int32_t>& tpos, int64_t block, ShardWriter& w) {
  const ShardHeader& h = src.header();
  const int64_t T = h.tokens;
  const int64_t XW = h.spec.n_layers * h.spec.features_per_layer();
  const int64_t YW = tr.target().n_layers * tr.target().features_per_layer();
  std::vector<float> k, v, ok, ov;
  std::vector<uint16_t> scratch;
  Progress progress("apply", T, 0, "tokens");
  for (int64_t t0 = 0; t0 < T; t0 += block) {
    const int64_t n = std::min(block, T - t0);
    k.resize(n * XW);
    v.resize(n * XW);
    ok.resize(n * YW);
    ov.resize(n * YW);
    src.read_rows("keys", t0, n, 1, k.data(), scratch);
    src.read_rows("values", t0, n, 1, v.data(), scratch);
    tr.apply(k.data(), v.data(), spos.data() + t0, tpos.data() + t0, n, ok.data(), ov.data());
    check_finite(ok, "keys", t0, tr.target(), source);
    check_finite(ov, "values", t0, tr.target(), source);
    w.write_rows("keys", t0, n, ok.data());
    w.write_rows("values", t0, n, ov.data());
    progress.add(n);
  }
  progress.finish();
}

// A failed run leaves no partial shard behind.
struct RemoveUnlessCommitted {
  std::string path;
  bool keep = false;
  ~RemoveUnlessCommitted() {
    std::error_code ec;
    if (!keep) std::filesystem::remove(path, ec);
  }
};

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{"crosskv-apply: map a source model's KV shard into the target model's format"};
  std::string mapper, source, out, positions_from, dtype_name, device = "cpu";
  int64_t block = 4096;
  bool no_rope = false, resident = false;
  app.add_option("--mapper", mapper, "mapper artifact folder (k<K>/)")->required();
  app.add_option("--source", source, "source model's shard (HDF5, docs/FORMATS.md, Calibration shards)")->required();
  app.add_option("--out", out, "shard to write in the target's format")->required();
  app.add_option("--target-positions", positions_from,
                 "take the target's RoPE positions from this shard (default: the source shard's positions)");
  app.add_option("--dtype", dtype_name, "stored dtype of the output: float32, float16, bfloat16 (default: the source's)");
  app.add_option("--block-tokens", block, "tokens per block")->check(CLI::PositiveNumber)->capture_default_str();
  app.add_option("--device", device, "cpu or cuda")->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_flag("--resident", resident, "keep every layer's weights in memory (default: one layer at a time)");
  app.add_flag("--no-target-rope", no_rope, "diagnostics only: leave the mapped keys without the target RoPE");
  if (auto rc = parse_command_line(app, argc, argv, "crosskv-apply")) return *rc;
  const BlasKernels& blas = select_blas_kernels();  // before any BLAS call
  setup_logging(0, 1, "info");
  log_blas_kernels(blas);
  return run_tool("crosskv-apply", [&]() -> int {
    for (const auto& [flag, input] : {std::pair{"--source", source}, std::pair{"--target-positions", positions_from}})
      if (!input.empty() && same_file(out, input))
        throw UserError("--out: " + out + " is the " + flag + " shard; write the mapped shard elsewhere");
    auto be = backend_for_this_rank(device_kind(device), 0, false);
    Transfer tr(mapper, *be, TransferOptions{resident, !no_rope, true});
    ShardReader src(source);
    const ShardHeader& h = src.header();
    check_kv_spec(tr.manifest(), true, h.spec, source);
    if (h.model != tr.manifest().source_model)
      spdlog::warn("{}: model '{}' differs from the mapper's source model '{}'", source, h.model,
                   tr.manifest().source_model);
    const int64_t T = h.tokens;
    const std::vector<int32_t> spos = src.positions(), tpos = target_positions(positions_from, src, source);
    const Dtype dt = output_dtype(dtype_name, h.key_dtype);
    const std::string tmp = temp_name_for(out);
    RemoveUnlessCommitted guard{tmp};
    {
      ShardWriter w(tmp, tr.manifest().target_model, h.domain, tr.target(), T, dt);
      w.write_token_ids(src.token_ids());
      w.write_positions(tpos);
      w.write_seq_offsets(src.seq_offsets());
      map_rows(tr, src, source, spos, tpos, block, w);
      w.close();
    }
    commit_file(tmp, out);
    guard.keep = true;
    spdlog::info("wrote {} ({} tokens, {} layers x {} KV heads x {}, {}; {} layer file reads)", out, T,
                 tr.target().n_layers, tr.target().n_kv_heads, tr.target().head_dim, to_string(dt), tr.layer_loads());
    return 0;
  });
}
