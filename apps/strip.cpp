// crosskv-strip --shard SHARD.h5 --out OUT.h5: a shard's keys (and queries) with its own RoPE stripped, i.e. in the
// content space the mapper works in (fp64 datasets content_keys [T, L, H, D], content_queries [T, L, Hq, D]).
// The conformity tests compare this with the pre-RoPE keys read inside Hugging Face's attention.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "runtime/cli.hpp"
#include "core/error.hpp"
#include "core/rope.hpp"
#include "io/h5.hpp"
#include "io/shard.hpp"

using namespace crosskv;

int main(int argc, char** argv) {
  CLI::App app{"crosskv-strip: a shard's keys in RoPE-free content space"};
  std::string shard, out;
  app.add_option("--shard", shard, "shard (docs/FORMATS.md, Calibration shards)")->required();
  app.add_option("--out", out, "HDF5 file to write")->required();
  if (auto rc = parse_command_line(app, argc, argv, "crosskv-strip")) return *rc;
  return run_tool("crosskv-strip", [&]() -> int {
    ShardReader r(shard);
    const ShardHeader& h = r.header();
    const KvSpec& s = h.spec;
    const int64_t T = h.tokens;
    Rope rope(s, shard);
    auto pos = r.positions();
    std::vector<uint16_t> scratch;
    h5::Handle f = h5::create_file(out);
    auto strip = [&](const char* dataset, int heads, const char* name) {
      std::vector<float> x(T * int64_t{s.n_layers} * heads * s.head_dim);
      r.read_rows(dataset, 0, T, 1, x.data(), scratch);
      rope.strip_block(x.data(), T, {0, s.n_layers, heads}, pos.data());
      std::vector<double> d(x.begin(), x.end());
      h5::write_f64(f.get(), name,
                    {static_cast<hsize_t>(T), static_cast<hsize_t>(s.n_layers), static_cast<hsize_t>(heads),
                     static_cast<hsize_t>(s.head_dim)},
                    d.data());
    };
    strip("keys", s.n_kv_heads, "content_keys");
    if (h.has_queries) strip("queries", s.n_q_heads, "content_queries");
    return 0;
  });
}
