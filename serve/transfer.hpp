#pragma once
// Applying a mapper from its folder to host arrays — the library API that crosskv-apply and the Python streamed
// mapper link: a source model's KV cache for a batch of tokens in, the target model's KV cache out (docs/METHOD.md, RoPE and docs/FORMATS.md, Mapper artifact). A
// window of the one apply (serve/serving_mapper): resident, one ServingMapper over every target layer for the
// object's lifetime; streamed (the default), one target layer's ServingMapper at a time, so that the peak is one
// layer's weights.
#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "core/kind.hpp"
#include "serve/serving_mapper.hpp"

namespace crosskv {

struct TransferOptions {
  bool resident = false;     // keep every layer's weights on the backend (a GPU's memory for cuda); else one
                             // layer at a time (peak: one layer)
  bool target_rope = true;   // false leaves the mapped keys in content space: the "- inference RoPE" ablation
  bool verify = true;        // check each layer file's SHA-256 the first time it is read
};

class Transfer {
 public:
  // Reads and validates the manifest now; layer files when first needed.
  Transfer(const std::string& mapper_dir, ServingKernels& be, TransferOptions opts = {});
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  const MapperManifest& manifest() const { return m_; }
  const KvSpec& source() const { return m_.source; }
  const KvSpec& target() const { return m_.target; }

  // keys, values: [rows, Ls, Hs, Ds] as the source model caches them (keys post-RoPE at src_pos). One call at a
  // time per object (its scratch is shared).
  // out_keys, out_values: [rows, Lt, Ht, Dt] as the target model would cache them (keys post-RoPE at tgt_pos).
  // With `layers`, only those target layers, and the outputs hold them alone ([rows, count, Ht, Dt]).
  void apply(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos, int64_t rows,
             float* out_keys, float* out_values, TargetLayers layers = {});
  // Content space: X [rows, Ls*F] (RoPE-stripped keys, or values) -> out [rows, Lt*G]; no RoPE on either side.
  void map_content(Kind kind, const float* X, int64_t rows, float* out);
  // Both kinds at once (one read of each layer's weights).
  void map_content(const float* Xk, const float* Xv, int64_t rows, float* out_k, float* out_v,
                   TargetLayers layers = {});

  int64_t layer_loads() const { return loads_; }  // layer files read so far

 private:
  // Target layers [first, first + count) through ServingMapper windows: the resident one, or one per layer.
  void map_windows(const ContentBatch& b);

  MapperManifest m_;
  ServingKernels& be_;
  TransferOptions opts_;
  std::unique_ptr<ServingMapper> resident_;
  std::vector<bool> verified_;
  std::vector<float> content_, one_k_, one_v_;
  int64_t loads_ = 0;
};

}  // namespace crosskv
