#pragma once
// crosskv-synth: a source and a target store with a planted relation that behaves like a model family.
#include <cstdint>
#include <string>
#include <vector>

#include "core/kv_spec.hpp"
#include "io/shard.hpp"

namespace crosskv {

enum class SynthRelation {
  family,  // target layer l ~ source layers of similar relative depth, mildly non-linear, with noise
  linear,    // target layer l = source layer (l mod Ls) (content space) x M_l + c_l exactly; no noise
  per_head,  // linear with M_l head-matched: target head h from source head h alone (needs equal head counts)
  nonlinear  // linear, plus relu(x N1_l) N2_l of the same source layer (no large-mean channels): a planted
             // non-linearity that ridge explains only in part (held-out R² about 0.85) and an MLP can learn
};

struct SynthOptions {
  std::string out;
  KvSpec source, target;
  std::string source_model = "synth-small", target_model = "synth-large";
  Dtype dtype = Dtype::f32;
  std::vector<std::string> domains = {"web"};
  int shards_per_domain = 2;
  int sequences_per_shard = 4;
  int seq_len = 256;
  uint64_t seed = 1234;       // the planted maps
  uint64_t data_seed = 0;     // the tokens (0: derived from seed); change it for held-out data
  SynthRelation relation = SynthRelation::family;
  double noise = 0.8;             // family: relative noise
  double large_mean = 40.0;       // offset of the large-mean key channels (content space)
  int large_mean_channels = 2;    // per head
  bool gapped_positions = true;   // random start offsets and steps of 1-3 (non-contiguous positions)
  bool with_queries = false;
  bool with_weights = false;  // per-token `weights` in the target's shards (log-uniform over [0.1, 10])
  int64_t chunk_tokens = 256;
  bool checksum = true;  // Fletcher-32 on every dataset (false: shards as older writers made them)
};

// Defaults: source 8 layers x 4 heads x 32 (default rope, theta 1e4), target 12 layers x 4 x 32 (llama3 rope).
SynthOptions default_synth_options();
// Writes <out>/source/<domain>/shard-NNN.h5 and <out>/target/... Returns the number of tokens written.
int64_t synthesize(const SynthOptions& o);

}  // namespace crosskv
