#pragma once
// Held-out diagnostics of one target layer (docs/METHOD.md, Diagnostics) through the compute backend: causal attention per sequence and
// KV-head group as batched GEMMs (scores, softmax, outputs), the truth's side computed once and every prediction
// (a mapper, a baseline, each k) diagnosed against it. The scalar diagnose() of tests/scalar_oracle is its oracle.
#include <cstdint>
#include <vector>

#include "eval/evaluation.hpp"
#include "core/backend.hpp"
#include "core/kv_spec.hpp"

namespace crosskv {

// The target model's own cache of one layer for the held-out tokens.
struct LayerTruth {
  int layer = 0;
  KvSpec spec;                        // the target's
  int64_t tokens = 0;
  const int32_t* positions = nullptr;        // [tokens]
  const int64_t* seq_offsets = nullptr;      // [sequences + 1]
  int64_t sequences = 0;
  std::vector<float> keys, values;    // [tokens x H*D], keys post-RoPE as cached
  std::vector<float> queries;         // [tokens x Hq*D] post-RoPE, or empty (no attention figures)
};

// Flops of one diagnose() call, and of the truth's side (for plans and benchmarks).
struct LayerDiagnosticsCost {
  double truth_flops = 0, prediction_flops = 0;
  int64_t scratch_bytes = 0;  // the scores of one tile and the truth's attention outputs
};
LayerDiagnosticsCost layer_diagnostics_cost(const KvSpec& target, int64_t tokens,
                                            const std::vector<int64_t>& seq_offsets, bool attention);

class LayerDiagnoser {
 public:
  // Computes the truth's side: content-space keys and column means, attention outputs and the squared attention
  // weights (V-concentration), and the eigen-decomposition of every query head's covariance (K-concentration).
  // `tile_floats` bounds the scores held at once (rows of a long sequence go through in tiles; tests make it small).
  LayerDiagnoser(DenseMaths& be, const LayerTruth& truth, int64_t tile_floats = kDefaultTileFloats);
  static constexpr int64_t kDefaultTileFloats = int64_t{1} << 24;  // 64 MiB of scores
  // A prediction of this layer, [tokens x H*D] each, keys post-RoPE as served.
  LayerDiagnostics diagnose(const float* keys, const float* values);

 private:
  // Attention outputs O[tokens x Hq*D] over keys/values; adds the squared weights to wsq[Hq x tokens] when given.
  void attention(const float* keys, const float* values, float* out, double* wsq);
  // One KV head's group of query heads over sequence s, in row tiles (scores: the unit's scratch).
  void attention_unit(int g, int64_t s, const float* keys, const float* values, float* out, double* wsq,
                      std::vector<float>& scores);
  // The steps of diagnose(), in order; all but the first only with queries.
  void r2_per_head(const float* keys, const float* values, LayerDiagnostics& ld);
  void cosine_per_query_head(const float* keys, const float* values, LayerDiagnostics& ld);
  void errors(const float* keys, const float* values);
  void project_key_error();
  void concentrations(LayerDiagnostics& ld) const;

  DenseMaths& be_;
  const LayerTruth& t_;
  int H_ = 0, Hq_ = 0, D_ = 0, group_ = 1;
  int window_ = 0;  // a sliding layer's window in positions (0: full attention)
  int64_t T_ = 0, G_ = 0, tile_floats_ = 0;
  bool attention_ = false;
  std::vector<float> content_keys_;          // the truth's keys, target RoPE stripped
  std::vector<double> mean_k_, mean_v_;      // per column
  std::vector<double> sst_k_, sst_v_;        // per KV head
  std::vector<float> out_;                   // the truth's attention outputs
  std::vector<double> wsq_;                  // [Hq x T]: sum over queries of the squared true attention weight
  std::vector<double> sig2_;                 // [Hq x D] eigenvalues of Q_j^T Q_j
  std::vector<float> vecs_;                  // [Hq x D x D] their eigenvectors (columns)
  // Kept between calls, so no fresh pages per prediction.
  std::vector<float> pred_out_, scratch_;
  std::vector<float> dk_;                    // [T x H*D] the key error
  std::vector<float> cov_, proj_;            // [H x D x D] its covariance per KV head; [Hq x D x D] that times V_j
  std::vector<double> e2_;                   // [H x T] the squared value error
};

// The per-layer figures of a prediction over every layer, averaged as diagnose() does.
Diagnostics summarize_layers(std::vector<LayerDiagnostics> layers, int64_t tokens, bool attention);

}  // namespace crosskv
