#pragma once
// The calibration data validate() found (stage 1), which every stage of a fit works on.
#include <cstdint>
#include <functional>
#include <map>
#include <string>
#include <vector>

#include "core/kv_spec.hpp"
#include "fit/moments.hpp"
#include "fit/config.hpp"

namespace crosskv {

struct ShardPair {
  std::string rel, domain;
  std::string source_path, target_path;
  int64_t rows = 0;        // tokens in the shard
  int64_t used = 0;        // tokens used: rows 0, s, 2s, ... (after token_stride and max_tokens)
  std::string fingerprint; // SHA-256 over both sides' token_ids and positions
};

struct Calibration {
  FitConfig cfg;
  KvSpec source, target;
  std::string source_model, target_model;
  std::string source_weights, target_weights;  // the shards' model_weights fingerprints (empty: not recorded)
  std::vector<std::string> domains;
  std::vector<ShardPair> shards;  // sorted by relative path
  std::vector<ShardPair> eval_shards;  // held out (eval.shards): not read by the fit
  int64_t tokens_used = 0;
  double stored_bytes_per_token = 0;  // keys and values of both models as stored (the largest over the shards)
  // The shard pair whose first block gives the provisional shift: the store's first pair over every domain, so
  // that the shift (and moments kept per domain) does not change with the domains a fit selects.
  ShardPair shift_shard;
  int64_t shard_files = 0, unchecked_files = 0;  // the fit's shard files; those without Fletcher-32 on keys/values
  std::vector<std::string> skipped;  // store entries passed over ("<path>: skipped (why)"), for the log
  PairDims dims() const;
};

}  // namespace crosskv
