// crosskv-synth --out DIR [shape/rope/dtype options]: a synthetic source/target pair of stores.
#include <cstdio>

#include <CLI/CLI.hpp>

#include "runtime/cli.hpp"
#include "core/error.hpp"
#include "core/dtype.hpp"
#include "tools/synth.hpp"

using namespace crosskv;

namespace {

void add_side(CLI::App& app, const std::string& p, KvSpec& s, std::string& rope_convention) {
  app.add_option("--" + p + "-layers", s.n_layers, p + " layers")->capture_default_str();
  app.add_option("--" + p + "-heads", s.n_kv_heads, p + " KV heads")->capture_default_str();
  app.add_option("--" + p + "-head-dim", s.head_dim, p + " head dim")->capture_default_str();
  app.add_option("--" + p + "-q-heads", s.n_q_heads, p + " query heads")->capture_default_str();
  app.add_option("--" + p + "-rope", s.rope.type, p + " rope type: default, linear, llama3, yarn, none")
      ->capture_default_str();
  app.add_option("--" + p + "-theta", s.rope.theta, p + " rope theta")->capture_default_str();
  app.add_option("--" + p + "-rotary-dim", s.rope.rotary_dim, p + " rotary dim (0: head dim)")->capture_default_str();
  app.add_option("--" + p + "-rope-convention", rope_convention, p + " convention: half or interleaved")
      ->capture_default_str();
}

void finish_side(KvSpec& s, const std::string& conv, const std::string& side) {
  if (s.rope.rotary_dim <= 0 || s.rope.rotary_dim > s.head_dim) s.rope.rotary_dim = s.head_dim;
  if (conv == "half") s.rope.convention = RopeConvention::half;
  else if (conv == "interleaved") s.rope.convention = RopeConvention::interleaved;
  else throw UserError("--" + side + "-rope-convention: expected half or interleaved, got \"" + conv + "\"");
  const auto& t = s.rope.type;
  if (t == "linear" && !s.rope.factor) s.rope.factor = 4.0;
  if (t == "llama3") {
    if (!s.rope.factor) s.rope.factor = 8.0;
    if (!s.rope.low_freq_factor) s.rope.low_freq_factor = 1.0;
    if (!s.rope.high_freq_factor) s.rope.high_freq_factor = 4.0;
    if (!s.rope.original_max_position_embeddings) s.rope.original_max_position_embeddings = 8192.0;
  }
  if (t == "yarn") {
    if (!s.rope.factor) s.rope.factor = 4.0;
    if (!s.rope.original_max_position_embeddings) s.rope.original_max_position_embeddings = 4096.0;
    if (!s.rope.beta_fast) s.rope.beta_fast = 32.0;
    if (!s.rope.beta_slow) s.rope.beta_slow = 1.0;
  }
  if (t != "none" && t != "default" && t != "linear" && t != "llama3" && t != "yarn")
    throw UserError("--" + side + "-rope: unsupported rope type \"" + t + "\"");
}

}  // namespace

int main(int argc, char** argv) {
  SynthOptions o = default_synth_options();
  std::string dtype = "float32", relation = "family", conv_s = "half", conv_t = "half";
  CLI::App app{"crosskv-synth: write a synthetic source/target pair of calibration stores"};
  app.add_option("--out", o.out, "output folder (gets source/ and target/)")->required();
  add_side(app, "source", o.source, conv_s);
  add_side(app, "target", o.target, conv_t);
  app.add_option("--dtype", dtype, "stored dtype: float32, float16, bfloat16")->capture_default_str();
  app.add_option("--domains", o.domains, "domain names")->capture_default_str();
  app.add_option("--shards", o.shards_per_domain, "shards per domain")->capture_default_str();
  app.add_option("--sequences", o.sequences_per_shard, "sequences per shard")->capture_default_str();
  app.add_option("--seq-len", o.seq_len, "tokens per sequence")->capture_default_str();
  app.add_option("--seed", o.seed, "random seed of the planted relation")->capture_default_str();
  app.add_option("--data-seed", o.data_seed, "random seed of the tokens (0: from --seed); vary for held-out data")
      ->capture_default_str();
  app.add_option("--relation", relation, "family (realistic), linear (exact, for tests), per_head (linear and head-matched) or nonlinear (linear plus a planted ReLU layer: ridge falls short)")->capture_default_str();
  app.add_option("--noise", o.noise, "family: layer-private noise level")->capture_default_str();
  app.add_option("--large-mean", o.large_mean, "offset of the large-mean key channels")->capture_default_str();
  app.add_flag("--with-queries", o.with_queries, "also write queries");
  app.add_flag("--with-weights", o.with_weights,
               "also write per-token weights into the target's shards (log-uniform over [0.1, 10]; fit.weighting: dataset)");
  app.add_flag("!--no-checksum", o.checksum, "datasets without Fletcher-32 checksums (as older writers made them)");
  app.add_flag("!--contiguous-positions", o.gapped_positions, "positions 0,1,2,... in every sequence");
  if (auto rc = parse_command_line(app, argc, argv, "crosskv-synth")) return *rc;
  return run_tool("crosskv-synth", [&]() -> int {
    finish_side(o.source, conv_s, "source");
    finish_side(o.target, conv_t, "target");
    const auto d = dtype_from_string(dtype);
    if (!d) throw UserError("--dtype: expected float32, float16 or bfloat16, got \"" + dtype + "\"");
    o.dtype = *d;
    if (relation == "family") o.relation = SynthRelation::family;
    else if (relation == "linear") o.relation = SynthRelation::linear;
    else if (relation == "nonlinear") o.relation = SynthRelation::nonlinear;
    else if (relation == "per_head") o.relation = SynthRelation::per_head;
    else throw UserError("--relation: expected family, linear, per_head or nonlinear, got \"" + relation + "\"");
    const int64_t n = synthesize(o);
    std::printf("wrote %lld tokens per store: %s/source and %s/target\n", static_cast<long long>(n), o.out.c_str(),
                o.out.c_str());
    return 0;
  });
}
