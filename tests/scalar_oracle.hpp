#pragma once
// The scalar oracle of the held-out diagnostics (tests and benchmarks only): whole caches read into memory, scalar
// loops over them, and the evaluation of a mapper through Transfer. The GEMM-based, streamed diagnostics
// (eval/layer_diagnostics, eval/held_out) are tested against it.
#include <cstdint>
#include <string>
#include <vector>

#include "core/kv_spec.hpp"
#include "eval/evaluation.hpp"
#include "serve/transfer.hpp"

namespace crosskv {

// One model's cache for a set of tokens, as captured (keys and queries post-RoPE), fp32 [T, L, H, D].
struct Cache {
  std::string path;  // the shard(s) it was read from, for messages
  KvSpec spec;
  std::vector<float> keys, values, queries;  // queries empty when not captured
  std::vector<int32_t> positions;
  std::vector<int64_t> seq_offsets;  // [S+1]
  int64_t tokens = 0;
};
Cache read_cache(const std::string& shard_path, bool want_queries = true);
// Several shards of one model as one cache (their sequences one after another).
Cache read_caches(const std::vector<std::string>& shard_paths, bool want_queries = true);

// `truth`: the target's own cache (with queries for the attention figures). `keys`/`values`: a prediction of it
// in the same layout (keys post target-RoPE, as served). Scalar loops over the whole cache: the oracle of the
// GEMM-based, streamed diagnostics (eval/layer_diagnostics, eval/held_out).
Diagnostics diagnose(const Cache& truth, const std::vector<float>& keys, const std::vector<float>& values);

// The oracle's evaluation (diagnose() on whole caches). Maps `source` with the mapper and diagnoses against `target`
// (same tokens), with the two baselines: the mean-only
// predictor (the mapper applied to the source's mean content over these tokens: a constant that uses no target
// data) and the mapper without the target RoPE (the paper's "- inference RoPE" bug).
Evaluation evaluate(Transfer& tr, const Cache& source, const Cache& target);

}  // namespace crosskv
