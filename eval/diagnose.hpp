#pragma once
// Held-out diagnostics of a mapper (SPEC §7): held-out R² per layer and head, attention-output cosine, K- and
// V-concentration; for the mapper and two baselines in one report.
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "serve/transfer.hpp"
#include "core/kv_spec.hpp"

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

struct LayerDiagnostics {
  int layer = 0;
  std::vector<double> r2_k, r2_v;  // per KV head, content space
  double r2_k_mean = 0, r2_v_mean = 0;
  // Per query head; empty when the target cache has no queries.
  std::vector<double> cosine, k_concentration, v_concentration;
  double cosine_mean = 0, k_concentration_mean = 0, v_concentration_mean = 0;
};

struct Diagnostics {
  std::vector<LayerDiagnostics> layers;
  double r2_k = 0, r2_v = 0;
  std::optional<double> attention_cosine, k_concentration, v_concentration;
  int64_t tokens = 0;
  nlohmann::json json() const;  // SPEC §9 keys: r2_k, r2_v, attention_cosine, k_concentration, v_concentration, layers
};

// `truth`: the target's own cache (with queries for the attention figures). `keys`/`values`: a prediction of it
// in the same layout (keys post target-RoPE, as served). Scalar loops over the whole cache: the oracle of the
// GEMM-based, streamed diagnostics (eval/layer_diagnostics, stages/eval), kept for tests and benchmarks.
Diagnostics diagnose(const Cache& truth, const std::vector<float>& keys, const std::vector<float>& values);

struct Evaluation {
  Diagnostics mapper, mean_only, no_target_rope;
  std::optional<Diagnostics> ridge_only;  // a mapper with residual MLPs (issue 15): the same without them
  std::string verdict;
  bool ok = false;
  nlohmann::json json() const;  // the mapper's figures at the top level, baselines and verdict beside them
};
// The oracle's evaluation (diagnose() on whole caches). Maps `source` with the mapper and diagnoses against `target`
// (same tokens), with the two baselines: the mean-only
// predictor (the mapper applied to the source's mean content over these tokens: a constant that uses no target
// data) and the mapper without the target RoPE (the paper's "- inference RoPE" bug).
Evaluation evaluate(Transfer& tr, const Cache& source, const Cache& target);

// Sets ev.verdict and ev.ok from the mapper's figures and the mean-only baseline's (VerdictThresholds).
void judge(Evaluation& ev);

// Thresholds of the verdict.
struct VerdictThresholds {
  double min_cosine = 0.90;  // attention-output cosine of the mapper
  double min_r2 = 0.0;       // held-out R² of keys and values (0: better than the mean)
};

}  // namespace crosskv
