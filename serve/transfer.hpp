#pragma once
// Applying a mapper — the library API that serving code links: a source model's KV cache for a batch of tokens in,
// the target model's KV cache out. Per target layer: strip the source RoPE, one GEMM per selected source layer,
// bias, then the target RoPE (SPEC §2, §6).
#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "core/backend.hpp"
#include "artifact/mapper.hpp"

namespace crosskv {

// Target layers [first, first + count) of a mapper (count -1: to the last). A call given a range writes outputs
// that hold those layers alone: [rows, count, Ht, Dt]. Layer by layer, a serving stack maps layer l while the model
// computes the layers before it.
struct TargetLayers {
  int first = 0, count = -1;
  int end(int n_layers) const { return count < 0 ? n_layers : first + count; }
  int size(int n_layers) const { return end(n_layers) - first; }
};
// InputError naming `layers` unless the range is a non-empty part of [0, n_layers).
void check_target_layers(const TargetLayers& r, int n_layers);

// Target KV heads [first, first + count) (count -1: to the last): the heads one tensor-parallel worker of a serving
// engine holds. A mapper restricted to them computes their output columns alone ([rows, Lt, count, Dt]).
struct TargetHeads {
  int first = 0, count = -1;
  int end(int n_heads) const { return count < 0 ? n_heads : first + count; }
  int size(int n_heads) const { return end(n_heads) - first; }
};
// InputError naming `target_heads` unless the range is a non-empty part of [0, n_heads).
void check_target_heads(const TargetHeads& r, int n_heads);

struct TransferOptions {
  bool resident = false;     // keep every layer's weights in memory (on a GPU backend, in device memory too);
                             // else one layer at a time (peak: one layer)
  bool target_rope = true;   // false leaves the mapped keys in content space: the "- inference RoPE" bug
  bool verify = true;        // check each layer file's SHA-256 the first time it is read
};

// The index of the first NaN or infinity in x[0, n), or -1: a source cache that holds one would map to wrong KV.
// Memory-bound (every value read once, the exponents OR-ed 4096 at a time), a few percent of a mapping's time.
int64_t first_non_finite(const float* x, int64_t n);
// A serving call's caches checked, so that it fails closed: keys and values finite. Throws InputError naming the
// argument and the element ("keys: element 17 (token 0) is NaN"). (Positions are checked where they are cast.)
void check_finite_caches(const float* keys, const float* values, int64_t values_per_token, int64_t rows);

// Y [rows x G] (row stride YW) = X W + b for one target layer whose selected source layers are already gathered
// side by side in X [rows x K] (leading dim K), W [K x G]: the product every apply of a layer makes.
void map_gathered(DenseMaths& be, const float* X, int64_t K, const float* W, const float* b, int64_t G, int64_t rows,
                  float* Y, int64_t YW);
// One target layer of one kind: Y[rows, G] (row stride YW) = X[:, selected source layers] W + b. The selected
// layers' columns are gathered into `scratch` first, so the product is one GEMM over k*F features.
void map_one_layer(ComputeBackend& be, const float* X, int64_t XW, const std::vector<int>& layers, int64_t F,
                   const float* W, const float* b, int64_t G, int64_t rows, float* Y, int64_t YW,
                   std::vector<float>& scratch);

// One source slot j of a per_head layer's product, as one GEMM batched over the heads: for every head h of
// [h0, h0 + n), Y[:, (h-h0)*Dt..] += X[:, a*F + h*Ds..] W[h-h0][j*Ds.., :] (a the slot's source layer, F = heads*Ds;
// X row stride XW, Y row stride YW; W [n][k*Ds x Dt]). The k slots in turn, after the bias, are the layer's product:
// nothing is gathered. `only` (default: every head) is a tensor-parallel worker's heads.
DenseMaths::BatchedGemm per_head_slot(const float* X, int64_t XW, int a, int j, int k, int heads, int64_t Ds,
                                      int64_t Dt, const float* W, int64_t rows, float* Y, int64_t YW,
                                      TargetHeads only = {});

// Adds a residual MLP's f(X) (when it has parameters) to Y [rows x G] (row stride YW): X [rows x K] is X's selected
// source layers, gathered side by side (leading dim K).
void add_residual_mlp(ComputeBackend& be, const MlpParams& mlp, const float* X, int64_t rows, float* Y, int64_t YW,
                      MlpWorkspace& ws);

class Transfer {
 public:
  // Reads and validates the manifest now; layer files when first needed.
  Transfer(const std::string& mapper_dir, ComputeBackend& be, TransferOptions opts = {});
  ~Transfer();
  Transfer(const Transfer&) = delete;
  Transfer& operator=(const Transfer&) = delete;

  const MapperManifest& manifest() const { return m_; }
  const KvSpec& source() const { return m_.source; }
  const KvSpec& target() const { return m_.target; }

  // keys, values: [rows, Ls, Hs, Ds] as the source model caches them (keys post-RoPE at src_pos). One call at a
  // time per object (its scratch and layer cache are shared).
  // out_keys, out_values: [rows, Lt, Ht, Dt] as the target model would cache them (keys post-RoPE at tgt_pos).
  // With `layers`, only those target layers, and the outputs hold them alone ([rows, count, Ht, Dt]).
  void apply(const float* keys, const float* values, const int32_t* src_pos, const int32_t* tgt_pos, int64_t rows,
             float* out_keys, float* out_values, TargetLayers layers = {});
  // Content space: X [rows, Ls*F] (RoPE-stripped keys, or values) -> out [rows, Lt*G]; no RoPE on either side.
  void map_content(bool keys, const float* X, int64_t rows, float* out);
  // Both kinds at once (one read of each layer's weights).
  void map_content(const float* Xk, const float* Xv, int64_t rows, float* out_k, float* out_v,
                   TargetLayers layers = {});

  int64_t layer_loads() const { return loads_; }  // layer files read so far

 private:
  const MapperLayer& layer(int l);
  void release(int l);
  // Layer w of one kind into out [rows x YW] at column `at`.
  void map_layer(const MapperLayer& w, bool keys, const float* X, int64_t rows, float* out, int64_t at, int64_t YW);

  MapperManifest m_;
  ComputeBackend& be_;
  TransferOptions opts_;
  std::map<int, MapperLayer> loaded_;
  std::vector<bool> verified_;
  std::vector<float> scratch_, gathered_;
  MlpWorkspace mlp_ws_;
  int64_t loads_ = 0;
};

}  // namespace crosskv
